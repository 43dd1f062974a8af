"""Counter-based random bits for stochastic rounding, identical in every backend.

Round-to-nearest is biased for values that are small against their block's scale: INT4 zeroes
everything below scale / 2 (on Gaussian blocks ~16 % of the entries, and a small persistent
gradient comes out at ~0.58 of its mean). Stochastic rounding, ``q = floor(y + u)`` with
``u ~ U[0, 1)``, is unbiased: ``E[q] = y``. For reruns to be bit-identical and the backends
(reference, C, Triton) to agree bit for bit, ``u`` is not drawn from torch's generator but
computed from a key and the element's position with one 32-bit hash defined here and copied
operation for operation into ``cpu_kernels.c`` and ``triton_kernels.py``.

Definition (since issue 22; before it, every element had its own hash and 24 random bits)::

    mix32(x) = lowbias32: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
               x ^= x >> 16                                   (all mod 2**32)
    h        = mix32((c >> 1) ^ k)                  one hash per pair of columns 2j, 2j + 1
    r(k, c)  = h & 0x7FFF if c is even else h >> 17                (15 random bits)
    q        = floor((fl(y + 384) - 384) + r * 2**-15)            (y as in round-to-nearest)

``c`` is the element's position in its (block-padded) row, ``k`` a 32-bit key per row. The
caller derives row keys with :func:`derive_key` from whatever must make them differ (seed,
iteration, rank, bucket, quantization point, chunk) and agree (the same values on a rerun).

Why 384, and why no clamp. ``|y| <= qmax (1 + 2**-23)`` (``qmax <= 127``): ``|x p| <= absmax p
= A`` and ``inv = fl(qmax / A) <= (qmax / A)(1 + 2**-24)``, so ``|y| <= fl(qmax (1 + 2**-24))``,
which is ``qmax`` or its fp32 successor. So ``y + 384`` lies in ``[256, 512)``, where fp32's
spacing is ``2**-15``: ``v = fl(y + 384)`` is 384 plus ``y`` rounded to nearest (even) on the
grid of ``2**-15``, and ``yr = v - 384`` is exact (Sterbenz). ``qmax 2**-23 < 2**-16`` is below
half that spacing, so ``|yr| <= qmax``. With ``yr = n + f 2**-15`` (integer n, ``0 <= f <
2**15``) and ``r`` uniform on ``[0, 2**15)``, ``yr + r 2**-15`` is exact (a multiple of
``2**-15`` below 128 in magnitude) and ``q = n + [r >= 2**15 - f]``: ``n`` or ``n + 1``, and
``n + 1`` only if ``f > 0``, so ``q`` stays in ``[-qmax, qmax]`` without a clamp, and
``E[q] = yr`` exactly.

Bias bound: ``|E[q] - y| = |yr - y| <= 2**-16`` of a quantization step, from the first rounding
(the old 24-bit definition had ``2**-25``). That is the size of the fp32 error already in ``y``
near ``qmax`` for INT8 (``2 qmax 2**-24``), and far below the noise of the rounding itself. The
pair's two 15-bit fields use 30 of the hash's 32 bits (bits 15 and 16 are unused).

The kernels compute the same ``q`` without a floor or any int/float conversion: ``v`` lies in
``[257, 511]`` (``|yr| <= 127``), so its bits are ``b = 0x43800000 + m`` (the exponent field of
``[256, 512)``) with mantissa ``m = (v - 256) 2**15 <= 255 * 2**15``. Since ``r < 2**15``,
``m + r < 2**23`` never carries into the exponent, and ``(b + r) >> 15 = 0x8700 + floor((m + r)
2**-15) = q + 0x8780``: one integer addition and one shift. ``q + 0x8780`` has ``q + 128``
(1 ... 255) in its low byte, so the code's bits are read off directly (INT8: XOR 0x80; INT4: the
low nibble, ``q``'s two's complement nibble).
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
    keys = torch.tensor([derive_key(base, r) for r in rows], dtype=torch.int64)
    return to_device(keys, device)


def to_device(keys: torch.Tensor, device) -> torch.Tensor:
    """``keys`` (or a row order) on ``device`` without synchronizing the host."""
    # The keys change every call, so they are built on the host each time. A blocking copy
    # would synchronize the host with the current stream (the comm stream, in training) on
    # every quantization; cudaMemcpyAsync from pageable memory stages the bytes before it
    # returns, so the host tensor may go at once, and the stream orders the copy before the
    # kernel that reads it.
    if device is None or torch.device(device) == keys.device:
        return keys
    return keys.to(device, non_blocking=True)


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


def random_bits(keys: torch.Tensor, numel: int) -> torch.Tensor:
    """int64 ``r (len(keys), numel)`` in ``[0, 2**15)``: ``h = mix32((c >> 1) ^ keys[row])``,
    ``r = h & 0x7FFF`` for even columns ``c`` and ``h >> 17`` for odd ones."""
    pairs = torch.arange(-(-numel // 2), dtype=torch.int64, device=keys.device)
    h = mix32_tensor(pairs[None, :] ^ keys.to(torch.int64)[:, None])
    r = torch.stack((h & 0x7FFF, h >> 17), dim=-1).view(keys.numel(), -1)
    return r[:, :numel]


def uniforms(keys: torch.Tensor, numel: int) -> torch.Tensor:
    """fp32 ``u = random_bits(keys, numel) * 2**-15`` (exact), in ``[0, 1)``."""
    return random_bits(keys, numel).to(torch.float32) * (2.0 ** -15)


def stochastic_round(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``floor((fl(y + 384) - 384) + u)`` in fp32, for ``|y| <= 127 (1 + 2**-23)`` and ``u``
    from :func:`uniforms`: the stochastic rounding of the module docstring (every step exact
    except the first addition, so no clamp is needed)."""
    yr = (y + 384.0) - 384.0
    return torch.floor(yr + u)


def check_keys(keys, rows: int) -> torch.Tensor:
    """``keys`` as an int64 tensor of ``rows`` entries in [0, 2**32), or ValueError."""
    if not isinstance(keys, torch.Tensor):
        keys = torch.tensor(list(keys), dtype=torch.int64)
    if keys.dtype != torch.int64 or keys.dim() != 1 or keys.numel() != rows:
        raise ValueError(f"row keys must be a 1-D int64 tensor of {rows} entries, got "
                         f"{keys.dtype} of shape {tuple(keys.shape)}")
    # Values are read on the host only: reading a device tensor's would be a host sync per
    # call. Keys on a device come from row_keys, whose values are in range by construction.
    if keys.numel() and keys.device.type == "cpu" and (
            int(keys.min()) < 0 or int(keys.max()) > MASK32):
        raise ValueError("row keys must lie in [0, 2**32)")
    return keys


def key_list(keys: torch.Tensor) -> List[int]:
    """Row keys as Python ints (for the C kernels)."""
    return [int(k) for k in keys.tolist()]


def permuted(keys: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``keys`` in the given row order."""
    return keys[to_device(torch.tensor(list(order), dtype=torch.int64), keys.device)]
