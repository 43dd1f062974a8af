"""The CPU backend: C kernels (``cpu_kernels.c``) compiled on first use, called through ctypes.

Every result is bit-identical to the reference, dequantize-reduce included: the C code adds each
piece with ``fmaf``, the fused multiply-add the reference emulates in fp64 (see
:func:`~megatron_zeropp.quant.qgz_reference.fma32`). The kernels read each input once and write
each output once, one block at a time in an L1 buffer; the pure-torch backend
(:mod:`.cpu_fast`) makes several full passes with fp32 temporaries.

Build. The source is compiled with the system C compiler (``$CC``, else ``cc`` / ``gcc``) into a
shared library cached under ``$ZEROPP_KERNEL_CACHE`` (default ``~/.cache/megatron_zeropp``),
named by a hash of the source, the flags and the compiler's version, so every process and test
on a machine shares one build (0.4 s of gcc 12 here). Ranks starting together take a file lock:
one compiles, the others wait and load its result. No torch headers and no Python extension
module: the kernels take raw pointers, so the build compiles one small C file and nothing else.
Flags: ``-O3 -ffp-contract=off`` (nothing fused that the reference rounds twice), plus
``-mavx2 -mfma`` when torch reports an AVX2-capable x86 CPU; without hardware FMA
``fmaf`` is libm's exact software version (correct, slower).

When it cannot be built, :func:`library` raises :class:`NativeUnavailable` with the compiler's
message; :mod:`megatron_zeropp.quant` then warns once and uses :mod:`.cpu_fast` (or raises, if
``ZEROPP_QUANT_BACKEND=cpu`` asked for this backend by name).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch

from . import reference as _ref
from .qgz_reference import check_reduce_input, check_swizzle_input, qgz_chunk_order
from .rounding import check_keys

CACHE_ENV = "ZEROPP_KERNEL_CACHE"
SOURCE = Path(__file__).with_name("cpu_kernels.c")
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class NativeUnavailable(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine (the message says why)."""


def compiler() -> Optional[str]:
    """The C compiler to use: ``$CC`` as given (build() reports it if it does not run), else
    ``cc`` or ``gcc`` from PATH, else None."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return shutil.which("cc") or shutil.which("gcc")


def compile_flags() -> List[str]:
    """The compiler flags for this machine (part of the cache key)."""
    flags = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
    if (platform.machine() in ("x86_64", "AMD64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        flags += ["-mavx2", "-mfma"]
    return flags


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron_zeropp"


def build(cc: Optional[str] = None, directory: Optional[Path] = None) -> Path:
    """Compile the kernels (or find the cached build); returns the shared library's path."""
    cc = compiler() if cc is None else cc
    if cc is None:
        raise NativeUnavailable("no C compiler found (set CC, or install gcc)")
    flags = compile_flags()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeUnavailable(f"cannot run the C compiler {cc!r}: {exc}") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    directory = cache_dir() if directory is None else Path(directory)
    lib = directory / f"zpp_cpu_kernels_{key}.so"
    if lib.exists():
        return lib
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():
                _compile(cc, flags, directory, lib)
    except OSError as exc:
        raise NativeUnavailable(f"cannot write the kernel cache {directory}: {exc}") from None
    return lib


def _compile(cc: str, flags: List[str], directory: Path, lib: Path) -> None:
    # A private name renamed into place: a reader never sees a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeUnavailable(f"compiling {SOURCE.name} with {cc}: {exc}") from None
        if proc.returncode != 0:
            raise NativeUnavailable(
                f"{cc} {' '.join(flags)} {SOURCE.name} failed (rc {proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: Union[str, Path]) -> ctypes.CDLL:
    """Open a built library and declare the kernels' signatures."""
    try:
        so = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {path}: {exc}") from None
    so.zpp_quantize_rows.argtypes = [_PTR, ctypes.c_int, _PTR, _I64, _I64, ctypes.c_int, _I64,
                                     _PTR, _PTR, _PTR]
    so.zpp_dequantize_rows.argtypes = [_PTR, _I64, _PTR, _I64, _I64, ctypes.c_int, _I64, _PTR,
                                       ctypes.c_int]
    so.zpp_dequantize_reduce.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int,
                                         _I64, ctypes.c_int, _I64, _PTR, _PTR, _PTR,
                                         ctypes.c_int, _PTR]
    for fn in (so.zpp_quantize_rows, so.zpp_dequantize_rows, so.zpp_dequantize_reduce):
        fn.restype = None
    return so


_LIB: Optional[ctypes.CDLL] = None
_ERROR: Optional[NativeUnavailable] = None


def library() -> ctypes.CDLL:
    """The process's kernels, built or loaded once; raises :class:`NativeUnavailable` (every
    call, with the first failure's message) when that failed."""
    global _LIB, _ERROR
    if _LIB is None and _ERROR is None:
        try:
            _LIB = load(build())
        except NativeUnavailable as exc:
            _ERROR = exc
    if _ERROR is not None:
        raise _ERROR
    return _LIB


def _as_kernel_input(x: torch.Tensor) -> torch.Tensor:
    """fp32 / bf16 as they are; fp16 converted (exact) since the kernels do not read it."""
    return x.to(torch.float32) if x.dtype == torch.float16 else x


def _rows(x2d: torch.Tensor, order: Optional[Tuple[int, ...]] = None):
    """(contiguous base tensor, int64 element offsets of the rows to quantize)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    idx = range(x2d.shape[0]) if order is None else order
    offsets = torch.tensor([i * x2d.stride(0) for i in idx], dtype=torch.int64)
    return x2d, offsets


def _keys_arg(keys: Optional[torch.Tensor], rows: int):
    """(pointer or None, the tensor to keep alive) for optional stochastic-rounding keys."""
    if keys is None:
        return None, None
    keys = check_keys(keys, rows).to("cpu").contiguous()
    return keys.data_ptr(), keys


def _quantize(x2d: torch.Tensor, bits: int, block_size: int,
              order: Optional[Tuple[int, ...]] = None,
              row_keys: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    x2d, offsets = _rows(_as_kernel_input(x2d), order)
    rows, numel = len(offsets), x2d.shape[1]
    nbytes, nblocks = _ref.quantized_sizes(numel, bits, block_size)
    data = torch.empty(rows, nbytes, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(rows, nblocks, dtype=torch.float32)
    keys_ptr, _keep = _keys_arg(row_keys, rows)
    library().zpp_quantize_rows(x2d.data_ptr(), _DTYPE_CODE[x2d.dtype], offsets.data_ptr(), rows,
                                numel, bits, block_size, data.data_ptr(), scales.data_ptr(),
                                keys_ptr)
    return data, scales


def _rows_in_place(data: torch.Tensor) -> torch.Tensor:
    """Codes whose rows are contiguous, copied only if they are not (strides are passed on)."""
    return data if data.stride(-1) == 1 else data.contiguous()


def _check_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the CPU kernels take CPU tensors, got one on {t.device}")


def quantize_chunks(x2d: torch.Tensor, bits: int, block_size: int,
                    row_keys: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """Bit-identical to the reference's ``quantize_chunks`` (stochastic rounding included)."""
    if x2d.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x2d.shape)}")
    _ref.check_float_dtype(x2d.dtype, "input")
    _ref.check_bits_and_block_size(bits, block_size)
    _check_cpu(x2d)
    return _quantize(x2d, bits, block_size, row_keys=row_keys)


def swizzled_quantize(x_flat: torch.Tensor, nodes: int, ranks_per_node: int, bits: int,
                      block_size: int, row_keys: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bit-identical to the reference's ``swizzled_quantize``; the chunks are read in send order
    where they lie (no reordered copy)."""
    _ref.check_bits_and_block_size(bits, block_size)
    chunk = check_swizzle_input(x_flat, nodes, ranks_per_node)
    _check_cpu(x_flat)
    return _quantize(x_flat.view(-1, chunk), bits, block_size,
                     qgz_chunk_order(nodes, ranks_per_node), row_keys)


def _output(rows: int, numel: int, dtype: torch.dtype, out: Optional[torch.Tensor]):
    """(tensor the kernel writes, tensor to return): fp16 goes through an fp32 buffer."""
    if dtype == torch.float16:
        return torch.empty(rows, numel, dtype=torch.float32), out
    if out is None:
        out = torch.empty(rows, numel, dtype=dtype)
    return out, out


def _finish(written: torch.Tensor, result: Optional[torch.Tensor], dtype: torch.dtype):
    if written.dtype == dtype:
        return written
    if result is None:
        return written.to(dtype)
    return result.copy_(written)


def dequantize_chunks(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                      numel: int, dtype: torch.dtype,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bit-identical to the reference's ``dequantize_chunks`` (into ``out`` when given)."""
    rows = _ref.check_dequantize_input(data, scales, bits, block_size, numel, dtype, out)
    _check_cpu(data)
    data, scales = _rows_in_place(data), scales.contiguous()
    written, result = _output(rows, numel, dtype, out)
    library().zpp_dequantize_rows(data.data_ptr(), data.stride(0), scales.data_ptr(), rows, numel,
                                  bits, block_size, written.data_ptr(),
                                  _DTYPE_CODE[written.dtype])
    return _finish(written, result, dtype)


def dequantize_reduce(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
    out_bits: Optional[int] = None, out_block_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32, out_row_keys: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Bit-identical to the reference's ``dequantize_reduce`` (a true fused multiply-add)."""
    out_block_size = check_reduce_input(data, scales, bits, block_size, numel, out_bits,
                                        out_block_size, out_dtype)
    _check_cpu(data)
    pieces, rows, _ = data.shape
    data, scales = _rows_in_place(data), scales.contiguous()
    lib = library()

    def kernel(*tail):
        lib.zpp_dequantize_reduce(data.data_ptr(), data.stride(0), data.stride(1),
                                  scales.data_ptr(), pieces, rows, numel, bits, block_size, *tail)

    if out_bits is None:
        written, _ = _output(rows, numel, out_dtype, None)
        kernel(0, out_block_size, None, None, written.data_ptr(), _DTYPE_CODE[written.dtype],
               None)
        return _finish(written, None, out_dtype)
    nbytes, nblocks = _ref.quantized_sizes(numel, out_bits, out_block_size)
    out_data = torch.empty(rows, nbytes, dtype=torch.int8 if out_bits == 8 else torch.uint8)
    out_scales = torch.empty(rows, nblocks, dtype=torch.float32)
    keys_ptr, _keep = _keys_arg(out_row_keys, rows)
    kernel(out_bits, out_block_size, out_data.data_ptr(), out_scales.data_ptr(), None, 0,
           keys_ptr)
    return out_data, out_scales
