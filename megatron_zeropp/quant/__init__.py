"""Block quantization (INT8 / INT4) and qgZ's local steps, with a Triton and a reference backend.

Backend choice, per call: the Triton kernels for CUDA tensors when ``triton`` imports, the C
kernels (:mod:`.cpu_native`, compiled on first use) for CPU tensors, the pure torch reference
otherwise. If the C kernels cannot be built (no compiler), CPU tensors use the pure-torch CPU
backend (:mod:`.cpu_fast`) and a warning says so, once per process.
``ZEROPP_QUANT_BACKEND`` forces one: ``reference``, ``cpu`` (the C kernels; an error if they
cannot be built), ``cpu_torch``, ``triton`` (also on CPU tensors, which needs
``TRITON_INTERPRET=1`` set before triton is first imported) or ``auto`` (the default).
Triton, the C kernels and the reference give bit-identical results for round-to-nearest;
``cpu_torch`` is bit-identical except :func:`dequantize_reduce`, which rounds each product in
fp32 instead of fusing the multiply-add (bound in :mod:`.cpu_fast`). Stochastic rounding by row
keys (``row_keys=`` / ``out_row_keys=``, :mod:`.rounding`) runs in the Triton and C kernels,
bit-identical to the reference (``cpu_torch`` hands it to the reference); the torch-generator
stochastic rounding of :func:`quantize_blockwise` runs on the reference only. Importing this
package never imports megatron-core.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple, Union

import torch

from . import cpu_fast as _cpu_torch
from . import cpu_native as _native
from . import qgz_reference as _qgz_ref
from . import reference as _ref
from .qgz_reference import qgz_chunk_order
from .reference import QuantizedTensor, quantized_sizes

try:
    from . import triton_kernels as _triton
    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # CPU-only installs without triton keep the reference backend
    _triton = None
    _TRITON_IMPORT_ERROR = exc

BACKEND_ENV = "ZEROPP_QUANT_BACKEND"
_BACKENDS = ("auto", "reference", "cpu", "cpu_torch", "triton")
_warned_native = False

__all__ = [
    "BACKEND_ENV",
    "QuantizedTensor",
    "backend_for",
    "dequantize_blockwise",
    "dequantize_chunks",
    "dequantize_reduce",
    "qgz_chunk_order",
    "quantize_blockwise",
    "quantize_chunks",
    "quantized_sizes",
    "swizzled_quantize",
    "triton_available",
]


def triton_available() -> bool:
    """Whether the Triton kernels imported."""
    return _triton is not None


def backend_for(device: Union[torch.device, str]) -> str:
    """``"triton"``, ``"cpu"``, ``"cpu_torch"`` or ``"reference"``: what a call on ``device``
    tensors will use."""
    mode = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if mode not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {_BACKENDS}, got {mode!r}")
    if mode in ("reference", "cpu_torch"):
        return mode
    if mode == "cpu":
        try:
            _native.library()
        except _native.NativeUnavailable as exc:
            raise RuntimeError(f"{BACKEND_ENV}=cpu but the C kernels are unavailable: {exc}") \
                from None
        return "cpu"
    if mode == "triton":
        if _triton is None:
            raise RuntimeError(
                f"{BACKEND_ENV}=triton but triton could not be imported: {_TRITON_IMPORT_ERROR}"
            )
        return "triton"
    kind = torch.device(device).type
    if kind == "cuda" and _triton is not None:
        return "triton"
    if kind != "cpu":
        return "reference"
    return _cpu_backend()


def _cpu_backend() -> str:
    global _warned_native
    try:
        _native.library()
        return "cpu"
    except _native.NativeUnavailable as exc:
        if not _warned_native:
            _warned_native = True
            warnings.warn(
                f"megatron_zeropp.quant: the C kernels for CPU tensors are unavailable ({exc}); "
                f"using the slower pure-torch CPU backend (set {BACKEND_ENV}=cpu_torch to "
                "choose it and silence this)", RuntimeWarning, stacklevel=3)
        return "cpu_torch"


def _impl(device):
    return {"triton": _triton, "cpu": _native, "cpu_torch": _cpu_torch}.get(backend_for(device))


def _with_keys(impl, keys):
    """The backend module for a call; ``cpu_torch`` has no stochastic kernels: the reference."""
    if impl is None or (keys is not None and impl is _cpu_torch):
        return None
    return impl


def quantize_chunks(x2d: torch.Tensor, bits: int, block_size: int,
                    row_keys: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """Quantize each row of ``x2d (C, n)`` independently, padded per row to whole blocks.

    Returns ``data (C, nbytes)`` (int8, or uint8 holding two INT4 codes per byte) and fp32
    ``scales (C, nblocks)``; ``(nbytes, nblocks) = quantized_sizes(n, bits, block_size)``.
    ``row_keys`` (int64, one 32-bit key per row, :mod:`.rounding`): stochastic rounding.
    """
    impl = _with_keys(_impl(x2d.device), row_keys)
    if impl is None:
        return _ref.quantize_chunks(x2d, bits, block_size, row_keys)
    if row_keys is None:
        return impl.quantize_chunks(x2d, bits, block_size)
    return impl.quantize_chunks(x2d, bits, block_size, row_keys=row_keys)


def dequantize_chunks(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                      numel: int, dtype: torch.dtype,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_chunks`: ``(C, numel)`` in ``dtype``, written into ``out``
    (contiguous, that shape and dtype) when given, saving a copy."""
    impl = _impl(data.device)
    if impl is None:
        return _ref.dequantize_chunks(data, scales, bits, block_size, numel, dtype, out=out)
    return impl.dequantize_chunks(data, scales, bits, block_size, numel, dtype, out=out)


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block_size: int = 256, *,
                       stochastic: bool = False,
                       generator: Optional[torch.Generator] = None) -> QuantizedTensor:
    """Quantize ``x`` (any shape; bf16, fp16 or fp32) with one fp32 scale per block.

    See :mod:`megatron_zeropp.quant.reference` for the format, the error bound and what happens
    to zeros, NaN and Inf. ``stochastic=True`` always runs on the reference backend.
    """
    impl = _impl(x.device)
    if impl is None or stochastic:
        return _ref.quantize_blockwise(x, bits, block_size, stochastic=stochastic,
                                       generator=generator)
    _ref.check_bits_and_block_size(bits, block_size)
    _ref.check_float_dtype(x.dtype, "input")
    data, scales = impl.quantize_chunks(x.reshape(1, -1), bits, block_size)
    return QuantizedTensor(data[0], scales[0], bits, block_size, x.numel(), x.dtype, x.shape)


def dequantize_blockwise(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Back to a tensor of shape ``qt.shape`` in ``dtype`` (default: the original dtype)."""
    impl = _impl(qt.data.device)
    if impl is None:
        return _ref.dequantize_blockwise(qt, dtype)
    out = impl.dequantize_chunks(qt.data.view(1, -1), qt.scales.view(1, -1), qt.bits,
                                 qt.block_size, qt.numel, qt.dtype if dtype is None else dtype)
    return out.view(qt.shape)


def swizzled_quantize(x_flat: torch.Tensor, nodes: int, ranks_per_node: int, bits: int,
                      block_size: int, row_keys: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ's first step: the Z chunks of ``x_flat`` in send order, each quantized as one row.

    Equal to ``quantize_chunks(x_flat.view(Z, -1)[qgz_chunk_order(nodes, ranks_per_node)], ...)``;
    ``x_flat.numel()`` must be divisible by ``Z = nodes * ranks_per_node``. ``row_keys``: one per
    send position, stochastic rounding (:mod:`.rounding`).
    """
    impl = _with_keys(_impl(x_flat.device), row_keys)
    if impl is None:
        return _qgz_ref.swizzled_quantize(x_flat, nodes, ranks_per_node, bits, block_size,
                                          row_keys)
    if row_keys is None:
        return impl.swizzled_quantize(x_flat, nodes, ranks_per_node, bits, block_size)
    return impl.swizzled_quantize(x_flat, nodes, ranks_per_node, bits, block_size,
                                  row_keys=row_keys)


def dequantize_reduce(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
    out_bits: Optional[int] = None, out_block_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32, out_row_keys: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Sum P pieces ``data (P, C, nbytes)`` / ``scales (P, C, nblocks)`` in fp32, per element.

    Piece order 0..P-1, each piece added with one rounding (``fl(acc + q * s)``, a fused
    multiply-add) on the Triton, C (``cpu``) and reference backends; ``cpu_torch`` rounds the
    product too (``fl(acc + fl(q * s))``, within ``(3P - 2) * 2**-24 * sum |q * s|`` of the
    reference).

    With ``out_bits`` the C row sums are requantized (``out_block_size`` defaults to
    ``block_size``) and ``(data (C, nbytes_out), scales (C, nblocks_out))`` is returned; without,
    the sums are cast to ``out_dtype`` and returned as ``(C, numel)``. ``out_row_keys``: round
    the requantization stochastically (one key per row, :mod:`.rounding`).
    """
    impl = _with_keys(_impl(data.device), out_row_keys)
    fn = _qgz_ref.dequantize_reduce if impl is None else impl.dequantize_reduce
    if out_row_keys is None:
        return fn(data, scales, bits, block_size, numel, out_bits, out_block_size, out_dtype)
    return fn(data, scales, bits, block_size, numel, out_bits, out_block_size, out_dtype,
              out_row_keys=out_row_keys)
