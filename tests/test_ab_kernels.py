"""benchmarks/ab_kernels.py on CPU tensors under Triton's interpreter: the script a kernel change
is timed with on the device runs, and its bit check between the two versions can fail. The
timings mean nothing on CPU."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "megatron_zeropp", "quant", "triton_kernels.py")


def _run(prev, out):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ab_kernels.py"),
                           "--smoke-cpu", "--numel", "8192", "--rounds", "1", "--prev",
                           str(prev), "--json", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_both_versions_run_every_kernel_and_match(tmp_path):
    pytest.importorskip("triton")
    prev = tmp_path / "prev_triton_kernels.py"
    prev.write_text(open(KERNELS).read())
    proc = _run(prev, tmp_path / "ab.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "ab.json").read_text())
    assert {(r["kernel"], r["rounding"]) for r in out["rows"]} == {
        (k, r) for k in ("INT4 -> INT4", "INT4 -> INT8") for r in ("nearest", "stochastic")}
    assert all(len(r[v]["ms"]) == 1 for r in out["rows"] for v in ("prev", "new"))
    # the same source under two names: one hash
    assert out["sha256"]["prev"] == out["sha256"]["new"]


@pytest.mark.slow
def test_a_version_that_sums_differently_is_caught(tmp_path):
    pytest.importorskip("triton")
    source = open(KERNELS).read()
    wrong = "a1 = tl.fma(c1, s, a1)"
    assert source.count(wrong) == 1
    prev = tmp_path / "prev_triton_kernels.py"
    prev.write_text(source.replace(wrong, "a1 = tl.fma(c2, s, a1)"))
    proc = _run(prev, tmp_path / "ab.json")
    assert proc.returncode != 0
    assert "INT4 -> INT4 nearest: new vs prev" in proc.stderr
    assert not (tmp_path / "ab.json").exists()
