"""Where a numerics-lab iteration spends its time, beside one process training the same batch.

For the device machine (one GPU). Each run is pretrain_gpt.py's training loop (this file runs
it under torchrun with a per-iteration hook; mock data, the study's training flags) for
``--iters`` iterations of ``--model`` at global batch ``--global-batch-size``:

* ``one``: one process, world size 1 (NCCL), the whole global batch on one rank;
* ``lab-host`` / ``lab-shared``: the lab at ``--nodes`` x ``--ranks-per-node`` ranks on the GPU
  with each transport (``--lab-transport``), for each of ``--configs`` (``zero3``: no flag;
  ``all3``: qwZ + hpZ + qgZ with the defaults);
* ``four-apart`` (``--apart``): Z independent one-process runs at once, each with a Z-th of the
  batch: the lab's compute and time-sharing of the GPU with no exchange at all.

Per run: the median wall time of an iteration (rank 0, iterations after ``--warmup``), and per
rank the host seconds per iteration in each phase of the transports (``comm/lab_transport.py``:
``host.wait_device`` (the lane draining before a device-to-host copy), ``host.to_host``,
``host.gloo``, ``host.from_host``; ``shared.write``, ``shared.barrier``, ``shared.read``,
``shared.open``: issue times, the copies run on the device). Also: whether ``lab-host`` and
``lab-shared`` of a configuration logged the same loss and grad norm at every iteration (they
move the same bytes; all3's exchanges are all-gathers and all-to-alls). Writes ``--out`` (JSON)
and prints a table; each run's log and rank files go to ``<out>_runs/<run>/``::

    python benchmarks/lab_profile.py --out $OUT/lab_profile.json --model 125m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _convergence_gpu as G  # noqa: E402
from _pretrain_log import parse_iteration_line  # noqa: E402
from gpu_shaped import COMMON_ENV, _free_port  # noqa: E402

CONFIGS = {"zero3": [], "all3": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]}


def rank_main(out_dir: str, argv: List[str]) -> None:
    """Inside one rank: pretrain with a hook that stamps every iteration with the wall clock and
    the transports' phase totals; rank files ``rank<R>.json`` in ``out_dir``."""
    from megatron_zeropp.comm.lab_transport import TIMES
    from megatron_zeropp.training.fallbacks import silence_fallback_warnings
    from megatron_zeropp.training.launch import run_guarded, single_process_defaults

    silence_fallback_warnings()
    single_process_defaults()
    from megatron_zeropp.training.loop import pretrain

    stamps = []

    def hook(iteration, chunks, optimizer):
        stamps.append({"iteration": iteration, "t": time.perf_counter(),
                       "phases": TIMES.snapshot()})

    def run():
        pretrain(argv, on_iteration=hook)
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "stamps": stamps}, f)

    run_guarded(run)


def flags(model: str, iters: int, mbs: int, gbs: int, vocab: int, extra: List[str]) -> List[str]:
    return G.MODELS[model] + [f for f in G.TRAINING if f != "--ckpt-format"
                              and f != "torch"] + [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
        "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
        "--train-iters", str(iters), "--lr-warmup-iters", "2", "--eval-iters", "0",
        "--eval-interval", str(iters + 1)] + extra


def _torchrun(nproc: int, out_dir: str, argv: List[str]) -> List[str]:
    return ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
             str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             os.path.abspath(__file__), "--rank-dir", out_dir, "--"] + argv)


def start(cmd: List[str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ, **COMMON_ENV, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


def summarise(run_dir: str, warmup: int) -> Dict[str, object]:
    """Median iteration time (rank 0) and mean host seconds per iteration per phase (each rank,
    iterations after ``warmup``); the log's loss and grad norm per iteration."""
    ranks = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(run_dir, name)) as f:
                ranks.append(json.load(f))
    out: Dict[str, object] = {"ranks": len(ranks)}
    if not ranks:
        return out
    per_rank = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        s = [x for x in r["stamps"] if x["iteration"] >= warmup]
        if len(s) < 2:
            continue
        steps = [b["t"] - a["t"] for a, b in zip(s, s[1:])]
        n = len(steps)
        phases = {}
        for k in set(s[-1]["phases"]) | set(s[0]["phases"]):
            last = s[-1]["phases"].get(k, {"s": 0.0, "calls": 0, "bytes": 0})
            first = s[0]["phases"].get(k, {"s": 0.0, "calls": 0, "bytes": 0})
            phases[k] = {"s_per_iter": (last["s"] - first["s"]) / n,
                         "calls_per_iter": (last["calls"] - first["calls"]) / n,
                         "bytes_per_iter": (last["bytes"] - first["bytes"]) / n}
        per_rank.append({"rank": r["rank"], "median_s": statistics.median(steps),
                         "steps_s": steps, "phases": phases})
    out["per_rank"] = per_rank
    out["median_s"] = per_rank[0]["median_s"] if per_rank else None
    return out


def _log_numbers(path: str) -> List[tuple]:
    with open(path, errors="replace") as f:
        its = [parse_iteration_line(line) for line in f]
    return [(i["iteration"], i.get("loss"), i.get("grad_norm")) for i in its
            if i is not None and "loss" in i]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--rank-dir"]:
        rest = argv[argv.index("--") + 1:]
        rank_main(argv[1], rest)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="lab_profile.json")
    p.add_argument("--model", default="125m", choices=sorted(G.MODELS))
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--host-iters", type=int, default=8,
                   help="lab-host runs stop after this many iterations (--exit-interval)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=["zero3", "all3"], choices=sorted(CONFIGS))
    p.add_argument("--runs", nargs="+", default=["one", "lab-shared", "lab-host", "apart"],
                   choices=["one", "lab-shared", "lab-host", "apart"])
    args = p.parse_args(argv)
    z = args.nodes * args.ranks_per_node
    # The runs' logs and rank files beside the report, in a folder of its own: two reports
    # written to one folder at once (two profiles sharing the GPU) must not read each other's.
    base = os.path.splitext(os.path.abspath(args.out))[0] + "_runs"
    report: Dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                 "settings": vars(args), "runs": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    def one_run(name: str, procs: List[List[str]], warmup: int) -> None:
        run_dir = os.path.join(base, name.replace(" ", "_"))
        os.makedirs(run_dir, exist_ok=True)
        t0 = time.monotonic()
        started = []
        for i, argv_ in enumerate(procs):
            sub = os.path.join(run_dir, f"p{i}") if len(procs) > 1 else run_dir
            os.makedirs(sub, exist_ok=True)
            started.append((sub, start(_torchrun(argv_[0], sub, argv_[1:]),
                                       os.path.join(sub, "train.log"))))
        codes = [proc.wait() for _, proc in started]
        entry = {"rc": codes, "wall_s": round(time.monotonic() - t0, 1)}
        subs = [summarise(sub, warmup) for sub, _ in started]
        entry.update(subs[0] if len(subs) == 1 else {"apart": subs, "median_s": max(
            (s.get("median_s") or 0) for s in subs)})
        entry["log"] = _log_numbers(os.path.join(started[0][0], "train.log"))
        report["runs"][name] = entry
        print(f"{name}: rc {codes}, median {entry.get('median_s')} s/iteration, "
              f"{entry['wall_s']} s wall", flush=True)
        save()

    lab = ["--ranks-share-gpu", "--ranks-per-node", str(args.ranks_per_node)]
    for config in args.configs:
        extra = CONFIGS[config]
        full = flags(args.model, args.iters, args.micro_batch_size, args.global_batch_size,
                     args.vocab_size, extra)
        if "one" in args.runs:
            one_run(f"one {config}", [[1] + full], args.warmup)
        if "lab-shared" in args.runs:
            one_run(f"lab-shared {config}", [[z] + full + lab + ["--lab-transport", "shared"]],
                    args.warmup)
        if "lab-host" in args.runs:
            # The same schedule as the other runs (the learning rate of every step), stopped
            # early: the logged numbers are comparable iteration by iteration.
            short = full + ["--exit-interval", str(args.host_iters)]
            one_run(f"lab-host {config}", [[z] + short + lab + ["--lab-transport", "host"]],
                    min(args.warmup, args.host_iters - 3))
            shared = report["runs"].get(f"lab-shared {config}", {}).get("log", [])
            host = report["runs"][f"lab-host {config}"]["log"]
            n = min(len(shared), len(host))
            report["runs"][f"lab-host {config}"]["same_as_shared"] = (
                n > 0 and shared[:n] == host[:n], n)
        if "apart" in args.runs and config == args.configs[0]:
            part = flags(args.model, args.iters, args.micro_batch_size,
                         args.global_batch_size // z, args.vocab_size, extra)
            one_run(f"apart {config}", [[1] + part for _ in range(z)], args.warmup)
    one_s = {c: report["runs"].get(f"one {c}", {}).get("median_s") for c in args.configs}
    print("\n| run | s per iteration | / one process | host s per iteration per phase "
          "(rank 0) |\n|---|---:|---:|---|")
    for name, e in report["runs"].items():
        config = name.split()[1]
        ms = e.get("median_s")
        ratio = f"{ms / one_s[config]:.2f}" if ms and one_s.get(config) else "-"
        phases = ", ".join(f"{k} {v['s_per_iter']:.3f}" for k, v in sorted(
            (e.get("per_rank") or [{}])[0].get("phases", {}).items()) if v["calls_per_iter"])
        print(f"| {name} | {ms if ms is None else round(ms, 3)} | {ratio} | {phases} |")
        if "same_as_shared" in e:
            print(f"|   same loss and grad norm as lab-shared over {e['same_as_shared'][1]} "
                  f"iterations: {e['same_as_shared'][0]} | | | |")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
