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

``--gpu`` runs ``GPU_CONFIGS`` instead, on this host's GPUs as two nodes, all at once, with a
~124M GPT on the ``sources`` corpus (``tools/build_sample_corpus.py --corpus sources --prepare``,
given as ``--data-dir``), resumable over several calls (``benchmarks/_convergence_gpu.py``)::

    python benchmarks/convergence.py --gpu --data-dir runs/conv_data --run-dir runs/conv \
        --iters 1200 --minutes 8 --out docs/convergence_gpu.png --json runs/conv/curves.json
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


# One GPU per node in the runs this is made for (2 x H200): the intra-node hop of qgZ is then a
# single rank, so the INT8-intra variant would equal "qwz+hpz+qgz" and is not listed.
_ALL3 = ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]
GPU_CONFIGS = {
    "zero3": [],
    "zero3-seed1235": ["--seed", "1235"],
    # Same fp32 sums as zero3 in another order (reduce per micro-batch, then accumulate): what
    # any harmless change does to the trajectory.
    "zero3-sum-order": ["--zeropp-shard-grads"],
    "hpz": ["--zeropp-hpz"],
    "qwz+hpz": ["--zeropp-qwz", "--zeropp-hpz"],
    "qwz+hpz+qgz": _ALL3,
    "qgz-first-50%": _ALL3 + ["--zeropp-qgz-fraction", "0.5"],
    "qgz+error-feedback": _ALL3 + ["--zeropp-qgz-error-feedback"],
    "qgz+hadamard": _ALL3 + ["--zeropp-qgz-hadamard"],
    # qwZ sending INT4 weight differences (issue 23), beside plain qwZ; two seeds each.
    "qwz+hpz-seed1235": ["--zeropp-qwz", "--zeropp-hpz", "--seed", "1235"],
    "qwz-diff4+hpz": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qwz-diff-bits", "4"],
    "qwz-diff4+hpz-seed1235": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qwz-diff-bits", "4",
                               "--seed", "1235"],
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
        ax_train.plot(h["iterations"], _smooth(h["loss"], 10), label=name, linewidth=1)
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


def _smooth(values, window):
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out


def _plot_gpu(results: dict, path: str) -> None:
    """Train loss, validation loss, grad norm and the train-loss difference to zero3; the qgZ
    relative error when a run logged it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_err = any(h["qgz_error"] for h in results.values())
    fig, axes = plt.subplots(2, 3 if with_err else 2, figsize=(18 if with_err else 12, 8))
    axes = axes.flatten()
    base = dict(zip(results["zero3"]["iterations"], results["zero3"]["loss"]))
    for name, h in results.items():
        its = h["iterations"]
        axes[0].plot(its, _smooth(h["loss"], 20), label=name, linewidth=1)
        if h["val_loss"]:
            vi, vv = zip(*h["val_loss"])
            axes[1].plot(vi, vv, marker="o", markersize=2, label=name, linewidth=1)
        gn = [g for g in h["grad_norm"]]
        axes[2].plot(its, _smooth([g if g is not None else float("nan") for g in gn], 20),
                     label=name, linewidth=1)
        common = [i for i in its if i in base]
        diff = [100 * (loss - base[i]) / base[i] for i, loss in zip(its, h["loss"]) if i in base]
        axes[3].plot(common, _smooth(diff, 20), label=name, linewidth=1)
        if with_err and h["qgz_error"]:
            axes[4].plot([e["iteration"] for e in h["qgz_error"]],
                         [e["total"] for e in h["qgz_error"]], label=name, linewidth=1)
    titles = ["train loss (20-iteration mean)", "validation loss", "grad norm (20-iteration mean)",
              "train loss vs zero3, % (20-iteration mean)", "qgZ relative error (whole model)"]
    for ax, title in zip(axes, titles):
        ax.set(title=title, xlabel="iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if with_err:
        axes[4].set_yscale("log")
        axes[5].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _table_gpu(results: dict) -> str:
    """Final validation loss at the last iteration every configuration reached, its gap to zero3,
    where each run first differs from zero3, and its largest train-loss difference."""
    common_val = set.intersection(*(set(i for i, _ in h["val_loss"]) for h in results.values()))
    at = max(common_val) if common_val else None
    base = results["zero3"]
    base_loss = dict(zip(base["iterations"], base["loss"]))
    base_val = dict(base["val_loss"]).get(at) if at else None
    rows = [f"| configuration | iterations run | validation loss at {at} | gap to zero3 | "
            "first iteration whose loss differs from zero3 | largest train-loss gap to zero3 | "
            "median ms / iteration (jobs share the GPUs) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, h in results.items():
        val = dict(h["val_loss"]).get(at) if at else None
        gap = f"{100 * (val - base_val) / base_val:+.3f} %" if val and base_val else "-"
        pairs = [(i, loss) for i, loss in zip(h["iterations"], h["loss"]) if i in base_loss]
        first = next((i for i, loss in pairs if loss != base_loss[i]), None)
        worst = max((abs(loss - base_loss[i]) / base_loss[i] for i, loss in pairs), default=None)
        ms = sorted(m for m in h["ms"][1:] if m)
        rows.append(
            f"| {name} | {h['iterations'][-1] if h['iterations'] else 0} | "
            f"{f'{val:.4f}' if val else '-'} | {gap} | "
            f"{first if first is not None else 'none (identical)'} | "
            f"{f'{100 * worst:.2f} %' if worst is not None else '-'} | "
            f"{ms[len(ms) // 2] if ms else '-'} |")
    return "\n".join(rows)


def _gpu_main(args) -> None:
    import _convergence_gpu as G

    unknown = [c for c in args.configs if c not in GPU_CONFIGS]
    if unknown or "zero3" not in args.configs:
        raise SystemExit(f"--configs: need zero3 and names from {list(GPU_CONFIGS)}, "
                         f"got {args.configs}")
    with open(os.path.join(args.data_dir, "sample_data.json")) as f:
        data = json.load(f)["data"]
    # The manifest holds absolute paths of the machine that built it: look next to it instead.
    prefixes = tuple(os.path.join(os.path.abspath(args.data_dir), os.path.basename(data[k]))
                     for k in ("train_data_prefix", "valid_data_prefix"))
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    try:
        run = G.GpuRun(
            configs={n: tuple(GPU_CONFIGS[n]) + tuple(args.extra) for n in args.configs},
            data_prefix=prefixes, vocab_size=data["vocab_size"],
            run_dir=os.path.abspath(args.run_dir), gpus=args.gpus, train_iters=args.iters,
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            eval_interval=args.eval_interval, eval_iters=args.eval_iters, minutes=args.minutes,
            model=args.model, qgz_error_interval=args.qgz_error_interval)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not args.collect_only:
        codes = G.run_all(run, echo=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"exit codes: {codes}", file=sys.stderr)
    results = G.collect(run.run_dir, list(run.configs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        _plot_gpu(results, args.out)
    print(f"{args.gpus} GPUs as 2 nodes x {args.gpus // 2}, model {args.model}, "
          f"{args.iters}-iteration schedule, global batch {args.global_batch_size} sequences; "
          f"curves in {args.out}\n")
    print(_table_gpu(results))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"CPU: {list(CONFIGS)}; --gpu: {list(GPU_CONFIGS)} (default: all)")
    parser.add_argument("--sample-dir", default="runs/sample")
    parser.add_argument("--out", default="docs/convergence.png")
    parser.add_argument("--json", default=None, help="also dump the curves here")
    parser.add_argument("--reuse", default=None,
                        help="a --json file of an earlier run with the same settings: its "
                             "configurations are taken from it instead of run again")
    gpu = parser.add_argument_group("--gpu mode")
    gpu.add_argument("--gpu", action="store_true", help="GPU_CONFIGS on this host's GPUs")
    gpu.add_argument("--data-dir", default="runs/conv_data",
                     help="a prepared corpus (tools/build_sample_corpus.py --prepare)")
    gpu.add_argument("--run-dir", default="runs/conv", help="checkpoints and logs, per config")
    gpu.add_argument("--gpus", type=int, default=None, help="default: all visible")
    gpu.add_argument("--minutes", type=float, default=8.0,
                     help="each job saves and stops after this long (resume with another call)")
    gpu.add_argument("--model", default="124m", choices=("124m", "tiny"),
                     help="tiny: a smoke run of the driver (also on CPU with --gpus 2)")
    gpu.add_argument("--micro-batch-size", type=int, default=8)
    gpu.add_argument("--global-batch-size", type=int, default=32)
    gpu.add_argument("--eval-iters", type=int, default=10)
    gpu.add_argument("--qgz-error-interval", type=int, default=0,
                     help="configurations with qgZ log its relative error every N iterations")
    gpu.add_argument("--collect-only", action="store_true",
                     help="only read the logs in --run-dir back (no training)")
    gpu.add_argument("extra", nargs="*", help="after --: more pretrain_gpt.py flags, every job")
    args = parser.parse_args(argv)
    if args.gpu:
        args.configs = args.configs or list(GPU_CONFIGS)
        return _gpu_main(args)
    args.configs = args.configs or list(CONFIGS)
    if any(c not in CONFIGS for c in args.configs):
        parser.error(f"--configs: choose from {list(CONFIGS)}, got {args.configs}")
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
