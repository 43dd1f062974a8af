"""Helpers shared by the comm protocols: group lookups, argument checks, byte packing.

Kept apart from the protocols so each protocol module reads as its algorithm only.
"""

from __future__ import annotations

import contextvars
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import lab_transport as lab_transport_module
from .lab_transport import TIMES

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_OPS = ("sum", "avg")


def group_ranks(group) -> List[int]:
    """Global ranks of ``group`` (``None`` = the default group), in group-rank order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_size(group) -> int:
    return dist.get_world_size(group)


# (protocol name, CommStats) of the counted protocol call running in this context; set by
# work.run_protocol, read by the collective helpers below to record what they hand over.
CURRENT_CALL: contextvars.ContextVar = contextvars.ContextVar("zeropp_call", default=None)


def _record_handed(kind: str, group, tensor: torch.Tensor) -> None:
    call = CURRENT_CALL.get()
    if call is not None:
        protocol, stats = call
        stats.record_handed(protocol, kind, group_ranks(group), dist.get_rank(),
                            tensor.numel() * tensor.element_size())


# The numerics lab (``--ranks-share-gpu``) runs Z ranks on one GPU, which NCCL refuses (one rank
# per device), so its collectives take one of two transports (``--lab-transport``):
#
# * ``shared`` (:mod:`.lab_transport`): device copies between the ranks' IPC-shared buffers,
#   ordered by a host barrier and CUDA IPC events; on CPU the same code over shared memory.
# * ``host``: host staging. A staged call copies its input to host memory, runs the same gloo
#   collective on the copy and copies the result back. The copies are blocking on the current
#   stream (a protocol's CUDA lane, ``work.py``), which has waited for the caller's stream: the
#   host copy sees the lane's and the caller's last writes, and the device output is written
#   before the lane's completion event is recorded, so ``handle.wait()`` keeps its meaning.
#   Staging is also what a CUDA tensor on a gloo group needs outside the lab (gloo has no
#   reduce-scatter for CUDA tensors).
#
# Either way the bytes moved, and so every bit downstream, are those of the direct call (a
# reduce-scatter's sum order aside, see lab_transport).
LAB_TRANSPORTS = ("shared", "host")
_LAB_TRANSPORT: Optional[str] = None
_SHARED = None  # the lab_transport.SharedTransport of this process


def set_lab_transport(name: Optional[str], timeout_s: float = 600.0) -> None:
    """Route every collective of this module through the lab's transport ``name`` (one of
    :data:`LAB_TRANSPORTS`; ``None``: direct calls), CPU tensors included: forcing it on CPU runs
    the lab's exact code path without a GPU, which is how it is tested against the direct path
    (``tests/test_numerics_lab.py``, ``tests/test_lab_transport.py``). ``timeout_s``: how long
    the shared transport waits for a member at a barrier before raising."""
    global _LAB_TRANSPORT, _SHARED
    if name is not None and name not in LAB_TRANSPORTS:
        raise ValueError(f"lab transport must be one of {LAB_TRANSPORTS} or None, got {name!r}")
    _LAB_TRANSPORT = name
    if name == "shared":
        if _SHARED is None or _SHARED.timeout_s != timeout_s:
            _SHARED = lab_transport_module.SharedTransport(timeout_s)
    else:
        _SHARED = None


def set_host_staging(force: bool) -> None:
    """Stage every collective of this module through host memory (the ``host`` lab transport),
    or stop routing through a lab transport."""
    set_lab_transport("host" if force else None)


def lab_transport_name() -> Optional[str]:
    """The lab transport this process routes its collectives through (``None``: direct)."""
    return _LAB_TRANSPORT


def host_staging_forced() -> bool:
    """Whether host staging was forced in this process (``set_host_staging`` / the ``host``
    lab transport)."""
    return _LAB_TRANSPORT == "host"


def _shared():
    return _SHARED if _LAB_TRANSPORT == "shared" else None


def _staged(group, tensor: torch.Tensor) -> bool:
    if _LAB_TRANSPORT == "host":
        return True
    return tensor.device.type == "cuda" and dist.get_backend(group) == "gloo"


def _host_empty(like: torch.Tensor) -> torch.Tensor:
    # Pinned where there is a device to copy from (torch caches pinned blocks); the copies stay
    # blocking, so a block is never handed out again while a transfer still reads it.
    return torch.empty(like.shape, dtype=like.dtype, device="cpu",
                       pin_memory=like.device.type == "cuda")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cuda":
        # Split out of the blocking copy for --lab-timers: the wait for the lane to drain.
        start = time.perf_counter()
        torch.cuda.current_stream(t.device).synchronize()
        TIMES.add("host.wait_device", time.perf_counter() - start)
    start = time.perf_counter()
    host = _host_empty(t)
    host.copy_(t)
    TIMES.add("host.to_host", time.perf_counter() - start, t.numel() * t.element_size())
    return host


def _from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    start = time.perf_counter()
    dst.copy_(host)
    TIMES.add("host.from_host", time.perf_counter() - start, host.numel() * host.element_size())


def _gloo(fn, *args, **kwargs) -> None:
    start = time.perf_counter()
    fn(*args, **kwargs)
    TIMES.add("host.gloo", time.perf_counter() - start)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Synchronous equal-size all-gather of contiguous tensors, as flat buffers.

    Flat on both sides because gloo splits a 2-D output along dim 0 and then insists each piece
    has the input's exact shape. (The function's name differs across torch versions.)
    """
    _record_handed("all_gather", group, input)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if _shared() is not None:
        _shared().all_gather(output, input, group)
        return
    if _staged(group, input):
        host_out = _host_empty(output)
        _gloo(fn, host_out.view(-1), _to_host(input).view(-1), group=group)
        _from_host(output, host_out)
        return
    fn(output.view(-1), input.view(-1), group=group)


def reduce_scatter_from(output: torch.Tensor, input: torch.Tensor, op, group) -> None:
    """Synchronous equal-size reduce-scatter of contiguous tensors, as flat buffers."""
    _record_handed("reduce_scatter", group, input)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if _shared() is not None:
        _shared().reduce_scatter(output, input, op, group)
        return
    if _staged(group, input):
        host_out = _host_empty(output)
        _gloo(fn, host_out.view(-1), _to_host(input).view(-1), op=op, group=group)
        _from_host(output, host_out)
        return
    fn(output.view(-1), input.view(-1), op=op, group=group)


def all_to_all_into(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Synchronous all-to-all with equal splits along dim 0."""
    _record_handed("all_to_all", group, input)
    if _shared() is not None:
        _shared().all_to_all(output, input, group)
        return
    if _staged(group, input):
        host_out = _host_empty(output)
        _gloo(dist.all_to_all_single, host_out, _to_host(input), group=group)
        _from_host(output, host_out)
        return
    dist.all_to_all_single(output, input, group=group)


def all_to_all_v_into(output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                      input_splits: List[int], group) -> None:
    """Synchronous all-to-all of flat uint8 buffers with uneven splits (bytes per group rank)."""
    call = CURRENT_CALL.get()
    if call is not None:
        protocol, stats = call
        stats.record_handed(protocol, "all_to_all", group_ranks(group), dist.get_rank(),
                            input.numel(), splits=list(input_splits))
    if _shared() is not None:
        _shared().all_to_all_v(output, input, output_splits, input_splits, group)
        return
    if _staged(group, input):
        host_out = _host_empty(output)
        _gloo(dist.all_to_all_single, host_out, _to_host(input),
              output_split_sizes=list(output_splits), input_split_sizes=list(input_splits),
              group=group)
        _from_host(output, host_out)
        return
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


def code_dtype(bits: int) -> torch.dtype:
    """dtype of quantized codes on the wire: int8 for INT8, packed uint8 for INT4."""
    return torch.int8 if bits == 8 else torch.uint8


def empty_codes(rows: int, bits: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``rows`` rows of 0 elements (a bucket whose every parameter travels
    exactly): the kernels are not called on empty rows."""
    return (torch.empty(rows, 0, dtype=code_dtype(bits), device=device),
            torch.empty(rows, 0, dtype=torch.float32, device=device))


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


def check_rounding_key(rounding_key) -> None:
    """A stochastic-rounding key is a 32-bit unsigned int, or None (round to nearest)."""
    if rounding_key is not None and (not isinstance(rounding_key, int)
                                     or isinstance(rounding_key, bool)
                                     or not 0 <= rounding_key < 2**32):
        raise ValueError(f"rounding_key must be an int in [0, 2**32) or None, got "
                         f"{rounding_key!r}")


def check_quant_args(bits, block_size) -> None:
    """Quantized width must be 4 or 8 bits; block size a positive int."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
