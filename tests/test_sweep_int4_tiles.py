"""benchmarks/sweep_int4_tiles.py on CPU tensors under Triton's interpreter: the first thing a
lease on an H200 runs, so a shape that no longer compiles or changes a bit shows here first.
The timings mean nothing on CPU; the bit checks are the ones the device run makes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep_json(tmp_path, *args) -> dict:
    """What ``sweep_int4_tiles.py --smoke-cpu`` (Triton's interpreter, 16384 elements) with
    ``args`` writes to ``--json``."""
    out = tmp_path / "sweep.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sweep_int4_tiles.py"),
                           "--smoke-cpu", "--numel", "16384", "--json", str(out), *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_shape_runs_and_matches_the_default_bit_for_bit(tmp_path):
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sweep_int4_tiles as sweep

    rows = _sweep_json(tmp_path)["rows"]
    # every shape of both kernels with both roundings, none skipped as failing to compile
    fields = ("tile", "num_warps", "fast", "maxnreg")
    ran = {(r["kernel"], r["rounding"], *(r[x] for x in fields)) for r in rows}
    want = {(k, rounding, *(sweep._tuning(s).get(x) for x in fields))
            for k, shapes in sweep.SHAPES.items() for s in shapes
            for rounding in ("nearest", "stochastic")}
    assert ran == want and len(rows) == len(want)
    # the default's stochastic output against the reference, every other shape against the default
    assert {r["check"] for r in rows if r["tile"] is None} == {"-", "reference"}
    assert {r["check"] for r in rows if r["tile"] is not None} == {"= default"}
    # the former default (no plain-tile test) times beside today's (which tests)
    assert {(r["tile"], r["fast"]) for r in rows if r["kernel"] == "quantize4"} >= {
        (None, None), (1024, False), (2048, True), (2048, False)}
    # register caps for both dequantize-reduce-requantize kernels, beside ptxas's own choice
    assert {(r["kernel"], r["maxnreg"]) for r in rows if r["tile"] == 4096} >= {
        (k, m) for k in ("reduce4", "reduce4to8") for m in (None, 72, 80, 96)}


@pytest.mark.slow
def test_a_short_lease_times_one_kernel_at_its_default_against_the_reference(tmp_path):
    pytest.importorskip("triton")
    got = _sweep_json(tmp_path, "--kernels", "reduce4to8", "--defaults-only")
    assert [(r["kernel"], r["rounding"], r["tile"], r["check"]) for r in got["rows"]] == [
        ("reduce4to8", "nearest", None, "-"), ("reduce4to8", "stochastic", None, "reference")]
    assert list(got["defaults"]) == ["reduce4to8"]
