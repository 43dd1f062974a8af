"""Randomized Hadamard rotation of quantization blocks (SDP4Bit-style smoothing for INT4).

A block of b values with a few outliers gets a scale set by the outliers, and every other value
of the block rounds to 0 or +-1 code. Rotating the block by ``R = H D`` (D a random +-1 diagonal,
H the normalized b x b Walsh-Hadamard matrix) spreads each outlier over the whole block, so the
absmax, and with it the scale and the error of every element, drops towards
``||x|| * sqrt(2 ln(2b) / b)`` instead of ``max |x|``.

R is orthonormal (H is symmetric with ``H H = I``, ``D D = I``), so ``R^-1 = D H`` and
``||R e|| = ||e||``: an error made in the rotated domain has the same norm after rotating back.
R is linear and the same on every rank (D from a shared seed), so sums of rotated blocks are
rotated sums: qgZ keeps the values rotated through both hops and rotates back once, on the final
chunk.

How H is applied depends on the device. On GPUs, the fast Walsh-Hadamard butterfly (log2 b
passes of fp32 adds and subtracts, memory-bound): a matmul there may run in TF32 (10-bit
mantissa) when the job allows it, which would round every gradient. On CPU, an fp32 matmul with
the b x b matrix: exact fp32 there, and about 8x faster than the butterfly's log2 b passes at
b = 128 (0.03 s vs 0.27 s for 7M elements, 2 cores). Both are fp32 with at most log2(b)
roundings per element per direction, so the round trip is within
``2 log2(b) * 2**-24 * ||x||`` of ``x`` (first order; the butterfly's roundings are on partial
sums of at most b terms, the matmul's on the dot products').
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

_SIGNS: Dict[Tuple[int, int, str], torch.Tensor] = {}
_MATRICES: Dict[Tuple[int, str], torch.Tensor] = {}


def check_rotation_block(block_size: int) -> None:
    """Raise ``ValueError`` unless ``block_size`` is a power of two >= 2."""
    if not isinstance(block_size, int) or block_size < 2 or block_size & (block_size - 1):
        raise ValueError(
            f"Hadamard rotation needs a power-of-two block size >= 2, got {block_size!r}"
        )


def random_signs(block_size: int, seed: int, device) -> torch.Tensor:
    """The +-1 diagonal D (fp32, ``block_size``), the same for the same seed on every rank
    (drawn on the CPU generator, then copied to ``device`` once and cached)."""
    check_rotation_block(block_size)
    key = (block_size, seed, str(torch.device(device)))
    d = _SIGNS.get(key)
    if d is None:
        g = torch.Generator().manual_seed(seed)
        bits = torch.randint(0, 2, (block_size,), generator=g)
        d = (bits * 2 - 1).to(torch.float32).to(device)
        _SIGNS[key] = d
    return d


def hadamard_matrix(block_size: int, device) -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix (Sylvester order, symmetric), fp32, cached."""
    check_rotation_block(block_size)
    key = (block_size, str(torch.device(device)))
    h = _MATRICES.get(key)
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < block_size:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        h = (h / math.sqrt(block_size)).to(device)
        _MATRICES[key] = h
    return h


def _apply_h(y: torch.Tensor, block_size: int) -> torch.Tensor:
    """H times every block of the flat fp32 ``y`` (see the module docstring for the choice)."""
    if y.device.type == "cpu":
        return (y.view(-1, block_size) @ hadamard_matrix(block_size, y.device)).view(-1)
    return fwht(y, block_size)


def fwht(y: torch.Tensor, block_size: int) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of every block of ``y`` by the butterfly (fp32,
    numel % b == 0); equals ``y.view(-1, b) @ hadamard_matrix(b)`` up to fp32 rounding."""
    rows = y.numel() // block_size
    h = 1
    while h < block_size:
        v = y.view(rows, block_size // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(-1) * (1.0 / math.sqrt(block_size))


def _check(x: torch.Tensor, block_size: int) -> None:
    check_rotation_block(block_size)
    if x.dtype != torch.float32:
        raise ValueError(f"Hadamard rotation works in fp32, got {x.dtype}")
    if x.numel() % block_size:
        raise ValueError(
            f"Hadamard rotation: {x.numel()} elements are not whole blocks of {block_size} "
            f"(block boundaries must align with the chunks; pad each chunk first)"
        )


def rotate_blocks(x: torch.Tensor, block_size: int, seed: int) -> torch.Tensor:
    """``H D`` applied to each consecutive block of ``block_size`` elements of fp32 ``x``;
    returns a new flat tensor."""
    _check(x, block_size)
    d = random_signs(block_size, seed, x.device)
    return _apply_h((x.reshape(-1, block_size) * d).reshape(-1), block_size)


def unrotate_blocks(y: torch.Tensor, block_size: int, seed: int) -> torch.Tensor:
    """The inverse, ``D H`` per block; returns a new flat tensor."""
    _check(y, block_size)
    d = random_signs(block_size, seed, y.device)
    return (_apply_h(y.reshape(-1), block_size).view(-1, block_size) * d).view(-1)
