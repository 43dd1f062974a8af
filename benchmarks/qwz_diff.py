"""qwZ with weight differences vs absolute INT8 qwZ: forward bytes and weight error in training.

Launch (CPU, gloo; a few minutes on 2 cores)::

    python benchmarks/qwz_diff.py                      # 2x1 error + bytes, 2x2 bytes, 50 steps
    python benchmarks/qwz_diff.py --steps 10 --layouts 2x1

The tiny GPT of the tests (4 layers, hidden 64, vocabulary 128, bf16 weights with fp32 Adam
master weights, small-parameter threshold 1000 so the matrices are quantized), one micro-batch
per rank, prefetch off (so the secondary read after a step holds exactly that step's weights).

* **bytes**: the forward phase's cross-node bytes per iteration as the collectives count them
  (``comm/accounting.py``), from the second iteration on (the first is the exact 16-bit gather);
* **error** (2x1 only: one DP rank per node, so every rank's secondary is the whole unit):
  ``||w_fwd - m|| / ||m||`` over all parameters, where ``m`` is the fp32 master weight the step
  started from and ``w_fwd`` the weights every gather of that step delivered (the secondary).
  "bf16" is plain hpZ (the 16-bit weights themselves): the floor any 16-bit gather has.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

CONFIGS = {
    "bf16 (hpZ, no qwZ)": dict(hpz=True),
    "qwZ INT8": dict(qwz=True, hpz=True),
    "differences INT8": dict(qwz=True, hpz=True, qwz_diff_bits=8),
    "differences INT4": dict(qwz=True, hpz=True, qwz_diff_bits=4),
    "differences INT4, stochastic": dict(qwz=True, hpz=True, qwz_diff_bits=4,
                                         qwz_stochastic_rounding=True),
}


def _forward_error(wrapped, masters):
    """(||w_fwd - m||^2, ||m||^2, ||w_fwd - w16||^2, ||w16||^2) over this rank's shard of
    every parameter (m: fp32 master, w16: the 16-bit primary weights, both before the step)."""
    num = den = num16 = den16 = 0.0
    for unit in wrapped.units:
        z, r = wrapped.comm.dp_size, wrapped.comm.dp_rank
        for p, k, (lo, hi), at in unit._chunk_ranges():
            if hi == lo:
                continue
            part = unit.secondary.partitions[k]
            chunk = part.numel // z
            fwd = part.slice_tensor()[: part.numel].view(z, chunk)[r][at : at + hi - lo]
            m, w16 = masters[p]
            num += float((fwd.float() - m).norm()) ** 2
            den += float(m.norm()) ** 2
            num16 += float((fwd.float() - w16).norm()) ** 2
            den16 += float(w16.norm()) ** 2
    return num, den, num16, den16


def _masters(wrapped, optimizer):
    from megatron_zeropp.optimizer.sharded_state import _mains_and_models
    from megatron_zeropp.optimizer.zero3 import distributed_optimizers

    return {model: (main.detach().float().clone(),
                    wrapped.shard_map[model].primary.detach().float().clone())
            for opt in distributed_optimizers(optimizer)
            for main, model in _mains_and_models(opt)}


def worker(ctx, name, steps, measure_error):
    import dataclasses

    from zero3_runs import build, train

    from megatron_zeropp.sharding import ZeroPPConfig

    cfg = dataclasses.replace(ZeroPPConfig(**CONFIGS[name]), prefetch_depth=0)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", cfg, dtype=torch.bfloat16,
                                  opt={"bf16": True, "loss_scale": 1.0})
    fwd, err, err16 = [], [], []
    masters = _masters(wrapped, optimizer) if measure_error else None

    def on_step(i):
        nonlocal masters
        counts = wrapped.comm_counts(reset=True)
        fwd.append(counts["forward"].total(locality="inter"))
        if measure_error:
            t = torch.tensor(_forward_error(wrapped, masters), dtype=torch.float64)
            torch.distributed.all_reduce(t, group=wrapped.comm.dp_group)
            err.append(float((t[0] / t[1]).sqrt()))
            err16.append(float((t[2] / t[3]).sqrt()))
            masters = _masters(wrapped, optimizer)

    results = train(wrapped, optimizer, steps, micro=1, global_batch=ctx.world_size,
                    on_step=on_step)
    return dict(fwd=fwd, err=err, err16=err16, loss=[r[0] for r in results])


def main(argv=None) -> int:
    import qwz_diff as this  # the workers unpickle by module name, not __main__

    from megatron_zeropp.simulated_nodes import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layouts", nargs="+", default=["2x1", "2x2"])
    args = p.parse_args(argv)
    print(f"# {datetime.date.today()} | {platform.machine()} CPU, {os.cpu_count()} cores | "
          f"torch {torch.__version__} | gloo | tiny GPT (4 x 64), bf16, {args.steps} steps")
    for layout in args.layouts:
        nodes, rpn = (int(v) for v in layout.split("x"))
        measure = rpn == 1
        rows = {}
        for name in CONFIGS:
            rows[name] = run_distributed(this.worker, nodes, rpn,
                                         args=(name, args.steps, measure))[0]
        base = sum(rows["qwZ INT8"]["fwd"][1:]) / (args.steps - 1)
        print(f"\n## {layout}: forward cross-node bytes per iteration (rank 0, iterations 2..)"
              + (", weight error vs the fp32 master" if measure else ""))
        head = "| configuration | bytes / iteration | vs qwZ INT8 | first iteration |"
        if measure:
            head += (" error vs master it. 1 | it. 10 | it. 25 | it. 50 | max | vs bf16 weights"
                     " it. 50 | max | final loss |")
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for name, res in rows.items():
            per = sum(res["fwd"][1:]) / (args.steps - 1)
            line = f"| {name} | {per:.0f} | {per / base:.3f} | {res['fwd'][0]} |"
            if measure:
                e = res["err"]
                picks = [e[min(i, len(e)) - 1] for i in (1, 10, 25, 50)]
                e16 = res["err16"]
                line += "".join(f" {v:.2e} |" for v in picks) + f" {max(e):.2e} |" \
                    + f" {e16[-1]:.2e} | {max(e16):.2e} | {res['loss'][-1]:.4f} |"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
