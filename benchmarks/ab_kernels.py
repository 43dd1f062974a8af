"""Two versions of ``megatron_zeropp/quant/triton_kernels.py`` side by side on one GPU: the INT4
dequantize-reduce kernels of qgZ, timed in alternating rounds, their outputs compared bit for bit.

Launch (on a CUDA machine; megatron-core is not needed)::

    git show REV:megatron_zeropp/quant/triton_kernels.py > runs/prev_triton_kernels.py
    PYTHONPATH=$PWD python benchmarks/ab_kernels.py --prev runs/prev_triton_kernels.py \
        --json out.json

Why: a kernel change that saves a few percent of the instructions is worth a point or two of
copy bandwidth on a card where the kernel is bound by issue (the H200), while two runs of one
kernel on two cards of one model differ by up to half a point (docs/benchmarks.md, the tile
sweeps). So the two versions run in one process on one card, ``--rounds`` times each in turn.

An H100 limited to 72 % of its SMs stands in for an H200 (the same bytes of memory bandwidth
per SM; the tile sweep there orders shapes as the H200 did and reads ~2 points higher;
docs/benchmarks.md, "An H200's stand-in")::

    . benchmarks/_mps.sh; mps_start
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=72 PYTHONPATH=$PWD python benchmarks/ab_kernels.py ...

``--prev`` is loaded as a module of the package ``megatron_zeropp.quant``, so its relative
imports take today's ``triton_rounding`` and references: the file must be a version that
imports what today's package has (a kernel change, not a package change).

Kernels (bf16 inputs, block 256, 8 pieces of ``--numel`` elements each, their default tiles):
INT4 -> INT4 (qgZ with ``--zeropp-qgz-inter-bits 4``) and INT4 -> INT8 (qgZ's default since
2026-12-06), each with round-to-nearest and stochastic rounding. Both versions' outputs must be
bit-identical to each other, and the stochastic ones to the reference. GB/s counts the bytes each
kernel must read and write, as ``sweep_int4_tiles.py`` does, against the median of the copy
bandwidths measured at the start of each round. The JSON names both sources by SHA-256.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels  # noqa: E402
from bench_kernels import (  # noqa: E402
    BS,
    assert_same,
    bench,
    copy_bandwidth,
    reduce_bytes,
    reduce_input,
)

from megatron_zeropp.quant import qgz_reference as qref  # noqa: E402
from megatron_zeropp.quant import triton_kernels as tk  # noqa: E402
from megatron_zeropp.quant.rounding import derive_key, row_keys  # noqa: E402

PIECES = 8


def load_prev(path: str):
    """``path`` as the module ``megatron_zeropp.quant._prev_triton_kernels``."""
    name = "megatron_zeropp.quant._prev_triton_kernels"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run(numel: int, prev_path: str, rounds: int, json_path=None) -> dict:
    device = bench_kernels.DEVICE
    prev = load_prev(prev_path)
    versions = {"prev": prev, "new": tk}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test)",
           "numel": numel, "prev": os.path.abspath(prev_path), "rounds": rounds,
           "sha256": {v: _sha256(m.__file__) for v, m in versions.items()},
           "copy_GB/s": [], "rows": []}
    data, scales = reduce_input(numel, torch.bfloat16, PIECES)
    keys = row_keys(derive_key(1234, 7, 0, 3), [0], device=device)
    cases = []
    for out_bits in (4, 8):
        moved = reduce_bytes(numel, PIECES, out_bits)
        for rounding, k in (("nearest", None), ("stochastic", keys)):
            calls = {v: (lambda m=m, b=out_bits, k=k:
                         m.dequantize_reduce(data, scales, 4, BS, numel, b, out_row_keys=k))
                     for v, m in versions.items()}
            got = calls["prev"]()
            assert_same(calls["new"](), got, f"INT4 -> INT{out_bits} {rounding}: new vs prev")
            if k is not None:
                assert_same(got, qref.dequantize_reduce(data, scales, 4, BS, numel, out_bits,
                                                        out_row_keys=k),
                            f"INT4 -> INT{out_bits} {rounding}: reference")
            del got
            cases.append((f"INT4 -> INT{out_bits}", rounding, moved, calls))
    ms = {(c[0], c[1], v): [] for c in cases for v in versions}
    for _ in range(rounds):
        # the copy bandwidth of each round beside it: the card's clocks move between rounds
        out["copy_GB/s"].append(copy_bandwidth(2 * numel))
        for kernel, rounding, _moved, calls in cases:
            for v, call in calls.items():
                ms[(kernel, rounding, v)].append(bench(call))
    copy = statistics.median(out["copy_GB/s"])
    for kernel, rounding, moved, _calls in cases:
        row = {"kernel": kernel, "rounding": rounding}
        for v in versions:
            t = statistics.median(ms[(kernel, rounding, v)])
            row[v] = {"ms": ms[(kernel, rounding, v)], "ms_median": t,
                      "of_copy": moved / t / 1e6 / copy}
        row["prev/new time"] = row["prev"]["ms_median"] / row["new"]["ms_median"]
        out["rows"].append(row)
        print(f"{kernel:13s} {rounding:10s} prev {row['prev']['ms_median']:7.3f} ms "
              f"{row['prev']['of_copy']:6.1%}   new {row['new']['ms_median']:7.3f} ms "
              f"{row['new']['of_copy']:6.1%}   prev/new {row['prev/new time']:.3f}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main() -> None:
    def more(parser):
        parser.add_argument("--prev", required=True,
                            help="the other version of megatron_zeropp/quant/triton_kernels.py")
        parser.add_argument("--rounds", type=int, default=5)

    args = bench_kernels.gpu_bench_args(__doc__.splitlines()[0], "write the numbers here", more)
    out = run(args.numel, args.prev, args.rounds, args.json)
    print(f"copy bandwidth {statistics.median(out['copy_GB/s']):.0f} GB/s (median of "
          f"{len(out['copy_GB/s'])}) on {out['device']}; bit-identical: prev = new, and "
          f"stochastic = reference")


if __name__ == "__main__":
    main()
