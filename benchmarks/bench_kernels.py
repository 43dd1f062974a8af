"""Quantization kernels on one GPU: correctness at full size, then time against naive PyTorch.

Launch (on a CUDA machine; megatron-core is not needed)::

    PYTHONPATH=$PWD python benchmarks/bench_kernels.py                  # 2**28 elements
    PYTHONPATH=$PWD python benchmarks/bench_kernels.py --sweep --json out.json

What it does, in one run:

1. Copy bandwidth: a large device-to-device copy, bytes read + written over the median time.
2. Edge cases at small sizes (zeros, NaN/Inf, 1e30 in bf16, subnormals, odd sizes, every
   kernel): Triton vs the reference on the GPU vs the reference on the CPU, all ``torch.equal``.
3. For bf16 and fp16 inputs of ``--numel`` elements: INT8 quantize, INT8 dequantize, INT4
   swizzled quantize (2x4 and 8x8), INT4 dequantize-reduce-requantize (8 pieces -> 1) and the
   last hop's dequantize-reduce to the input dtype. Each is checked bit-for-bit against the
   reference at full size, then timed (``triton.testing.do_bench``, median) for naive PyTorch
   (the reference, which is plain torch) and the kernel. GB/s counts the bytes each kernel must
   read and write (codes, scales, values), not what it happens to move.
4. ``--sweep``: the same kernels over tile sizes and warp counts (bf16), to choose defaults.

The last thing printed is the table. Inputs (>= 512 MB each) are far larger than the 50 MB L2,
so no input rotation is needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback
from functools import partial

import torch

from megatron_zeropp.quant import qgz_reference as qref
from megatron_zeropp.quant import reference as ref
from megatron_zeropp.quant import triton_kernels as tk

BS = 256
DEVICE = "cuda"  # --smoke-cpu switches to "cpu" (TRITON_INTERPRET=1) to test this script itself


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (do_bench flushes L2 between calls)."""
    if DEVICE == "cpu":  # script smoke test only: one untimed-quality call
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def gpu_bench_args(description: str, json_help: str, more=None):
    """``--numel``, ``--json`` and ``--smoke-cpu`` of the kernel benchmarks (``more(parser)``
    adds a script's own); sets :data:`DEVICE` (``--smoke-cpu``: CPU tensors under
    ``TRITON_INTERPRET=1``, to test the script itself) or exits without CUDA."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--numel", type=int, default=2**28)
    parser.add_argument("--json", help=json_help)
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="test this script on CPU tensors (needs TRITON_INTERPRET=1, tiny "
                             "--numel); the numbers mean nothing")
    args = parser.parse_args()
    global DEVICE
    if args.smoke_cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    return args


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = bench(partial(dst.copy_, src))
    assert torch.equal(src[:1 << 20], dst[:1 << 20])
    del src, dst
    return 2 * nbytes / ms / 1e6  # GB/s


def random_input(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values with a log-normal magnitude per block: block scales differ, as in grads."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(numel // BS, BS, device=DEVICE, generator=g)
    # block magnitudes over ~4 decades; kept below fp16's overflow (65504) on purpose
    x *= torch.exp(2 * torch.randn(numel // BS, 1, device=DEVICE, generator=g)).clamp(1e-3, 1e3)
    return x.view(-1).to(dtype)


def assert_same(a, b, what):
    """Bit-identical, with NaN == NaN (payloads may differ between CPU and GPU)."""
    if isinstance(a, tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
        return
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}")
    b = b.to(a.device)
    if a.dtype.is_floating_point:
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    else:
        same = a == b
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} elements differ, first at {bad}")


def quant_bytes(numel, bits, dtype_bytes):
    nbytes, nblocks = ref.quantized_sizes(numel, bits, BS)
    return numel * dtype_bytes + nbytes + 4 * nblocks


def reduce_input(numel: int, dtype: torch.dtype, pieces: int = 8):
    """The INT4 dequantize-reduce's input as qgZ's first hop leaves it: ``pieces`` rows of
    ``numel`` values (:func:`random_input`, seeds 10, 11, ...), each INT4-quantized by the Triton
    kernel; returns ``(data, scales)`` of shape ``[pieces, 1, ...]``."""
    parts = [tk.quantize_chunks(random_input(numel, dtype, seed=10 + p).view(1, -1), 4, BS)
             for p in range(pieces)]
    return torch.stack([d for d, _ in parts]), torch.stack([s for _, s in parts])


def reduce_bytes(numel: int, pieces: int, out_bits: int) -> int:
    """Bytes the INT4 dequantize-reduce-requantize must move: ``pieces`` INT4 rows in (codes and
    fp32 scales) and one row out at ``out_bits``."""
    nbytes4, nblocks = ref.quantized_sizes(numel, 4, BS)
    nbytes_out, nblocks_out = ref.quantized_sizes(numel, out_bits, BS)
    return pieces * (nbytes4 + 4 * nblocks) + nbytes_out + 4 * nblocks_out


def edge_cases():
    """Small adversarial inputs: Triton == reference (GPU) == reference (CPU)."""
    cases = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(7, 1000, dtype=torch.float32)
        x[0, :300] = 0.0  # zero blocks
        x[1, 5] = float("nan")
        x[2, 700] = float("inf")
        x[2, 20] = -float("inf")
        x[3] *= 1e-41 if dtype != torch.float16 else 1e-6  # subnormal / tiny blocks
        if dtype != torch.float16:
            x[4] *= 1e30  # huge (bf16/fp32 only: fp16 overflows by design)
        x[5, ::7] = 0.5  # many exact ties after scaling are unlikely; halves help
        x = x.to(dtype)
        for bits in (8, 4):
            for bs in (32, 256, 1024):
                want = ref.quantize_chunks(x, bits, bs)
                xd = x.to(DEVICE)
                assert_same(tk.quantize_chunks(xd, bits, bs), want, f"q {dtype} {bits} {bs}")
                assert_same(ref.quantize_chunks(xd, bits, bs), want, f"ref-gpu q {dtype}")
                deq = ref.dequantize_chunks(*want, bits, bs, 1000, dtype)
                got = tk.dequantize_chunks(want[0].to(DEVICE), want[1].to(DEVICE), bits, bs, 1000,
                                           dtype)
                assert_same(got, deq, f"dq {dtype} {bits} {bs}")
                cases += 2
        flat = x.view(-1)[: 7 * 1000 // 8 * 8].contiguous()
        for nodes, rpn in ((2, 4), (8, 8), (3, 2), (1, 8)):
            z = nodes * rpn
            xf = flat[: flat.numel() // z * z]
            for bits in (4, 8):
                want = qref.swizzled_quantize(xf, nodes, rpn, bits, 32)
                assert_same(tk.swizzled_quantize(xf.to(DEVICE), nodes, rpn, bits, 32), want,
                            f"swz {dtype} {nodes}x{rpn} {bits}")
                cases += 1
    for bits in (4, 8):
        pieces, rows, n = 5, 3, 1000
        x = torch.randn(pieces * rows, n) * torch.exp(3 * torch.randn(pieces * rows, 1))
        x[4, 17] = float("nan")
        d, s = ref.quantize_chunks(x, bits, 64)
        d, s = d.view(pieces, rows, -1), s.view(pieces, rows, -1)
        outs = ((None, None, torch.bfloat16), (None, None, torch.float32), (4, 64, torch.float32),
                (8, 128, torch.float32), (4, 32, torch.float32))
        for out_bits, out_bs, out_dtype in outs:
            want = qref.dequantize_reduce(d, s, bits, 64, n, out_bits, out_bs, out_dtype)
            got = tk.dequantize_reduce(d.to(DEVICE), s.to(DEVICE), bits, 64, n, out_bits, out_bs,
                                       out_dtype)
            assert_same(got, want, f"drr {bits}->{out_bits}")
            cases += 1
    # The sums where rounding the product first (or rounding through fp64) goes wrong: piece 1
    # adds 3 * (1 + 2**-23), exactly halfway between two fp32 numbers, to a tiny +-2**-100 from
    # piece 0, so the single rounding must go up for + and down for -.
    data = torch.empty(2, 2, 16, dtype=torch.uint8)
    data[0, 0], data[0, 1], data[1] = 0x11, 0xFF, 0x33  # codes +1, -1, and 3
    scales = torch.empty(2, 2, 1)
    scales[0], scales[1] = 2.0**-100, 1 + 2.0**-23
    want = torch.tensor([[3 + 2.0**-21], [3 + 2.0**-22]]).expand(2, 32)
    for impl in (qref, tk):
        got = impl.dequantize_reduce(data.to(DEVICE), scales.to(DEVICE), 4, 32, 32)
        assert_same(got.cpu(), want.contiguous(), f"fma tie {impl.__name__}")
        cases += 1
    return cases


class Table:
    def __init__(self, copy_gbs):
        self.copy_gbs = copy_gbs
        self.rows = []

    def add(self, name, dtype, nbytes, naive_ms, kernel_ms, check, note=""):
        row = dict(op=name, dtype=str(dtype).replace("torch.", ""), bytes=nbytes,
                   naive_ms=naive_ms, kernel_ms=kernel_ms,
                   naive_gbs=nbytes / naive_ms / 1e6 if naive_ms else None,
                   kernel_gbs=nbytes / kernel_ms / 1e6, check=check, note=note)
        row["naive_pct"] = 100 * row["naive_gbs"] / self.copy_gbs if naive_ms else None
        row["kernel_pct"] = 100 * row["kernel_gbs"] / self.copy_gbs
        self.rows.append(row)
        print(f"  {name:<40} {row['dtype']:<9} kernel {kernel_ms:7.3f} ms "
              f"{row['kernel_gbs']:7.0f} GB/s {row['kernel_pct']:5.1f}%  "
              f"naive {naive_ms or float('nan'):8.3f} ms  {check} {note}", flush=True)

    def render(self):
        lines = [
            f"copy bandwidth (read + write): {self.copy_gbs:.0f} GB/s",
            "| op | input | naive ms | naive GB/s (% copy) | kernel ms | kernel GB/s | % copy | "
            "vs reference |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            naive = (f"{r['naive_ms']:.2f} | {r['naive_gbs']:.0f} ({r['naive_pct']:.1f} %)"
                     if r["naive_ms"] else "- | -")
            lines.append(f"| {r['op']} | {r['dtype']} | {naive} | {r['kernel_ms']:.3f} | "
                         f"{r['kernel_gbs']:.0f} | {r['kernel_pct']:.1f} % | {r['check']} |")
        return "\n".join(lines)


def rel_err(approx, exact):
    approx, exact = approx.float(), exact.float()
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))


def run_dtype(table, numel, dtype, naive):
    dbytes = torch.finfo(dtype).bits // 8
    x = random_input(numel, dtype, seed=1)
    x2d = x.view(1, -1)

    # INT8 quantize
    got = tk.quantize_chunks(x2d, 8, BS)
    want = ref.quantize_chunks(x2d, 8, BS)
    assert_same(got, want, "int8 quantize")
    err = rel_err(ref.dequantize_chunks(*got, 8, BS, numel, torch.float32), x2d)
    del want
    table.add("INT8 quantize", dtype, quant_bytes(numel, 8, dbytes),
              bench(partial(ref.quantize_chunks, x2d, 8, BS)) if naive else None,
              bench(partial(tk.quantize_chunks, x2d, 8, BS)), "bit-identical",
              f"quant rel err {err:.2e}")

    # INT8 dequantize
    d8, s8 = got
    assert_same(tk.dequantize_chunks(d8, s8, 8, BS, numel, dtype),
                ref.dequantize_chunks(d8, s8, 8, BS, numel, dtype), "int8 dequantize")
    table.add("INT8 dequantize", dtype, quant_bytes(numel, 8, dbytes),
              bench(partial(ref.dequantize_chunks, d8, s8, 8, BS, numel, dtype)) if naive else None,
              bench(partial(tk.dequantize_chunks, d8, s8, 8, BS, numel, dtype)), "bit-identical")
    del got, d8, s8

    # INT4 swizzled quantize
    for nodes, rpn in ((2, 4), (8, 8)):
        got = tk.swizzled_quantize(x, nodes, rpn, 4, BS)
        assert_same(got, qref.swizzled_quantize(x, nodes, rpn, 4, BS), "swizzled quantize")
        del got
        table.add(f"INT4 swizzled quantize {nodes}x{rpn}", dtype, quant_bytes(numel, 4, dbytes),
                  bench(partial(qref.swizzled_quantize, x, nodes, rpn, 4, BS)) if naive else None,
                  bench(partial(tk.swizzled_quantize, x, nodes, rpn, 4, BS)), "bit-identical")

    # INT4 dequantize-reduce-requantize, 8 pieces of one row -> 1 row
    pieces = 8
    data, scales = reduce_input(numel, dtype, pieces)
    del x, x2d
    moved = reduce_bytes(numel, pieces, 4)
    want = qref.dequantize_reduce(data, scales, 4, BS, numel, 4)
    assert_same(tk.dequantize_reduce(data, scales, 4, BS, numel, 4), want, "drr int4")
    table.add("INT4 dequant-reduce-requant (8 -> 1)", dtype, moved,
              bench(partial(qref.dequantize_reduce, data, scales, 4, BS, numel, 4))
              if naive else None,
              bench(partial(tk.dequantize_reduce, data, scales, 4, BS, numel, 4)), "bit-identical")
    del want
    # last hop: dequantize-reduce to the input dtype
    nbytes, nblocks = ref.quantized_sizes(numel, 4, BS)
    moved = pieces * (nbytes + 4 * nblocks) + numel * dbytes
    assert_same(tk.dequantize_reduce(data, scales, 4, BS, numel, None, None, dtype),
                qref.dequantize_reduce(data, scales, 4, BS, numel, None, None, dtype),
                "drr cast")
    table.add("INT4 dequant-reduce -> input dtype (8 -> 1)", dtype, moved,
              bench(partial(qref.dequantize_reduce, data, scales, 4, BS, numel, None, None, dtype))
              if naive else None,
              bench(partial(tk.dequantize_reduce, data, scales, 4, BS, numel, None, None, dtype)),
              "bit-identical")


def sweep(numel, copy_gbs):
    """Kernel time per (tile, num_warps) for bf16; returns rows for the JSON."""
    out = []
    x = random_input(numel, torch.bfloat16, seed=3)
    x2d = x.view(1, -1)
    d8, s8 = tk.quantize_chunks(x2d, 8, BS)
    d4, s4 = tk.quantize_chunks(x2d, 4, BS)
    data = d4.expand(8, -1).reshape(8, 1, -1).contiguous()
    scales = s4.expand(8, -1).reshape(8, 1, -1).contiguous()
    nbytes4, nblocks = ref.quantized_sizes(numel, 4, BS)
    kernels = {
        "q8": (quant_bytes(numel, 8, 2),
               lambda c: tk.quantize_chunks(x2d, 8, BS, **c)),
        "q8_fast": (quant_bytes(numel, 8, 2),
                    lambda c: tk.quantize_chunks(x2d, 8, BS, fast=True, **c)),
        "dq8": (quant_bytes(numel, 8, 2),
                lambda c: tk.dequantize_chunks(d8, s8, 8, BS, numel, torch.bfloat16, **c)),
        "swz4": (quant_bytes(numel, 4, 2),
                 lambda c: tk.swizzled_quantize(x, 2, 4, 4, BS, **c)),
        "swz4_fast": (quant_bytes(numel, 4, 2),
                      lambda c: tk.swizzled_quantize(x, 2, 4, 4, BS, fast=True, **c)),
        "dq4": (quant_bytes(numel, 4, 2),
                lambda c: tk.dequantize_chunks(d4, s4, 4, BS, numel, torch.bfloat16, **c)),
        "drr4": (9 * (nbytes4 + 4 * nblocks),
                 lambda c: tk.dequantize_reduce(data, scales, 4, BS, numel, 4, **c)),
        "drr4_nofast": (9 * (nbytes4 + 4 * nblocks),
                        lambda c: tk.dequantize_reduce(data, scales, 4, BS, numel, 4, fast=False,
                                                       **c)),
        "drr4_cast": (8 * (nbytes4 + 4 * nblocks) + 2 * numel,
                      lambda c: tk.dequantize_reduce(data, scales, 4, BS, numel, None, None,
                                                     torch.bfloat16, **c)),
    }
    for name, (moved, fn) in kernels.items():
        best = None
        for tile in (1024, 2048, 4096, 8192):
            for warps in (2, 4, 8):
                if not 16 <= tile // (32 * warps) <= 64:  # run 2: 32 per thread was best
                    continue
                try:
                    ms = bench(partial(fn, dict(tile=tile, num_warps=warps)))
                except Exception as exc:  # a config that fails to compile is reported, not fatal
                    print(f"  sweep {name} tile={tile} warps={warps}: {exc!r}"[:300])
                    continue
                pct = 100 * moved / ms / 1e6 / copy_gbs
                out.append(dict(kernel=name, tile=tile, num_warps=warps, ms=ms, pct=pct))
                if best is None or ms < best[0]:
                    best = (ms, tile, warps, pct)
        if best is None:
            print(f"  sweep {name}: no config ran", flush=True)
            continue
        print(f"  sweep {name:<16} best tile={best[1]} warps={best[2]}: {best[0]:.3f} ms "
              f"{best[3]:.1f}% of copy", flush=True)
    return out


def _own_flags(parser) -> None:
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-naive", action="store_true", help="skip timing naive PyTorch")


def main():
    args = gpu_bench_args(__doc__.splitlines()[0], "write all numbers here", _own_flags)
    import triton

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)"
    now = datetime.datetime.now().isoformat(timespec="seconds")
    info = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, date=now,
                numel=args.numel, block_size=BS, argv=sys.argv)
    print(info, flush=True)
    result = dict(info=info, errors=[])
    copy_gbs = copy_bandwidth(4 << 30 if DEVICE == "cuda" else 1 << 20)
    result["copy_gbs"] = copy_gbs
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    try:
        print(f"edge cases: {edge_cases()} comparisons bit-identical", flush=True)
    except Exception:
        result["errors"].append(traceback.format_exc())
        traceback.print_exc()
    table = Table(copy_gbs)
    for dtype in (torch.bfloat16, torch.float16):
        try:
            run_dtype(table, args.numel, dtype, naive=not args.no_naive)
        except Exception:
            result["errors"].append(traceback.format_exc())
            traceback.print_exc()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if args.sweep:
        try:
            result["sweep"] = sweep(args.numel, copy_gbs)
        except Exception:
            result["errors"].append(traceback.format_exc())
            traceback.print_exc()
    result["rows"] = table.rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print()
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, {info['date']}, "
          f"numel {args.numel} (2**{math.log2(args.numel):.0f}), block {BS}")
    print(table.render())
    if result["errors"]:
        print(f"{len(result['errors'])} section(s) FAILED (tracebacks above)")
        sys.exit(1)


if __name__ == "__main__":
    main()
