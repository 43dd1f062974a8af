"""benchmarks/gpu_lab_lease.sh as a lease's first call runs it, on CPU: the real plan
(lab_study.py plan, on a results file with records on the stand-in GPU model), the rest of the
device's programs stood in for (nvidia-smi, pip, the recheck, the queue, the poll), so what is
tested is the script's own flow and what it leaves in OUT. The device returns at most 8 files of
a call (a ninth, a recheck verdict, was dropped on 2026-12-06): the script must leave room for
the call's own JSON beside its files."""

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
from test_lab_study import _rec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = "NVIDIA H100 80GB HBM3"
DEVICE_FILES = 8  # what the device returns of a call's OUT


def _stand_ins(bin_dir, fail_recheck=False, verdict=True):
    """python3: the real interpreter for plan, stand-ins that write what their program writes
    for what needs a GPU or the wheel; nvidia-smi: the stand-in GPU."""
    os.makedirs(bin_dir)
    py = f"""#!/usr/bin/env bash
all="$*"
out=""
prev=""
job=""
for a in "$@"; do [ "$prev" = --out ] && out=$a; [ "$prev" = --job ] && job=$a; prev=$a; done
case "$all" in
  *"-m pip install"*) exit 0 ;;
  *"lab_study.py recheck"*)
    mkdir -p "$out"
    {"" if verdict else "exit 2  # dies before its verdict"}
    # a verdict as lab_study.py recheck writes it: this GPU, the record's GPU from the results
    {sys.executable} -c 'import json, sys
rec = {{}}
for line in open("docs/lab_study/results.jsonl"):
    r = json.loads(line)
    rec = r if r["job"] == sys.argv[1] else rec
print(json.dumps({{"job": sys.argv[1], "iters": 100, "device": "{GPU}",
                  "recorded": {{"device": rec.get("device")}},
                  "identical": {not fail_recheck}}}, indent=1))' "$job" > "$out/recheck.json"
    echo "recheck: stand-in"; exit {3 if fail_recheck else 0} ;;
  *"lab_study.py start"*) echo "queued (stand-in): $all"; exit 0 ;;
  *"lab_study.py poll"*)
    for f in records.jsonl status.json partial.jsonl; do echo '{{}}' > "$out/$f"; done; exit 0 ;;
  *lab_profile.py*) mkdir -p "$(dirname "$out")"; echo '{{}}' > "$out"; exit 0 ;;
esac
exec {sys.executable} "$@"
"""
    smi = f"""#!/usr/bin/env bash
case "$*" in
  *memory.used*) echo "memory.used [MiB], utilization.gpu [%]"; echo "1 MiB, 0 %" ;;
  *name,memory*) echo "{GPU}, 81559 MiB, 580.159.04" ;;
  *) echo "{GPU}" ;;
esac
"""
    for name, text in (("python3", py), ("nvidia-smi", smi)):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)


SEED_1234 = [("zero3", 1234, GPU), ("all3", 1234, GPU)]


def _lease(tmp_path, fail_recheck=False, preload=0, verdict=True, recorded=SEED_1234,
           studies="smoke", **env):
    """Run the script in a copy of the repo's layout whose results hold the smoke study's
    ``recorded`` jobs (configuration, seed, GPU model; by default zero3 and all3 of seed 1234 on
    the stand-in GPU, so a seed's and the all3 recheck run), with ``preload`` files already in
    OUT (a call's own); returns (process, OUT)."""
    work = tmp_path / "repo"
    (work / "docs" / "lab_study").mkdir(parents=True)
    for name in ("benchmarks", "megatron_zeropp", "tools"):
        os.symlink(os.path.join(REPO, name), work / name)
    with open(work / "docs" / "lab_study" / "results.jsonl", "w") as f:
        for config, seed, gpu in recorded:
            f.write(json.dumps(_rec(job=f"smoke/{config}@seed{seed}", config=config, seed=seed,
                                    device=gpu)) + "\n")
    (work / ".whl").mkdir()
    (work / ".whl" / "megatron_core-0-py3-none-any.whl").write_text("")
    (work / "runs").mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n")
    with tarfile.open(work / "runs" / "lab_data.tar.xz", "w:xz") as t:
        t.add(corpus, arcname="corpus.txt")
    _stand_ins(tmp_path / "bin", fail_recheck, verdict)
    out = tmp_path / "out"
    out.mkdir()
    for k in range(preload):
        (out / f"own{k}.json").write_text("{}")
    environ = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", MPS="0",
                   SCRATCH=str(tmp_path / "scratch"), **env)
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_lab_lease.sh"),
                           str(out), "abc", studies, "2", "0"], cwd=work, env=environ,
                          capture_output=True, text=True, timeout=300)
    return proc, out


def _verdicts(out):
    """(job, identical) of each line of OUT's rechecks.jsonl."""
    return [(v["job"], v["identical"]) for v in map(json.loads, (out / "rechecks.jsonl")
                                                    .read_text().splitlines())]


def _files(out):
    return sorted(os.path.relpath(os.path.join(d, f), out)
                  for d, _, fs in os.walk(out) for f in fs)


@pytest.mark.parametrize("checks", ["0", "1"])
def test_a_lease_leaves_room_in_out_for_the_calls_own_file(tmp_path, checks):
    proc, out = _lease(tmp_path, CHECKS=checks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = _files(out)
    expected = ["lease.txt", "partial.jsonl", "rechecks.jsonl", "records.jsonl", "status.json"]
    if checks == "1":
        expected = sorted(expected + ["lab_speed_mbs8.json"])
    assert files == expected
    assert len(files) <= DEVICE_FILES - 2
    # names the device returns: letters, digits, '.', '_' and '-', at most 2 folders down
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}", f) for f in files)
    log = (out / "lease.txt").read_text()
    assert log.startswith(f"{GPU}, 81559 MiB")
    assert "[plan] smoke on NVIDIA H100 80GB HBM3" in log  # the real plan's lines
    assert log.count("recheck: stand-in") == 2 and "queued (stand-in)" in log
    # both verdicts, one line each, as record --rechecks reads them
    assert _verdicts(out) == [("smoke/zero3@seed1234", True), ("smoke/all3@seed1234", True)]
    assert "warning" not in log
    # the scratch files went to SCRATCH, not OUT
    assert (tmp_path / "scratch" / "plan.sh").exists()
    assert (tmp_path / "scratch" / "lab_data" / "corpus.txt").exists()


def test_a_failing_recheck_queues_nothing_and_keeps_its_verdict(tmp_path):
    proc, out = _lease(tmp_path, fail_recheck=True)
    assert proc.returncode == 3
    assert _files(out) == ["lease.txt", "rechecks.jsonl"]
    assert _verdicts(out) == [("smoke/zero3@seed1234", False)]
    log = (out / "lease.txt").read_text()
    assert "the recheck (seed1: smoke/zero3@seed1234) did not pass (exit code 3)" in log
    assert "queued (stand-in)" not in log


def test_a_recheck_that_dies_leaves_no_verdict_not_an_earlier_one(tmp_path):
    stale = tmp_path / "scratch" / "recheck_seed1"
    stale.mkdir(parents=True)
    (stale / "recheck.json").write_text('{"identical": true}')  # an earlier call's
    proc, out = _lease(tmp_path, verdict=False)
    assert proc.returncode == 2
    assert _files(out) == ["lease.txt"]


def test_the_warning_fires_when_out_holds_more_than_the_device_returns(tmp_path):
    # negative control of the count: three files of the call's own beside the script's six
    proc, out = _lease(tmp_path, preload=3, CHECKS="1")
    assert proc.returncode == 0 and len(_files(out)) == DEVICE_FILES + 1
    assert "[lease] warning: OUT holds 9 files; the device returns 8 of them" in proc.stdout
    assert "warning: OUT holds 9 files" in (out / "lease.txt").read_text()


def test_a_plan_that_fails_stops_the_lease_and_its_reason_is_in_the_log(tmp_path):
    proc, out = _lease(tmp_path, SEEDS="7")  # not a seed of the smoke study
    assert proc.returncode == 1
    assert _files(out) == ["lease.txt"]
    assert "seeds [7] are not study smoke's" in (out / "lease.txt").read_text()


def test_each_seed_queued_with_a_record_is_rechecked_first(tmp_path):
    # seeds 1234 and 1235 both have records (a job added after both ran): one lease runs both
    # seeds' jobs, each seed's first record rerun before anything queues
    proc, out = _lease(tmp_path, recorded=[("zero3", 1234, GPU), ("zero3", 1235, GPU),
                                           ("all3", 1235, GPU)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [json.loads(x)["job"] for x in (out / "rechecks.jsonl").read_text().splitlines()] == [
        "smoke/zero3@seed1234", "smoke/zero3@seed1235", "smoke/all3@seed1235"]
    log = (out / "lease.txt").read_text()
    assert re.search(r"queued \(stand-in\): .*--keys smoke/all3@seed1234 "
                     r"smoke/zero3\+2mb@seed1234 smoke/zero3\+2mb@seed1235 ", log)


def test_a_model_with_nothing_of_the_first_study_runs_the_next(tmp_path):
    # smoke's two seeds ran on another GPU model: this one runs the next study's jobs
    other = "NVIDIA H200"
    proc, out = _lease(tmp_path, recorded=[("zero3", 1234, other), ("zero3", 1235, other)],
                       studies="smoke 125m-lr3e-4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (out / "lease.txt").read_text()
    assert "[plan] smoke on NVIDIA H100 80GB HBM3: 0 job(s) to run" in log
    assert "[plan] 125m-lr3e-4 on NVIDIA H100 80GB HBM3: 15 job(s) to run" in log
    assert re.search(r"queued \(stand-in\): .*start --study 125m-lr3e-4 --jobs 2 .*--keys "
                     r"125m-lr3e-4/zero3@seed1234 ", log)
    assert "recheck: stand-in" not in log  # nothing of 125m-lr3e-4 recorded: nothing to rerun
    # control: with the first study alone nothing runs (exit code 4)
    proc, out = _lease(tmp_path / "alone", recorded=[("zero3", 1234, other),
                                                     ("zero3", 1235, other)])
    assert proc.returncode == 4
    assert "nothing of smoke to run on this GPU model" in (out / "lease.txt").read_text()


def test_a_cross_model_recheck_that_passes_moves_its_seed_here(tmp_path):
    # seed 1235's zero3 ran on an H200; CROSS reruns it on this H100 before the plan
    zero3 = "smoke/zero3@seed1235"
    proc, out = _lease(tmp_path, recorded=[("zero3", 1235, "NVIDIA H200")], CROSS=zero3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _verdicts(out) == [(zero3, True)]  # not rerun again as the seed's recheck
    log = (out / "lease.txt").read_text()
    assert f"seed 1235 runs here too: this model reproduced {zero3}" in log
    assert f"recheck (seed1: {zero3}): rerun above (CROSS)" in log
    assert re.search(r"--keys smoke/zero3@seed1234 .*smoke/all3@seed1235 ", log)
    # control: the rerun differs, so seed 1235 stays on the H200 and only 1234 queues
    proc, out = _lease(tmp_path / "differs", recorded=[("zero3", 1235, "NVIDIA H200")],
                       CROSS=zero3, fail_recheck=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _verdicts(out) == [(zero3, False)]
    log = (out / "lease.txt").read_text()
    assert f"the cross-model recheck (cross1: {zero3}) did not pass (exit code 3)" in log
    assert "seed 1235 left out: its jobs ran on NVIDIA H200" in log
    assert "@seed1235" not in log.split("queued (stand-in)")[1]
