"""ZeRO-3 shards described to megatron-core's ``dist_checkpointing``, without gathering a weight.

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
from typing import Dict, List, Optional, Sequence, Tuple

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


def unwrap_model(chunk) -> torch.nn.Module:
    """The GPTModel inside a data-parallel wrapper and Float16Module (as Megatron-LM's
    ``unwrap_model``): its ``sharded_state_dict`` keys are the ones Megatron-LM writes."""
    from megatron.core.transformer.module import Float16Module

    module = chunk
    while hasattr(module, "module") and (module is chunk or isinstance(module, Float16Module)):
        module = module.module
    return module


def zero_param_ranges(chunk) -> Dict[torch.nn.Parameter, Tuple[int, int]]:
    """Element range ``[start, end)`` of every parameter that this DP rank's primary shard holds
    (empty ranges left out), from the chunk's shard map; the range megatron-core's distributed
    optimizer gives the same parameter."""
    return {p: (s.start, s.end) for p, s in chunk.shard_map.items() if s.end > s.start}


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


def _templates(model_sd: dict, params: Dict[int, torch.nn.Parameter]):
    """(path, template) for every entry of ``model_sd`` whose data is one of ``params``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for name, value in model_sd.items():
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and id(value.data) in params:
            yield name, value


def zero_model_sharded_state_dict(chunk, metadata: Optional[dict] = None):
    """``(sharded state dict, templates)`` of a ZeroPPDataParallel chunk: megatron-core's model
    sharded state dict with each ZeRO-sharded parameter replaced by the boxes of this rank's
    primary shard (a list; left out when the rank owns none of it). ``templates`` maps each such
    parameter to its original entry (key, layout), for the optimizer state."""
    gpt = unwrap_model(chunk)
    sd = gpt.sharded_state_dict(prefix="", metadata=metadata)
    ranges = zero_param_ranges(chunk)
    params = {id(p): p for u in chunk.units for p in u.params}
    templates = {}
    for name, template in list(_templates(sd, params)):
        p = params[id(template.data)]
        templates[p] = template
        boxes = shard_boxes(template, template.key, p.shape, ranges[p],
                           chunk.shard_map[p].primary) \
            if p in ranges else []
        if boxes:
            sd[name] = boxes
        else:
            # No empty container: rank 0's would be stored in common.pt and clash with the
            # tensors other ranks load under the same name.
            del sd[name]
    missing = [tuple(p.shape) for p in params.values() if p not in templates]
    if missing:
        raise ValueError(f"parameters of shapes {missing[:3]} are not in the model's "
                         f"sharded_state_dict; cannot checkpoint them")
    return sd, templates


OPTIMIZER_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors of megatron-core's ``fully_reshardable`` optimizer format, stored as
``optimizer.state.<name>.<model key>`` (``param`` is the fp32 main weight)."""


def zero_optimizer_param_state(opt, chunk, templates, allocate: bool = False) -> dict:
    """The ``param_state`` of a DistributedOptimizer over ZeRO shards in ``fully_reshardable``
    keys, each rank's boxes only. ``allocate`` creates missing Adam moments (zeros, to load
    into)."""
    ranges = zero_param_ranges(chunk)
    state = {}
    index = 0
    for main_groups, model_groups in (
        (opt.shard_fp32_from_float16_groups, opt.model_float16_groups),
        (opt.shard_fp32_groups, opt.model_fp32_groups),
    ):
        for mains, models in zip(main_groups, model_groups):
            for main, p in zip(mains, models):
                if p not in templates:
                    continue  # another chunk's parameter
                adam = opt.optimizer.state.setdefault(main, {}) if allocate else \
                    opt.optimizer.state.get(main, {})
                if allocate:
                    for k in ("exp_avg", "exp_avg_sq"):
                        adam.setdefault(k, torch.zeros_like(main))
                missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in adam]
                if missing:
                    raise ValueError(
                        f"no Adam state {missing} for {templates[p].key}: no optimizer step "
                        f"has been taken, nothing to checkpoint as optimizer state (use "
                        f"--no-save-optim)")
                tensors = {"param": main, "exp_avg": adam["exp_avg"],
                           "exp_avg_sq": adam["exp_avg_sq"]}
                template = templates[p]
                state[index] = {
                    name: shard_boxes(template, f"optimizer.state.{name}.{template.key}",
                                      p.shape, ranges[p], t.view(-1))
                    for name, t in tensors.items()
                }
                index += 1
    return state


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
