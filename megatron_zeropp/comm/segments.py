"""Parameter-aligned wire layout for the quantized collectives (qwZ, qgZ).

A bucket holds many parameters back to back. Quantizing its chunks in plain blocks lets one
block cover the end of one parameter and the start of the next: a LayerNorm bias that shares a
block with LayerNorm weights near 1.0 gets the weights' scale and comes back with a 20-24 %
relative error. So the caller may describe the bucket as **segments**, ``(start, end, exact)``
element ranges that cover ``[0, numel)`` in order (one per parameter, its alignment padding
included), and every quantization block then lies inside one segment; ``exact`` segments
(small parameters: norms, biases) are not quantized at all and travel in a full-precision dtype.

A collective cuts the flat bucket into ``rows`` equal rows of ``row_numel`` elements (qwZ: the
Z shards; qgZ: the Z chunks). Row ``m``'s pieces are the segments intersected with it. On the
wire a row is::

    [ codes of W quantized elements | W / block_size fp32 scales | E exact elements ]

where the quantized pieces of the row are laid end to end, each zero-padded to whole blocks, and
``W`` / ``E`` are the largest quantized / exact widths over all rows (collectives need equal
rows; a row with less is padded with zeros, which quantize to code 0 with scale 0). The layout
is a pure function of ``(segments, rows, row_numel, block_size)``, so it is identical on every
rank, and the same row of every rank has the same layout (qgZ sums rows elementwise).

Cost, per row: at most ``block_size - 1`` padding elements per quantized piece, the exact
elements at their full width instead of ``bits / 8`` bytes, and the padding of rows up to the
widest one. ``docs/design.md`` gives the numbers for the test model and a GPT-124M layer.

With ``segments=None`` (or segments that make no difference: one quantized segment per row) the
layout is the **identity**: ``W = row_numel``, no exact part, no copies, blocks as before.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch

Segment = Tuple[int, int, bool]
"""``(start, end, exact)``: elements ``[start, end)`` of the bucket; ``exact`` = not quantized."""


def check_segments(segments, numel: int) -> Tuple[Segment, ...]:
    """Validate ``segments`` against a bucket of ``numel`` elements; returns them as a tuple.

    They must be ``(start, end, exact)`` with ints ``start < end``, ``exact`` a bool, starting at
    0, each starting where the previous ended, the last ending at ``numel``.
    """
    if not isinstance(segments, (tuple, list)) or not segments:
        raise ValueError(f"segments must be a non-empty list of (start, end, exact), got "
                         f"{segments!r}")
    out = []
    pos = 0
    for i, seg in enumerate(segments):
        if not isinstance(seg, (tuple, list)) or len(seg) != 3:
            raise ValueError(f"segment {i} must be (start, end, exact), got {seg!r}")
        start, end, exact = seg
        if (not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end))
                or not isinstance(exact, bool)):
            raise ValueError(f"segment {i} must be (int, int, bool), got {seg!r}")
        if start != pos or end <= start:
            raise ValueError(
                f"segment {i} is {seg!r}: segments must cover [0, {numel}) in order without gaps "
                f"or overlaps, and this one should start at {pos} and end after it"
            )
        out.append((start, end, exact))
        pos = end
    if pos != numel:
        raise ValueError(f"segments end at {pos}, the tensor has {numel} elements")
    return tuple(out)


class SegmentLayout:
    """Where each element of ``rows`` rows of ``row_numel`` elements goes on the wire."""

    def __init__(self, segments: Optional[Sequence[Segment]], rows: int, row_numel: int,
                 block_size: int):
        self.rows, self.row_numel, self.block_size = rows, row_numel, block_size
        numel = rows * row_numel
        segs = ((0, numel, False),) if segments is None else check_segments(segments, numel)
        q_pieces, e_pieces = [], []
        for m in range(rows):
            lo, hi = m * row_numel, (m + 1) * row_numel
            qs, es = [], []
            for start, end, exact in segs:
                a, b = max(start, lo) - lo, min(end, hi) - lo
                if a < b:
                    (es if exact else qs).append((a, b))
            q_pieces.append(qs)
            e_pieces.append(es)
        self.identity = all(qs == [(0, row_numel)] for qs in q_pieces)
        if self.identity:
            self.quant_numel, self.exact_numel = row_numel, 0
        else:
            self.quant_numel = max(sum(_padded(b - a, block_size) for a, b in qs)
                                   for qs in q_pieces)
            self.exact_numel = max(sum(b - a for a, b in es) for es in e_pieces)
        # Per row: (row-local start, end, wire column) of each piece, quantized and exact.
        self._q_pieces = [self._columns(qs, block_size) for qs in q_pieces]
        self._e_pieces = [self._columns(es, 1) for es in e_pieces]

    @staticmethod
    def _columns(pieces, align: int):
        out, col = [], 0
        for a, b in pieces:
            out.append((a, b, col))
            col += _padded(b - a, align)
        return out

    def exact_elements(self, row: int) -> int:
        """Exact elements row ``row`` really carries (the rest of ``exact_numel`` is padding)."""
        return sum(b - a for a, b, _ in self._e_pieces[row])

    def pieces(self, row: int, kind: str = "q"):
        """Row ``row``'s quantized (``"q"``) or exact (``"e"``) pieces as ``(start, end,
        wire column)``, row-local."""
        return list(self._q_pieces[row] if kind == "q" else self._e_pieces[row])

    def wire_positions(self, row: int) -> torch.Tensor:
        """Row-local element at each quantized wire column of row ``row`` (``-1`` = padding):
        what a test needs to check that no block spans two parameters."""
        if self.identity:
            return torch.arange(self.row_numel)
        pos = torch.full((self.quant_numel,), -1, dtype=torch.int64)
        for a, b, col in self._q_pieces[row]:
            pos[col : col + b - a] = torch.arange(a, b)
        return pos

    def gather(self, kind: str, x: torch.Tensor, rows: Sequence[int],
               local: bool = False) -> torch.Tensor:
        """Rows ``rows`` of the wire's quantized (``kind="q"``) or exact (``"e"``) part:
        ``(len(rows), W or E)`` in ``x``'s dtype, zeros at padding.

        ``x`` holds all rows (``rows * row_numel`` elements), or with ``local=True`` exactly
        the requested rows in that order (e.g. one rank's own shard). One slice copy per piece
        (about one per parameter and row), no per-element index tensors.
        """
        rows = tuple(rows)
        flat = x.reshape(-1)
        n = self.row_numel
        if kind == "q" and self.identity:
            if local or rows == tuple(range(self.rows)):
                return flat.view(len(rows), n)
            return flat.view(self.rows, n)[list(rows)]
        width = self.quant_numel if kind == "q" else self.exact_numel
        table = self._q_pieces if kind == "q" else self._e_pieces
        out = flat.new_zeros(len(rows), width)
        for i, m in enumerate(rows):
            base = (i if local else m) * n
            for a, b, col in table[m]:
                out[i, col : col + b - a] = flat[base + a : base + b]
        return out

    def scatter(self, out: torch.Tensor, rows: Sequence[int], quantized: torch.Tensor,
                exact: Optional[torch.Tensor], local: bool = False) -> None:
        """Write wire rows back into ``out`` (all rows, or with ``local=True`` just ``rows`` in
        that order, like :meth:`gather`): ``quantized (len(rows), >= W)``, ``exact
        (len(rows), E)``. Every element of the written rows is set (segments cover them)."""
        rows = tuple(rows)
        flat = out.view(-1)
        n = self.row_numel
        if self.identity:
            q = quantized[:, :n]
            if local or rows == tuple(range(self.rows)):
                flat.view(len(rows), n).copy_(q)
            else:
                flat.view(self.rows, n)[list(rows)] = q.to(out.dtype)
            return
        for table, vals in ((self._q_pieces, quantized), (self._e_pieces, exact)):
            for i, m in enumerate(rows):
                base = (i if local else m) * n
                for a, b, col in table[m]:
                    flat[base + a : base + b] = vals[i, col : col + b - a]


def _padded(n: int, align: int) -> int:
    return math.ceil(n / align) * align


@lru_cache(maxsize=4096)
def segment_layout(segments: Optional[Tuple[Segment, ...]], rows: int, row_numel: int,
                   block_size: int) -> SegmentLayout:
    """The (cached) layout of ``segments`` cut into ``rows`` rows of ``row_numel``."""
    return SegmentLayout(segments, rows, row_numel, block_size)


def layout_for(segments, rows: int, row_numel: int, block_size: int) -> SegmentLayout:
    """:func:`segment_layout` for any sequence of segments (``None`` = identity)."""
    if segments is not None:
        segments = tuple(tuple(s) for s in segments)
    return segment_layout(segments, rows, row_numel, block_size)


def param_segments(ranges: Sequence[Tuple[int, int]], numel: int,
                   exact_below: int) -> Tuple[Segment, ...]:
    """Segments of a bucket of ``numel`` elements holding parameters at ``ranges``.

    ``ranges`` are the parameters' ``(start, end)`` inside the bucket (any order, disjoint).
    Each segment runs from its parameter's start to the next one's (the alignment padding
    between them rides with the parameter before it; the first also takes any padding before
    it, the last the bucket's end padding). Parameters of fewer than ``exact_below`` elements are
    exact; ``exact_below=0`` quantizes all of them (still one block range per parameter).
    """
    ranges = sorted((int(a), int(b)) for a, b in ranges)
    if not ranges:
        return ((0, numel, False),)
    segs = []
    for i, (a, b) in enumerate(ranges):
        start = 0 if i == 0 else a
        end = numel if i == len(ranges) - 1 else ranges[i + 1][0]
        if end < b or b <= a:
            raise ValueError(f"parameter ranges {ranges} overlap or are empty (bucket of {numel})")
        segs.append((start, end, (b - a) < exact_below))
    return check_segments(segs, numel)
