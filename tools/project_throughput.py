"""Project the step time of ZeRO-3 and ZeRO++ at scale with an alpha-beta model.

Usage::

    python tools/project_throughput.py                  # the ZeRO++ paper's two 384-GPU settings
    python tools/project_measured.py runs/shaped/results.json   # from GPU measurements
    python tools/project_throughput.py --params 7e9 --tokens-per-gpu 4096 --gpus-per-node 8 \\
        --nodes 16 --tflops 400 --inter-gbit 400 --intra-gbyte 300 [--overlap]

Byte counts: not typed in by hand. For every configuration the tool replays, for one rank, the
calls the sharding layer makes per unit (forward gather, backward gather, gradient reduction)
into :class:`megatron_zeropp.comm.CommStats`, with the sizes the protocols themselves use
(``megatron_zeropp.quant.quantized_sizes`` for qwZ, ``megatron_zeropp.comm.qgz_plan`` for qgZ,
``ceil(numel / N)`` 16-bit elements plus an 8-byte version tag for hpZ). That is the accounting
model the training code counts with; ``benchmarks/comm_volume.py`` checks, bucket by bucket, that
this replay gives exactly the bytes measured in training.

Time model, per iteration and per GPU (TP = PP = 1: the model chunk is the whole model, M = P)::

    compute   = 6 * P * tokens_per_gpu / (tflops * 1e12)
    comm      = sum over the collectives of   bytes / bandwidth  +  calls * (g - 1) * alpha
    step      = compute + comm                 (default: no overlap)
              = max(compute, comm)             (--overlap: perfect overlap, a lower bound)

Bandwidths: a ring collective whose group spans nodes (ZeRO-3's gathers and reduce-scatter, qwZ)
is paced by its cross-node edge; each node's link carries one edge of the ring, i.e. the bytes
ONE rank sends, so it runs at the node's inter-node bandwidth (``--nic-share node``, the default;
``--nic-share gpu`` instead gives each GPU 1/G of the link, which is what the per-rank byte count
naively suggests and far too pessimistic for rings). An all-to-all (qgZ's inter-node hop) sends
every rank's bytes across nodes at once, so it gets 1/G of the node's link per GPU. Intra-node
traffic (hpZ, qgZ's first hop, a ring inside one node) runs at ``--intra-gbyte`` per GPU.
Latency: ``alpha`` per step, ``g - 1`` steps per collective of a group of ``g`` ranks, per call.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# megatron-core (imported by the sharding package) warns about optional GPU libraries on import.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from megatron_zeropp.comm import CommStats, StepCounts, qgz_plan  # noqa: E402
from megatron_zeropp.comm.qgz import record_plan_bytes as record_qgz  # noqa: E402
from megatron_zeropp.comm.segments import layout_for  # noqa: E402
from megatron_zeropp.quant import quantized_sizes  # noqa: E402
from megatron_zeropp.sharding import ZeroPPConfig  # noqa: E402

PHASES = ("forward", "backward", "grad")
HPZ_TAG_BYTES = 8  # the int64 weight version hpZ appends to every slice (comm/hpz.py)
ALL_TO_ALL = {"qgz_reduce_scatter"}

CONFIGS: Dict[str, ZeroPPConfig] = {
    "ZeRO-3": ZeroPPConfig(),
    "qwZ+hpZ": ZeroPPConfig(qwz=True, hpz=True),
    # the paper's protocol, which its runs measured: INT4 gradients on both qgZ hops (this
    # project's defaults are INT8 on both: the intra-node hop as SDP4Bit, the cross-node one
    # since the 125M loss study)
    "ZeRO++": ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_intra_bits=4, qgz_inter_bits=4),
}

# The ZeRO++ paper's 384-GPU runs (18B model, 48 nodes x 8 V100) and what it measured.
PAPER_SETTINGS = (
    dict(label="1 IB link, 1K tokens/GPU", tokens=1024, inter_gbit=100.0,
         paper_zero3=14.15, paper_zeropp=30.57, paper_speedup=2.16),
    dict(label="8 IB links, 2K tokens/GPU", tokens=2048, inter_gbit=800.0,
         paper_zero3=47.31, paper_zeropp=53.65, paper_speedup=1.13),
)


# -- bytes: the project's accounting model, replayed ------------------------------------------
def iteration_counts(
    bucket_sizes: Sequence[int], nodes: int, ranks_per_node: int, zeropp: ZeroPPConfig,
    segments: Optional[Sequence] = None, grad_itemsize: int = 2,
) -> Dict[str, StepCounts]:
    """Bytes DP rank 0 sends in one iteration (one micro-batch), per phase.

    ``bucket_sizes``: elements of every gathered bucket (each a multiple of the DP size, as the
    sharding layer pads them). ``segments``: per bucket its parameters' ``(start, end, exact)``
    (``ShardedUnit.segments``), for the parameter-aligned layout qwZ and qgZ use; ``None``:
    blocks across parameters (one segment per bucket). ``grad_itemsize``: bytes per gradient
    element (qgZ's hop 1 sends exact small parameters in the gradient dtype). The DP group is
    ``nodes * ranks_per_node`` ranks, node-major
    (TP = PP = 1). Mirrors ``ShardComm``/``ShardedUnit``: forward = qwZ or plain all-gather over
    the DP group; backward = hpZ's intra-node gather when on, else as forward; grad = qgZ's two
    all-to-alls when on, else a plain reduce-scatter.
    """
    for name, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    z = nodes * ranks_per_node
    dp = list(range(z))
    intra, inter = list(range(ranks_per_node)), list(range(0, z, ranks_per_node))
    hpz_size = zeropp.hpz_partition_size or ranks_per_node
    if ranks_per_node % hpz_size:
        raise ValueError(f"hpz_partition_size {hpz_size} must divide ranks_per_node "
                         f"{ranks_per_node}")
    hpz_ranks = list(range(hpz_size))
    stats = {p: CommStats(ranks_per_node) for p in PHASES}
    if segments is None:
        segments = [None] * len(bucket_sizes)
    for numel, segs in zip(bucket_sizes, segments):
        if not isinstance(numel, int) or numel < 1 or numel % z:
            raise ValueError(f"bucket size {numel!r} must be a positive multiple of DP size {z}")
        shard = numel // z
        qwz_layout = layout_for(segs, z, shard, zeropp.qwz_block_size)
        qgz_layout = None if segs is None else layout_for(segs, z, shard, zeropp.qgz_block_size)
        for phase in ("forward", "backward"):
            s = stats[phase]
            if phase == "backward" and zeropp.hpz:
                s.count_call("hpz_allgather")
                slice_bytes = 2 * math.ceil(numel / hpz_size)
                s.record_ring("hpz_allgather", hpz_ranks, slice_bytes, HPZ_TAG_BYTES)
            elif zeropp.qwz:
                nbytes, nblocks = quantized_sizes(qwz_layout.quant_numel, zeropp.qwz_bits,
                                                  zeropp.qwz_block_size)
                s.count_call("qwz_allgather")
                s.record_ring("qwz_allgather", dp, nbytes, 4 * nblocks)
                if qwz_layout.exact_numel:  # rank 0's exact small parameters, to every peer
                    s.record_all_to_all("qwz_allgather", dp, 0, 2 * qwz_layout.exact_elements(0))
            else:
                s.count_call("zero3_allgather")
                s.record_ring("zero3_allgather", dp, 2 * shard)
        s = stats["grad"]
        if zeropp.qgz:
            # bf16 gradients, as the sharding layer's buffers for a bf16 model
            plan = qgz_plan(numel, nodes, ranks_per_node,
                            (zeropp.qgz_intra_bits, zeropp.qgz_inter_bits), zeropp.qgz_block_size,
                            qgz_layout, grad_itemsize)
            record_qgz(s, plan, intra, inter, 0, 0)
        else:
            s.count_call("zero3_reduce_scatter")
            s.record_ring("zero3_reduce_scatter", dp, 2 * shard)
    return {p: stats[p].step() for p in PHASES}


def even_buckets(params: float, units: int, dp_size: int) -> List[int]:
    """``units`` equal buckets covering ``params`` elements, each padded to a multiple of DP."""
    if params <= 0 or units < 1:
        raise ValueError(f"params must be > 0 and units >= 1, got {params} and {units}")
    per = math.ceil(params / units / dp_size) * dp_size
    return [per] * units


# -- time ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """The machine: nodes of GPUs, a link per node, links inside the node."""

    gpus_per_node: int
    nodes: int
    inter_gbit: float
    """Inter-node bandwidth of one node, Gbit/s, one direction (1 IB EDR link ~ 100)."""
    intra_gbyte: float
    """Intra-node bandwidth per GPU, GB/s, one direction (NVLink)."""
    tflops: float
    """Achieved compute per GPU, TFLOP/s, on the model's math alone."""
    alpha_inter_us: float = 5.0
    alpha_intra_us: float = 2.0
    nic_share: str = "node"
    """How a ring spanning nodes shares the node link: "node" (one edge per node) or "gpu"."""

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("inter_gbit", "intra_gbyte", "tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("alpha_inter_us", "alpha_intra_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.nic_share not in ("node", "gpu"):
            raise ValueError(f"nic_share must be 'node' or 'gpu', got {self.nic_share!r}")

    @property
    def inter_bytes_per_s(self) -> float:
        return self.inter_gbit * 1e9 / 8

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_gbyte * 1e9


def _group_size(protocol: str, locality: str, cluster: Cluster, hpz_size: int) -> int:
    if protocol == "hpz_allgather":
        return hpz_size
    if protocol in ALL_TO_ALL:
        return cluster.gpus_per_node if locality == "intra" else cluster.nodes
    return cluster.nodes * cluster.gpus_per_node if cluster.nodes > 1 else cluster.gpus_per_node


def comm_seconds(counts: StepCounts, cluster: Cluster, hpz_size: Optional[int] = None) -> float:
    """Seconds one phase's collectives take on ``cluster`` (see the module docstring)."""
    g_node = cluster.gpus_per_node
    hpz_size = hpz_size or g_node
    total = 0.0
    for protocol in counts.protocols:
        calls = counts.calls.get(protocol, 0)
        for locality in ("intra", "inter"):
            nbytes = counts.total(protocol, locality)
            if nbytes == 0:
                continue
            if locality == "intra":
                bw, alpha = cluster.intra_bytes_per_s, cluster.alpha_intra_us
            else:
                alpha = cluster.alpha_inter_us
                shared = protocol in ALL_TO_ALL or cluster.nic_share == "gpu"
                bw = cluster.inter_bytes_per_s / (g_node if shared else 1)
            steps = _group_size(protocol, locality, cluster, hpz_size) - 1
            total += nbytes / bw + calls * steps * alpha * 1e-6
    return total


@dataclass(frozen=True)
class Projection:
    """Projected iteration of one configuration."""

    name: str
    compute_s: float
    comm_s: Dict[str, float]
    """Seconds per phase (forward, backward, grad)."""
    inter_bytes: int
    """Bytes one rank sends cross-node per iteration (accounting model)."""
    node_link_bytes: int
    """Bytes one node's link carries per iteration: one rank's ring bytes (one ring edge per
    node) plus every rank's all-to-all bytes. The paper's "3M -> 0.75M" is this quantity."""
    intra_bytes: int
    flop: float
    """flop_factor * P * tokens per GPU (6 by default)."""

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    def step_s(self, overlap: bool) -> float:
        if overlap:
            return max(self.compute_s, self.comm_total_s)
        return self.compute_s + self.comm_total_s

    def tflops(self, overlap: bool) -> float:
        return self.flop / self.step_s(overlap) / 1e12


def project(name: str, zeropp: ZeroPPConfig, params: float, tokens_per_gpu: float,
            cluster: Cluster, units: int, flop_factor: float = 6.0) -> Projection:
    """Project one configuration; ``units`` gathered buckets (about the layer count)."""
    if tokens_per_gpu <= 0 or flop_factor <= 0:
        raise ValueError(f"tokens_per_gpu and flop_factor must be > 0, got {tokens_per_gpu} "
                         f"and {flop_factor}")
    buckets = even_buckets(params, units, cluster.nodes * cluster.gpus_per_node)
    counts = iteration_counts(buckets, cluster.nodes, cluster.gpus_per_node, zeropp)
    flop = flop_factor * params * tokens_per_gpu
    a2a = sum(c.total(p, "inter") for c in counts.values() for p in c.protocols if p in ALL_TO_ALL)
    inter = sum(c.total(locality="inter") for c in counts.values())
    return Projection(
        name=name,
        compute_s=flop / (cluster.tflops * 1e12),
        comm_s={p: comm_seconds(c, cluster, zeropp.hpz_partition_size) for p, c in counts.items()},
        inter_bytes=inter,
        node_link_bytes=inter - a2a + cluster.gpus_per_node * a2a,
        intra_bytes=sum(c.total(locality="intra") for c in counts.values()),
        flop=flop,
    )


# -- output ----------------------------------------------------------------------------------
def projection_table(projections: Sequence[Projection], params: float, overlap: bool) -> str:
    """Markdown table: bytes in units of M (P elements, i.e. 2M bytes), seconds, TFLOP/s."""
    unit = 2.0 * params
    base = projections[0]
    rows = [
        "| configuration | inter-node per rank [M] | per node link [M] | intra-node per rank [M] "
        "| compute s | comm s (fwd / bwd / grad) | step s | TFLOP/s per GPU "
        f"| vs {base.name} |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for p in projections:
        comm = " / ".join(f"{p.comm_s[ph]:.3f}" for ph in PHASES)
        rows.append(
            f"| {p.name} | {p.inter_bytes / unit:.4f} | {p.node_link_bytes / unit:.4f} | "
            f"{p.intra_bytes / unit:.4f} | {p.compute_s:.3f} | {comm} | {p.step_s(overlap):.3f} "
            f"| {p.tflops(overlap):.2f} | {base.step_s(overlap) / p.step_s(overlap):.2f}x |"
        )
    return "\n".join(rows)


def paper_settings(a: argparse.Namespace):
    """(setting, cluster, {name: Projection}) for the paper's two settings under the CLI's
    assumptions (compute rate, intra-node bandwidth, alphas, NIC share, units, FLOP factor)."""
    for s in PAPER_SETTINGS:
        cluster = Cluster(a.gpus_per_node, a.nodes, s["inter_gbit"], a.intra_gbyte, a.tflops,
                          a.alpha_inter_us, a.alpha_intra_us, a.nic_share)
        projs = {n: project(n, c, a.params, s["tokens"], cluster, a.units, a.flop_factor)
                 for n, c in CONFIGS.items()}
        yield s, cluster, projs


def paper_comparison(a: argparse.Namespace) -> str:
    """Modelled TFLOP/s and speed-up (with and without overlap) next to the paper's measured
    ones, and notes on where they differ."""
    rows = [
        "| setting | source | ZeRO-3 TFLOP/s | ZeRO++ TFLOP/s | speed-up |",
        "|---|---|---:|---:|---:|",
    ]
    notes = []
    for s, cluster, projs in paper_settings(a):
        z3, zpp = projs["ZeRO-3"], projs["ZeRO++"]
        for overlap in (False, True):
            label = "model, perfect overlap" if overlap else "model, no overlap"
            rows.append(
                f"| {s['label']} | {label} | {z3.tflops(overlap):.2f} | {zpp.tflops(overlap):.2f}"
                f" | {z3.step_s(overlap) / zpp.step_s(overlap):.2f}x |"
            )
        rows.append(f"| {s['label']} | paper, measured | {s['paper_zero3']:.2f} | "
                    f"{s['paper_zeropp']:.2f} | {s['paper_speedup']:.2f}x |")
        # The paper's TFLOP/s turned back into step times with this run's FLOP count.
        implied = z3.flop / (s["paper_zero3"] * 1e12)
        wire = z3.node_link_bytes / cluster.inter_bytes_per_s
        note = (
            f"- {s['label']}: the paper's ZeRO-3 {s['paper_zero3']} TFLOP/s means a step of "
            f"{implied:.2f} s at {a.flop_factor:g}*P*tokens; ZeRO-3's cross-node bytes alone "
            f"need {wire:.2f} s on one {s['inter_gbit']:.0f} Gbit/s node link, model compute "
            f"{z3.compute_s:.2f} s."
        )
        if wire > implied:
            note += (" The measured step is shorter than the transfer alone: the paper must count"
                     " more FLOPs per token than this run (activation recomputation adds 2*P per "
                     "token) or have more link bandwidth than modelled.")
        notes.append(note)
        for overlap in (False, True):
            model = z3.step_s(overlap) / zpp.step_s(overlap)
            err = model / s["paper_speedup"] - 1
            notes.append(f"  speed-up {'with' if overlap else 'without'} overlap: {model:.2f}x vs "
                         f"measured {s['paper_speedup']:.2f}x ({err:+.0%})")
    notes.append(
        "- Not modelled: partial overlap (it would land between the two rows), the time the "
        "quantization kernels add to ZeRO++, links running below line rate, congestion. Perfect "
        "overlap hides all communication once compute exceeds it, so it predicts no gain at 8 "
        "links where the paper measured one: ZeRO-3's communication was not hidden there."
    )
    notes.append(
        f"- NIC share: rings spanning nodes run at the node's whole link here (--nic-share "
        f"{a.nic_share}); a ring puts one rank's bytes on each node link. Giving every GPU 1/G of "
        "the link for rings too (--nic-share gpu) makes ZeRO-3's gathers G times slower, far below "
        "the paper's measurements."
    )
    return "\n".join(rows) + "\n\n" + "\n".join(notes)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=18e9, help="model parameters (P = M)")
    p.add_argument("--tokens-per-gpu", type=float, default=None,
                   help="tokens per GPU per iteration; omit for the paper's two settings")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=48)
    p.add_argument("--tflops", type=float, default=60.0,
                   help="achieved compute per GPU, TFLOP/s (V100 default: the paper's best "
                        "measured 53.65 includes communication, so compute alone is above it)")
    p.add_argument("--flop-factor", type=float, default=6.0,
                   help="FLOPs per parameter per token (6; 8 with activation recomputation)")
    p.add_argument("--inter-gbit", type=float, default=100.0,
                   help="inter-node bandwidth per node, Gbit/s (custom setting only)")
    p.add_argument("--intra-gbyte", type=float, default=100.0, help="intra-node GB/s per GPU")
    p.add_argument("--alpha-inter-us", type=float, default=5.0)
    p.add_argument("--alpha-intra-us", type=float, default=2.0)
    p.add_argument("--units", type=int, default=40,
                   help="gathered units (~ layers; an 18B GPT: 40 layers of hidden 6144)")
    p.add_argument("--nic-share", choices=("node", "gpu"), default="node")
    p.add_argument("--overlap", action="store_true",
                   help="custom setting: step = max(compute, comm) instead of the sum")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"alpha-beta projection: P = {a.params:.3g}, {a.nodes} nodes x {a.gpus_per_node} GPUs, "
          f"compute {a.flop_factor:g}*P*tokens at {a.tflops} TFLOP/s per GPU, intra-node "
          f"{a.intra_gbyte} GB/s per GPU, alpha {a.alpha_inter_us}/{a.alpha_intra_us} us "
          f"(inter/intra), {a.units} units, NIC share of rings: {a.nic_share}. Bytes: "
          f"megatron_zeropp.comm's accounting model (CommStats), per iteration of one micro-batch.")
    if a.tokens_per_gpu is not None:
        cluster = Cluster(a.gpus_per_node, a.nodes, a.inter_gbit, a.intra_gbyte, a.tflops,
                          a.alpha_inter_us, a.alpha_intra_us, a.nic_share)
        projs = [project(n, c, a.params, a.tokens_per_gpu, cluster, a.units, a.flop_factor)
                 for n, c in CONFIGS.items()]
        print(f"\n{a.tokens_per_gpu:g} tokens/GPU, {a.inter_gbit:g} Gbit/s per node, "
              f"{'perfect overlap' if a.overlap else 'no overlap'}\n")
        print(projection_table(projs, a.params, a.overlap))
        return 0
    for s, _, projs in paper_settings(a):
        print(f"\n{s['label']} ({s['inter_gbit']:.0f} Gbit/s per node), no overlap\n")
        print(projection_table(list(projs.values()), a.params, False))
    print("\nThe paper's measurements next to the model:\n")
    print(paper_comparison(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
