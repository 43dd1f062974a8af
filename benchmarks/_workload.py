"""The workload the CPU benchmarks share: a megatron-core GPT under ZeroPPDataParallel.

Every rank trains on ONE micro-batch per iteration, so an iteration is exactly one forward weight
gather, one backward weight gather and one gradient reduction per unit (the paper's "3M").
Weights and gradients are bf16 (16-bit, the unit the byte model counts in), the optimizer is
megatron-core's distributed Adam attached to the primary shards.

This module is imported as a top-level module (``benchmarks/`` on ``sys.path``): the
simulated-node workers of :func:`megatron_zeropp.simulated_nodes.run_distributed` unpickle the
worker functions below by module name, so they cannot live in a script's ``__main__``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List

import torch

# megatron-core warns on import that optional GPU libraries are absent; noise on a CPU run.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from megatron_zeropp.sharding import ZeroPPConfig  # noqa: E402

CONFIGS: Dict[str, ZeroPPConfig] = {
    "ZeRO-3": ZeroPPConfig(),
    "hpZ": ZeroPPConfig(hpz=True),
    "qwZ": ZeroPPConfig(qwz=True),
    "qgZ": ZeroPPConfig(qgz=True),
    "qwZ+hpZ": ZeroPPConfig(qwz=True, hpz=True),
    "qwZ+hpZ+qgZ": ZeroPPConfig(qwz=True, hpz=True, qgz=True),
    # qgZ's cross-node hop at INT4: the default until the 125M lab study (docs/benchmarks.md)
    # found it costs loss there; ZeRO++'s fewest bytes. And the other setting that met the
    # study's target, qwZ sending 4-bit weight differences, with the INT4 hop it ran with.
    "qwZ+hpZ+qgZ (INT4 hop)": ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_inter_bits=4),
    "qwZ diff4+hpZ+qgZ (INT4 hop)": ZeroPPConfig(qwz=True, hpz=True, qgz=True, qwz_diff_bits=4,
                                                 qgz_inter_bits=4),
}
"""The configurations the benchmarks compare, by display name."""

PHASES = ("forward", "backward", "grad")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the GPT and of one rank's micro-batch."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 16
    micro_batch: int = 1
    """Sequences in this rank's one micro-batch (tokens per rank = micro_batch * seq)."""

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def tokens_per_rank(self) -> int:
        return self.micro_batch * self.seq


def setup_megatron(seed: int = 1234) -> None:
    """Patch megatron-core for CPU, build its parallel state (TP = PP = 1), seed its RNGs."""
    from megatron_zeropp.backend import init_megatron

    init_megatron(1, 1, seed=seed)


def _transformer_config(spec: ModelSpec):
    from megatron_zeropp.training.builders import gpt_transformer_config

    return gpt_transformer_config(spec.layers, spec.hidden, spec.heads, dtype=torch.bfloat16,
                                  hidden_dropout=0.0, attention_dropout=0.0)


@dataclass
class Built:
    """One model wrapped for ZeRO(++) with its optimizer."""

    name: str
    wrapped: object
    optimizer: object
    elements: int
    """M: 16-bit parameter elements of this rank's model chunk (padded bucket sizes)."""


def build(topology, name: str, zeropp: ZeroPPConfig, spec: ModelSpec, seed: int = 1234) -> Built:
    """A bf16 GPTModel (local spec) under ZeroPPDataParallel plus megatron-core's distributed Adam.

    Call :func:`setup_megatron` first. Several models may be built in one process (each gets
    its own TransformerConfig, so the schedule hooks do not collide).
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_zeropp.optimizer import get_zeropp_optimizer
    from megatron_zeropp.sharding import ZeroPPDataParallel
    from megatron_zeropp.training.builders import adam_config, gpt_model, wire_schedule_hooks

    torch.manual_seed(seed)
    config = _transformer_config(spec)
    module = gpt_model(config, spec.vocab, spec.seq)  # Float16Module: bf16 compute needs it
    wrapped = ZeroPPDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True), module, topology,
        zeropp,
    )
    optimizer = get_zeropp_optimizer(
        adam_config(1e-4, dtype=torch.bfloat16, weight_decay=0.01, clip_grad=1.0), [wrapped]
    )
    wire_schedule_hooks(config, wrapped, optimizer)
    elements = sum(b.param_data.numel() for u in wrapped.units for b in u.buckets)
    return Built(name, wrapped, optimizer, elements)


def _microbatch(spec: ModelSpec, step: int, rank: int) -> Iterator[dict]:
    # Random tokens: the benchmarks time and count, they do not need a learnable task.
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq + 1), generator=g)
    yield {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(spec.micro_batch, spec.seq),
        "position_ids": torch.arange(spec.seq).unsqueeze(0).expand(spec.micro_batch, -1),
        "attention_mask": None,
    }


def train_iteration(built: Built, spec: ModelSpec, step: int):
    """One optimizer step on one micro-batch per rank; returns the StepResult."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zeropp.training.gpt_step import train_step

    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    pp = parallel_state.get_pipeline_model_parallel_group()
    return train_step([built.wrapped], built.optimizer, _microbatch(spec, step, dist.get_rank()),
                      1, spec.seq, spec.micro_batch, dp, pp)


def counts_table_row(counts: dict) -> Dict[str, Dict[str, int]]:
    """Plain dict of one iteration's counts: {phase: {(protocol|locality|part): bytes}}."""
    out: Dict[str, Dict[str, int]] = {}
    for phase, c in counts.items():
        out[phase] = {"|".join(k): v for k, v in c.bytes_by_key.items()}
    return out


def measure_volume(ctx, names: List[str], spec: ModelSpec, iterations: int = 2) -> dict:
    """Worker (run_distributed): bytes this rank sent in the last of ``iterations`` iterations.

    The first iteration records the unit order (prefetch starts on the second), so with the
    default two the counted iteration is a steady-state one. Returns
    ``{name: {"elements": M, "buckets": [numel, ...], "counts": {phase: {"protocol|locality|part":
    bytes}}, "calls": {phase: {protocol: n}}, "loss": float}}``.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    setup_megatron()
    topology = ctx.topology()
    out = {}
    for name in names:
        built = build(topology, name, CONFIGS[name], spec)
        for i in range(iterations):
            built.wrapped.comm_counts(reset=True)
            result = train_iteration(built, spec, i)
        counts = built.wrapped.comm_counts(reset=True)
        out[name] = {
            "elements": built.elements,
            "buckets": [b.param_data.numel() for u in built.wrapped.units for b in u.buckets],
            "segments": [seg for u in built.wrapped.units for seg in u.segments],
            "counts": counts_table_row(counts),
            "calls": {phase: dict(c.calls) for phase, c in counts.items()},
            "loss": result.loss,
        }
        del built
    return out


def timed_iteration(built: Built, spec: ModelSpec, step: int) -> float:
    """Seconds for one iteration, between two barriers (so it is the slowest rank's time)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    train_iteration(built, spec, step)
    # The gathers the step's end starts for the next step belong to this iteration: without
    # the wait they would run inside the next configuration's timed iteration.
    built.wrapped.wait_for_gathers()
    dist.barrier()
    return time.perf_counter() - start


ALL_TO_ALL = ("qgz_reduce_scatter", "qwz_diff")
"""Protocols whose cross-node bytes are sent per destination (not a ring), so a node's link
carries every one of its ranks' (qwZ's weight differences go from each rank to one rank of
every other node)."""


def total_bytes(counts: Dict[str, Dict[str, int]], phase=None, locality=None, part=None,
                protocols=None) -> int:
    """Sum of a :func:`counts_table_row` result over the keys matching every given filter."""
    total = 0
    for ph, keys in counts.items():
        if phase not in (None, ph):
            continue
        for key, v in keys.items():
            proto, loc, prt = key.split("|")
            if locality in (None, loc) and part in (None, prt) and (
                protocols is None or proto in protocols
            ):
                total += v
    return total


def node_link(counts: Dict[str, Dict[str, int]], ranks_per_node: int) -> int:
    """Bytes one node's link carries per iteration: a ring's cross-node bytes are one rank's
    (every step of the ring crosses each node boundary once), an all-to-all's are every rank's."""
    inter = total_bytes(counts, locality="inter")
    a2a = total_bytes(counts, locality="inter", protocols=ALL_TO_ALL)
    return inter - a2a + ranks_per_node * a2a


def machine_summary() -> str:
    """One line: cores, CPU model, RAM, torch version, date (for the docs next to a number)."""
    import datetime
    import os
    import platform

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = "?"
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
        ram = f"{kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    today = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"nproc {len(os.sched_getaffinity(0))}, {cpu}, RAM {ram}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {today}")
