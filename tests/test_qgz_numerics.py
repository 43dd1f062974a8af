"""benchmarks/qgz_numerics.py: its one-process qgZ emulation equals the distributed
qgz_reduce_scatter bit for bit (gloo, several layouts and bit widths), the exact variants are the
fp32 sums they claim to be, and a tiny training run on CPU writes what the report reads."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import qgz_numerics as Q  # noqa: E402
from megatron_zeropp.simulated_nodes import run_distributed  # noqa: E402

NUMEL = 5000  # not a multiple of Z * block: the padding path runs too


def _inputs(z):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(NUMEL, generator=g) * (1 + r) for r in range(z)]
    xs[0][17] = 40.0  # one outlier block
    return xs


def _distributed(ctx, bits, block):
    from megatron_zeropp.comm.qgz import qgz_reduce_scatter
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology())
    z, d = len(groups.dp_ranks), groups.dp_ranks.index(ctx.rank)
    x = _inputs(z)[d]
    out = torch.empty((NUMEL + z - 1) // z, dtype=torch.float32)
    qgz_reduce_scatter(out, x, groups.intra_node, groups.inter_node, "sum", bits=bits,
                       block_size=block)
    return d, out


@pytest.mark.parametrize("nodes, rpn, bits, block", [
    (2, 1, (4, 4), 128), (2, 2, (4, 4), 128), (2, 2, (8, 4), 64), (1, 2, (8, 8), 128),
])
def test_emulation_equals_distributed_qgz(nodes, rpn, bits, block):
    results = run_distributed(_distributed, nodes, rpn, args=(bits, block))
    distributed = torch.cat([out for _, out in sorted(results)])[:NUMEL]
    emulated = Q.qgz_reduce_emulated(_inputs(nodes * rpn), nodes, rpn, bits, block)
    assert torch.equal(emulated, distributed)
    # The comparison can fail: another bit width gives other bits.
    other = (8, 8) if bits != (8, 8) else (4, 4)
    assert not torch.equal(Q.qgz_reduce_emulated(_inputs(nodes * rpn), nodes, rpn, other, block),
                           distributed)


def test_exact_variants_are_fp32_sums_in_their_order():
    g = torch.Generator().manual_seed(3)
    per_rank = [[torch.randn(1000, generator=g) * 10 ** (r + m) for m in range(2)]
                for r in range(2)]
    exact = Q.reduce_ranks(Q.VARIANTS["exact"], per_rank, 2, 1)
    assert torch.equal(exact, (per_rank[0][0] + per_rank[0][1]) + (per_rank[1][0] + per_rank[1][1]))
    order = Q.reduce_ranks(Q.VARIANTS["sum-order"], per_rank, 2, 1)
    assert torch.equal(order, ((per_rank[0][0] + per_rank[1][0]) + per_rank[0][1]) + per_rank[1][1])
    assert not torch.equal(order, exact)  # same sum, other rounding
    assert torch.allclose(order, exact, rtol=1e-5, atol=1e-2)


def test_tiny_training_run_and_report(tmp_path):
    from megatron_zeropp.data.sample_corpus import prepare_sample_data

    data_dir = str(tmp_path / "data")
    prepare_sample_data(data_dir)
    common = ["--data-dir", data_dir, "--tiny", "--iters", "4", "--seq-length", "64",
              "--micro-batch-size", "2", "--eval-interval", "2", "--eval-iters", "1",
              "--measure-interval", "2"]
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                          "qgz_numerics.py")
    # Own processes: training initialises torch.distributed, which must not leak into pytest's.
    for extra in (["--apply", "exact", "--measure", "int4", "int8", "sum-order",
                   "--out", str(tmp_path / "exact.jsonl")],
                  ["--apply", "int4", "--out", str(tmp_path / "int4.jsonl")]):
        subprocess.run([sys.executable, script] + common + extra, check=True,
                       capture_output=True, timeout=600)
    steps = [json.loads(line) for line in open(tmp_path / "exact.jsonl")][1:]
    assert [s["iteration"] for s in steps] == [1, 2, 3, 4]
    errors = steps[0]["errors"]
    assert 0 < errors["int8"]["total"] < errors["int4"]["total"] < 0.5
    assert 0 < errors["sum-order"]["total"] < 1e-5
    assert set(errors["int4"]["units"]) == {"embedding", "layer 0", "layer 1", "final"}
    table = Q.report([str(tmp_path / "exact.jsonl"), str(tmp_path / "int4.jsonl")],
                     str(tmp_path / "q.png"), "exact")
    assert "| exact | exact | 4 |" in table and "| int4 | int4 | 4 |" in table
    assert os.path.getsize(tmp_path / "q.png") > 0
