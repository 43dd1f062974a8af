"""Convergence of ZeRO++ against ZeRO-3 on real text, with seeds, at any DP on one GPU.

Issue 22's study through the numerics lab (``tools/numerics_lab.py``): each (configuration,
seed) is one job of Z = ``--nodes`` x ``--ranks-per-node`` ranks sharing this host's GPU
(``--ranks-share-gpu``), so the quantization, exchange placement and summation order are those
of a Z-GPU cluster of that shape. All jobs run at once and share the GPU; each saves and stops
after ``--minutes`` and resumes from its checkpoint on the next call (as ``convergence.py
--gpu``, whose job flags, data and log reading this reuses: ``_convergence_gpu.py``).
Configurations (``LAB_CONFIGS``):

    zero3        ZeRO-3 (no ZeRO++ flag), the baseline every gap refers to
    zero3+sg     ZeRO-3 with sharded gradients: the same fp32 sums in another order, no
                 quantization; its gap to zero3 is the study's noise floor (how far a run moves
                 when only rounding order changes)
    qwz+hpz      qwZ + hpZ (small parameters exact: the default)
    all3-old     all three as measured in issue 15: every parameter quantized (threshold 0),
                 qgZ INT4 on both hops, rounding to nearest (blocks are per parameter now;
                 that part cannot be undone)
    all3         all three with per-parameter blocks, parameters below 1e5 elements exact,
                 qgZ INT8 intra-node / INT4 inter-node, rounding to nearest (the defaults
                 before the four-seed study)
    all3+sr      the same with stochastic rounding in qgZ (both hops): the defaults now
    all3+ef      all3 with qgZ error feedback
    qwz-diff4+hpz  qwZ sending 4-bit weight differences (issue 23) + hpZ
    qwz-sr+hpz   qwZ with stochastic rounding of the weights + hpZ

Writes a JSON (``--json``) with the settings, every job's per-iteration train loss, grad norm and
time, its validation losses, and a summary per configuration over the seeds (final validation
loss mean and spread, gap of the mean to zero3's); prints the summary as a table. Data: a
prepared corpus as for ``convergence.py --gpu`` (``tools/build_sample_corpus.py --corpus sources
--prepare``). Usage (the full 125M study, then the reduced one; see docs/benchmarks.md)::

    python benchmarks/convergence_lab.py --data-dir runs/conv_data --run-dir runs/lab \\
        --model 124m --iters 1500 --seeds 1234 1235 --minutes 9 --json runs/lab/curves.json
    python benchmarks/convergence_lab.py --data-dir runs/conv_data --run-dir runs/lab_small \\
        --model small --iters 300 --micro-batch-size 4 --global-batch-size 32 \\
        --eval-interval 50 --seeds 1234 1235 --minutes 8 --json runs/lab_small/curves.json

``--collect-only`` reads the logs back without training; ``--dry-run`` prints the job commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import _convergence_gpu as G  # noqa: E402
from gpu_shaped import COMMON_ENV  # noqa: E402
from numerics_lab import lab_command  # noqa: E402

_ALL3 = ("--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz")
# The configurations that ran before qgZ's default became stochastic rounding keep their
# rounding, so that a rerun is the run the study recorded.
_NEAREST = "--no-zeropp-qgz-stochastic-rounding"
LAB_CONFIGS: Dict[str, Tuple[str, ...]] = {
    "zero3": (),
    "zero3+sg": ("--zeropp-shard-grads",),
    "qwz+hpz": ("--zeropp-qwz", "--zeropp-hpz"),
    "all3-old": _ALL3 + ("--zeropp-small-param-threshold", "0", "--zeropp-qgz-intra-bits", "4",
                         _NEAREST),
    "all3": _ALL3 + (_NEAREST,),
    "all3+sr": _ALL3 + ("--zeropp-qgz-stochastic-rounding",),
    "all3+ef": _ALL3 + ("--zeropp-qgz-error-feedback", _NEAREST),
    "qwz-diff4+hpz": ("--zeropp-qwz", "--zeropp-hpz", "--zeropp-qwz-diff-bits", "4"),
    "qwz-sr+hpz": ("--zeropp-qwz", "--zeropp-hpz", "--zeropp-qwz-stochastic-rounding"),
}


def job_name(config: str, seed: int) -> str:
    return f"{config}@seed{seed}"


def split_name(name: str) -> Tuple[str, int]:
    config, seed = name.rsplit("@seed", 1)
    return config, int(seed)


@dataclass(frozen=True, kw_only=True)
class LabRun(G.Study):
    """Validated settings of one call: the study's (``configs`` maps a job name,
    :func:`job_name`, to its pretrain_gpt.py flags, ``--seed`` included), plus the simulated
    layout."""

    nodes: int
    ranks_per_node: int

    @property
    def dp(self) -> int:
        return self.nodes * self.ranks_per_node

    def __post_init__(self):
        if min(self.nodes, self.ranks_per_node) < 1 or self.nodes * self.ranks_per_node < 2:
            raise ValueError(f"need DP >= 2 (--nodes x --ranks-per-node), got {self.nodes} x "
                             f"{self.ranks_per_node}")
        super().__post_init__()


def job_command(run: LabRun, name: str, port: int) -> List[str]:
    """One job: the lab's torchrun command (``tools/numerics_lab.lab_command``) over the same
    pretrain_gpt.py flags as the multi-GPU study."""
    return _lab_job(run, G.job_flags(run, name), port)


def _lab_job(run: LabRun, flags: Sequence[str], port: int) -> List[str]:
    env = ["env"] + [f"{k}={v}" for k, v in COMMON_ENV.items()]
    return env + lab_command(run.nodes, run.ranks_per_node, flags, python=run.python,
                             master_port=port)


def eval_name(config: str, seed: int) -> str:
    return f"zero3-as-{config}@seed{seed}"


def eval_command(run: LabRun, name: str, port: int, eval_iters: int) -> List[str]:
    """Evaluate zero3's last checkpoint of ``name``'s seed under ``name``'s configuration's
    flags (``--skip-train``, so the weights are exactly the trained ones and only the forward
    gathers differ: the discriminating check of issue 22). No ``--save``: nothing is written, and
    several evaluations of one checkpoint may run at once."""
    config, seed = split_name(name[len("zero3-as-"):])
    flags = G.job_flags(run, name)
    for flag in ("--save", "--exit-duration-in-mins", "--eval-iters"):
        i = flags.index(flag)
        del flags[i:i + 2]
    flags[flags.index("--load") + 1] = os.path.join(run.run_dir, job_name("zero3", seed), "ckpt")
    flags += ["--skip-train", "--eval-iters", str(eval_iters)]
    return _lab_job(run, flags, port)


def evaluate_zero3(run: LabRun, configs: Sequence[str], seeds: Sequence[int], eval_iters: int,
                   echo) -> Dict[str, dict]:
    """zero3's final checkpoint of each seed evaluated under each of ``configs``: {config:
    {seed: (iteration, validation loss) or None}}."""
    names = {eval_name(c, s): LAB_CONFIGS[c] + ("--seed", str(s)) for c in configs for s in seeds}
    erun = dataclasses.replace(run, configs=names)
    codes = G.run_all(erun, echo=echo,
                      command=lambda r, n, port: eval_command(r, n, port, eval_iters))
    out: Dict[str, dict] = {}
    for name, h in G.collect(run.run_dir, list(names)).items():
        config, seed = split_name(name[len("zero3-as-"):])
        found = tuple(h["final_val_loss"][-1]) if h["final_val_loss"] else None
        out.setdefault(config, {})[seed] = found
        if found is None:
            echo(f"{name}: no final validation line (exit code {codes[name]})")
    return out


def summary(results: Dict[str, dict], seeds: Sequence[int],
            at: Optional[int] = None) -> Dict[str, dict]:
    """Per configuration: final validation loss per seed (at validation iteration ``at``, by
    default the last one every job reached), mean, spread (max - min), the gap of the mean to
    zero3's mean over the same seeds, and the paired gap per seed (to zero3 of the same seed:
    the same initialisation and data order, so it is free of the seed-to-seed spread) with its
    mean and standard error."""
    if at is None:
        reached = [set(i for i, _ in h["val_loss"]) for h in results.values()]
        common = set.intersection(*reached) if reached else set()
        at = max(common) if common else None
    out: Dict[str, dict] = {}
    for name, h in results.items():
        config, seed = split_name(name)
        entry = out.setdefault(config, {"at": at, "val_loss": {}, "iterations": {}})
        entry["val_loss"][seed] = dict(h["val_loss"]).get(at) if at is not None else None
        entry["iterations"][seed] = h["iterations"][-1] if h["iterations"] else 0
    for entry in out.values():
        vals = [v for v in entry["val_loss"].values() if v is not None]
        entry["mean"] = statistics.fmean(vals) if vals else None
        entry["spread"] = max(vals) - min(vals) if len(vals) > 1 else None
    base = out.get("zero3", {}).get("val_loss", {})
    for entry in out.values():
        # Only the seeds both have: the seed-to-seed spread (1.4 % between 1234 and 1237 here)
        # is far larger than any gap, so a mean over other seeds would compare the seeds.
        both = [s for s, v in entry["val_loss"].items()
                if v is not None and base.get(s) is not None]
        mine = statistics.fmean(entry["val_loss"][s] for s in both) if both else None
        theirs = statistics.fmean(base[s] for s in both) if both else None
        entry["gap_pct"] = 100 * (mine - theirs) / theirs if both else None
        (entry["paired_gap_pct"], entry["paired_gap_mean_pct"],
         entry["paired_gap_se_pct"]) = paired_gaps(entry["val_loss"], base)
    return out


def paired_gaps(values: Dict[int, Optional[float]], base: Dict[int, Optional[float]]):
    """``({seed: gap %}, mean, standard error)`` of ``values`` against ``base`` over the seeds
    both have (``None`` where there is nothing to average; the standard error needs two seeds:
    the seeds are independent draws of the same run)."""
    gaps = {s: 100 * (v - base[s]) / base[s] for s, v in values.items()
            if v is not None and base.get(s) is not None}
    vals = list(gaps.values())
    return (gaps, statistics.fmean(vals) if vals else None,
            statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) > 1 else None)


def table(summ: Dict[str, dict]) -> str:
    if not summ:
        return "(no runs)"
    at = next(iter(summ.values()))["at"]
    rows = [f"| configuration | validation loss at {at} per seed | mean | spread | gap of the "
            "mean to zero3 (same seeds) | paired gap: mean +- s.e. | paired gap per seed | "
            "iterations run |",
            "|---|---|---:|---:|---:|---:|---|---|"]
    for config, e in summ.items():
        per_seed = ", ".join(f"{s}: {v:.4f}" if v is not None else f"{s}: -"
                             for s, v in sorted(e["val_loss"].items()))
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        gap = f"{e['gap_pct']:+.3f} %" if e["gap_pct"] is not None else "-"
        paired = ", ".join(f"{g:+.3f} %" for _, g in sorted(e["paired_gap_pct"].items())) or "-"
        pm, se = e["paired_gap_mean_pct"], e["paired_gap_se_pct"]
        paired_mean = "-" if pm is None else (f"{pm:+.3f} %" if se is None
                                              else f"{pm:+.3f} +- {se:.3f} %")
        its = ", ".join(str(i) for _, i in sorted(e["iterations"].items()))
        rows.append(f"| {config} | {per_seed} | {fmt(e['mean'], '.4f')} | "
                    f"{fmt(e['spread'], '.4f')} | {gap} | {paired_mean} | {paired} | {its} |")
    return "\n".join(rows)


def plot(results: Dict[str, dict], path: str) -> None:
    """Validation loss per configuration (mean over seeds, the seeds' range shaded) and the
    mean paired gap to zero3 of the same seed with its standard error, over the validation
    iterations (points shifted a little apart), in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_config: Dict[str, Dict[int, Dict[int, float]]] = {}
    for name, h in results.items():
        config, seed = split_name(name)
        by_config.setdefault(config, {})[seed] = dict(h["val_loss"])
    base = by_config.get("zero3", {})
    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(14, 4.8))
    for i, (config, seeds) in enumerate(by_config.items()):
        color = f"C{i}"
        its = sorted(set.intersection(*(set(v) for v in seeds.values())))
        if not its:
            continue
        vals = [[seeds[s][it] for s in seeds] for it in its]
        ax_loss.plot(its, [statistics.fmean(v) for v in vals], color=color, marker="o",
                     label=f"{config} ({len(seeds)} seed{'s' * (len(seeds) != 1)})")
        ax_loss.fill_between(its, [min(v) for v in vals], [max(v) for v in vals], color=color,
                             alpha=0.15)
        if config == "zero3":
            continue
        gaps: Dict[int, List[float]] = {}
        for seed, curve in seeds.items():
            ref = base.get(seed, {})
            for it in curve:
                if it in ref:
                    gaps.setdefault(it, []).append(100 * (curve[it] - ref[it]) / ref[it])
        its = sorted(gaps)
        if its:
            # mean paired gap and its standard error (none with a single seed)
            se = [statistics.stdev(gaps[it]) / len(gaps[it]) ** 0.5 if len(gaps[it]) > 1
                  else 0.0 for it in its]
            ax_gap.errorbar([it + 2 * (i - len(by_config) / 2) for it in its],
                            [statistics.fmean(gaps[it]) for it in its], yerr=se, color=color,
                            marker="o", capsize=3, linewidth=1,
                            label=f"{config} ({len(seeds)} seed{'s' * (len(seeds) != 1)})")
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel("validation loss")
    ax_loss.legend(fontsize=8)
    ax_gap.axhline(0, color="black", linewidth=0.8)
    ax_gap.set_xlabel("iteration")
    ax_gap.set_ylabel("gap to zero3 of the same seed (%), mean +- s.e.")
    ax_gap.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _data(data_dir: str) -> Tuple[Tuple[str, str], int]:
    with open(os.path.join(data_dir, "sample_data.json")) as f:
        data = json.load(f)["data"]
    # The manifest holds absolute paths of the machine that built it: look next to it instead.
    prefixes = tuple(os.path.join(os.path.abspath(data_dir), os.path.basename(data[k]))
                     for k in ("train_data_prefix", "valid_data_prefix"))
    return prefixes, data["vocab_size"]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default="runs/conv_data",
                   help="a prepared corpus (tools/build_sample_corpus.py --prepare)")
    p.add_argument("--run-dir", default="runs/lab", help="checkpoints and logs, per job")
    p.add_argument("--configs", nargs="+", default=list(LAB_CONFIGS),
                   help=f"from {list(LAB_CONFIGS)} (default: all; without zero3, gaps need "
                        "its runs from --merge)")
    p.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                   help="add the runs of earlier calls' --json files to the summary and plot "
                        "(the runs are deterministic: a configuration need not run twice)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1234, 1235])
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes K")
    p.add_argument("--ranks-per-node", type=int, default=2, help="simulated GPUs per node N")
    p.add_argument("--model", default="124m", choices=sorted(G.MODELS))
    p.add_argument("--iters", type=int, default=1500)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--minutes", type=float, default=9.0,
                   help="each job saves and stops after this long (resume with another call)")
    p.add_argument("--qgz-error-interval", type=int, default=0)
    p.add_argument("--evaluate-zero3-as", nargs="*", default=[], metavar="CONFIG",
                   help="after training: evaluate zero3's final checkpoint of every seed under "
                        "each of these configurations (--skip-train; e.g. zero3 qwz+hpz: exact "
                        "and with qwZ weights)")
    p.add_argument("--evaluate-iters", type=int, default=40,
                   help="--eval-iters of those evaluations")
    p.add_argument("--at", type=int, default=None,
                   help="summarise at this validation iteration (default: the last every job "
                        "reached)")
    p.add_argument("--plot", default=None, help="write the curves as a PNG here (matplotlib)")
    p.add_argument("--json", default=None, help="write settings, curves and summary here")
    p.add_argument("--collect-only", action="store_true", help="read the logs back only")
    p.add_argument("--dry-run", action="store_true", help="print the job commands only")
    p.add_argument("extra", nargs="*", help="after --: more pretrain_gpt.py flags, every job")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in LAB_CONFIGS]
    if unknown:
        p.error(f"--configs: names from {list(LAB_CONFIGS)}, got {args.configs}")
    bad = [c for c in args.evaluate_zero3_as if c not in LAB_CONFIGS]
    if bad:
        p.error(f"--evaluate-zero3-as: names from {list(LAB_CONFIGS)}, got {bad}")
    if args.evaluate_zero3_as and "zero3" not in args.configs:
        p.error("--evaluate-zero3-as evaluates zero3's checkpoints: --configs must include zero3")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must differ, got {args.seeds}")
    try:
        prefixes, vocab = _data(args.data_dir)
        run = LabRun(
            configs={job_name(c, s): LAB_CONFIGS[c] + ("--seed", str(s)) + tuple(args.extra)
                     for c in args.configs for s in args.seeds},
            data_prefix=prefixes, vocab_size=vocab, run_dir=os.path.abspath(args.run_dir),
            nodes=args.nodes, ranks_per_node=args.ranks_per_node, train_iters=args.iters,
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            eval_interval=args.eval_interval, eval_iters=args.eval_iters, minutes=args.minutes,
            model=args.model, qgz_error_interval=args.qgz_error_interval)
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    if args.dry_run:
        for name in run.configs:
            print(shlex.join(job_command(run, name, 0)))
        return 0
    if not args.collect_only:
        codes = G.run_all(run, echo=lambda m: print(m, file=sys.stderr, flush=True),
                          command=job_command)
        print(f"exit codes: {codes}", file=sys.stderr)
    results = G.collect(run.run_dir, list(run.configs))
    for path in args.merge:
        with open(path) as f:
            for name, h in json.load(f)["runs"].items():
                if not results.get(name, {}).get("iterations"):  # this call's own run wins
                    results[name] = h
    order = list(LAB_CONFIGS)  # tables and plots in one order, however the calls were split
    results = dict(sorted(results.items(), key=lambda kv: (order.index(split_name(kv[0])[0]),
                                                           split_name(kv[0])[1])))
    summ = summary(results, args.seeds, args.at)
    evaluations = {}
    if args.evaluate_zero3_as:
        evaluations = evaluate_zero3(run, args.evaluate_zero3_as, args.seeds,
                                     args.evaluate_iters,
                                     echo=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("collect_only", "dry_run")}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "dp": run.dp, "runs": results,
                       "summary": summ, "zero3_evaluated_as": evaluations}, f)
    if args.plot:
        plot(results, args.plot)
    print(f"DP {run.dp} = {run.nodes} nodes x {run.ranks_per_node} on one GPU (numerics lab), "
          f"model {run.model}, {run.train_iters}-iteration schedule, global batch "
          f"{run.global_batch_size} sequences, seeds {args.seeds}\n")
    print(table(summ))
    if evaluations:
        print(f"\nzero3's final checkpoint evaluated ({args.evaluate_iters} batches) as:")
        for config, per_seed in evaluations.items():
            print(f"  {config}: " + ", ".join(
                f"seed {s}: " + (f"{v[1]:.6f} at {v[0]}" if v else "-")
                for s, v in sorted(per_seed.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
