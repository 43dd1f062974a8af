"""Project the GPU shaped-link measurements (``benchmarks/gpu_shaped.py``'s JSON) to real clusters.

Usage::

    python tools/project_measured.py runs/shaped/results.json [--ib-link-gbit 400]

What is taken from the measurement:

- the compute rate: the TFLOP/s/GPU pretrain_gpt.py logged for megatron-core on NVLink (the
  run with the least communication), the highest over the micro-batch counts;
- the NVLink rate the link probe saw (intra-node bandwidth), if it ran;
- the cross-node bytes the ZeRO++ layer counted per iteration, next to what the byte model
  below predicts for the measured layout: a check that the model describes the runtime that was
  measured (it must, before its projection means anything).

The byte model per optimizer step and rank (m micro-batches; one micro-batch's collectives
replayed by ``project_throughput.iteration_counts``, the accounting the training code counts
with):

- megatron-core's distributed optimizer: one reduce-scatter of the bf16 gradients and one
  all-gather of the bf16 weights over the DP group per step, whatever m;
- ZeRO-3 / ZeRO++ without hpZ: a weight gather (qwZ: INT8) in every forward and every backward,
  2m per step, all across nodes (a GPT's tied embedding: 3m, lookup + logits forward, logits
  backward);
- with hpZ: the first forward gather of a step crosses nodes (qwZ) and keeps the node-local
  copy; the other 2m - 1 gathers of the step read it inside the node;
- gradients: reduced once per step (the full-size buffer, qgZ or plain reduce-scatter), or in
  every micro-batch with ``--zeropp-shard-grads``.

Time per step = compute + communication (no overlap), and max(compute, communication) (perfect
overlap): the real step lies between. Compute = model FLOPs (pretrain_gpt.py's formula) /
the measured rate, times (1 + (PP - 1) / m) for the pipeline bubble. Tensor- and pipeline-
parallel traffic is not modelled (it is the same for every data-parallel layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from project_throughput import Cluster, comm_seconds, even_buckets, iteration_counts

from megatron_zeropp.comm import CommStats, StepCounts
from megatron_zeropp.sharding import ZeroPPConfig

# name -> (ZeRO++ switches, gradients reduced every micro-batch); None = megatron-core DistOpt.
CONFIGS: Dict[str, Optional[Tuple[ZeroPPConfig, bool]]] = {
    "megatron": None,
    "zero3": (ZeroPPConfig(), False),
    "qwz_hpz": (ZeroPPConfig(qwz=True, hpz=True), False),
    "all3": (ZeroPPConfig(qwz=True, hpz=True, qgz=True), False),
    "all3_shard": (ZeroPPConfig(qwz=True, hpz=True, qgz=True), True),
    # What examples/llama_70b_tp8_pp4.sh ships (no hpZ: one DP rank per node with TP 8).
    "qwz_qgz": (ZeroPPConfig(qwz=True, qgz=True), False),
}


@dataclass(frozen=True)
class Model:
    """The shape pretrain_gpt.py's FLOP formula needs (megatron_zeropp/training/model.py)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    ffn: int
    vocab: int
    """Padded vocabulary."""
    query_groups: Optional[int] = None
    swiglu: bool = False
    untied: bool = False
    learned_pos: bool = False
    """Learned absolute position embeddings (GPT) instead of RoPE."""

    def embedding(self) -> int:
        """Elements of the embedding unit (word + learned position embeddings)."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.learned_pos else 0)

    def params(self) -> float:
        """Weights: attention, MLP, norms/biases (approximate), embeddings (+ output if untied)."""
        kv = self.hidden * (self.query_groups or self.heads) // self.heads
        mlp = self.hidden * self.ffn * (3 if self.swiglu else 2)
        per_layer = self.hidden * (self.hidden + 2 * kv) + self.hidden ** 2 + mlp + 13 * self.hidden
        output = self.vocab * self.hidden if self.untied else 0
        return self.layers * per_layer + self.embedding() + output

    def flops(self, tokens: float) -> float:
        """pretrain_gpt.py's model FLOPs of one training pass over ``tokens`` tokens."""
        from types import SimpleNamespace

        from megatron_zeropp.training.model import num_floating_point_operations

        args = SimpleNamespace(
            hidden_size=self.hidden, num_layers=self.layers, seq_length=self.seq,
            num_attention_heads=self.heads, num_query_groups=self.query_groups,
            group_query_attention=self.query_groups is not None, ffn_hidden_size=self.ffn,
            swiglu=self.swiglu, padded_vocab_size=self.vocab)
        return num_floating_point_operations(args, tokens)


@dataclass(frozen=True)
class Target:
    """A cluster and job to project to."""

    label: str
    model: Model
    tp: int
    pp: int
    dp: int
    dp_per_node: int
    """DP ranks of one group per node (8 with TP = 1 on 8-GPU nodes; 1 with TP 8)."""
    groups_per_node: int
    """DP groups sharing one node's links at the same time (TP x ranks of other stages)."""
    micro_batch_tokens: int
    micro_batches: int
    inter_gbit: float
    """All of one node's inter-node links together, Gbit/s per direction."""


# 18B GPT as in the ZeRO++ paper's 384-GPU runs: 48 nodes x 8, 1K and 2K tokens per GPU.
GPT_18B = Model("GPT 18B", layers=40, hidden=6144, heads=48, seq=2048, ffn=4 * 6144, vocab=50304,
                learned_pos=True)
# examples/llama_70b_tp8_pp4.sh (Llama tokenizer: 32000 padded to a multiple of 128 x TP 8).
LLAMA_70B = Model("Llama 70B", layers=80, hidden=8192, heads=64, seq=4096, ffn=28672,
                  vocab=32768, query_groups=8, swiglu=True, untied=True)


def targets(link_gbit: float) -> List[Target]:
    """GPT 18B at 1 and 8 IB links per node (1 and 8 micro-batches) and the 70B recipe."""
    out = []
    for links, tokens in ((1, 1024), (8, 2048)):
        for m in (1, 8):
            out.append(Target(f"GPT 18B, 48 x 8 GPUs, {links} IB link(s) per node, {tokens} "
                              f"tokens/GPU per micro-batch, {m} micro-batch(es)", GPT_18B,
                              1, 1, 384, 8, 1, tokens, m, links * link_gbit))
    # 32 nodes x 8 = 256 GPUs: TP 8 fills a node, so a node holds one rank of 8 DP groups.
    for links in (1, 8):
        out.append(Target(f"Llama 70B TP8 PP4 DP8 (examples/llama_70b_tp8_pp4.sh), 32 x 8 GPUs, "
                          f"{links} IB link(s) per node, 128 micro-batches of 4096 tokens",
                          LLAMA_70B, 8, 4, 8, 1, 8, 4096, 128, links * link_gbit))
    return out


# -- bytes and time per step ---------------------------------------------------------------------
def _megatron_counts(buckets: Sequence[int], nodes: int, per_node: int) -> Dict[str, StepCounts]:
    """megatron-core DistOpt: one bf16 all-gather and one reduce-scatter over DP per step."""
    z = nodes * per_node
    stats = {"forward": CommStats(per_node), "grad": CommStats(per_node)}
    for numel in buckets:
        stats["forward"].count_call("zero3_allgather")
        stats["forward"].record_ring("zero3_allgather", list(range(z)), 2 * (numel // z))
        stats["grad"].count_call("zero3_reduce_scatter")
        stats["grad"].record_ring("zero3_reduce_scatter", list(range(z)), 2 * (numel // z))
    return {k: v.step() for k, v in stats.items()}


# qgZ's cross-node hop was INT4 by default until this date (the 125M loss study moved it to
# INT8): a run recorded before it ran the INT4 hop without naming it.
INT8_HOP_SINCE = "2026-12-06"


def spec_as_recorded(config: str, date: str) -> Optional[Tuple[ZeroPPConfig, bool]]:
    """``CONFIGS[config]`` with the defaults of the day a run of it was recorded (``date``
    begins ``YYYY-MM-DD``, as results' meta writes it)."""
    spec = CONFIGS[config]
    if spec is not None and spec[0].qgz and date[:10] < INT8_HOP_SINCE:
        spec = (dataclasses.replace(spec[0], qgz_inter_bits=4), spec[1])
    return spec


def step_phases(config: str, buckets: Sequence[int], nodes: int, per_node: int, m: int,
                tied_embedding: Optional[int] = None,
                spec: Optional[Tuple[ZeroPPConfig, bool]] = None
                ) -> List[Tuple[StepCounts, int]]:
    """(one collective's counts, how often per step) for every kind of collective in a step.

    ``tied_embedding``: elements of the embedding unit when the output layer shares its weight
    (GPT, PP = 1): the ZeRO layer then gathers that unit twice per forward (lookup and logits)
    and once per backward (logits; the lookup's gradient needs no weight). ``spec``: the
    switches, if not today's ``CONFIGS[config]`` (:func:`spec_as_recorded`).
    """
    spec = CONFIGS[config] if spec is None else spec
    if spec is None:
        everything = list(buckets) + ([tied_embedding] if tied_embedding else [])
        c = _megatron_counts(everything, nodes, per_node)
        return [(c["forward"], 1), (c["grad"], 1)]
    zeropp, shard_grads = spec
    units = [(list(buckets), 1, 1)]  # (buckets, forward gathers, backward gathers) per mb
    if tied_embedding:
        units.append(([tied_embedding], 2, 1))
    out = []
    for unit_buckets, fwd, bwd in units:
        c = iteration_counts(unit_buckets, nodes, per_node, zeropp)
        out.append((c["grad"], m if shard_grads else 1))
        if zeropp.hpz:
            # The first gather of a unit in a step crosses nodes; the rest read the node copy.
            out += [(c["forward"], 1), (c["backward"], (fwd + bwd) * m - 1)]
        else:
            out += [(c["forward"], fwd * m), (c["backward"], bwd * m)]
    return out


def inter_bytes(phases: Sequence[Tuple[StepCounts, int]]) -> float:
    """Cross-node bytes one rank sends per step."""
    return sum(c.total(locality="inter") * n for c, n in phases)


@dataclass(frozen=True)
class Row:
    config: str
    inter_bytes: float
    compute_s: float
    comm_s: float

    def step_s(self, overlap: bool) -> float:
        return max(self.compute_s, self.comm_s) if overlap else self.compute_s + self.comm_s


def _buckets(model: Model, tp: int, pp: int, dp: int) -> Tuple[List[int], Optional[int]]:
    """Layer buckets of one model chunk, and the tied embedding unit (GPT with PP = 1) apart."""
    layers = max(model.layers // pp, 1)
    if pp == 1 and not model.untied:
        emb = model.embedding() / tp
        return (even_buckets(model.params() / tp - emb, layers, dp),
                even_buckets(emb, 1, dp)[0])
    return even_buckets(model.params() / (tp * pp), layers, dp), None


def project_target(t: Target, tflops: float, intra_gbyte: float, configs: Sequence[str],
                   alpha_inter_us: float = 5.0, alpha_intra_us: float = 2.0) -> List[Row]:
    """Every configuration's step on ``t`` (see the module docstring)."""
    if not tflops > 0:
        raise ValueError(f"tflops must be > 0, got {tflops!r}")
    nodes = t.dp // t.dp_per_node
    buckets, tied = _buckets(t.model, t.tp, t.pp, t.dp)
    # The node's links are shared by the DP groups running at once on that node.
    cluster = Cluster(t.dp_per_node, nodes, t.inter_gbit / t.groups_per_node, intra_gbyte, tflops,
                      alpha_inter_us, alpha_intra_us)
    replica_tokens = t.micro_batch_tokens * t.micro_batches * t.dp_per_node * nodes
    flops_per_gpu = t.model.flops(replica_tokens) / (t.dp * t.tp * t.pp)
    bubble = 1 + (t.pp - 1) / t.micro_batches
    compute = flops_per_gpu / (tflops * 1e12) * bubble
    rows = []
    for name in configs:
        phases = step_phases(name, buckets, nodes, t.dp_per_node, t.micro_batches, tied)
        comm = sum(comm_seconds(c, cluster) * n for c, n in phases)
        rows.append(Row(name, inter_bytes(phases), compute, comm))
    return rows


# -- the measurement -----------------------------------------------------------------------------
def measured_model(meta: dict) -> Tuple[Model, int]:
    """The measured GPT (from the driver's preset flags) and its micro-batch size."""
    flags = meta["model_flags"]

    def get(name, default=None):
        return int(flags[flags.index(name) + 1]) if name in flags else default

    h, vocab = get("--hidden-size"), get("--vocab-size")
    padded = int(math.ceil(vocab / 128) * 128)
    model = Model(f"measured GPT ({meta['model']})", get("--num-layers"), h,
                  get("--num-attention-heads"), get("--seq-length"),
                  get("--ffn-hidden-size", 4 * h), padded,
                  learned_pos="--position-embedding-type" not in flags or "rope" not in flags)
    return model, get("--micro-batch-size")


def compute_rate(data: dict) -> Optional[float]:
    """Highest median TFLOP/s/GPU of megatron-core on NVLink (None if it did not run)."""
    rates = [r["tflops_median"] for r in data["runs"] if r["link"] == "nvlink"
             and r["config"] == "megatron" and r.get("status") == "ok" and r.get("tflops_median")]
    return max(rates) if rates else None


def byte_check(data: dict) -> List[dict]:
    """Measured cross-node bytes per iteration vs the byte model, per shaped run."""
    model, _ = measured_model(data["meta"])
    gpus = data["meta"]["gpus"]
    per_node = gpus // 2
    buckets, tied = _buckets(model, 1, 1, gpus)
    out = []
    for r in data["runs"]:
        if r.get("status") != "ok" or r["config"] not in CONFIGS or r["config"] == "megatron":
            continue
        measured = r.get("inter_bytes_median")
        if measured is None:
            continue
        spec = spec_as_recorded(r["config"], data["meta"]["date"])
        predicted = inter_bytes(step_phases(r["config"], buckets, 2, per_node,
                                            r["micro_batches"], tied, spec))
        out.append({"link": r["link"], "config": r["config"], "micro_batches": r["micro_batches"],
                    "measured": measured, "model": predicted, "ratio": measured / predicted})
    return out


def report(data: dict, link_gbit: float, tflops: Optional[float] = None,
           intra_gbyte: Optional[float] = None) -> str:
    """The assumptions, the byte check and one table per target."""
    measured_tflops = compute_rate(data)
    rate = tflops or measured_tflops
    if rate is None:
        raise ValueError("no megatron run on nvlink with a TFLOP/s in the JSON: pass --tflops")
    probe = data.get("probes", {}).get("nvlink", {}).get("recv_gbit_per_rank")
    intra = intra_gbyte or (probe / 8 if probe else 200.0)
    model, _ = measured_model(data["meta"])
    lines = [
        "Assumptions:",
        f"- compute: {rate:.1f} TFLOP/s per GPU ("
        + ("given by --tflops" if tflops else "measured: megatron-core on NVLink, median, best "
           "micro-batch count") + f"), on pretrain_gpt.py's model FLOPs; measured on "
        f"{data['meta']['machine']} with {model.name} ({model.params() / 1e9:.2f}B parameters).",
        f"- intra-node: {intra:.0f} GB/s per GPU ("
        + ("given" if intra_gbyte else "the NVLink probe" if probe else "default, no probe")
        + f"); inter-node: {link_gbit:g} Gbit/s per IB link per direction; alpha 5 us / 2 us.",
        "- no overlap (sum) and perfect overlap (max) bound the step; TP/PP traffic not "
        "modelled; pipeline bubble (PP - 1) / m added to compute.",
        "- bytes: the byte model of tools/project_measured.py (megatron-core DistOpt: one "
        "all-gather + one reduce-scatter per step; ZeRO: gathers per micro-batch, hpZ: one "
        "cross-node gather per step), checked against the measurement below.",
        "",
        "Byte check (cross-node bytes per iteration and rank, measured by the ZeRO++ layer vs "
        "the model for the measured layout):",
        "",
        "| link | config | micro-batches | measured | model | measured / model |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in byte_check(data):
        lines.append(f"| {c['link']} | {c['config']} | {c['micro_batches']} | "
                     f"{c['measured']:.4g} | {c['model']:.4g} | {c['ratio']:.3f} |")
    for t in targets(link_gbit):
        rows = project_target(t, rate, intra, list(CONFIGS))
        base = rows[0]
        unit = 2 * t.model.params() / (t.tp * t.pp)
        lines += ["", f"{t.label} (model chunk {unit / 2e9:.2f}B parameters per GPU):", "",
                  "| configuration | cross-node bytes / step / rank [2M] | compute s | comm s | "
                  "step s (no overlap .. perfect) | vs megatron (no overlap .. perfect) |",
                  "|---|---:|---:|---:|---|---|"]
        for r in rows:
            lines.append(
                f"| {r.config} | {r.inter_bytes / unit:.3f} | {r.compute_s:.3f} | {r.comm_s:.3f} | "
                f"{r.step_s(False):.3f} .. {r.step_s(True):.3f} | "
                f"{base.step_s(False) / r.step_s(False):.2f}x .. "
                f"{base.step_s(True) / r.step_s(True):.2f}x |")
    return "\n".join(lines)


def main_measured(path: str, link_gbit: float, tflops: Optional[float],
                  intra_gbyte: Optional[float]) -> int:
    """The command line: print :func:`report` of a ``results.json``."""
    with open(path) as f:
        data = json.load(f)
    print(report(data, link_gbit, tflops, intra_gbyte))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("measured", metavar="RESULTS_JSON",
                   help="benchmarks/gpu_shaped.py's results.json")
    p.add_argument("--ib-link-gbit", type=float, default=400.0,
                   help="one InfiniBand link, Gbit/s per direction (NDR 400)")
    p.add_argument("--tflops", type=float, default=None,
                   help="compute per GPU, TFLOP/s (default: the measured megatron-core rate)")
    p.add_argument("--intra-gbyte", type=float, default=None,
                   help="intra-node GB/s per GPU (default: the NVLink probe)")
    a = p.parse_args(argv)
    return main_measured(a.measured, a.ib_link_gbit, a.tflops, a.intra_gbyte)


if __name__ == "__main__":
    raise SystemExit(main())
