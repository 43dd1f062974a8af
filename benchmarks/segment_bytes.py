"""Wire bytes of parameter-aligned qwZ / qgZ blocks vs blocks across parameters (arithmetic).

    python benchmarks/segment_bytes.py --hidden 768 2048 --layouts 2x4 2x8 8x8

One GPT transformer layer (local spec, ffn = 4 x hidden, biases, LayerNorm with bias) laid out
as megatron-core lays out its bucket (reverse registration order, each parameter start padded
to 64 elements, the bucket end to lcm(Z, 128)); per DP layout K x N the bytes one rank sends per
qwZ gather (to all Z - 1 others, ring model) and per qgZ reduction (hop 1 to the N - 1 node
peers, hop 2 to the K - 1 other nodes), computed by the same layout code the collectives use
(``megatron_zeropp.comm.segments``). No process group, no model: sizes only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_zeropp.comm.accounting import CommStats  # noqa: E402
from megatron_zeropp.comm.qgz import qgz_plan, record_plan_bytes  # noqa: E402
from megatron_zeropp.comm.segments import layout_for, param_segments  # noqa: E402
from megatron_zeropp.quant import quantized_sizes  # noqa: E402


def layer_bucket(hidden: int, z: int):
    """(parameter ranges, bucket numel) of one layer, in megatron-core's buffer order."""
    h = hidden
    sizes = [h, 4 * h * h, 4 * h, 4 * h * h, h, h, 3 * h, 3 * h * h, h, h * h, h, h]
    ranges, pos = [], 0
    for n in sizes:
        pos = math.ceil(pos / 64) * 64
        ranges.append((pos, pos + n))
        pos += n
    div = math.lcm(z, 128)
    return ranges, math.ceil(pos / div) * div


def bytes_sent(segs, k: int, n: int, numel: int, grad_itemsize: int):
    """Bytes per rank, averaged over the Z ranks: (qwZ gather, qgZ hop 1, qgZ hop 2), as the
    collectives' own byte accounting (``comm/accounting.py``) charges them."""
    z, c = k * n, numel // (k * n)
    lq = layout_for(segs, z, c, 256)
    lg = layout_for(segs, z, c, 128)
    nbytes, nblocks = quantized_sizes(lq.quant_numel, 8, 256)
    plan = qgz_plan(numel, k, n, (4, 4), 128, None if segs is None else lg, grad_itemsize)
    qwz = hop1 = hop2 = 0
    for d in range(z):
        kk, j = divmod(d, n)
        s = CommStats(ranks_per_node=n)
        s.record_ring("qwz", list(range(z)), nbytes, 4 * nblocks)
        if lq.exact_numel:
            s.record_all_to_all("qwz", list(range(z)), d, 2 * lq.exact_elements(d))
        qwz += s.step().total()
        s = CommStats(ranks_per_node=n)
        record_plan_bytes(
            s, plan, [kk * n + i for i in range(n)], [i * n + j for i in range(k)], d, j)
        counts = s.step()
        hop1 += counts.total(locality="intra")
        hop2 += counts.total(locality="inter")
    return qwz / z, hop1 / z, hop2 / z


def table(hidden: int, layouts, threshold: int, grad_itemsize: int) -> str:
    lines = [f"hidden {hidden}: one layer, {threshold=}, grads {8 * grad_itemsize}-bit; "
             "bytes sent per rank, parameter-aligned / blocks across parameters",
             "| K x N | qwZ INT8/256 | qgZ INT4/128 hop 1 (intra) | hop 2 (inter) |",
             "|---|---|---|---|"]
    for k, n in layouts:
        ranges, numel = layer_bucket(hidden, k * n)
        new = bytes_sent(param_segments(ranges, numel, threshold), k, n, numel, grad_itemsize)
        old = bytes_sent(None, k, n, numel, grad_itemsize)
        cells = [f"{a:.0f} / {b:.0f} ({a / b - 1:+.2%})" if b else "0"
                 for a, b in zip(new, old)]
        lines.append(f"| {k} x {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[768, 2048])
    p.add_argument("--layouts", nargs="+", default=["2x4", "2x8", "8x8"],
                   help="K x N: nodes x DP ranks per node")
    p.add_argument("--threshold", type=int, default=100_000)
    p.add_argument("--grad-bits", type=int, choices=(16, 32), default=32,
                   help="gradient dtype width (megatron-core reduces fp32 grads by default)")
    args = p.parse_args(argv)
    layouts = [tuple(int(v) for v in s.split("x")) for s in args.layouts]
    for h in args.hidden:
        print(table(h, layouts, args.threshold, args.grad_bits // 8))
        print()


if __name__ == "__main__":
    main()
