"""Convergence parity of ZeRO++ against ZeRO-3 on real text, same seed, data and model.

DP = 8 as 2 simulated nodes x 4 ranks on CPU (gloo), the embedded sample corpus (text that ships
with Python: pydoc topics and standard-library docstrings, ~720k training tokens) with its
held-out split for validation, a small GPT, a few hundred steps. Configurations:

    zero3            ZeRO-3 baseline (no ZeRO++ flag)
    hpz              hpZ                                         target: identical to zero3
    qwz+hpz          qwZ + hpZ                                   target: within noise
    qwz+hpz+qgz      all three, qgZ INT4 on both hops            target: within 0.5 % of zero3
    qgz-first-50%    all three, qgZ only for the first half      (the paper's 2.1340 run)
    qgz-int8-intra   all three, qgZ INT8 on the intra-node hop, INT4 across nodes (our change:
                     the intra-node hop is free bandwidth-wise, the cross-node bytes stay INT4)
    zero3-seed1235   the baseline with another seed: how far two equally good runs land apart
    coarse-int4      all three with qgZ blocks of 4096 (16x fewer scales): a deliberately larger
                     quantization error, to see whether a qgZ gap shows at this scale at all
    coarse-int8-intra  the same with INT8 on the intra-node hop (our change, under stress)

Prints a markdown table (final train loss = mean of the last 20 iterations, final validation loss,
gap to zero3 in %) and writes the curves to a PNG. Usage::

    python benchmarks/convergence.py --iters 300 --out docs/convergence.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

CONFIGS = {
    "zero3": [],
    "hpz": ["--zeropp-hpz"],
    "qwz+hpz": ["--zeropp-qwz", "--zeropp-hpz"],
    "qwz+hpz+qgz": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"],
    "qgz-first-50%": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                      "--zeropp-qgz-fraction", "0.5"],
    "qgz-int8-intra": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                       "--zeropp-qgz-intra-bits", "8"],
    "zero3-seed1235": ["--seed", "1235"],
    "coarse-int4": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                    "--zeropp-qgz-block-size", "4096"],
    "coarse-int8-intra": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                          "--zeropp-qgz-block-size", "4096", "--zeropp-qgz-intra-bits", "8"],
}


def _argv(args, sample_dir: str, extra) -> list:
    return [
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "32",
        "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(args.iters // 20, 1)), "--train-iters", str(args.iters),
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16",
        "--log-interval", str(args.iters), "--eval-interval", str(args.eval_interval),
        "--eval-iters", "4", "--sample-data", sample_dir,
        "--ranks-per-node", str(args.ranks_per_node),
    ] + (list(extra) if "--seed" in extra else ["--seed", "1234"] + list(extra))


def _worker(ctx, argv):
    import contextlib
    import io

    from megatron_zeropp.training.loop import pretrain

    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(argv)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, h in results.items():
        loss = h["loss"]
        window = 10
        smooth = []
        for i in range(len(loss)):
            recent = loss[max(0, i - window + 1) : i + 1]
            smooth.append(sum(recent) / len(recent))
        ax_train.plot(h["iterations"], smooth, label=name, linewidth=1)
        if h["val_loss"]:
            its, vals = zip(*h["val_loss"])
            ax_val.plot(its, vals, marker="o", markersize=3, label=name, linewidth=1)
    ax_train.set(title="train loss (10-iteration mean)", xlabel="iteration", ylabel="lm loss")
    ax_val.set(title="validation loss", xlabel="iteration", ylabel="lm loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(results: dict) -> str:
    def final_train(h):
        tail = h["loss"][-20:]
        return sum(tail) / len(tail)

    base_train = final_train(results["zero3"])
    base_val = results["zero3"]["val_loss"][-1][1]
    rows = ["| configuration | final train loss | gap | final validation loss | gap |",
            "|---|---|---|---|---|"]
    for name, h in results.items():
        t, v = final_train(h), h["val_loss"][-1][1]
        rows.append(f"| {name} | {t:.4f} | {100 * (t - base_train) / base_train:+.3f} % | "
                    f"{v:.4f} | {100 * (v - base_val) / base_val:+.3f} % |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sample-dir", default="runs/sample")
    parser.add_argument("--out", default="docs/convergence.png")
    parser.add_argument("--json", default=None, help="also dump the curves here")
    parser.add_argument("--reuse", default=None,
                        help="a --json file of an earlier run with the same settings: its "
                             "configurations are taken from it instead of run again")
    args = parser.parse_args(argv)
    if "zero3" not in args.configs:
        parser.error("--configs must include zero3 (the baseline the gaps refer to)")

    from megatron_zeropp.data.sample_corpus import prepare_sample_data
    from megatron_zeropp.simulated_nodes import run_distributed

    prepare_sample_data(args.sample_dir)
    results = {}
    if args.reuse:
        with open(args.reuse) as f:
            earlier = json.load(f)
        results.update({k: v for k, v in earlier.items() if k in args.configs})
    for name in args.configs:
        if name in results:
            continue
        start = time.time()
        history = run_distributed(
            _worker, args.nodes, args.ranks_per_node,
            args=(_argv(args, args.sample_dir, CONFIGS[name]),), timeout=6 * 3600,
        )[0]
        results[name] = history
        print(f"{name}: {time.time() - start:.0f} s, last loss {history['loss'][-1]:.4f}",
              file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    _plot(results, args.out)
    print(f"DP {args.nodes * args.ranks_per_node} = {args.nodes} nodes x {args.ranks_per_node}, "
          f"{args.iters} iterations, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; curves in {args.out}\n")
    print(_table(results))
    if "hpz" in results:
        same = results["hpz"]["loss"] == results["zero3"]["loss"]
        print(f"\nhpz train loss identical to zero3 at every iteration: {same}")


if __name__ == "__main__":
    main()
