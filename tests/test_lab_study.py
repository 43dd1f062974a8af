"""benchmarks/lab_study.py with its matrix (lab_studies.py), plan (lab_lease_plan.py) and tables
(lab_study_report.py):
which jobs run next, a job's record read from its log, the results file skipping what it holds,
the study's table of paired gaps and noise floor, a rerun compared with its record; and (slow)
the smoke study's jobs trained on CPU, recorded and rechecked."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import lab_lease_plan as P  # noqa: E402
import lab_studies as D  # noqa: E402
import lab_study as S  # noqa: E402
import lab_study_report as R  # noqa: E402


def test_pending_skips_recorded_and_started_jobs_seed_by_seed():
    done = {D.job_key("125m", "zero3", 1234): {}}
    started = {D.job_key("125m", "all3", 1234): {}}
    todo = P.pending("125m", done, started)
    assert todo[:3] == [("qwz+hpz", 1234), ("all3+diff4", 1234), ("zero3+2mb", 1234)]
    assert todo[3] == ("zero3", 1235) and len(todo) == 5 * 3 - 2
    # the 10 %-warmup study measures the floor right after zero3 of each seed
    assert P.pending("125m-w150", {}, {})[:3] == [("zero3", 1234), ("zero3+2mb", 1234),
                                                 ("all3", 1234)]
    assert P.pending("350m", {}, {}, only=["all3"]) == [("all3", 1234), ("all3", 1235)]
    # a lease can finish one seed (its pairs on one GPU model) before it starts another
    assert P.pending("125m-w150", done, {}, seeds=[1235])[0] == ("zero3", 1235)
    assert {s for _, s in P.pending("125m-w150", done, {}, seeds=[1235])} == {1235}
    with pytest.raises(ValueError, match=r"seeds \[99\] are not study 125m-w150's"):
        P.pending("125m-w150", {}, {}, seeds=[99, 1234])
    # a configuration outside the study would queue nothing without a word
    with pytest.raises(ValueError, match=r"configurations \['all3\+diff4'\] are not study "
                       r"smoke's"):
        P.pending("smoke", {}, {}, only=["all3+diff4", "all3"])


def test_studies_are_the_issues_matrix():
    small, medium = D.STUDIES["125m"], D.STUDIES["350m"]
    assert small.iters >= 1500 and len(small.seeds) >= 3
    assert {"zero3", "qwz+hpz", "all3", "all3+diff4"} <= set(small.configs)
    assert D.CONFIGS["all3+diff4"][-2:] == ("--zeropp-qwz-diff-bits", "4")
    assert medium.iters >= 1000 and len(medium.seeds) >= 2 and set(medium.configs) == {
        "zero3", "all3", D.FLOOR}
    assert medium.configs[:2] == ("zero3", "all3")  # the target's job before the floor
    warm = D.STUDIES["125m-w150"]
    assert (warm.model, warm.iters, warm.seeds) == (small.model, small.iters, small.seeds)
    assert set(warm.configs) == set(small.configs) and D.FLOOR in warm.configs
    # the first study's recipe stays what its recorded jobs ran: warmup 2 % (30), lr 6e-4
    assert (small.warmup, warm.warmup, medium.warmup) == (30, 150, 100)
    assert (small.lr, small.min_lr, medium.lr, medium.min_lr) == (6e-4, 6e-5, 3e-4, 3e-5)
    low = D.STUDIES["125m-lr3e-4"]
    assert (low.model, low.iters, low.seeds, set(low.configs)) == (
        warm.model, warm.iters, warm.seeds, set(warm.configs))
    assert low.configs[:3] == ("zero3", "all3", "qwz+hpz")  # the targets' jobs first
    assert (low.warmup, low.lr, low.min_lr) == (150, 3e-4, 3e-5)
    # the rule set before seed 1236's data: a miss runs all three with the INT8 cross-node hop
    assert low.if_missed == ("all3+qgz8",) and small.if_missed == ()
    # set before any 350M job with qgZ: a miss there names the switch first, then the 4-bit
    # differences (the other setting that met the target at 125M); the INT8 hop is the
    # default by then, all3 itself
    assert medium.if_missed == ("qwz+hpz", "all3+diff4") and medium.pinned == ()
    assert "qwz+hpz" not in medium.configs
    assert D.CONFIGS["all3+qgz8"] == D.CONFIGS["all3"] + ("--zeropp-qgz-inter-bits", "8")


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_job_flags_carry_the_recipe_and_the_floors_cut(sample_dir):
    small, medium_study = D.STUDIES["125m"], D.STUDIES["350m"]
    zero3 = S.job_flags(small, "zero3", 1234, sample_dir, "d")
    # the values the recorded jobs ran (they were passed as "6e-4" and "6e-5": the same doubles)
    assert [_flag(zero3, f) for f in ("--lr", "--min-lr", "--lr-warmup-iters",
                                      "--micro-batch-size")] == ["0.0006", "6e-05", "30", "8"]
    assert (float(_flag(zero3, "--lr")), float(_flag(zero3, "--min-lr"))) == (
        float("6e-4"), float("6e-5"))
    medium = S.job_flags(medium_study, "all3", 1234, sample_dir, "d")
    assert [_flag(medium, f) for f in ("--lr", "--min-lr", "--lr-warmup-iters")] == [
        "0.0003", "3e-05", "100"]
    floor = S.job_flags(small, D.FLOOR, 1234, sample_dir, "d")
    assert _flag(floor, "--micro-batch-size") == "4"  # the same global batch, cut in two
    assert floor[:floor.index("--micro-batch-size")] == zero3[:zero3.index(
        "--micro-batch-size")]
    assert _flag(S.job_flags(small, D.FLOOR, 1, sample_dir, "d", 2), "--micro-batch-size") == "1"
    with pytest.raises(ValueError, match="does not divide"):
        S.job_flags(small, D.FLOOR, 1234, sample_dir, "d", 3)


def _zeropp(flags):
    """The ZeroPPConfig pretrain_gpt.py builds from a job's flags (its --zeropp-* ones)."""
    import argparse

    from megatron_zeropp.sharding.config_flags import add_zeropp_flags, config_from_args
    parser = argparse.ArgumentParser()
    add_zeropp_flags(parser)
    known, _ = parser.parse_known_args(flags)
    return config_from_args(known)


def test_a_studys_pinned_defaults_hold_and_its_configurations_override_them(sample_dir):
    # every 125M job ran qgZ's cross-node hop at INT4, its default then: their flags say so
    for name in ("125m", "125m-w150", "125m-lr3e-4"):
        study = D.STUDIES[name]
        assert _zeropp(S.job_flags(study, "all3", 1234, sample_dir, "d")).qgz_inter_bits == 4
    small = D.STUDIES["125m-lr3e-4"]
    assert _zeropp(S.job_flags(small, "all3+qgz8", 1234, sample_dir, "d")).qgz_inter_bits == 8
    # negative control: without the pin the same job runs today's default, INT8
    unpinned = dataclasses.replace(small, pinned=())
    assert _zeropp(S.job_flags(unpinned, "all3", 1234, sample_dir, "d")).qgz_inter_bits == 8


def _fake_job(tmp_path, config, seed, final, iters=20, gap=0.0):
    """A job directory with a log shaped like pretrain_gpt.py's."""
    job_dir = tmp_path / "run" / f"smoke_{config}@seed{seed}"
    job_dir.mkdir(parents=True)
    lines = []
    for it in [1] + list(range(10, iters + 1, 10)):
        lines.append(f" [2026-12-02 08:00:00] iteration {it:8d}/{iters:8d} | elapsed time per "
                     f"iteration (ms): 300.0 | lm loss: {5.0 - it / 100 + gap:.6E} |")
        if it % 10 == 0:
            lines.append(f" validation loss at iteration {it} | lm loss value: "
                         f"{5.1 - it / 100 + gap:.6E} |")
    if final is not None:
        lines.append(f" validation loss at iteration {iters} on validation set | lm loss value: "
                     f"{final:.6E} |")
    (job_dir / "train.log").write_text("\n".join(lines) + "\n")
    return {"study": "smoke", "config": config, "seed": seed, "dir": str(job_dir), "pid": -1,
            "flags": [], "commit": "abc", "started": 0.0}


def test_poll_record_table(tmp_path, capsys):
    finals = {("zero3", 1234): 4.0, ("zero3", 1235): 4.2, ("all3", 1234): 4.004,
              ("all3", 1235): None}  # still running or failed: not recorded
    ledger = {D.job_key("smoke", c, s): _fake_job(tmp_path, c, s, f)
              for (c, s), f in finals.items()}
    run = tmp_path / "run"
    (run / "jobs.json").write_text(json.dumps(ledger))
    out = tmp_path / "out"
    assert S.main(["poll", "--run-dir", str(run), "--out", str(out)]) == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["job"] for r in records) == sorted(
        D.job_key("smoke", c, s) for (c, s), f in finals.items() if f is not None)
    r = next(r for r in records if r["config"] == "zero3" and r["seed"] == 1234)
    assert r["loss_every_10"] == [[10, 4.9], [20, 4.8]] and r["final_val_loss"] == 4.0
    assert r["val_loss"] == [[10, 5.0], [20, 4.9]] and r["ms_median"] == 300.0
    status = json.loads((out / "status.json").read_text())
    assert status[D.job_key("smoke", "all3", 1235)]["state"] == "failed"  # pid -1: not alive
    results = tmp_path / "results.jsonl"
    for _ in range(2):  # the second time everything is already there
        S.main(["record", "--records", str(out / "records.jsonl"), "--results", str(results)])
    assert len(results.read_text().splitlines()) == 3
    assert "0 new job(s)" in capsys.readouterr().out
    S.main(["table", "--results", str(results), "--study", "smoke"])
    table = capsys.readouterr().out
    # all3 seed 1234 against zero3 seed 1234: +0.1 %
    assert "| all3 | 1234: 4.0040 | 4.0040 | - | +0.100 % |" in table


def test_record_refuses_an_unfinished_job(tmp_path):
    rec = tmp_path / "r.jsonl"
    rec.write_text(json.dumps({"job": "smoke/all3@seed1", "final_val_loss": None}) + "\n")
    with pytest.raises(SystemExit):
        S.main(["record", "--records", str(rec), "--results", str(tmp_path / "res.jsonl")])


def _queued_ledger(tmp_path, configs, mbs=2):
    run = tmp_path / "run"
    ledger = {}
    for c in configs:
        job_dir = run / f"smoke_{c}@seed1234"
        job_dir.mkdir(parents=True)
        ledger[D.job_key("smoke", c, 1234)] = {
            "study": "smoke", "config": c, "seed": 1234, "dir": str(job_dir), "pid": None,
            "micro_batch_size": mbs, "flags": [], "commit": "abc", "started": None}
    S._write_ledger(str(run), ledger)
    return run


def test_queue_runs_its_jobs_one_after_the_other(tmp_path, monkeypatch):
    """run-queue starts a job only when the one before has ended, in ledger order, and goes on
    past a job that fails; poll says 'queued' for a job not started yet."""
    run = _queued_ledger(tmp_path, ["zero3", "all3", "qwz+hpz"])
    # before the runner: every job queued
    out = tmp_path / "out0"
    S.main(["poll", "--run-dir", str(run), "--out", str(out)])
    assert {s["state"] for s in json.loads((out / "status.json").read_text()).values()} == {
        "queued"}
    spans = tmp_path / "spans.txt"

    def fake_launch(entry):
        code = 3 if entry["config"] == "all3" else 0  # the middle one fails
        prog = (f"import time; t = time.time(); time.sleep(0.3); "
                f"open({str(spans)!r}, 'a').write('{entry['config']} %r %r\\n' % (t, time.time()));"
                f" raise SystemExit({code})")
        return subprocess.Popen([sys.executable, "-c", prog])

    monkeypatch.setattr(S, "_launch", fake_launch)
    assert S.main(["run-queue", "--run-dir", str(run)]) == 0
    rows = [line.split() for line in spans.read_text().splitlines()]
    assert [r[0] for r in rows] == ["zero3", "all3", "qwz+hpz"]
    for before, after in zip(rows, rows[1:]):
        assert float(after[1]) >= float(before[2])  # no overlap
    ledger = S._read_ledger(str(run))
    assert [e["returncode"] for e in ledger.values()] == [0, 3, 0]
    assert all(e["pid"] and e["started"] for e in ledger.values())


def test_start_refuses_while_a_queue_runner_runs(tmp_path):
    run = _queued_ledger(tmp_path, ["zero3"])
    (run / "queue.pid").write_text(str(os.getpid()))  # alive: this process
    argv = ["start", "--study", "smoke", "--data-dir", str(tmp_path), "--run-dir", str(run),
            "--results", str(tmp_path / "res.jsonl"), "--commit", "abc"]
    with pytest.raises(SystemExit):
        S.main(argv)
    assert S._queue_pid(str(run)) == os.getpid()
    (run / "queue.pid").write_text("-1")  # control: a runner that is gone does not block
    assert S._queue_pid(str(run)) is None


def test_table_refuses_mixed_micro_batch_sizes(tmp_path):
    results = tmp_path / "res.jsonl"
    base = {"study": "smoke", "iters": 20, "val_loss": [[10, 5.0]], "final_val_loss": 4.0,
            "last_iteration": 20, "seed": 1234}
    rows = [dict(base, job="smoke/zero3@seed1234", config="zero3", micro_batch_size=2),
            dict(base, job="smoke/all3@seed1234", config="all3", micro_batch_size=4)]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        S.main(["table", "--results", str(results), "--study", "smoke"])
    rows[1]["micro_batch_size"] = 2  # control: one size is a table
    # the floor runs the study's micro-batch cut in two
    rows.append(dict(base, job="smoke/zero3+2mb@seed1234", config="zero3+2mb",
                     micro_batch_size=1))
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert S.main(["table", "--results", str(results), "--study", "smoke"]) == 0
    rows[2]["micro_batch_size"] = 2  # a floor cut from a micro-batch of 4: another study
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        S.main(["table", "--results", str(results), "--study", "smoke"])


def test_table_refuses_mixed_corpora(tmp_path):
    results = tmp_path / "res.jsonl"
    base = {"study": "smoke", "iters": 20, "val_loss": [[10, 5.0]], "final_val_loss": 4.0,
            "last_iteration": 20, "seed": 1234, "micro_batch_size": 2}
    rows = [dict(base, job="smoke/zero3@seed1234", config="zero3",
                 corpus={"train_tokens": 28_000_000}),
            dict(base, job="smoke/all3@seed1234", config="all3",
                 corpus={"train_tokens": 52_000_000})]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        S.main(["table", "--results", str(results), "--study", "smoke"])
    # the same token count, other tokens (a rebuild that differs)
    rows[0]["corpus"] = {"train_tokens": 28_000_000, "train_sha256": "aa"}
    rows[1]["corpus"] = {"train_tokens": 28_000_000, "train_sha256": "bb"}
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        S.main(["table", "--results", str(results), "--study", "smoke"])
    rows[1]["corpus"] = rows[0]["corpus"]  # control: one corpus is a table
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert S.main(["table", "--results", str(results), "--study", "smoke"]) == 0


def test_corpus_record_carries_the_training_tokens_hash(tmp_path):
    import hashlib

    (tmp_path / "lab_train_text_document.bin").write_bytes(b"\x01\x02" * 1000)
    (tmp_path / "sample_data.json").write_text(json.dumps({"data": {
        "train_data_prefix": "/elsewhere/lab_train_text_document",
        "valid_data_prefix": "/elsewhere/lab_valid_text_document", "vocab_size": 512,
        "train_tokens": 1000, "valid_tokens": 0}}))
    prefixes, vocab, corpus = S._data(str(tmp_path))
    assert prefixes[0] == str(tmp_path / "lab_train_text_document") and vocab == 512
    assert corpus["train_sha256"] == hashlib.sha256(b"\x01\x02" * 1000).hexdigest()


def test_gpu_sharing_names_an_mps_daemon_only_while_its_pipe_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert S.gpu_sharing() == "time-slicing"
    (tmp_path / "control").write_text("")
    assert S.gpu_sharing() == "mps"


def test_table_names_seeds_whose_jobs_ran_on_two_gpu_models():
    rows = [{"config": c, "seed": s, "device": d} for c, s, d in (
        ("zero3", 1234, "NVIDIA H200"), ("all3", 1234, "NVIDIA H100 80GB HBM3"),
        ("zero3", 1235, "NVIDIA H200"), ("all3", 1235, "NVIDIA H200"))]
    notes = R.device_notes(rows)
    assert notes[0] == ("GPU models: NVIDIA H100 80GB HBM3: all3@1234; NVIDIA H200: "
                        "zero3@1234, zero3@1235, all3@1235")
    assert notes[1:] == ["seed 1234: its jobs ran on NVIDIA H100 80GB HBM3 and NVIDIA H200", ""]
    assert R.device_notes(rows[2:]) == []  # control: one model, nothing to say


def test_timeline_splits_a_jobs_wall_clock():
    """Launch at 1000 s; lines at iterations 10, 20, 30 stamped 13, 15.5 and 18 s later, logging
    300, 200 and 200 ms per iteration; the log last written 7 s after the last line."""
    h = {"iterations": [10, 20, 30], "ms": [300.0, 200.0, 200.0],
         "time": [1013.0, 1015.5, 1018.0]}
    assert S.timeline(1000.0, h, 1025.0) == {"startup": 10.0, "iterations": 4.0,
                                             "between_lines": 1.0, "after_last_line": 7.0}
    assert S.timeline(1000.0, dict(h, time=[None] * 3), 1025.0) is None  # lines without stamps


def test_job_record_reads_the_stamps_of_its_log(tmp_path):
    entry = _fake_job(tmp_path, "zero3", 1234, 4.0)
    log = os.path.join(entry["dir"], "train.log")
    text = open(log).read().replace("[2026-12-02 08:00:00] iteration       20",
                                    "[2026-12-02 08:00:06.500000] iteration       20")
    open(log, "w").write(text)
    first = S.G.collect(os.path.dirname(entry["dir"]), [os.path.basename(entry["dir"])])
    t1 = first[os.path.basename(entry["dir"])]["time"][0]  # iteration 1, 08:00:00
    os.utime(log, (t1 + 10.0, t1 + 10.0))
    rec = S.job_record(dict(entry, started=t1 - 5.3), "k", D.SMOKE, {}, "cpu")
    # launch 5.3 s before the first line (1 iteration at 300 ms): 5.0 s of startup; lines 10 and
    # 20 add 9 + 10 iterations at 300 ms = 5.7 s of the 6.5 s between the stamps of 1 and 20
    assert rec["seconds"] == {"startup": 5.0, "iterations": 5.7, "between_lines": 0.8,
                              "after_last_line": 3.5}


def _summary(finals):
    """convergence_lab.summary of {(config, seed): final validation loss}."""
    results = {f"{c}@seed{s}": {"val_loss": [[100, v]], "iterations": [100]}
               for (c, s), v in finals.items()}
    return S.L.summary(results, sorted({s for _, s in finals}), at=100)


def test_targets_met_missed_and_open():
    study = D.Study("125m", 100, (1, 2, 3), ("zero3", "all3", "qwz+hpz"), micro_batch_size=8)
    zero3 = {("zero3", 1): 3.00, ("zero3", 2): 3.06, ("zero3", 3): 3.03}
    met = {**zero3, **{("all3", s): 1.002 * v for (_, s), v in zero3.items()},
           ("qwz+hpz", 1): 3.01, ("qwz+hpz", 2): 3.05, ("qwz+hpz", 3): 3.02}
    lines = R.targets(_summary(met), study)
    assert lines[0] == "target all3 <= +0.25 %: +0.200 % +- 0.000: met"
    assert lines[1].endswith("[3.0000, 3.0600]: mean 3.0267: met")
    # all3 +0.3 % on every seed; qwz+hpz below ZeRO-3's lowest seed
    missed = {**met, **{("all3", s): 1.003 * v for (_, s), v in zero3.items()},
              **{("qwz+hpz", s): 2.9 for s in (1, 2, 3)}}
    lines = R.targets(_summary(missed), study)
    assert lines[0].endswith(": MISSED") and lines[1].endswith("mean 2.9000: MISSED")
    # two of three seeds: both open, whatever the numbers
    partial = {k: v for k, v in missed.items() if k[1] != 3}
    lines = R.targets(_summary(partial), study)
    assert lines == ["target all3 <= +0.25 %: +0.300 % +- 0.000: open (2 of 3 seeds)",
                     "target qwz+hpz inside zero3's seed band: open (2 of 3 seeds)"]


def test_a_missed_target_holds_the_rules_settings_against_it():
    study = D.Study("125m", 100, (1, 2, 3), ("zero3", "all3", "all3+diff4"), micro_batch_size=8,
                    if_missed=("all3+qgz8",), if_missed_compare=("all3+diff4",))
    zero3 = {("zero3", 1): 3.00, ("zero3", 2): 3.06, ("zero3", 3): 3.03}
    missed = {**zero3, **{("all3", s): 1.003 * v for (_, s), v in zero3.items()}}
    rule = "the rule for the missed all3 target: "
    # all3 missed and nothing of the rule's run yet
    assert R.targets(_summary(missed), study)[1:] == [rule + "all3+qgz8: no job yet",
                                                       rule + "all3+diff4: no job yet"]
    # the INT8 hop +0.1 % on all three seeds (met); the 4-bit differences +0.4 % on two (open)
    ran = {**missed, **{("all3+qgz8", s): 1.001 * v for (_, s), v in zero3.items()},
           ("all3+diff4", 1): 3.012, ("all3+diff4", 2): 1.004 * 3.06}
    assert R.targets(_summary(ran), study)[1:] == [
        rule + "all3+qgz8 <= +0.25 %: +0.100 % +- 0.000: met",
        rule + "all3+diff4 <= +0.25 %: +0.400 % +- 0.000: open (2 of 3 seeds)"]
    # its third seed: MISSED
    ran[("all3+diff4", 3)] = 1.004 * 3.03
    assert R.targets(_summary(ran), study)[2] == (
        rule + "all3+diff4 <= +0.25 %: +0.400 % +- 0.000: MISSED")
    # control: all3 met, so the rule says nothing, whatever the other settings did
    met = {**ran, **{("all3", s): 1.002 * v for (_, s), v in zero3.items()}}
    assert not any(line.startswith(rule) for line in R.targets(_summary(met), study))


def _rec(**kw):
    base = {"job": "smoke/zero3@seed1234", "study": "smoke", "config": "zero3", "seed": 1234,
            "iters": 20, "flags": [], "micro_batch_size": 2, "device": "NVIDIA H100",
            "commit": "abc", "gpu_sharing": "mps", "corpus": {"train_sha256": "ff"},
            "loss_every_10": [[10, 5.25], [20, 4.5]], "val_loss": [[10, 5.5], [20, 4.75]],
            "final_val_loss": 4.75, "last_iteration": 20}
    base.update(kw)
    return base


def _history(loss, val):
    return {"iterations": [1] + sorted(loss), "loss": [9.0] + [loss[i] for i in sorted(loss)],
            "val_loss": sorted(val.items())}


def _gap_records(gap_pct, seeds=(1234, 1235), study="smoke-m", device="NVIDIA H100"):
    """zero3 and all3 of ``seeds`` with all3's final validation loss ``gap_pct`` % above."""
    out = {}
    for seed in seeds:
        for config, final in (("zero3", 4.0), ("all3", 4.0 * (1 + gap_pct / 100))):
            key = f"{study}/{config}@seed{seed}"
            out[key] = _rec(job=key, study=study, config=config, seed=seed, device=device,
                            val_loss=[[10, 5.5], [20, final]], final_val_loss=final)
    return out


def test_a_missed_target_queues_the_studys_follow_up_on_every_seed(monkeypatch, tmp_path,
                                                                    capsys):
    study = dataclasses.replace(D.SMOKE, if_missed=("all3+qgz8",))
    monkeypatch.setitem(D.STUDIES, "smoke-m", study)
    own = [f"smoke-m/{D.FLOOR}@seed1234", f"smoke-m/{D.FLOOR}@seed1235"]
    follow = ["smoke-m/all3+qgz8@seed1234", "smoke-m/all3+qgz8@seed1235"]
    # all3 +0.3 % at both seeds: MISSED, so the follow-up joins after the seeds' own jobs
    missed = _gap_records(0.3)
    assert R.all3_verdict(R.study_summary(list(missed.values())), study) == "MISSED"
    assert [S.job_key("smoke-m", c, s) for c, s in P.pending("smoke-m", missed, {})] == (
        own + follow)
    # a lease runs them across both recorded seeds, each seed's record rerun first
    p = P.lease_plan(missed, "smoke-m", "NVIDIA H100")
    assert p["jobs"] == own + follow and p["all3_verdict"] == "MISSED"
    assert p["rechecks"] == ["smoke-m/zero3@seed1234", "smoke-m/zero3@seed1235"]
    results = tmp_path / "results.jsonl"
    for records, line in ((missed, "all3's verdict MISSED; all3+qgz8 queued on every seed"),
                          (_gap_records(0.2), "all3's verdict met; all3+qgz8 runs only if it "
                                              "is MISSED")):
        results.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
        assert S.main(["plan", "--study", "smoke-m", "--results", str(results), "--device",
                       "NVIDIA H100"]) == 0
        assert f"[plan] smoke-m: {line}" in capsys.readouterr().out
    # another GPU model runs none of the seeds' jobs, and the line says so
    results.write_text("".join(json.dumps(r) + "\n" for r in missed.values()))
    assert S.main(["plan", "--study", "smoke-m", "--results", str(results), "--device",
                   "NVIDIA H200"]) == 0
    assert ("[plan] smoke-m: all3's verdict MISSED; all3+qgz8 queued on every seed, none on "
            "this model (above)") in capsys.readouterr().out
    # controls: met (+0.2 %), or open (one seed without all3): no follow-up
    met = _gap_records(0.2)
    assert R.all3_verdict(R.study_summary(list(met.values())), study) == "met"
    assert [S.job_key("smoke-m", c, s) for c, s in P.pending("smoke-m", met, {})] == own
    half = {k: v for k, v in missed.items() if k != "smoke-m/all3@seed1235"}
    assert R.all3_verdict(R.study_summary(list(half.values())), study) is None
    assert "smoke-m/all3+qgz8@seed1234" not in [
        S.job_key("smoke-m", c, s) for c, s in P.pending("smoke-m", half, {})]
    # a study without the rule never queues it, whatever its verdict
    plain = _gap_records(0.3, study="smoke")
    assert R.all3_verdict(R.study_summary(list(plain.values())), D.SMOKE) == "MISSED"
    assert all(c != "all3+qgz8" for c, _ in P.pending("smoke", plain, {}))


def test_compare_to_record_identical_different_and_missing():
    rec = _rec()
    same = S.compare_to_record(rec, _history({10: 5.25}, {10: 5.5}), 10)
    assert same == {"identical": True, "compared": 2, "first_difference": None, "missing": []}
    # a rerun past the compared iterations is compared up to them only
    assert S.compare_to_record(rec, _history({10: 5.25, 20: 1.0}, {10: 5.5}), 10)["identical"]
    off = S.compare_to_record(rec, _history({10: 5.25}, {10: 5.500001}), 10)
    assert not off["identical"] and off["first_difference"] == {
        "kind": "val_loss", "iteration": 10, "recorded": 5.5, "rerun": 5.500001}
    short = S.compare_to_record(rec, _history({}, {}), 10)  # the rerun died before line 10
    assert not short["identical"] and short["missing"] == [["loss", 10], ["val_loss", 10]]
    assert short["compared"] == 0 and short["first_difference"] is None


def test_recheck_refuses_another_job_or_corpus_before_running(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_rec(flags=["--zeropp-qgz"])) + "\n")
    (tmp_path / "sample_data.json").write_text(json.dumps({"data": {
        "train_data_prefix": "t", "valid_data_prefix": "v", "vocab_size": 512}}))
    base = ["recheck", "--study", "smoke", "--results", str(results), "--data-dir",
            str(tmp_path), "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "o"),
            "--commit", "x", "--iters", "10"]
    with pytest.raises(SystemExit):  # the record's flags are not zero3's: another job
        S.main(base)
    results.write_text(json.dumps(_rec()) + "\n")
    with pytest.raises(SystemExit):  # no training tokens to hash: not the recorded corpus
        S.main(base)
    with pytest.raises(SystemExit):  # not a multiple of the log interval
        S.main(base[:-1] + ["15"])
    assert not (tmp_path / "run").exists()  # nothing started
    results.write_text("")
    assert S.main(base) == 0  # nothing recorded yet: nothing to recheck


def test_recheck_key_picks_the_studys_first_job_or_its_first_of_a_configuration():
    jobs = [_rec(job="w/zero3@seed1", study="w"), _rec(job="other/all3@seed1", study="other",
            config="all3"), _rec(job="w/all3@seed1", study="w", config="all3"),
            _rec(job="w/all3@seed2", study="w", config="all3")]
    results = {r["job"]: r for r in jobs}
    assert P.recheck_key(results, "w") == "w/zero3@seed1"
    assert P.recheck_key(results, "w", config="all3") == "w/all3@seed1"  # not another study's
    assert P.recheck_key(results, "w", config="qwz+hpz") is None  # none yet: nothing to rerun
    assert P.recheck_key(results, "w", job="w/all3@seed2") == "w/all3@seed2"
    with pytest.raises(ValueError, match="is not in the results"):
        P.recheck_key(results, "w", job="w/all3@seed3")
    with pytest.raises(ValueError, match="name one"):
        P.recheck_key(results, "w", job="w/all3@seed2", config="all3")


def test_record_keeps_rechecks_and_table_prints_them(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(_rec()) + "\n")
    check = {"job": "smoke/zero3@seed1234", "iters": 10, "device": "NVIDIA H200",
             "commit": "def", "recorded": {"device": "NVIDIA H100", "commit": "abc"},
             "returncode": 0, "identical": True, "compared": 2, "first_difference": None,
             "missing": []}
    (tmp_path / "recheck.json").write_text(json.dumps(check))
    assert S.main(["record", "--records", str(records), "--results", str(results),
                   "--rechecks", str(tmp_path / "recheck.json")]) == 0
    assert json.loads((tmp_path / "rechecks.jsonl").read_text()) == check
    capsys.readouterr()
    S.main(["table", "--results", str(results), "--study", "smoke"])
    assert ("recheck of smoke/zero3@seed1234 on NVIDIA H200 at def (recorded on NVIDIA H100 at "
            "abc), 10 iterations: identical (2 logged values)") in capsys.readouterr().out
    differs = dict(check, identical=False, first_difference={
        "kind": "loss", "iteration": 10, "recorded": 5.25, "rerun": 5.26})
    assert R.recheck_line(differs).endswith("DIFFERENT: loss at iteration 10 5.26 (recorded "
                                            "5.25)")
    # a lease's verdicts, one per line in one file (pretty-printed ones are one JSON each)
    (tmp_path / "lease.jsonl").write_text(json.dumps(differs) + "\n" + json.dumps(check) + "\n")
    (tmp_path / "pretty.json").write_text(json.dumps(check, indent=1))
    assert S.main(["record", "--records", str(records), "--results", str(results),
                   "--rechecks", str(tmp_path / "lease.jsonl"), str(tmp_path / "pretty.json")]) == 0
    kept = [json.loads(x) for x in (tmp_path / "rechecks.jsonl").read_text().splitlines()]
    assert kept == [check, differs, check, check]


class _Clock:
    """time for lab_study: monotonic() advances only by sleep(), which counts its calls."""

    def __init__(self):
        self.now, self.sleeps = 0.0, 0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        self.sleeps += 1

    def __getattr__(self, name):
        return getattr(time, name)


def _poll_with(monkeypatch, tmp_path, ledger, finish_after, wait):
    """poll --wait over ``ledger`` where every started job finishes after ``finish_after``
    sleeps of the poll loop; returns (clock, status written)."""
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir(exist_ok=True)
    (run / "jobs.json").write_text(json.dumps(ledger))
    clock = _Clock()
    monkeypatch.setattr(S, "time", clock)

    def record(entry, key, study, corpus, device):
        done = clock.sleeps >= finish_after
        return {"job": key, "final_val_loss": 4.0 if done else None,
                "last_iteration": study.iters if done else 5, "ms_median": 1.0, "seconds": {}}
    monkeypatch.setattr(S, "job_record", record)
    assert S.main(["poll", "--run-dir", str(run), "--out", str(out), "--wait", str(wait)]) == 0
    return clock, json.loads((out / "status.json").read_text())


def test_poll_wait_ends_when_a_job_finishes_nothing_runs_or_time_is_up(monkeypatch, tmp_path):
    running = {"study": "smoke", "pid": os.getpid(), "dir": "d", "started": time.time()}
    ledger = {"smoke/zero3@seed1234": running, "smoke/all3@seed1234": {"study": "smoke"}}
    # the running job finishes at the third look after the first: the queued one is not awaited
    clock, status = _poll_with(monkeypatch, tmp_path, ledger, finish_after=3, wait=600)
    assert clock.sleeps == 3 and status["smoke/zero3@seed1234"]["state"] == "finished"
    assert status["smoke/all3@seed1234"]["state"] == "queued"
    assert [json.loads(line)["job"] for line in open(tmp_path / "out" / "records.jsonl")] == [
        "smoke/zero3@seed1234"]
    # it does not finish in time: looks every 10 s until the 25 s are up
    clock, status = _poll_with(monkeypatch, tmp_path, ledger, finish_after=99, wait=25)
    assert (clock.sleeps, clock.now) == (3, 25) and status["smoke/zero3@seed1234"]["state"] == (
        "running")
    # finished before the first look and nothing else running: no wait
    clock, status = _poll_with(monkeypatch, tmp_path, {"smoke/zero3@seed1234": running},
                               finish_after=0, wait=600)
    assert clock.sleeps == 0 and status["smoke/zero3@seed1234"]["state"] == "finished"
    # without --wait: one look
    clock, _ = _poll_with(monkeypatch, tmp_path, ledger, finish_after=3, wait=0)
    assert clock.sleeps == 0


def _wait_for_queue(run_dir, seconds=300):
    deadline = time.monotonic() + seconds
    while S._queue_pid(run_dir) is not None:
        assert time.monotonic() < deadline, "the queue runner did not finish"
        time.sleep(1)


@pytest.mark.slow
def test_a_job_run_recorded_and_rechecked_on_cpu(tmp_path, sample_dir):
    """The driver end to end on CPU (the smoke study's tiny GPT, 2 x 2 ranks): start its jobs
    through the queue runner, poll, record (the noise floor's numbers move off zero3's); a
    rerun of its first 10 iterations logs the same numbers; a record claiming those numbers
    for all three switches does not pass (the rerun trains all3 and differs)."""
    data, run, out = sample_dir, str(tmp_path / "run"), str(tmp_path / "out")
    results = str(tmp_path / "results.jsonl")
    assert S.main(["start", "--study", "smoke", "--jobs", "3", "--one-at-a-time", "--data-dir",
                   data, "--run-dir", run, "--results", results, "--commit", "c0"]) == 0
    _wait_for_queue(run)
    assert S.main(["poll", "--run-dir", run, "--out", out, "--data-dir", data]) == 0
    assert S.main(["record", "--records", os.path.join(out, "records.jsonl"),
                   "--results", results]) == 0
    rec = P.read_results(results)["smoke/zero3@seed1234"]
    assert rec["last_iteration"] == 20 and [i for i, _ in rec["val_loss"]] == [10, 20]
    assert rec["qgz_error"] == [] and rec["qwz_error"] == []  # nothing quantized to measure
    # the noise floor: the same global batch in micro-batches of 1 moves the numbers (rounding)
    floor = P.read_results(results)["smoke/zero3+2mb@seed1234"]
    assert floor["micro_batch_size"] == 1 and rec["micro_batch_size"] == 2
    assert floor["loss_every_10"] != rec["loss_every_10"]
    assert R.same_as_zero3([rec, floor]) == []
    all3 = P.read_results(results)["smoke/all3@seed1234"]
    assert all3["last_iteration"] == 20 and all3["final_val_loss_exact"] is not None
    for what in ("qgz_error", "qwz_error"):  # every validation interval, and iteration 1
        assert [line["iteration"] for line in all3[what]] == [1, 10, 20], what
        assert all(0 <= v < 1 for line in all3[what] for v in line["units"].values())
        assert any(v > 0 for line in all3[what] for v in line["units"].values())
    check = ["recheck", "--study", "smoke", "--iters", "10", "--data-dir", data,
             "--run-dir", str(tmp_path / "re"), "--out", out, "--commit", "c1"]
    assert S.main(check + ["--results", results]) == 0
    same = json.load(open(os.path.join(out, "recheck.json")))
    assert same["identical"] and same["compared"] == 2 and same["returncode"] == 0
    assert rec["eval_weights"] == "both" and rec["final_val_loss_exact"] == rec["final_val_loss"]
    # all3's rerun (qwZ, hpZ, qgZ with stochastic rounding) logs its record's numbers too
    assert S.main(check + ["--results", results, "--config", "all3",
                           "--run-dir", str(tmp_path / "re3")]) == 0
    same3 = json.load(open(os.path.join(out, "recheck.json")))
    assert same3["job"] == "smoke/all3@seed1234" and same3["identical"], same3
    # negative control: the same numbers claimed by all3; its rerun trains all3
    wrong = dict(rec, job="smoke/all3@seed1234", config="all3", flags=list(D.CONFIGS["all3"]))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(wrong) + "\n")
    assert S.main(check + ["--results", str(other), "--run-dir", str(tmp_path / "re2")]) == 3
    diff = json.load(open(os.path.join(out, "recheck.json")))
    assert not diff["identical"] and diff["first_difference"]["iteration"] == 10


def test_job_record_reads_the_exact_weights_evaluations(tmp_path):
    entry = _fake_job(tmp_path, "all3", 1234, 4.0)
    log = os.path.join(entry["dir"], "train.log")
    with open(log, "a") as f:  # the lines --zeropp-eval-weights both adds
        f.write(" validation loss (exact weights) at iteration 10 | lm loss value: 4.870000E+00 "
                "| lm loss PPL: 1.3E+02 |\n validation loss (exact weights) at iteration 20 on "
                "validation set | lm loss value: 3.990000E+00 | lm loss PPL: 5.4E+01 |\n")
    entry["flags"] = ["--zeropp-eval-weights", "both"]
    rec = S.job_record(entry, "k", D.SMOKE, {}, "cpu")
    assert rec["eval_weights"] == "both"
    assert rec["val_loss_exact"] == [[10, 4.87]] and rec["final_val_loss_exact"] == 3.99
    assert rec["final_val_loss"] == 4.0  # the gathered evaluation stays the validation loss
    assert [i for i, _ in rec["val_loss"]] == [10, 20]  # the exact lines are not read as it


def test_exact_weights_table(tmp_path, capsys):
    base = {"study": "smoke", "iters": 20, "micro_batch_size": 2, "device": "cpu",
            "last_iteration": 20}
    rows = [
        # recorded before the exact evaluations: zero3 stands (no qwZ), all3 is left out
        dict(base, job="smoke/zero3@seed1234", config="zero3", seed=1234, flags=[],
             val_loss=[[10, 5.0]], final_val_loss=4.0),
        dict(base, job="smoke/all3@seed1234", config="all3", seed=1234,
             flags=list(D.CONFIGS["all3"]), val_loss=[[10, 5.1]], final_val_loss=4.1),
        dict(base, job="smoke/zero3@seed1235", config="zero3", seed=1235, flags=[],
             val_loss=[[10, 5.0]], final_val_loss=4.2, val_loss_exact=[[10, 5.0]],
             final_val_loss_exact=4.2),
        dict(base, job="smoke/all3@seed1235", config="all3", seed=1235,
             flags=list(D.CONFIGS["all3"]), val_loss=[[10, 5.2]], final_val_loss=4.242,
             val_loss_exact=[[10, 5.1]], final_val_loss_exact=4.221)]
    exact = R.exact_weights(rows)
    assert [(r["config"], r["seed"], r["final_val_loss"]) for r in exact] == [
        ("zero3", 1234, 4.0), ("zero3", 1235, 4.2), ("all3", 1235, 4.221)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert S.main(["table", "--results", str(results), "--study", "smoke"]) == 0
    out = capsys.readouterr().out
    head, tail = out.split("evaluated with the exact 16-bit weights")
    assert "| all3 | 1234: 4.1000, 1235: 4.2420 |" in head
    assert "seeds [1234, 1235]" in tail and "| all3 | 1235: 4.2210 |" in tail
    assert "+0.500 %" in tail  # 4.221 / 4.2 - 1, paired with zero3 of seed 1235
    rows = [r for r in rows if "final_val_loss_exact" not in r]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    S.main(["table", "--results", str(results), "--study", "smoke"])
    assert "exact 16-bit" not in capsys.readouterr().out  # control: no exact evaluation, no table


def test_diagnostics_follow_the_switches():
    assert D.diagnostic_flags("zero3", 100, "d") == []
    assert D.diagnostic_flags("qwz+hpz", 100, "d") == [
        "--zeropp-qwz-error-interval", "100", "--zeropp-qwz-error-log", "d/qwz_error.jsonl"]
    assert D.diagnostic_flags("all3+diff4", 10, "d") == [
        "--zeropp-qgz-error-interval", "10", "--zeropp-qgz-error-log", "d/qgz_error.jsonl",
        "--zeropp-qwz-error-interval", "10", "--zeropp-qwz-error-log", "d/qwz_error.jsonl"]


def test_layer_errors_rank_the_layers_over_iterations_and_seeds():
    def rec(seed, lines):
        return {"config": "all3", "seed": seed, "qwz_error": lines, "qgz_error": []}

    rows = [rec(1, [{"iteration": 1, "units": {"a": 9.0, "b": 9.0}, "total": 9.0},  # left out
                    {"iteration": 100, "units": {"a": 1e-3, "b": 4e-3}, "total": 3e-3},
                    {"iteration": 200, "units": {"a": 1e-3, "b": 4e-3}, "total": 5e-3}]),
            rec(2, [{"iteration": 100, "units": {"a": 3e-3, "b": 2e-3}, "total": 2.5e-3}]),
            {"config": "zero3", "seed": 1, "qwz_error": [], "qgz_error": []}]
    assert R.layer_errors(rows) == [
        "all3, qwz error per layer (mean over measured iterations > 1 and seeds [1, 2]): "
        "b 3.333e-03, a 1.667e-03",
        "all3, qwz error of the whole model per seed (same iterations): 1: 4.000e-03, "
        "2: 2.500e-03"]
    assert R.layer_errors(rows[2:]) == []  # control: no diagnostic, no line


def test_same_as_zero3_names_jobs_that_changed_no_bit():
    def rec(config, seed, loss):
        return {"config": config, "seed": seed, "loss_every_10": [[10, loss]],
                "val_loss": [[10, 5.0]], "final_val_loss": 4.0}

    rows = [rec("zero3", 1, 5.25), rec("zero3+sg", 1, 5.25), rec("zero3+2mb", 1, 5.2500001),
            rec("all3", 2, 5.25)]  # seed 2 has no zero3 to compare with
    lines = R.same_as_zero3(rows)
    assert len(lines) == 1 and lines[0].startswith("zero3+sg@1: logged the same numbers")
    rows[1]["final_val_loss"] = 4.0000001  # control: one number differs
    assert R.same_as_zero3(rows) == []


def test_floor_lines_say_whether_the_recipe_resolves_the_target():
    def summ(*gaps):
        return {D.FLOOR: {"paired_gap_pct": dict(enumerate(gaps))}}

    assert R.floor_lines({}) == ["noise floor: no zero3+2mb job yet"]
    narrow = R.floor_lines(summ(0.01, -0.02))
    assert narrow == ["noise floor (zero3+2mb, rounding only): |paired gap| up to 0.020 % over "
                      "2 seed(s)"]
    wide = R.floor_lines(summ(0.01, -1.5))
    assert "up to 1.500 %" in wide[0] and "cannot resolve" in wide[0]


def test_training_gaps_pair_each_job_with_zero3_of_its_seed():
    def rec(config, seed, losses):
        return {"config": config, "seed": seed,
                "loss_every_10": [[10 * (k + 1), v] for k, v in enumerate(losses)]}

    rows = [rec("zero3", 1, [8.0, 4.0]), rec("all3", 1, [8.0, 3.96]),
            rec("zero3", 2, [5.0]), rec("all3", 2, [5.05, 9.0]),  # zero3@2 logged 10 only
            rec("qwz+hpz", 3, [1.0])]  # no zero3 of seed 3: no row
    assert R.training_gaps(rows, at=(10, 20)).splitlines() == [
        "| training loss vs zero3, % | 10 | 20 |", "|---|---:|---:|",
        "| all3@1 | +0.00 | -1.00 |", "| all3@2 | +1.00 | - |"]
    assert R.training_gaps(rows, at=(30,)) == ""  # control: nothing logged there


def test_lease_plan_keeps_each_seed_on_the_gpu_model_of_its_records():
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    z = D.FLOOR
    recs = [_rec(job="smoke/zero3@seed1234", device=h100),
            _rec(job="smoke/all3@seed1234", config="all3", device=h100),
            _rec(job="other/all3@seed1235", study="other", config="all3", seed=1235,
                 device=h200)]  # another study's: never rechecked for this one
    results = {r["job"]: r for r in recs}
    p = P.lease_plan(results, "smoke", h100)
    assert p["seeds"] == [1234, 1235] and p["elsewhere"] == {}
    assert p["jobs"] == [f"smoke/{z}@seed1234", "smoke/zero3@seed1235", "smoke/all3@seed1235",
                         f"smoke/{z}@seed1235"]
    # seed 1235 has no record: nothing of it to rerun
    assert (p["rechecks"], p["recheck_all3"]) == (["smoke/zero3@seed1234"], "smoke/all3@seed1234")
    # another model: seed 1234's pairs stay on the H100; 1235 starts afresh, nothing to rerun
    p = P.lease_plan(results, "smoke", h200)
    assert p["seeds"] == [1235] and p["elsewhere"] == {1234: [h100]}
    assert p["jobs"][0] == "smoke/zero3@seed1235"
    assert (p["rechecks"], p["recheck_all3"]) == ([], None)
    # seed 1235's zero3 ran on the H200: the next H200 lease reruns it; an H100 lease leaves
    # 1235 out and reruns 1234's
    results["smoke/zero3@seed1235"] = _rec(job="smoke/zero3@seed1235", seed=1235, device=h200)
    p = P.lease_plan(results, "smoke", h200)
    assert p["jobs"] == ["smoke/all3@seed1235", f"smoke/{z}@seed1235"]
    assert (p["rechecks"], p["recheck_all3"]) == (["smoke/zero3@seed1235"], None)
    p = P.lease_plan(results, "smoke", h100)
    assert p["seeds"] == [1234] and p["elsewhere"] == {1235: [h200]}
    assert p["jobs"] == [f"smoke/{z}@seed1234"] and p["rechecks"] == ["smoke/zero3@seed1234"]
    # a finished seed: nothing to run, nothing to rerun
    results[f"smoke/{z}@seed1234"] = _rec(job=f"smoke/{z}@seed1234", config=z, device=h100)
    assert P.lease_plan(results, "smoke", h100, seeds=[1234]) == {
        "study": "smoke", "device": h100, "seeds": [1234], "elsewhere": {}, "bridged": {},
        "all3_verdict": None, "jobs": [], "rechecks": [], "recheck_all3": None}
    # a seed whose jobs already ran on both models pairs on neither
    results["smoke/all3@seed1235"] = _rec(job="smoke/all3@seed1235", config="all3", seed=1235,
                                         device=h100)
    assert P.lease_plan(results, "smoke", h200)["elsewhere"] == {1234: [h100],
                                                                 1235: [h100, h200]}
    with pytest.raises(ValueError, match=r"seeds \[7\] are not study smoke's"):
        P.lease_plan(results, "smoke", h100, seeds=[7])
    # jobs of two seeds with records (a job of 1234 ended without one while 1235's ran, or a
    # configuration added after both): both seeds' jobs queue, each seed's record rerun first
    results = {r["job"]: r for r in (
        _rec(job="smoke/zero3@seed1234", device=h100),
        _rec(job="smoke/all3@seed1235", config="all3", seed=1235, device=h100),
        _rec(job="smoke/zero3@seed1235", seed=1235, device=h100))}
    p = P.lease_plan(results, "smoke", h100)
    assert p["jobs"] == ["smoke/all3@seed1234", f"smoke/{z}@seed1234", f"smoke/{z}@seed1235"]
    # each seed's first recorded job (1235's all3 was recorded before its zero3)
    assert p["rechecks"] == ["smoke/zero3@seed1234", "smoke/all3@seed1235"]
    assert p["recheck_all3"] == "smoke/all3@seed1235"


def _verdict(job, device, recorded, identical=True, iters=10):
    """A recheck verdict as ``lab_study.py recheck`` writes it."""
    return {"job": job, "iters": iters, "device": device, "commit": "def",
            "gpu_sharing": "mps", "recorded": {"device": recorded, "commit": "abc",
                                               "gpu_sharing": "mps"},
            "returncode": 0 if identical else 3, "identical": identical, "compared": 4,
            "first_difference": None, "missing": []}


def test_a_seed_moves_to_a_gpu_model_that_reproduced_its_record():
    h100, h200, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100"
    z = D.FLOOR
    zero3 = "smoke/zero3@seed1235"
    results = {r["job"]: r for r in (
        _rec(device=h100), _rec(job=zero3, seed=1235, device=h200),
        _rec(job="other/zero3@seed1235", study="other", seed=1235, device=h200))}
    assert P.lease_plan(results, "smoke", h100)["elsewhere"] == {1235: [h200]}
    # the H100 reran the H200's zero3 of seed 1235 through a validation, the same numbers
    moved = [_verdict(zero3, h100, h200)]
    p = P.lease_plan(results, "smoke", h100, verdicts=moved)
    assert p["seeds"] == [1234, 1235] and p["elsewhere"] == {}
    assert p["bridged"] == {1235: [zero3]}
    assert p["jobs"] == ["smoke/all3@seed1234", f"smoke/{z}@seed1234", "smoke/all3@seed1235",
                         f"smoke/{z}@seed1235"]
    assert p["rechecks"] == ["smoke/zero3@seed1234", zero3]  # each seed's first, rerun again
    assert P.lease_plans(results, ["smoke"], h100, verdicts=moved)["jobs"] == p["jobs"]
    # controls: each of these leaves seed 1235 out
    for bad in (_verdict(zero3, h100, h200, identical=False),  # it differed
                _verdict(zero3, h100, h200, iters=5),  # stopped before a validation
                _verdict(zero3, h200, h200),  # the H200 reproduced itself
                _verdict(zero3, h100, a100),  # the verdict names another model than the record
                _verdict("other/zero3@seed1235", h100, h200),  # another study's record
                _verdict("smoke/zero3@seed9", h100, h200)):  # no such record
        p = P.lease_plan(results, "smoke", h100, verdicts=[bad])
        assert p["elsewhere"] == {1235: [h200]} and p["bridged"] == {}, bad
    # a seed on two other models needs a reproduced record of each
    results["smoke/all3@seed1235"] = _rec(job="smoke/all3@seed1235", config="all3", seed=1235,
                                         device=a100)
    assert P.lease_plan(results, "smoke", h100, verdicts=moved)["elsewhere"] == {
        1235: [a100, h200]}
    both = moved + [_verdict("smoke/all3@seed1235", h100, a100, iters=20)]
    p = P.lease_plan(results, "smoke", h100, verdicts=both)
    assert p["elsewhere"] == {} and p["bridged"] == {1235: ["smoke/all3@seed1235", zero3]}
    # the move is one way: the H200 has reproduced nothing of the H100's
    results["smoke/all3@seed1235"]["device"] = h100
    assert P.lease_plan(results, "smoke", h200, verdicts=moved)["elsewhere"] == {
        1234: [h100], 1235: [h100, h200]}


def test_plan_weighs_recorded_and_the_leases_own_rechecks(tmp_path, capsys):
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    zero3 = "smoke/zero3@seed1235"
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_rec(job=zero3, seed=1235, device=h200)) + "\n")
    base = ["plan", "--study", "smoke", "--results", str(results), "--device", h100,
            "--seeds", "1235", "--shell"]
    lease = tmp_path / "out" / "rechecks.jsonl"  # not there yet: no verdict
    assert S.main(base + ["--rechecks", str(lease)]) == 0
    out, err = capsys.readouterr()
    assert "PLAN_JOBS=''" in out and f"seed 1235 left out: its jobs ran on {h200}" in err
    lease.parent.mkdir()
    lease.write_text(json.dumps(_verdict(zero3, h100, h200)) + "\n")
    assert S.main(base + ["--rechecks", str(lease)]) == 0
    out, err = capsys.readouterr()
    assert "PLAN_JOBS='smoke/all3@seed1235 " in out
    assert f"seed 1235 runs here too: this model reproduced {zero3}" in err
    # recorded beside the results (record --rechecks): the same without --rechecks
    (tmp_path / "rechecks.jsonl").write_text(lease.read_text())
    assert S.main(base) == 0
    assert "PLAN_JOBS='smoke/all3@seed1235 " in capsys.readouterr().out


def _second_study(monkeypatch):
    """A second CPU-sized study beside smoke (its own seeds), as a lease's next study."""
    monkeypatch.setitem(D.STUDIES, "smoke-b", dataclasses.replace(D.SMOKE, seeds=(7,)))
    return "smoke-b"


def test_lease_plans_queue_the_studies_one_after_the_other(monkeypatch):
    other = _second_study(monkeypatch)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    results = {r["job"]: r for r in (
        _rec(job="smoke/zero3@seed1234", device=h100),
        _rec(job="smoke/all3@seed1234", config="all3", device=h100),
        _rec(job=f"{other}/zero3@seed7", study=other, seed=7, device=h200))}
    p = P.lease_plans(results, ["smoke", other], h100)
    smoke = P.lease_plan(results, "smoke", h100)["jobs"]
    assert p["studies"] == ["smoke"]  # seed 7 of the other ran on the H200: nothing here
    assert p["jobs"] == smoke and p["rechecks"] == ["smoke/zero3@seed1234"]
    assert p["recheck_all3"] == "smoke/all3@seed1234"
    # on the H200: smoke's seed 1234 ran on the H100 and 1235 has no record, so 1235's jobs
    # queue, then the other study's seed 7
    p = P.lease_plans(results, ["smoke", other], h200)
    assert p["studies"] == ["smoke", other]
    assert p["jobs"] == (P.lease_plan(results, "smoke", h200)["jobs"]
                         + [f"{other}/all3@seed7", f"{other}/{D.FLOOR}@seed7"])
    assert p["jobs"][0] == "smoke/zero3@seed1235"
    assert p["rechecks"] == [f"{other}/zero3@seed7"]  # smoke's 1235 has no record yet
    assert p["recheck_all3"] is None  # no all3 recorded on the H200
    # the first study finished on its model: the lease runs the next
    results["smoke/zero3@seed1235"] = _rec(job="smoke/zero3@seed1235", seed=1235, device=h100)
    for c in ("all3", D.FLOOR):
        for seed in (1234, 1235):
            key = f"smoke/{c}@seed{seed}"
            results.setdefault(key, _rec(job=key, config=c, seed=seed, device=h100))
    assert P.lease_plans(results, ["smoke", other], h100)["jobs"] == []
    p = P.lease_plans(results, [other, "smoke"], h200)
    assert p["studies"] == [other] and p["jobs"] == [f"{other}/all3@seed7",
                                                     f"{other}/{D.FLOOR}@seed7"]
    with pytest.raises(ValueError, match="name one study"):
        P.lease_plans(results, ["smoke", other], h100, seeds=[1234])


def test_plan_prints_assignments_a_lease_script_sources(tmp_path, capsys, monkeypatch):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_rec(device="NVIDIA H200")) + "\n")
    base = ["plan", "--study", "smoke", "--results", str(results), "--shell"]
    show = 'printf "%s|" "$PLAN_STUDIES" "$PLAN_JOBS" "$PLAN_RECHECKS" "$PLAN_RECHECK_ALL3"'
    assert S.main(base + ["--device", "NVIDIA H200"]) == 0
    out, err = capsys.readouterr()
    env = subprocess.run(["bash", "-c", out + show], capture_output=True, text=True,
                         check=True).stdout
    assert env == ("smoke|smoke/all3@seed1234 smoke/zero3+2mb@seed1234 smoke/zero3@seed1235 "
                   "smoke/all3@seed1235 smoke/zero3+2mb@seed1235|smoke/zero3@seed1234||")
    assert "recheck first: smoke/zero3@seed1234" in err
    assert S.main(base + ["--device", "NVIDIA H100 80GB HBM3", "--seeds", "1234"]) == 0
    out, err = capsys.readouterr()
    assert "PLAN_JOBS=''" in out and "seed 1234 left out: its jobs ran on NVIDIA H200" in err
    # two studies: the second's jobs after the first's
    other = _second_study(monkeypatch)
    assert S.main(base[:3] + [other] + base[3:] + ["--device", "NVIDIA H200"]) == 0
    out, err = capsys.readouterr()
    env = subprocess.run(["bash", "-c", out + show], capture_output=True, text=True,
                         check=True).stdout
    assert env.startswith(f"smoke {other}|smoke/all3@seed1234 ")
    assert f"smoke/{D.FLOOR}@seed1235 {other}/zero3@seed7 {other}/all3@seed7 " in env
    assert f"[plan] {other} on NVIDIA H200: 3 job(s) to run, seeds [7]" in err


def test_start_keys_queues_exactly_the_plans_jobs(tmp_path, monkeypatch, sample_dir):
    monkeypatch.setattr(S, "_launch", lambda entry: subprocess.Popen([sys.executable, "-c", ""]))
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_rec()) + "\n")  # smoke/zero3@seed1234 recorded
    base = ["start", "--study", "smoke", "--jobs", "9", "--data-dir", sample_dir,
            "--results", str(results), "--commit", "abc"]
    keys = ["smoke/zero3@seed1235", f"smoke/{D.FLOOR}@seed1234"]  # given out of order
    assert S.main(base + ["--run-dir", str(tmp_path / "a"), "--keys", *keys]) == 0
    assert list(S._read_ledger(str(tmp_path / "a"))) == [keys[1], keys[0]]  # the study's order
    for bad in ("smoke/zero3@seed1234", "smoke/all3@seed7"):  # recorded; not in the study
        with pytest.raises(SystemExit):
            S.main(base + ["--run-dir", str(tmp_path / "b"), "--keys", bad])
        assert not (tmp_path / "b" / "jobs.json").exists()
    # control: without --keys, every pending job of the study
    assert S.main(base + ["--run-dir", str(tmp_path / "c")]) == 0
    assert len(S._read_ledger(str(tmp_path / "c"))) == 5
    # two studies: keys of both, each job with its own study's recipe, in the studies' order
    other = _second_study(monkeypatch)
    two = base[:2] + ["smoke", other] + base[3:] + ["--run-dir", str(tmp_path / "d")]
    keys = [f"{other}/zero3@seed7", "smoke/all3@seed1234"]
    assert S.main(two + ["--keys", *keys]) == 0
    ledger = S._read_ledger(str(tmp_path / "d"))
    assert list(ledger) == [keys[1], keys[0]]
    assert [(e["study"], e["seed"]) for e in ledger.values()] == [("smoke", 1234), (other, 7)]
    for bad in (["--seeds", "7"], ["--micro-batch-size", "2"]):  # one study's, not two
        with pytest.raises(SystemExit):
            S.main(two[:-1] + [str(tmp_path / "e"), "--keys", *keys] + bad)
        assert not (tmp_path / "e" / "jobs.json").exists()


def test_switch_lines_pair_configurations_that_differ_in_one_switch():
    def summ(**by_config):
        return {c.replace("_", "+"): {"val_loss": v} for c, v in by_config.items()}

    assert R.switch_lines({}) == []
    one = R.switch_lines(summ(all3={1: 3.03}, qwz_hpz={1: 3.0}))
    assert one == ["qgZ (all3 vs qwz+hpz, same seed): +1.000 % (1: +1.000 %)"]
    # seeds 1 and 2 paired (+1 % and +3 %: mean 2, s.e. 1); seed 3 has no all3+diff4
    two = R.switch_lines(summ(all3={1: 2.0, 2: 2.0, 3: 2.0},
                              all3_diff4={1: 2.02, 2: 2.06, 3: None}))
    assert two == ["4-bit weight differences (all3+diff4 vs all3, same seed): +2.000 % +- 1.000 "
                   "(1: +1.000 %, 2: +3.000 %)"]
