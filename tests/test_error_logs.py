"""The error diagnostics through pretrain_gpt.py's loop (2 nodes x 2 ranks on CPU): one JSON
line per measured iteration from rank 0 (--zeropp-qgz-error-log, --zeropp-qwz-error-log), the
same totals as the run's history, and the training log line's field."""

import json
import math

import pytest

from megatron_zeropp.simulated_nodes import run_distributed

SWITCHES = {  # the diagnostic's name: the switches it measures
    "qgz": ["--zeropp-qgz"],
    "qwz": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-small-param-threshold", "0"],
}
# An upper bound on each total: for qgZ only a sanity one here (its derived bound is checked in
# tests/test_qgz_error.py); INT8 qwZ blocks of 256 weights are off by at most absmax / 254 each
# and each block's squared norm is at least absmax^2: at most sqrt(256) / 254 relatively.
BOUND = {"qgz": 1.0, "qwz": math.sqrt(256) / 254}


def _pretrain(ctx, argv, what):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)[f"{what}_error"]


@pytest.mark.parametrize("what", sorted(SWITCHES))
def test_pretrain_writes_one_json_line_per_measured_iteration(tmp_path, sample_dir, what):
    log = tmp_path / f"{what}_error.jsonl"
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters 4 "
            "--log-interval 1 --eval-interval 1000 --eval-iters 0 --ranks-per-node 2").split() + [
        "--sample-data", sample_dir, f"--zeropp-{what}-error-interval", "2",
        f"--zeropp-{what}-error-log", str(log)] + SWITCHES[what]
    out = run_distributed(_pretrain, 2, 2, args=(argv, what))
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    assert [d["iteration"] for d in lines] == [1, 2, 4]
    assert [(d["iteration"], d["total"]) for d in lines] == out[0]
    for d in lines:
        assert 0 < d["total"] < BOUND[what]
        assert any("layers.1" in name for name in d["units"]), d["units"]


@pytest.mark.parametrize("what", sorted(SWITCHES))
def test_log_line_field(what):
    from megatron_zeropp.training.logging_utils import IntervalStats, training_log_line

    line = training_log_line(3, 10, 24, IntervalStats(iterations=1, seconds=1.0), 1e-3, 8,
                             1.0, 1.0, 1e9, 4, 512, **{f"{what}_error": 0.012345})
    assert f"| {what} relative error: 1.2345E-02 |" in line
    assert what not in training_log_line(3, 10, 24, IntervalStats(), 1e-3, 8, 1.0, 1.0,
                                         1e9, 4, 512)
