"""benchmarks/_pretrain_log.py reads both training-line formats (ours and Megatron-LM's with a
timestamp) into the same numbers."""

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

from _pretrain_log import median, parse_iteration_line, parse_log  # noqa: E402

OURS = (" iteration        2/       4 | consumed samples:            8 | elapsed time per "
        "iteration (ms): 788.9 | throughput per GPU (TFLOP/s/GPU): 0.00325 | learning rate: "
        "5.000000E-05 | global batch size:     4 | lm loss: 1.085077E+01 | loss scale: 1.0 | "
        "grad norm: 1.183 | number of skipped iterations:   0 | number of nan iterations:   0 | "
        "tokens per second: 324.5 | peak memory (GB): 0.863 | inter-node bytes per iteration: "
        "4.2060E+06 | intra-node bytes per iteration: 0.0000E+00 | qwz_allgather forward bytes "
        "per iteration: 3.3231E+06 |")
MEGATRON = ("[2026-11-30 14:00:07] iteration        3/      12 | consumed samples:           12 |"
            " elapsed time per iteration (ms): 1167.3 | throughput per GPU (TFLOP/s/GPU): 59.1 | "
            "learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 9.547771E+00 | "
            "loss scale: 1.0 | grad norm: 2.517 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 |")


def test_our_line():
    it = parse_iteration_line(OURS)
    assert it["iteration"] == 2 and it["train_iters"] == 4
    assert it["ms"] == 788.9 and it["tflops"] == 0.00325 and it["loss"] == 10.85077
    assert it["peak_gb"] == 0.863 and it["inter_bytes"] == 4.206e6 and it["intra_bytes"] == 0.0
    assert it["qwz_allgather forward bytes per iteration"] == 3.3231e6
    assert it["global_batch_size"] == 4 and it["grad_norm"] == 1.183


def test_megatron_line_with_timestamp_and_prefixes():
    it = parse_iteration_line(MEGATRON)
    assert (it["iteration"], it["train_iters"], it["ms"], it["tflops"], it["loss"]) == (
        3, 12, 1167.3, 59.1, 9.547771)
    assert "inter_bytes" not in it and "peak_gb" not in it  # absent, not invented
    assert parse_iteration_line("[rank1]: " + MEGATRON)["ms"] == 1167.3
    assert parse_iteration_line(MEGATRON.replace("[2026-11-30 14:00:07] ", ""))["loss"] == 9.547771


def test_line_stamps_become_seconds():
    """Megatron-LM's stamp (and ours, with microseconds) as POSIX seconds; none without one."""
    later = MEGATRON.replace("[2026-11-30 14:00:07]", "[2026-11-30 14:01:09.250000]")
    assert parse_iteration_line(later)["time"] - parse_iteration_line(MEGATRON)["time"] == 62.25
    assert "time" not in parse_iteration_line(OURS)


def test_other_lines_are_not_iterations():
    for line in (" validation loss at iteration 10 | lm loss value: 9.1E+00 | lm loss PPL: 1E+4 |",
                 "> saved checkpoint of iteration 4 to /tmp/x", "  train_iters ......... 12",
                 "reiteration 3/4 | lm loss: 1 |", ""):
        assert parse_iteration_line(line) is None, line


def test_log_nan_memory_and_last_line_wins():
    lines = [MEGATRON, OURS, OURS.replace("lm loss: 1.085077E+01", "lm loss: nan"),
             "[Rank 0] (after 3 iterations) memory (MB) | allocated: 1024.5 | max allocated: "
             "2048.0 | reserved: 3000.0 | max reserved: 3000.0"]
    parsed = parse_log(lines)
    assert [it["iteration"] for it in parsed["iterations"]] == [2, 3]
    assert math.isnan(parsed["iterations"][0]["loss"])
    assert parsed["memory"] == [{"allocated": 1024.5, "max allocated": 2048.0,
                                 "reserved": 3000.0, "max reserved": 3000.0}]


def test_median_skips_missing_and_nan():
    assert median([3.0, None, 1.0, float("nan"), 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert median([None]) is None
