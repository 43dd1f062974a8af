"""qgZ's local steps in pure torch: the send order, swizzled quantization, dequantize-reduce.

qgZ reduce-scatters a flat gradient of ``numel`` elements (divisible by ``Z = K * N``: K nodes,
N DP ranks per node) with two all-to-alls instead of a ring, so every value is quantized once per
hop and summed in fp32 (a ring would requantize Z - 1 times). DP rank ``d = k * N + j`` (node k,
local index j) must end with chunk ``d`` (``numel / Z`` elements) of the sum, which is the layout
Megatron's distributed optimizer reads.

Deriving the send order
-----------------------
Hop 1 is an all-to-all among the N ranks of one node: local rank j' receives one piece from every
local rank and sums them. After hop 2 (an all-to-all among the K ranks with the same local index
j', one per node), rank (k', j') must hold chunk ``k' * N + j'``. So in hop 1, j' must receive
every chunk that some rank with local index j' will finally own: ``{k' * N + j' : k' < K}``, and
hop 2 sends the k'-th of them to node k'. An all-to-all sends the p-th slice of the buffer to rank
``p // K`` of the group, so the buffer is ordered by destination j' first, then k'::

    position p = j' * K + k'   holds   chunk  k' * N + j'

Worked example, 2 nodes x 4 (K=2, N=4, Z=8), from the point of view of any rank::

    position      0  1 | 2  3 | 4  5 | 6  7
    chunk         0  4 | 1  5 | 2  6 | 3  7      qgz_chunk_order(2, 4) = (0, 4, 1, 5, 2, 6, 3, 7)
    hop-1 dest    j'=0 | j'=1 | j'=2 | j'=3

After hop 1, local rank j' = 1 of node k holds, summed over its node, chunks (1, 5) as K = 2
rows. Hop 2 sends row k' to node k': chunk 1 to node 0 (DP rank 1), chunk 5 to node 1 (DP
rank 5). Summed over the two nodes, DP rank d holds chunk d of the full sum.

For one node (K = 1) the order is the identity and hop 2 is trivial; for N = 1 it is the identity
too and hop 1 is trivial.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .reference import (
    check_bits_and_block_size,
    check_codes,
    check_float_dtype,
    quantize_chunks,
    unpack_codes,
)


def qgz_chunk_order(nodes: int, ranks_per_node: int) -> Tuple[int, ...]:
    """Send position p -> chunk index, for K = ``nodes`` and N = ``ranks_per_node``.

    ``p = j' * K + k'`` holds chunk ``k' * N + j'`` (see the module docstring).
    """
    check_nodes(nodes, ranks_per_node)
    return tuple(
        (p % nodes) * ranks_per_node + p // nodes for p in range(nodes * ranks_per_node)
    )


def check_nodes(nodes: int, ranks_per_node: int) -> None:
    """Raise ``ValueError`` unless both are positive integers."""
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_swizzle_input(x_flat: torch.Tensor, nodes: int, ranks_per_node: int) -> int:
    """Validate a flat gradient for :func:`swizzled_quantize`; returns the chunk size."""
    check_nodes(nodes, ranks_per_node)
    check_float_dtype(x_flat.dtype, "input")
    z = nodes * ranks_per_node
    if x_flat.dim() != 1 or x_flat.numel() % z:
        raise ValueError(
            f"expected a 1-D tensor whose numel is divisible by nodes*ranks_per_node = {z} "
            f"(pad it first), got shape {tuple(x_flat.shape)}"
        )
    return x_flat.numel() // z


def swizzled_quantize(x_flat: torch.Tensor, nodes: int, ranks_per_node: int, bits: int,
                      block_size: int, row_keys: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reorder the Z chunks of ``x_flat`` into qgZ send order and quantize each as one row.

    Returns ``data (Z, nbytes)`` and ``scales (Z, nblocks)``, equal to
    ``quantize_chunks(x_flat.view(Z, -1)[qgz_chunk_order(...)], bits, block_size, row_keys)``
    (``row_keys`` in send order: stochastic rounding, :mod:`.rounding`).
    """
    check_bits_and_block_size(bits, block_size)
    chunk = check_swizzle_input(x_flat, nodes, ranks_per_node)
    order = torch.tensor(qgz_chunk_order(nodes, ranks_per_node), device=x_flat.device)
    return quantize_chunks(x_flat.view(-1, chunk)[order], bits, block_size, row_keys)


def check_reduce_input(data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                       numel: int, out_bits: Optional[int], out_block_size: Optional[int],
                       out_dtype: torch.dtype) -> int:
    """Validate :func:`dequantize_reduce` arguments; returns the output block size."""
    check_bits_and_block_size(bits, block_size)
    if data.dim() != 3:
        raise ValueError(f"expected data of shape (P, C, nbytes), got {tuple(data.shape)}")
    check_codes(data, scales, bits, block_size, numel)
    if data.shape[0] < 1:
        raise ValueError(f"need at least one piece to reduce, got data {tuple(data.shape)}")
    out_block_size = block_size if out_block_size is None else out_block_size
    if out_bits is None:
        check_float_dtype(out_dtype, "out_dtype")
    else:
        check_bits_and_block_size(out_bits, out_block_size)
    return out_block_size


def fma32(acc: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``acc + q * s`` rounded once to fp32 (a fused multiply-add), for integer codes ``q``.

    torch has no fused multiply-add for tensors, so it is emulated exactly: ``q * s`` is exact in
    fp64 (``|q| < 2**8`` times a 24-bit significand), and TwoSum gives ``hi + lo == acc + q * s``
    exactly. Rounding ``hi`` to fp32 is already right unless ``hi`` lies exactly halfway between two
    fp32 numbers while ``lo != 0``: then the exact sum is on ``lo``'s side of that midpoint, and the
    neighbour on that side is the answer. (A midpoint strictly between ``hi`` and the exact sum
    would be a closer fp64 number than ``hi``, which cannot be.) Past fp32's largest value, 2**128
    plays the part of the next fp32 number, so the overflow threshold is handled the same way.
    """
    a = acc.double()
    e = q.double() * s.double()
    hi = a + e
    b = hi - a
    lo = (a - (hi - b)) + (e - b)
    r = hi.float()
    r64 = r.double()
    past_max = torch.isinf(r) & torch.isfinite(hi)
    r64 = torch.where(past_max, torch.copysign(torch.full_like(hi, 2.0**128), hi), r64)
    inf = torch.full_like(r, float("inf"))
    other = torch.nextafter(r, torch.where(hi > r64, inf, -inf))  # fp32 neighbour on hi's side
    o64 = other.double()
    tie = (hi != r64) & (hi - r64 == o64 - hi)
    use_other = tie & (lo != 0) & ((lo > 0) == (o64 > r64))
    return torch.where(use_other, other, r)


def dequantize_reduce(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
    out_bits: Optional[int] = None, out_block_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32, out_row_keys: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Sum P received pieces of C quantized rows in fp32, then requantize or cast.

    ``data (P, C, nbytes)``, ``scales (P, C, nblocks)`` hold P pieces (one per sender) of C rows of
    ``numel`` elements each. Each element is summed in fp32 in piece order 0, 1, ..., P-1, each
    piece with one rounding: ``acc = fl(acc + q * s)`` (a fused multiply-add, see :func:`fma32`;
    it is both cheaper in the kernel and at least as accurate as rounding the product first). With
    ``out_bits`` set, every row is quantized again (``out_block_size`` defaults to ``block_size``)
    and ``(data (C, nbytes_out), scales (C, nblocks_out))`` is returned (rounded stochastically
    with ``out_row_keys``, :mod:`.rounding`); otherwise the sum is cast to ``out_dtype`` and
    returned as ``(C, numel)``.
    """
    out_block_size = check_reduce_input(data, scales, bits, block_size, numel, out_bits,
                                        out_block_size, out_dtype)
    pieces, rows, nbytes = data.shape
    nblocks = scales.shape[2]
    # An explicit left-to-right loop: torch.sum may reorder (pairwise / vectorized) additions,
    # and the kernels add in piece order.
    acc = torch.zeros(rows, nblocks * block_size, dtype=torch.float32, device=data.device)
    for p in range(pieces):
        q = unpack_codes(data[p], bits).view(rows, nblocks, block_size)
        acc = fma32(acc.view(rows, nblocks, block_size), q, scales[p].unsqueeze(-1))
    acc = acc.view(rows, nblocks * block_size)[:, :numel].contiguous()
    if out_bits is None:
        return acc.to(out_dtype)
    return quantize_chunks(acc, out_bits, out_block_size, out_row_keys)
