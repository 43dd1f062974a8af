"""The numerics lab on a GPU: does it run, is it deterministic, and what does a rank cost?

For the device machine (one GPU). Three checks, each a pretrain_gpt.py run through
``tools/numerics_lab.py`` (all three techniques with stochastic rounding, the mock dataset):

1. **rerun**: the same 2 x 2 lab run twice; every logged loss and grad norm must agree (the
   staged copies follow the lanes' stream order, or a rerun would read a half-written buffer);
2. **one rank, staged vs NCCL**: 1 x 1 through the lab (gloo, staged) and as a plain
   pretrain_gpt.py run (NCCL); the same numbers expected (no sum crosses ranks);
3. **cost per rank**: each ``--sizes`` model (default the study's reduced 23M GPT and the 124M
   one) at each ``--layouts`` (default 2 x 2 and 2 x 4): ms per iteration, the allocator's peak
   per rank (the log's ``peak memory (GB)``, CUDA context not included) and the whole GPU's used
   memory from ``nvidia-smi`` while it ran.

    python benchmarks/lab_gpu_check.py --out $OUT/lab_gpu_check.json

Prints one line per check and rewrites ``--out`` after each (a run stopped at its time limit
still leaves what it measured); exit code 1 if check 1 or 2 fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

from _pretrain_log import parse_iteration_line  # noqa: E402
from gpu_shaped import COMMON_ENV  # noqa: E402
from numerics_lab import PRETRAIN, lab_command  # noqa: E402

FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192", "--bf16",
         "--accumulate-allreduce-grads-in-fp32", "--lr", "3e-4", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
         "--zeropp-qgz-stochastic-rounding", "--zeropp-qwz-stochastic-rounding"]
SIZES = {
    "tiny": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "256", "--micro-batch-size", "2"],
    "small": ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8",
              "--seq-length", "512", "--micro-batch-size", "4"],
    "124m": ["--num-layers", "12", "--hidden-size", "896", "--num-attention-heads", "14",
             "--ffn-hidden-size", "3584", "--seq-length", "1024", "--micro-batch-size", "2"],
}


def _gpu_used_mb() -> Optional[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def run(cmd: List[str], log_path: str) -> Dict[str, object]:
    """Run one job; its iterations, the peak of nvidia-smi's used memory while it ran."""
    env = dict(os.environ, **COMMON_ENV, PYTHONUNBUFFERED="1")
    peak = {"mb": 0}
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

        def sample():
            while proc.poll() is None:
                used = _gpu_used_mb()
                if used is not None:
                    peak["mb"] = max(peak["mb"], used)
                time.sleep(1)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        rc = proc.wait()
        t.join()
    with open(log_path) as f:
        its = [it for it in map(parse_iteration_line, f) if it is not None and "loss" in it]
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "gpu_used_peak_mb": peak["mb"],
            "iterations": its}


def _numbers(result) -> List[tuple]:
    return [(it["iteration"], it["loss"], it.get("grad_norm")) for it in result["iterations"]]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="lab_gpu_check.json")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sizes", nargs="+", default=["small", "124m"], choices=sorted(SIZES))
    p.add_argument("--layouts", nargs="+", default=["2x2", "2x4"])
    p.add_argument("--cost-iters", type=int, default=10)
    args = p.parse_args(argv)
    logs = os.path.dirname(os.path.abspath(args.out))
    report: Dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    tiny = SIZES["tiny"] + FLAGS + ["--train-iters", str(args.iters),
                                    "--global-batch-size", "8"]
    ok = True

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    a = run(lab_command(2, 2, tiny), os.path.join(logs, "rerun_a.log"))
    b = run(lab_command(2, 2, tiny), os.path.join(logs, "rerun_b.log"))
    same = a["rc"] == b["rc"] == 0 and _numbers(a) == _numbers(b) and len(_numbers(a)) == \
        args.iters
    report["rerun_2x2"] = {"identical": same, "a": a, "b": b}
    print(f"1. 2x2 lab rerun identical over {args.iters} iterations: {same} "
          f"(rc {a['rc']}, {b['rc']}; {a['wall_s']} s, {b['wall_s']} s)", flush=True)
    ok &= same
    save()

    one = tiny[:-1] + ["2"]  # global batch 2: one rank, one micro-batch
    lab1 = run(lab_command(1, 1, one), os.path.join(logs, "one_rank_lab.log"))
    nccl1 = run([sys.executable, PRETRAIN] + one, os.path.join(logs, "one_rank_nccl.log"))
    same1 = lab1["rc"] == nccl1["rc"] == 0 and _numbers(lab1) == _numbers(nccl1)
    report["one_rank_lab_vs_nccl"] = {"identical": same1, "lab": lab1, "nccl": nccl1}
    print(f"2. 1x1 lab (gloo, staged) equals NCCL: {same1} (rc {lab1['rc']}, {nccl1['rc']})",
          flush=True)
    ok &= same1
    save()

    report["cost"] = {}
    for size, layout in ((s, lay) for s in args.sizes for lay in args.layouts):
        k, n = map(int, layout.split("x"))
        z = k * n
        mbs = int(SIZES[size][SIZES[size].index("--micro-batch-size") + 1])
        flags = SIZES[size] + FLAGS + ["--train-iters", str(args.cost_iters),
                                       "--global-batch-size", str(mbs * z)]
        r = run(lab_command(k, n, flags), os.path.join(logs, f"cost_{size}_{layout}.log"))
        ms = sorted(it["ms"] for it in r["iterations"][3:] if it.get("ms"))
        peak = max((it.get("peak_gb") or 0 for it in r["iterations"]), default=None)
        row = {"rc": r["rc"], "ranks": z, "median_ms": ms[len(ms) // 2] if ms else None,
               "allocator_peak_gb_per_rank": peak, "gpu_used_peak_mb": r["gpu_used_peak_mb"],
               "wall_s": r["wall_s"]}
        report["cost"][f"{size} {layout}"] = row
        print(f"3. {size} at {layout}: {row}", flush=True)
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
