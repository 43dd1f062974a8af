"""Bytes per training iteration of ZeRO-3 and the ZeRO++ configurations, by protocol and by
intra-/inter-node, measured in training on simulated nodes.

Launch (CPU, gloo; about a minute on 2 cores)::

    python benchmarks/comm_volume.py                               # 2x4 and 4x2, 8 configurations
    python benchmarks/comm_volume.py --layouts 2x2 --configs ZeRO-3 --layers 1 --hidden 32

DP = nodes x ranks per node (TP = PP = 1), a bf16 megatron-core GPT, one micro-batch per rank:
one iteration is one forward gather, one backward gather and one gradient reduction per unit.
The second iteration is counted (prefetch is on from the second). Bytes are what this rank sent,
as the collectives count them (``megatron_zeropp.comm.accounting``: a ring collective whose group
spans nodes is charged wholly inter-node; all-to-all exactly per destination), in units of M:
M = 16-bit parameter elements of one rank's model chunk, so 1.0 = 2M bytes.

"node link" is what one node's inter-node link carries per iteration (one direction): one
rank's ring bytes (a ring crosses each node boundary once per step) plus the all-to-all bytes of
all the node's ranks; it is the paper's "3M -> 0.75M" quantity. Each layout ends with a check that
``tools/project_throughput.py``'s replay of the accounting model gives exactly the measured bytes
for the measured bucket sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Sequence, Tuple

import _workload as W

from megatron_zeropp.simulated_nodes import run_distributed

_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def parse_layout(text: str) -> Tuple[int, int]:
    """"2x4" -> (2 nodes, 4 ranks per node)."""
    try:
        nodes, rpn = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout must look like NODESxRANKS, e.g. 2x4, got {text!r}") from None
    if nodes < 1 or rpn < 1:
        raise ValueError(f"layout {text!r}: nodes and ranks per node must be >= 1")
    return nodes, rpn


def measure(layouts: Sequence[Tuple[int, int]], names: Sequence[str], spec: W.ModelSpec,
            iterations: int = 2, timeout: float = 600.0) -> Dict[Tuple[int, int], dict]:
    """Run every configuration on every layout; {(nodes, rpn): {name: rank 0's result, plus
    "ranks_agree": whether every rank sent the same bytes}}."""
    unknown = [n for n in names if n not in W.CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {list(W.CONFIGS)}")
    out = {}
    for nodes, rpn in layouts:
        per_rank = run_distributed(W.measure_volume, nodes, rpn, args=(list(names), spec,
                                   iterations), timeout=timeout)
        res = per_rank[0]
        for name in names:
            res[name]["ranks_agree"] = all(r[name]["counts"] == res[name]["counts"]
                                           for r in per_rank)
        out[(nodes, rpn)] = res
    return out


def summary_table(results: dict, ranks_per_node: int) -> str:
    """One row per configuration: inter-node bytes per phase, totals, ratio to ZeRO-3."""
    rows = ["| configuration | forward inter | backward inter | grad inter | **inter total** | "
            "intra total | node link | inter vs ZeRO-3 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = results.get("ZeRO-3")
    for name, r in results.items():
        c, unit = r["counts"], 2.0 * r["elements"]
        inter = W.total_bytes(c, locality="inter")
        ratio = f"{inter / W.total_bytes(base['counts'], locality='inter'):.3f}" if base else "-"
        phases = [W.total_bytes(c, ph, "inter") / unit for ph in W.PHASES]
        rows.append(
            f"| {name} | " + " | ".join(f"{v:.4f}" for v in phases)
            + f" | **{inter / unit:.4f}** | {W.total_bytes(c, locality='intra') / unit:.4f} | "
            f"{W.node_link(c, ranks_per_node) / unit:.4f} | {ratio} |"
        )
    return "\n".join(rows)


def detail_table(results: dict) -> str:
    """One row per (configuration, phase, protocol): payload and scales, intra and inter."""
    rows = ["| configuration | phase | protocol | calls | intra payload | intra scales | "
            "inter payload | inter scales |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        unit = 2.0 * r["elements"]
        for phase in W.PHASES:
            protos = sorted({k.split("|")[0] for k in r["counts"].get(phase, {})})
            for proto in protos:
                vals = [W.total_bytes(r["counts"], phase, loc, prt, (proto,)) / unit
                        for loc in ("intra", "inter") for prt in ("payload", "scales")]
                rows.append(f"| {name} | {phase} | {proto} | {r['calls'][phase].get(proto, 0)} | "
                            + " | ".join(f"{v:.4f}" for v in vals) + " |")
    return "\n".join(rows)


def replayed(name: str) -> bool:
    """Whether the projection tool's byte model covers configuration ``name``: it does not
    model qwZ's weight differences (their sends depend on the hpZ holders and the step)."""
    return not W.CONFIGS[name].qwz_diff_bits


def replay(result: dict, nodes: int, rpn: int, config) -> dict:
    """The projection tool's byte model for one measured result's buckets and segments under
    ``config`` (a :class:`ZeroPPConfig`), in the measured counts' table form."""
    if _TOOLS not in sys.path:
        sys.path.insert(0, _TOOLS)
    from project_throughput import iteration_counts

    return W.counts_table_row(iteration_counts(result["buckets"], nodes, rpn, config,
                                               result.get("segments")))


def model_check(results: dict, nodes: int, rpn: int) -> List[str]:
    """Configurations whose measured bytes differ from the projection tool's replay (those
    it does not model, see :func:`replayed`, are left out)."""
    return [name for name, r in results.items()
            if replayed(name) and replay(r, nodes, rpn, W.CONFIGS[name]) != r["counts"]]


def report(measured: Dict[Tuple[int, int], dict], spec: W.ModelSpec) -> str:
    """The markdown the docs take: per layout a summary and a detail table."""
    parts = []
    for (nodes, rpn), results in measured.items():
        m = next(iter(results.values()))["elements"]
        z = nodes * rpn
        agree = all(r["ranks_agree"] for r in results.values())
        bad = model_check(results, nodes, rpn)
        unmodelled = [n for n in results if not replayed(n)]
        parts.append(
            f"### {nodes} nodes x {rpn} ranks (DP {z}), M = {m} elements\n\n"
            f"Bytes rank 0 sent in one iteration, in units of 2M bytes "
            f"({'every rank sent the same' if agree else 'RANKS DIFFER: rank 0 shown'}).\n\n"
            + summary_table(results, rpn) + "\n\n" + detail_table(results) + "\n\n"
            + ("Byte model replay (`tools/project_throughput.py`) = measured, for every "
               "configuration it models." if not bad else f"Byte model replay DIFFERS for {bad}.")
            + (f" Not in the byte model: {unmodelled}." if unmodelled else "")
        )
    return "\n\n".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="2x4,4x2", help="comma list of NODESxRANKS")
    p.add_argument("--configs", default=",".join(W.CONFIGS), help="comma list of configurations")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--json", help="also write the raw counts here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    spec = W.ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab,
                       seq=a.seq)
    layouts = [parse_layout(t) for t in a.layouts.split(",")]
    names = [n.strip() for n in a.configs.split(",")]
    print(f"machine: {W.machine_summary()}")
    print(f"model: {spec}\n")
    measured = measure(layouts, names, spec, a.iterations)
    print(report(measured, spec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{n}x{r}": v for (n, r), v in measured.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
