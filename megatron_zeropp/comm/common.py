"""Helpers shared by the comm protocols: group lookups, argument checks, byte packing.

Kept apart from the protocols so each protocol module reads as its algorithm only.
"""

from __future__ import annotations

import contextvars
from typing import List, Tuple

import torch
import torch.distributed as dist

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_OPS = ("sum", "avg")


def group_ranks(group) -> List[int]:
    """Global ranks of ``group`` (``None`` = the default group), in group-rank order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


# (protocol name, CommStats) of the counted protocol call running in this context; set by
# work.run_protocol, read by the collective helpers below to record what they hand over.
CURRENT_CALL: contextvars.ContextVar = contextvars.ContextVar("zeropp_call", default=None)


def _record_handed(kind: str, group, tensor: torch.Tensor) -> None:
    call = CURRENT_CALL.get()
    if call is not None:
        protocol, stats = call
        stats.record_handed(protocol, kind, group_ranks(group), dist.get_rank(),
                            tensor.numel() * tensor.element_size())


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Synchronous equal-size all-gather of contiguous tensors, as flat buffers.

    Flat on both sides because gloo splits a 2-D output along dim 0 and then insists each piece
    has the input's exact shape. (The function's name differs across torch versions.)
    """
    _record_handed("all_gather", group, input)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output.view(-1), input.view(-1), group=group)


def reduce_scatter_from(output: torch.Tensor, input: torch.Tensor, op, group) -> None:
    """Synchronous equal-size reduce-scatter of contiguous tensors, as flat buffers."""
    _record_handed("reduce_scatter", group, input)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output.view(-1), input.view(-1), op=op, group=group)


def all_to_all_into(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Synchronous all-to-all with equal splits along dim 0."""
    _record_handed("all_to_all", group, input)
    dist.all_to_all_single(output, input, group=group)


def all_to_all_v_into(output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                      input_splits: List[int], group) -> None:
    """Synchronous all-to-all of flat uint8 buffers with uneven splits (bytes per group rank)."""
    call = CURRENT_CALL.get()
    if call is not None:
        protocol, stats = call
        stats.record_handed(protocol, "all_to_all", group_ranks(group), dist.get_rank(),
                            input.numel(), splits=list(input_splits))
    dist.all_to_all_single(output, input, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)


def check_tensor(name: str, t, dtypes=FLOAT_DTYPES, contiguous: bool = True) -> None:
    """Raise ``ValueError`` unless ``t`` is a non-empty tensor of an allowed dtype."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, dtypes))}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, stride {t.stride()}) must be contiguous: the "
            "collective writes it as one flat buffer"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def check_member(name: str, group) -> Tuple[List[int], int]:
    """(global ranks, my group rank) of ``group``; ``ValueError`` if this rank is not in it."""
    ranks = group_ranks(group)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of {name} {ranks}")
    return ranks, ranks.index(me)


def pack_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Concatenate quantized rows and their fp32 scales into one uint8 row per chunk.

    One collective per hop instead of two halves the latency-bound part of small messages.
    """
    return torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def unpack_rows(
    packed: torch.Tensor, nbytes: int, data_dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_rows` for a (..., nbytes + 4 * nblocks) uint8 tensor.

    The codes come back as a strided view into ``packed`` (no copy: the CPU kernels read rows
    where they lie, the Triton wrappers make them contiguous themselves)."""
    data = packed[..., :nbytes].view(data_dtype)  # 1-byte dtypes: a view at any stride
    # A fresh contiguous copy, not contiguous(): viewing bytes as fp32 needs offset 0 and strides
    # divisible by 4, and contiguous() may return the offset view itself when leading dims are 1.
    scale_bytes = packed[..., nbytes:].clone(memory_format=torch.contiguous_format)
    if scale_bytes.shape[-1] == 0:  # rows without quantized elements (all exact)
        return data, torch.empty(scale_bytes.shape, dtype=torch.float32, device=packed.device)
    scales = scale_bytes.view(torch.float32)
    return data, scales


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


def check_quant_args(bits, block_size) -> None:
    """Quantized width must be 4 or 8 bits; block size a positive int."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
