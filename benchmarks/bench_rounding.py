"""Stochastic rounding in the Triton kernels on one GPU: bit-identity with the reference at full
size, and bandwidth beside round-to-nearest, in one run.

Launch (on a CUDA machine; megatron-core is not needed)::

    PYTHONPATH=$PWD python benchmarks/bench_rounding.py --json out.json

For bf16 inputs of ``--numel`` elements, each kernel qgZ and qwZ use, with round-to-nearest and
with stochastic rounding (keys from :mod:`megatron_zeropp.quant.rounding`, one per row): INT8
quantize (qwZ), INT4 swizzled quantize 2x4 (qgZ hop 1), INT4 dequantize-reduce-requantize
(8 -> 1, qgZ's requantization after hop 1). Every stochastic output is compared bit for bit with
the reference run on the same GPU; GB/s counts the bytes each kernel must read and write (as
``bench_kernels.py``), and the last column is the fraction of the copy bandwidth.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels  # noqa: E402
from bench_kernels import (  # noqa: E402
    BS,
    assert_same,
    bench,
    copy_bandwidth,
    quant_bytes,
    random_input,
    reduce_bytes,
    reduce_input,
)

from megatron_zeropp.quant import qgz_reference as qref  # noqa: E402
from megatron_zeropp.quant import reference as ref  # noqa: E402
from megatron_zeropp.quant import triton_kernels as tk  # noqa: E402
from megatron_zeropp.quant.rounding import derive_key, row_keys  # noqa: E402


def host_syncs(fn) -> str:
    """Whether one call of ``fn`` synchronizes the host with the GPU (CUDA's sync debug mode
    raises at the first synchronizing operation); training must not, in the steady state."""
    if bench_kernels.DEVICE == "cpu":
        return "-"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "no host sync"
    except RuntimeError as e:
        return "HOST SYNC: " + str(e).splitlines()[0][:70]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run(numel: int) -> dict:
    copy = copy_bandwidth(2 * numel)
    rows = []

    def add(name, nbytes, ms, check):
        gbs = nbytes / ms / 1e6
        rows.append({"kernel": name, "ms": ms, "GB/s": gbs, "of_copy": gbs / copy,
                     "check": check})
        print(f"{name:55s} {ms:8.3f} ms {gbs:8.0f} GB/s {gbs / copy:6.1%}  {check}", flush=True)

    if bench_kernels.DEVICE != "cpu":  # the sync check can fail: a read of a device value
        control = host_syncs(lambda: int(torch.ones(1, device="cuda").sum()))
        print(f"sync check on a device read (control): {control}")
        assert control.startswith("HOST SYNC"), control
    dtype = torch.bfloat16
    x = random_input(numel, dtype, seed=1)
    x2d = x.view(1, -1)
    key = derive_key(1234, 7, 0, 3)
    device = bench_kernels.DEVICE
    k1 = row_keys(key, [0], device=device)
    moved = quant_bytes(numel, 8, 2)
    add("INT8 quantize, nearest", moved, bench(partial(tk.quantize_chunks, x2d, 8, BS)), "-")
    assert_same(tk.quantize_chunks(x2d, 8, BS, row_keys=k1),
                ref.quantize_chunks(x2d, 8, BS, k1), "int8 stochastic")
    add("INT8 quantize, stochastic", moved,
        bench(partial(tk.quantize_chunks, x2d, 8, BS, row_keys=k1)), "bit-identical")
    # as training calls it: keys built from the call's integers every time
    fresh = lambda x2d=x2d: tk.quantize_chunks(  # noqa: E731
        x2d, 8, BS, row_keys=row_keys(key, [0], device))
    add("INT8 quantize, stochastic, keys built per call", moved, bench(fresh), host_syncs(fresh))

    z = 8
    kz = row_keys(key, range(z), device=device)
    moved = quant_bytes(numel, 4, 2)
    add("INT4 swizzled quantize 2x4, nearest", moved,
        bench(partial(tk.swizzled_quantize, x, 2, 4, 4, BS)), "-")
    assert_same(tk.swizzled_quantize(x, 2, 4, 4, BS, row_keys=kz),
                qref.swizzled_quantize(x, 2, 4, 4, BS, kz), "swizzled stochastic")
    add("INT4 swizzled quantize 2x4, stochastic", moved,
        bench(partial(tk.swizzled_quantize, x, 2, 4, 4, BS, row_keys=kz)), "bit-identical")
    fresh = lambda x=x: tk.swizzled_quantize(  # noqa: E731
        x, 2, 4, 4, BS, row_keys=row_keys(key, range(z), device))
    add("INT4 swizzled quantize 2x4, stochastic, keys built per call", moved, bench(fresh),
        host_syncs(fresh))
    del x, x2d, fresh

    pieces = 8
    data, scales = reduce_input(numel, dtype, pieces)
    moved = reduce_bytes(numel, pieces, 4)
    add("INT4 dequant-reduce-requant 8->1, nearest", moved,
        bench(partial(tk.dequantize_reduce, data, scales, 4, BS, numel, 4)), "-")
    assert_same(tk.dequantize_reduce(data, scales, 4, BS, numel, 4, out_row_keys=k1),
                qref.dequantize_reduce(data, scales, 4, BS, numel, 4, out_row_keys=k1),
                "drr stochastic")
    add("INT4 dequant-reduce-requant 8->1, stochastic", moved,
        bench(partial(tk.dequantize_reduce, data, scales, 4, BS, numel, 4, out_row_keys=k1)),
        "bit-identical")
    fresh = lambda: tk.dequantize_reduce(  # noqa: E731
        data, scales, 4, BS, numel, 4, out_row_keys=row_keys(key, [0], device))
    add("INT4 dequant-reduce-requant 8->1, stochastic, keys built per call", moved,
        bench(fresh), host_syncs(fresh))
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test)",
            "numel": numel, "copy_GB/s": copy,
            # the stochastic rounding these numbers are for (quant/rounding.py; issue 22)
            "rounding": "one lowbias32 per pair of columns, 15 bits each, (bits(y+384)+r)>>15",
            "rows": rows}


def main() -> None:
    args = bench_kernels.gpu_bench_args(__doc__.splitlines()[0], "write the numbers here")
    out = run(args.numel)
    print(f"copy bandwidth {out['copy_GB/s']:.0f} GB/s on {out['device']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
