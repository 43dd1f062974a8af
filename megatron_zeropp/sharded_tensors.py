"""A contiguous element range of a parameter described to megatron-core's ``dist_checkpointing``.

Each DP rank owns one contiguous element range ``[start, end)`` of every flattened parameter (its
primary shard; the fp32 main weights and Adam moments cover the same range). megatron-core 0.16
no longer accepts ``ShardedTensor.flattened_range``, so a range is described as a few N-D boxes of
the parameter, each a view of the flat shard::

    param (5 x 8), rank range [13, 30):   row 1 cols 5..7 | rows 2..2 whole | row 3 cols 0..5
                                           (partial first row, whole rows, partial last row;
                                            applied recursively to higher dimensions)

The boxes tile exactly the global tensors megatron-core's ``GPTModel.sharded_state_dict()`` and
the DistributedOptimizer's ``fully_reshardable`` format describe (same keys, global shapes and
TP/PP offsets, ShardedTensorFactory layouts such as SwiGLU's included); only the chunking on disk
differs, and torch.distributed.checkpoint reads any chunking into any other. So Megatron-LM loads
these at any TP/PP/DP, and this layer loads Megatron-LM's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import List, Sequence, Tuple

import torch

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape) inside a tensor


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """Boxes (offset, shape) covering elements ``[start, end)`` of a row-major tensor of
    ``shape``, in increasing flat order; each box is contiguous in the flat tensor."""
    shape = tuple(shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), ((end - start),) * len(shape))]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)

    def row(r, lo, hi):
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


def _leaves(template, key: str, shape, dtype) -> List[Tuple[object, int]]:
    """(ShardedTensor, flat offset in the parameter) of each tensor ``template`` stores for a
    parameter of ``shape``: one for a ShardedTensor, the built pieces for a factory."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stand_in = torch.empty(shape, dtype=dtype, device="meta")
    if isinstance(template, ShardedTensorFactory):
        built = replace(template, key=key, data=stand_in).build()
        leaves = list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
    else:
        leaves = [replace(template, key=key, data=stand_in, dtype=dtype)]
    out = []
    for leaf in leaves:
        if not isinstance(leaf, ShardedTensor) or not leaf.data.is_contiguous():
            raise ValueError(f"{key}: checkpoint layout {type(leaf).__name__} is not a "
                             f"contiguous piece of the parameter; the ZeRO++ layer cannot "
                             f"describe its shard of it")
        out.append((leaf, leaf.data.storage_offset()))
    return out


def _replica_id(replica_id):
    # (PP, TP, DP) replicas: every DP rank holds other elements, so none of them is a replica.
    if not isinstance(replica_id, tuple) or len(replica_id) != 3:
        raise ValueError(f"expected a (PP, TP, DP) replica_id, got {replica_id!r}")
    return (*replica_id[:2], 0)


def shard_boxes(template, key: str, shape, rank_range: Tuple[int, int],
                source: torch.Tensor) -> list:
    """ShardedTensors covering ``rank_range`` of a parameter of ``shape`` under ``template``'s
    layout (a model ShardedTensor or factory), stored under ``key``, with data viewed from
    ``source`` (1-D, the values of that range)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    a, b = rank_range
    if source.dim() != 1 or source.numel() != b - a:
        raise ValueError(f"{key}: source of shape {tuple(source.shape)} for range [{a}, {b})")
    out = []
    for leaf, offset in _leaves(template, key, shape, source.dtype):
        n = math.prod(leaf.local_shape)
        lo, hi = max(a, offset), min(b, offset + n)
        if hi <= lo:
            continue
        pos = lo - a
        k = leaf.prepend_axis_num
        for box_offset, box_shape in flat_range_boxes(leaf.local_shape, lo - offset, hi - offset):
            numel = math.prod(box_shape)
            # Prepended axes (the layer index of stacked layers) become leading dims of size
            # 1: megatron-core writes irregular chunks without prepend_axis_num support.
            local_shape = (1,) * k + tuple(box_shape)
            out.append(ShardedTensor(
                key=leaf.key,
                data=source[pos : pos + numel].view(local_shape),
                dtype=source.dtype,
                local_shape=local_shape,
                global_shape=leaf.global_shape,
                global_offset=leaf.global_offset[:k] + tuple(
                    g + o for g, o in zip(leaf.global_offset[k:], box_offset)),
                axis_fragmentations=None,  # irregular: the grid check is left to DCP
                replica_id=_replica_id(leaf.replica_id),
                allow_shape_mismatch=leaf.allow_shape_mismatch,
            ))
            pos += numel
    return out


def copy_loaded(request, loaded) -> int:
    """Copy what ``dist_checkpointing.load`` returned into the views ``request`` described
    (a no-op where it loaded in place); returns the number of elements copied."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(request, ShardedTensor):
        if loaded.data_ptr() != request.data.data_ptr():
            request.data.copy_(loaded)
        return request.data.numel()
    if isinstance(request, dict):
        return sum(copy_loaded(v, loaded[k]) for k, v in request.items() if k in loaded)
    if isinstance(request, list):
        return sum(copy_loaded(v, w) for v, w in zip(request, loaded))
    return 0
