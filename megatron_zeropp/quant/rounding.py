"""Counter-based random numbers for stochastic rounding, identical in every backend.

Round-to-nearest is biased for values that are small against their block's scale: INT4 zeroes
everything below scale / 2 (on Gaussian blocks ~16 % of the entries, and a small persistent
gradient comes out at ~0.58 of its mean). Stochastic rounding, ``q = floor(y + u)`` with
``u ~ U[0, 1)``, is unbiased: ``E[q] = y``. For reruns to be bit-identical and the backends
(reference, C, Triton) to agree bit for bit, ``u`` is not drawn from torch's generator but
computed from a key and the element's position with one 32-bit hash defined here and copied
operation for operation into ``cpu_kernels.c`` and ``triton_kernels.py``::

    mix32(x) = lowbias32: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
               x ^= x >> 16                                   (all mod 2**32)
    u(row key k, column c) = (mix32(c ^ k) >> 8) * 2**-24     (exact in fp32, in [0, 1))
    q = clamp(floor(fl(y + u)), -qmax, qmax)                  (y as in round-to-nearest)

``c`` is the element's position in its (block-padded) row, ``k`` a 32-bit key per row. The
caller derives row keys with :func:`derive_key` from whatever must make them differ (seed,
iteration, rank, bucket, quantization point, chunk) and agree (the same values on a rerun).
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def mix32(x: int) -> int:
    """lowbias32 of a Python int (its low 32 bits)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def derive_key(*parts: int) -> int:
    """A 32-bit key from integers (each reduced mod 2**32), chained through :func:`mix32`."""
    k = 0x9E3779B9
    for p in parts:
        if not isinstance(p, int) or isinstance(p, bool):
            raise ValueError(f"key parts must be ints, got {p!r}")
        k = mix32(k ^ (p & MASK32))
        k = mix32(k ^ ((p >> 32) & MASK32))
    return k


def row_keys(base: int, rows: Iterable[int], device=None) -> torch.Tensor:
    """int64 tensor of ``derive_key(base, r)`` for each row id ``r`` (values < 2**32)."""
    return torch.tensor([derive_key(base, r) for r in rows], dtype=torch.int64, device=device)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` elementwise on an int64 tensor of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, numel: int) -> torch.Tensor:
    """fp32 ``u (len(keys), numel)``: ``u[r, c] = (mix32(c ^ keys[r]) >> 8) * 2**-24``."""
    cols = torch.arange(numel, dtype=torch.int64, device=keys.device)
    h = mix32_tensor(cols[None, :] ^ keys.to(torch.int64)[:, None])
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


def check_keys(keys, rows: int) -> torch.Tensor:
    """``keys`` as an int64 tensor of ``rows`` entries in [0, 2**32), or ValueError."""
    if not isinstance(keys, torch.Tensor):
        keys = torch.tensor(list(keys), dtype=torch.int64)
    if keys.dtype != torch.int64 or keys.dim() != 1 or keys.numel() != rows:
        raise ValueError(f"row keys must be a 1-D int64 tensor of {rows} entries, got "
                         f"{keys.dtype} of shape {tuple(keys.shape)}")
    if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) > MASK32):
        raise ValueError("row keys must lie in [0, 2**32)")
    return keys


def key_list(keys: torch.Tensor) -> List[int]:
    """Row keys as Python ints (for the C kernels)."""
    return [int(k) for k in keys.tolist()]


def permuted(keys: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``keys`` in the given row order."""
    return keys[torch.tensor(list(order), dtype=torch.int64, device=keys.device)]
