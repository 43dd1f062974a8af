"""benchmarks/lab_compare_runs.py: lab_profile.py reports side by side, a run's loss log held
against the baseline's."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import lab_compare_runs as C  # noqa: E402


def _report(path, median_s, log):
    with open(path, "w") as f:
        json.dump({"runs": {"lab-shared zero3": {"rc": [0], "median_s": median_s,
                                                 "log": log}}}, f)


def test_same_log_and_ratio_against_the_baseline(tmp_path):
    log = [[1, 10.5, 2.0], [2, 10.1, 1.5]]
    _report(tmp_path / "plain.json", 0.4, log)
    _report(tmp_path / "mps.json", 0.3, log)
    lines = C.rows(str(tmp_path), ["plain", "mps"])
    assert lines[-1] == ("| mps | lab-shared zero3 | [0] | 0.300 | 0.75 | same at all 2 "
                         "iterations |")


def test_a_different_loss_is_named_with_its_iteration(tmp_path):
    _report(tmp_path / "plain.json", 0.4, [[1, 10.5, 2.0], [2, 10.1, 1.5]])
    _report(tmp_path / "mps.json", 0.3, [[1, 10.5, 2.0], [2, 10.1000001, 1.5]])
    last = C.rows(str(tmp_path), ["plain", "mps", "absent"])
    assert "differs from iteration 2: [10.1, 1.5] vs [10.1000001, 1.5]" in last[-2]
    assert last[-1] == "| absent | (no report) | | | | |"
    assert C.identity([], [[1, 1.0, 1.0]]) == "no log"
