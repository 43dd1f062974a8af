"""The lab study's matrix: its configurations (with the noise floor), the studies (model,
schedule, recipe, seeds, configurations in run order) and what names a job. Shared by the
driver (``lab_study.py``) and its tables (``lab_study_report.py``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _convergence_gpu as G  # noqa: E402

_ALL3 = ("--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz")
FLOOR = "zero3+2mb"
FLOOR_CUTS = 2
CONFIGS: Dict[str, Tuple[str, ...]] = {
    "zero3": (),
    # Planned as the noise floor (it was at 23M: gloo, two micro-batches per rank), but with
    # one micro-batch per rank both paths reduce-scatter the same fp32 sums once, and the lab's
    # transport adds in one fixed order: bit-identical to zero3 (125m/zero3+sg@seed1234).
    "zero3+sg": ("--zeropp-shard-grads",),
    # The noise floor: zero3 with each rank's share of the global batch cut into
    # FLOOR_CUTS micro-batches (same samples, same math; other GEMM shapes, fp32 gradients
    # accumulated over the pieces): how far a run moves when nothing but rounding changes.
    FLOOR: (),
    "qwz+hpz": ("--zeropp-qwz", "--zeropp-hpz"),
    # the defaults (qgZ stochastic rounding, small params exact, on top of the study's pinned
    # ones: the 125M studies' cross-node hop is INT4, the default when they ran)
    "all3": _ALL3,
    "all3+diff4": _ALL3 + ("--zeropp-qwz-diff-bits", "4"),
    # qgZ's cross-node hop at INT8 (16x finer steps than INT4, twice its cross-node bytes):
    # what 125m-lr3e-4 ran after all3 missed its target (Study.if_missed), to tell whether
    # the INT4 hop costs the loss. It met the target, and INT8 became the default.
    "all3+qgz8": _ALL3 + ("--zeropp-qgz-inter-bits", "8"),
}


def micro_batch_cuts(config: str) -> int:
    """Into how many micro-batches ``config`` cuts the study's micro-batch (1 but the floor)."""
    return FLOOR_CUTS if config == FLOOR else 1


@dataclass(frozen=True)
class Study:
    """One study of the issue: model, schedule, seeds and configurations, in the order jobs
    run (seed by seed, so that paired sets complete first)."""

    model: str
    iters: int
    seeds: Tuple[int, ...]
    configs: Tuple[str, ...]
    micro_batch_size: int
    global_batch_size: int = 32
    eval_interval: int = 100
    eval_iters: int = 10
    warmup_iters: Optional[int] = None
    """Linear learning-rate warmup; ``None``: 2 % of the schedule (the first 125m study's)."""
    lr: float = 6e-4
    min_lr: float = 6e-5
    """Peak and final learning rate (cosine decay)."""
    if_missed: Tuple[str, ...] = ()
    """Configurations that run on every seed, after the study's own, once the all3 target's
    verdict over all seeds is MISSED (a rule set before the data decides what follows a
    miss; ``lab_study.pending`` applies it)."""
    if_missed_compare: Tuple[str, ...] = ()
    """The study's own configurations that the same rule holds against the all3 target beside
    ``if_missed``'s once it is MISSED (``lab_study_report.targets`` prints their verdicts)."""
    pinned: Tuple[str, ...] = ()
    """ZeRO++ defaults as they were when the study's first job ran, spelled out before every
    job's configuration flags (which override them): a default changed later does not change
    what the study's configurations, and their recorded jobs, mean (a recheck reruns them)."""

    def jobs(self) -> List[Tuple[str, int]]:
        return [(c, s) for s in self.seeds for c in self.configs]

    @property
    def warmup(self) -> int:
        return self.warmup_iters if self.warmup_iters is not None else max(1, self.iters // 50)


# qgZ's cross-node hop was INT4 by default until 2026-12-06 (the 125M studies' rule moved it to
# INT8): every 125M job ran with it.
_INT4_HOP = ("--zeropp-qgz-inter-bits", "4")
_W150 = Study("125m", 1500, (1234, 1235, 1236), ("zero3", FLOOR, "all3", "qwz+hpz", "all3+diff4"),
              micro_batch_size=8, warmup_iters=150, pinned=_INT4_HOP)

STUDIES = {
    # GPT-3 small: >= 1,500 iterations, >= 3 seeds. Its 30-iteration warmup to 6e-4 at 32k
    # tokens a batch let paired runs part at the warmup's end (iterations 30-40, the escape
    # from the unigram plateau) and stay apart by percents: all3's gap +0.36 % at seed 1234,
    # -4.16 % at 1235 (docs/benchmarks.md). Kept as recorded; the study goes on as 125m-w150.
    "125m": Study("125m", 1500, (1234, 1235, 1236),
                  ("zero3", "all3", "qwz+hpz", "all3+diff4", FLOOR), micro_batch_size=8,
                  pinned=_INT4_HOP),
    # The same with a 10 % warmup (150 iterations), the floor right after zero3 of each seed:
    # its first jobs say whether paired runs stay together.
    "125m-w150": _W150,
    # 125m-w150 failed the rule set before its data (its floor's paired gap at 1,500 within
    # 0.05 %, training-loss gap within 0.1 %): zero3+2mb@1234 -0.251 % at 1,500, up to 0.24 %
    # in training. The rule's next recipe: the same at half the peak learning rate. Set before
    # its data: it is the study if its floor passes that rule; if not, rounding alone moves a
    # run this far at 125M, and the study goes on with whichever recipe's floor is narrower.
    # Its floor (2026-12-06, seed 1234): +0.053 % at 1,500 (over the 0.05 % bar by 0.003),
    # training gaps within 0.04 %; the narrower floor, so this is the study either way.
    # Set before seed 1236's data (2026-12-06): if all3 misses +0.25 % over the three seeds,
    # all three with the INT8 cross-node hop runs on all three before any default changes.
    # Added before seed 1236's quantized data: all3+diff4's three-seed gap is reported beside
    # it, as the second setting that could meet the target (table prints both verdicts).
    # The recipe chosen, the targets' jobs run before the floor (seed 1236, the last, was
    # begun with zero3 only: a short lease then still decides the targets).
    "125m-lr3e-4": replace(_W150, lr=3e-4, min_lr=3e-5, if_missed=("all3+qgz8",),
                           if_missed_compare=("all3+diff4",),
                           configs=("zero3", "all3", "qwz+hpz", FLOOR, "all3+diff4")),
    # GPT-3 medium (its learning rate, 3e-4): >= 1,000 iterations, 2 seeds; warmup 10 % as
    # 125m-w150's. That study's floor moved its final loss as far as the target, so this one
    # measures its own floor too, right after zero3 of each seed: with two seeds, a gap means
    # nothing without it (two ~11-minute jobs more, two per lease).
    # Set before any 350M data (2026-12-06, after 125M's all3 missed its target with qgZ the
    # switch): if all3 misses here too, qwz+hpz on both seeds names the switch at 350M (the
    # issue's 350M matrix has no qwz+hpz), then the INT8 cross-node hop tells whether INT4 is
    # what costs, as at 125M; four ~11-minute jobs, only after a miss.
    # Added still before any 350M data (2026-12-06, after 125M's all3+diff4 met the target
    # over three seeds): all3+diff4 on both seeds after a miss too, so that the setting that
    # met the target at 125M is judged at 350M; two more jobs, only after a miss.
    # 125m-lr3e-4's all3+qgz8 met the target (2026-12-06), so qgZ's cross-node hop became
    # INT8 by default, before any 350M job with qgZ ran (only zero3@1234 had, no qgZ in it):
    # 350M's all3 runs the new defaults, all3+qgz8 would repeat it bit for bit, and a miss
    # runs qwz+hpz and all3+diff4 (with the INT8 hop) on both seeds.
    # The order changed on 2026-12-07 (three jobs recorded, none with qgZ): all3 before the
    # floor, so a lease cut short (each seed's jobs need its own GPU model now) still runs the
    # target's job; what the study runs is the same.
    "350m": Study("350m", 1000, (1234, 1235), ("zero3", "all3", FLOOR), micro_batch_size=4,
                  warmup_iters=100, lr=3e-4, min_lr=3e-5,
                  if_missed=("qwz+hpz", "all3+diff4")),
}
NODES, RANKS_PER_NODE = 2, 2

# Every validation twice over the same batches: with the weights training's forward gathers
# (qwZ-quantized where qwZ is on; the study's validation loss) and with the exact 16-bit
# weights a checkpoint holds, to tell what quantized evaluation costs from what training lost.
# Training computes the same bits either way (tests/test_eval_weights.py). The first three jobs
# (seed 1234's zero3, all3 and qwz+hpz at 125M, 2026-12-05) evaluated the gathered weights only.
EVAL_WEIGHTS = "both"

SMOKE = Study("tiny", 20, (1234, 1235), ("zero3", "all3", FLOOR), micro_batch_size=2,
              global_batch_size=8, eval_interval=10, eval_iters=2)
"""A CPU-sized study for the driver's own test."""


def diagnostic_flags(config: str, interval: int, job_dir: str) -> List[str]:
    """The per-layer error diagnostics of a configuration's switches, every ``interval``
    iterations (and the first), each in a JSON-lines file beside the job's log: qgZ's
    reduction error (``--zeropp-qgz-error-interval``) and the weight error qwZ's forward
    computes with (``--zeropp-qwz-error-interval``). They read only (training computes the
    same bits, tests/test_qgz_error.py, tests/test_qwz_error.py); if a configuration misses
    its target, they say which layers its error sits in. The first three jobs (seed 1234's,
    2026-12-05) ran without them."""
    return G.error_flags(CONFIGS[config], interval, job_dir)


def study_named(name: str) -> Study:
    """The study called ``name``: one of :data:`STUDIES`, or ``"smoke"``."""
    return SMOKE if name == "smoke" else STUDIES[name]


def job_key(study: str, config: str, seed: int) -> str:
    return f"{study}/{config}@seed{seed}"


def job_micro_batch(study_size: int, config: str) -> int:
    """The micro-batch size a job of ``config`` runs when its study's is ``study_size``."""
    cuts = micro_batch_cuts(config)
    if study_size % cuts:
        raise ValueError(f"{config} cuts the micro-batch in {cuts}: {study_size} does not divide")
    return study_size // cuts
