"""Fault injection through the real launcher (torchrun, gloo on CPU): each fault ends the job with
the right exit code and message, and no file of a previous run changes.

A "previous run" (2 ranks, real .bin/.idx data, checkpoints at iterations 2 and 4) is made once;
each test copies it, fingerprints the copy, injects its fault (tests/fault_entry.py) and compares
fingerprints afterwards. Liveness is bounded by generous subprocess timeouts, never timed asserts.
"""

import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import numpy
import pytest

# CI's second pass (pytest -m slow): the operator failures are whole torchrun jobs, about two
# minutes together, which the README's command leaves out to stay short.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(ROOT, "tests", "fault_entry.py")
VOCAB = 64  # NullTokenizer: ids 0..63, EOD 64, so .vocab_size == 65
LIMIT_S = 300  # far above any expected run; only there so CI can never hang


def _model(layers=2):
    return (f"--num-layers {layers} --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            f"--micro-batch-size 1 --lr 1e-3 --log-interval 1 --eval-iters 0 "
            f"--tokenizer-type NullTokenizer --vocab-size {VOCAB}").split()


def _env(fault=None, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **extra)
    env.pop("ZEROPP_TEST_FAULT", None)
    if fault:
        env["ZEROPP_TEST_FAULT"] = fault
    return env


def _torchrun(nproc, argv, torchrun_args=()):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(_free_port()), *torchrun_args, ENTRY, *argv]


def _launch(nproc, argv, fault=None, cwd=None, env=None, torchrun_args=()):
    """torchrun the job; whatever way it ends, no process of it may be left (checked here)."""
    marker = uuid.uuid4().hex
    run = subprocess.run(_torchrun(nproc, argv, torchrun_args), capture_output=True, text=True,
                         env={**_env(fault, ZEROPP_TEST_JOB=marker), **(env or {})},
                         timeout=LIMIT_S, cwd=cwd or ROOT)
    assert _survivors(marker) == [], run.stderr[-3000:]
    return run


def _on_rank_1(old, new):
    """Environment for fault_entry.py: rank 1 reads ``new`` where the command line says
    ``old`` (a node-local path)."""
    return {"ZEROPP_TEST_RANK_ARGV": "1", "ZEROPP_TEST_ARGV_FROM": old,
            "ZEROPP_TEST_ARGV_TO": new}


def _survivors(marker):
    """Processes (other than zombies) whose environment carries ``marker``: what a job left."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and \
                    p.environ().get("ZEROPP_TEST_JOB") == marker:
                out.append((p.pid, " ".join(p.info["cmdline"] or [])[:200]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _launch_behind_tee(nproc, argv, log, fault=None):
    """``torchrun ... 2>&1 | tee log`` as Megatron-LM's scripts log; returns (run, marker)."""
    marker = uuid.uuid4().hex
    line = f"set -o pipefail; {shlex.join(_torchrun(nproc, argv))} 2>&1 | tee {shlex.quote(log)}"
    # capture_output: run() returns only once every holder of the pipe has closed it, so a
    # process left behind holding it shows up as the (generous) timeout
    run = subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=ROOT,
                         env=_env(fault, ZEROPP_TEST_JOB=marker), timeout=LIMIT_S)
    return run, marker


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fingerprint(*dirs):
    out = {}
    for d in dirs:
        for base, _, files in os.walk(d):
            for name in files:
                path = os.path.join(base, name)
                with open(path, "rb") as f:
                    out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


def _write_data(prefix, top_id):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    rng = numpy.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(10, 40))
        doc = rng.integers(0, VOCAB, n)
        builder.add_document(doc, [n])
    builder.add_document(numpy.array([top_id] * 5), [5])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """A finished 2-rank run: data, and checkpoints of iterations 2 and 4 (with checksums)."""
    base = tmp_path_factory.mktemp("previous")
    data = str(base / "data" / "corpus_text_document")
    os.makedirs(os.path.dirname(data))
    _write_data(data, VOCAB - 1)
    ckpt = str(base / "ckpt")
    run = _launch(2, _model() + ["--train-iters", "4", "--train-data-path", data,
                                 "--save", ckpt, "--save-interval", "2", "--ckpt-checksums"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "iteration        4/       4" in run.stdout
    return base


@pytest.fixture
def prev(previous, tmp_path):
    """A private copy of the previous run, and its fingerprint."""
    copy = tmp_path / "previous"
    shutil.copytree(previous, copy)
    dirs = (str(copy / "data"), str(copy / "ckpt"))
    return copy, _fingerprint(*dirs), dirs


def _resume(copy, iters, extra=()):
    data = str(copy / "data" / "corpus_text_document")
    ckpt = str(copy / "ckpt")
    return _model() + ["--train-iters", str(iters), "--train-data-path", data,
                       "--data-cache-path", str(copy.parent / "index_cache"),
                       "--load", ckpt, "--save", ckpt, "--save-interval", "2", *extra]


def _one_line_from_rank_0(stderr, message):
    lines = [line for line in stderr.splitlines() if message in line]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: ")
    # no rank printed a traceback (torchrun prints its own ChildFailedError one)
    assert f'File "{ROOT}/megatron_zeropp' not in stderr


def test_a_frozen_rank_ends_the_job_naming_rank_and_collective(prev, tmp_path):
    copy, before, dirs = prev
    # 4 ranks as 2 nodes x 2, all of ZeRO++: rank 3 stops responding after iteration 5 (before
    # that iteration's save); the others must give up after the 6 s timeout, not 30 minutes.
    argv = _resume(copy, 8, ["--ranks-per-node", "2", "--zeropp-qwz", "--zeropp-hpz",
                             "--zeropp-qgz", "--distributed-timeout-minutes", "0.1",
                             "--use-checkpoint-opt_param-scheduler", "--global-batch-size", "4"])
    run = _launch(4, argv, fault="freeze:3:5")
    assert run.returncode != 0
    failed = [line for line in run.stderr.splitlines() if "] FAILED in torch.distributed." in line]
    assert failed, run.stderr[-3000:]
    assert all("timed out" in line for line in failed)
    assert {line.split("]")[0] for line in failed} <= {"[rank 0", "[rank 1", "[rank 2"}
    # iteration 6 was never saved; everything of the previous run is as it was
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_killed_rank_ends_the_job(prev):
    copy, before, dirs = prev
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]),
                  fault="kill:1:5")
    assert run.returncode != 0
    assert "exitcode  : 9" in run.stderr and "rank      : 1" in run.stderr, run.stderr[-3000:]
    assert _fingerprint(*dirs) == before


def test_torchrun_restarts_a_killed_rank_0_and_the_job_completes(prev):
    # --max-restarts: the restarted ranks used to fail in init_process_group ("Gloo
    # connectFullMesh failed ... Connection refused": the previous attempt's addresses in
    # torchrun's store); now they take over the dead rank 0's lock, resume from iteration 4 and
    # finish (the fault is injected in the first attempt only)
    copy, before, dirs = prev
    ckpt = str(copy / "ckpt")
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]),
                  fault="kill:0:5", torchrun_args=("--max-restarts", "1"))
    assert run.returncode == 0, run.stderr[-3000:]
    took = [x for x in run.stdout.splitlines() if "took over the lock of" in x]
    assert len(took) == 1 and took[0].startswith(f"> --save {ckpt}: took over the lock of host "
                                                 f"{socket.gethostname()} pid "), run.stdout[-3000:]
    assert took[0].endswith("on this host is gone")
    assert run.stdout.count("> loaded checkpoint of iteration 4") == 2  # once per attempt
    assert "iteration        8/       8" in run.stdout
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "8"
    assert not os.path.exists(os.path.join(ckpt, ".save_lock"))
    after = _fingerprint(*dirs)
    assert {k: v for k, v in after.items() if k in before and "latest_" not in k} == {
        k: v for k, v in before.items() if "latest_" not in k}  # iterations 2 and 4 kept


def test_a_save_killed_half_way_leaves_the_previous_checkpoints(prev):
    copy, before, dirs = prev
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]),
                  fault="kill_save:1:6")
    assert run.returncode != 0
    after = _fingerprint(*dirs)
    # iteration 6's directory may exist only as the unfinished .tmp; nothing else changed
    assert {k: v for k, v in after.items() if "iter_0000006.tmp" not in k} == before
    assert open(os.path.join(dirs[1], "latest_checkpointed_iteration.txt")).read() == "4"


@pytest.mark.long
def test_a_typo_in_load_is_an_error_not_a_fresh_start(prev):
    copy, before, dirs = prev
    argv = _resume(copy, 8)
    argv[argv.index("--load") + 1] += "_typo"
    run = _launch(2, argv)
    assert run.returncode != 0  # torchrun reports the ranks' code 2 as its own failure
    _one_line_from_rank_0(run.stderr, "_typo does not exist: no checkpoint to resume from")
    assert "iteration " not in run.stdout
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_fresh_run_into_a_directory_with_newer_checkpoints_is_refused(prev):
    copy, before, dirs = prev
    run = _launch(2, _resume(copy, 8, ["--ckpt-step", "2"]))  # saves 4 again, then 6...
    _one_line_from_rank_0(run.stderr, "already holds iteration(s) [4] after this run's start")
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_checkpoint_of_another_model_is_refused(prev):
    copy, before, dirs = prev
    argv = _resume(copy, 8)
    argv[argv.index("--num-layers") + 1] = "1"
    run = _launch(2, argv)
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, "--num-layers checkpoint 2 vs this run 1")
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_longer_schedule_on_resume_needs_a_choice(prev):
    copy, before, dirs = prev
    run = _launch(2, _resume(copy, 8))  # --train-iters 4 -> 8 changes the LR decay
    _one_line_from_rank_0(run.stderr, "the checkpoint's LR schedule differs")
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_truncated_data_is_found_before_training(prev):
    copy, before, dirs = prev
    broken = str(copy / "broken_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(str(copy / "data" / "corpus_text_document") + ext, broken + ext)
    size = os.path.getsize(broken + ".bin")
    os.truncate(broken + ".bin", size - size // 25)  # the last 4 %
    argv = _resume(copy, 8)
    argv[argv.index("--train-data-path") + 1] = broken
    run = _launch(2, argv)
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, f"data file {broken}.bin: has {size - size // 25} bytes")
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_data_of_a_larger_vocabulary_is_found_before_training(prev):
    copy, before, dirs = prev
    bigger = str(copy / "bigger_text_document")
    _write_data(bigger, 300)
    argv = _resume(copy, 8)
    argv[argv.index("--train-data-path") + 1] = bigger
    run = _launch(2, argv)
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, f"{bigger}.bin: holds token id 300, but the tokenizer "
                                      f"has {VOCAB + 1} tokens")
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_nan_stops_the_run_before_it_saves(prev):
    copy, before, dirs = prev
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]), fault="nan:5")
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, "iteration 6: the loss is not finite")
    assert "iteration        5/" in run.stdout and "iteration        6/" not in run.stdout
    assert _fingerprint(*dirs) == before
    # and with the check off the same fault trains to the end; as in Megatron-LM's log, the
    # line of a step whose loss is NaN has no loss field (its mean is not > 0) and the nan
    # counter counts only skipped steps (fp32 here has no scaler to skip it)
    off = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler",
                                       "--no-check-for-nan-in-loss-and-grad",
                                       "--save", str(copy / "other")]),
                  fault="nan:5")
    assert off.returncode == 0, off.stderr[-3000:]
    lines = {i: next(x for x in off.stdout.splitlines() if f"iteration {i:8d}/" in x)
             for i in (5, 6, 8)}
    assert "lm loss:" in lines[5] and "lm loss:" not in lines[6]
    assert "number of nan iterations:   0" in lines[6]


def test_a_failed_job_behind_tee_returns_and_leaves_no_process(prev, tmp_path):
    copy, before, dirs = prev
    # A torch_dist save at iteration 6 (megatron-core's writer used to start a manager process
    # there), then a NaN stop at 7: the pipeline must return and nothing of the job survive.
    argv = _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"])
    argv[argv.index("--save") + 1] = str(copy / "other")
    run, marker = _launch_behind_tee(2, argv, str(tmp_path / "log"), fault="nan:6")
    assert run.returncode == 1, run.stdout[-3000:]
    assert "> saved checkpoint of iteration 6" in run.stdout
    lines = [x for x in run.stdout.splitlines() if "iteration 7: the loss is not finite" in x]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), run.stdout[-3000:]
    assert _survivors(marker) == []
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_start_up_error_on_rank_1_only_stops_every_rank_with_its_message(prev):
    copy, before, dirs = prev
    data = str(copy / "data" / "corpus_text_document")
    broken = str(copy / "node1" / "corpus_text_document")
    os.makedirs(os.path.dirname(broken))
    for ext in (".bin", ".idx"):
        shutil.copy(data + ext, broken + ext)
    size = os.path.getsize(broken + ".bin")
    os.truncate(broken + ".bin", size - 8)
    run = _launch(2, _resume(copy, 8), env=_on_rank_1(data, broken))
    assert run.returncode != 0
    # printed once, by rank 0, naming rank 1 and its file (it used to be printed by no rank)
    _one_line_from_rank_0(run.stderr, f"on rank 1 ({socket.gethostname()}): data file "
                                      f"{broken}.bin: has {size - 8} bytes")
    assert "timed out" not in run.stderr and "iteration " not in run.stdout
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_ranks_that_would_load_different_checkpoints_are_refused(prev):
    copy, before, dirs = prev
    ckpt = str(copy / "ckpt")
    # node 1's directory holds only iteration 2 (a stale copy)
    node1 = str(copy / "node1_ckpt")
    os.makedirs(node1)
    shutil.copytree(os.path.join(ckpt, "iter_0000002"), os.path.join(node1, "iter_0000002"))
    with open(os.path.join(node1, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    argv = _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"])
    argv[argv.index("--save") + 1] = str(copy / "other")
    run = _launch(2, argv, env=_on_rank_1(ckpt, node1))
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, "the ranks disagree on the checkpoint to load: rank 0")
    line = next(x for x in run.stderr.splitlines() if "the ranks disagree" in x)
    assert f"iteration 4 of --load {ckpt}" in line and f"iteration 2 of --load {node1}" in line
    assert "iteration " not in run.stdout
    assert _fingerprint(*dirs) == before


def test_a_save_directory_held_by_another_job_is_refused(prev):
    copy, before, dirs = prev
    lock = copy / "ckpt" / ".save_lock"
    lock.write_text(json.dumps({"host": "node-17", "pid": 4242, "job": "8812",
                                "token": "x", "started": "2026-12-01T09:00:00Z"}))
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]))
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, "is in use by another job: host node-17 pid 4242, job 8812")
    assert "--break-save-lock" in run.stderr and "iteration " not in run.stdout
    after = _fingerprint(*dirs)
    assert after.pop(str(lock)) and after == before


@pytest.mark.long
def test_a_save_that_is_a_file_is_refused_before_training(prev):
    copy, before, dirs = prev
    target = copy / "not_a_dir"
    target.write_text("x")  # (a read-only --save, and one under a file: test_faults_units.py)
    argv = _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"])
    argv[argv.index("--save") + 1] = str(target)
    run = _launch(2, argv)
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, f"--save {target} exists and is not a directory")
    assert "iteration " not in run.stdout
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_cut_shard_is_named_before_loading(prev):
    copy, before, dirs = prev
    it4 = copy / "ckpt" / "iter_0000004"
    shard = sorted(p for p in os.listdir(it4) if p.endswith(".distcp"))[-1]
    os.truncate(it4 / shard, os.path.getsize(it4 / shard) // 2)
    before = _fingerprint(*dirs)
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]))
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, f"checkpoint file {it4 / shard} has ")
    assert "the file is cut" in run.stderr
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_checksums_find_garbage_that_sizes_cannot(prev):
    copy, before, dirs = prev
    it4 = copy / "ckpt" / "iter_0000004"
    assert (it4 / "checksums.json").exists()  # the previous run saved with --ckpt-checksums
    shard = sorted(p for p in os.listdir(it4) if p.endswith(".distcp"))[0]
    size = os.path.getsize(it4 / shard)
    with open(it4 / shard, "r+b") as f:  # garbage in place: the size stays right
        f.seek(size // 4)
        f.write(os.urandom(min(65536, size // 2)))
    before = _fingerprint(*dirs)
    run = _launch(2, _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"]))
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, f"checkpoint file {it4 / shard} does not match its SHA-256")
    assert "iteration " not in run.stdout
    assert _fingerprint(*dirs) == before


def test_sigterm_with_exit_signal_handler_saves_then_exits(prev, tmp_path):
    copy, before, dirs = prev
    other = copy / "other"
    argv = _resume(copy, 3000, ["--override-opt_param-scheduler", "--exit-signal-handler"])
    argv[argv.index("--save") + 1] = str(other)
    argv[argv.index("--save-interval") + 1] = "3000"
    marker = uuid.uuid4().hex
    log = str(tmp_path / "log")
    line = f"{shlex.join(_torchrun(2, argv))} 2>&1 | tee {shlex.quote(log)}"
    job = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                           env=_env(ZEROPP_TEST_JOB=marker), start_new_session=True)
    out = []
    for text in job.stdout:  # bounded by the iterations, and by LIMIT_S below
        out.append(text)
        if "iteration       10/" in text:
            break
    import psutil

    torchrun = [p for p in psutil.Process(job.pid).children(recursive=True)
                if "torch.distributed.run" in " ".join(p.cmdline())]
    assert len(torchrun) == 1, out[-20:]
    torchrun[0].send_signal(signal.SIGTERM)  # what a scheduler's preemption sends
    rest, _ = job.communicate(timeout=LIMIT_S)
    text = "".join(out) + rest
    saved = [x for x in text.splitlines() if "> saved checkpoint of iteration" in x]
    assert len(saved) == 1, text[-3000:]
    iteration = int(saved[0].split("iteration ")[1].split(" ")[0])
    assert "on SIGTERM (--exit-signal-handler)" in text
    assert open(other / "latest_checkpointed_iteration.txt").read() == str(iteration)
    assert iteration >= 10 and _survivors(marker) == []
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_a_save_directory_that_is_not_shared_is_refused_at_start(prev):
    copy, before, dirs = prev
    other, node1 = str(copy / "other"), str(copy / "node1_other")
    argv = _resume(copy, 8, ["--use-checkpoint-opt_param-scheduler"])
    argv[argv.index("--save") + 1] = other
    run = _launch(2, argv, env=_on_rank_1(other, node1))
    assert run.returncode != 0
    _one_line_from_rank_0(run.stderr, "the ranks disagree on the --save directory: rank 0")
    assert f"rank 1 ({socket.gethostname()}) see no lock in --save {node1}" in run.stderr
    assert "iteration " not in run.stdout
    assert not os.path.exists(os.path.join(other, ".save_lock"))  # given back
    assert _fingerprint(*dirs) == before


@pytest.mark.long
def test_two_jobs_started_together_on_one_save_directory(prev, tmp_path):
    # Two real jobs race for one fresh --save (a Slurm requeue overlapping its old allocation):
    # one must be refused at start naming the other, the other must finish, and its checkpoint
    # must be its own (it used to publish a common.pt of the other job and exit 0).
    copy, before, dirs = prev
    shared = str(tmp_path / "shared")
    data = str(copy / "data" / "corpus_text_document")
    argv = _model() + ["--train-iters", "12", "--train-data-path", data,
                       "--data-cache-path", str(tmp_path / "index_cache"),
                       "--save", shared, "--save-interval", "4"]
    markers = [uuid.uuid4().hex for _ in range(2)]
    jobs = [subprocess.Popen(_torchrun(2, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, env=_env(ZEROPP_TEST_JOB=m)) for m in markers]
    outs = [job.communicate(timeout=LIMIT_S) for job in jobs]
    codes = [job.returncode for job in jobs]
    assert sorted(codes)[0] == 0 and sorted(codes)[1] != 0, (codes, outs[0][1][-2000:],
                                                              outs[1][1][-2000:])
    won, lost = (0, 1) if codes[0] == 0 else (1, 0)
    _one_line_from_rank_0(outs[lost][1], f"--save {shared} is in use by another job: host "
                                         f"{socket.gethostname()} pid ")
    assert "iteration " not in outs[lost][0]
    assert "> saved checkpoint of iteration 12" in outs[won][0]
    assert all(_survivors(m) == [] for m in markers)
    assert not os.path.exists(os.path.join(shared, ".save_lock"))  # given back by the winner
    # the winner's checkpoint is whole: it resumes
    run = _launch(2, _model() + ["--train-iters", "13", "--train-data-path", data,
                                 "--data-cache-path", str(tmp_path / "index_cache"),
                                 "--load", shared, "--use-checkpoint-opt_param-scheduler"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "iteration       13/      13" in run.stdout
    assert _fingerprint(*dirs) == before


def test_a_rank_blocked_outside_python_ends_on_sigterm_and_gives_back_the_lock(prev):
    # Rank 1 exits before joining the process group; rank 0, holding the --save lock, waits for
    # it inside gloo's rendezvous (C++), where Python cannot run its SIGTERM handler. It sat out
    # torchrun's SIGTERM until the SIGKILL 30 s later and left the lock behind; now its signal
    # watcher ends it, lock given back.
    copy, _, _ = prev
    save = str(copy / "fresh")
    run = _launch(2, _model() + ["--train-iters", "2", "--mock-data", "--save", save],
                  fault="exit_at_start:1")
    assert run.returncode != 0
    said = [line for line in run.stderr.splitlines() if line.startswith("[rank 0] stopped by")]
    assert said == ["[rank 0] stopped by SIGTERM: the main thread did not return to Python "
                    "within 5 s of it (blocked in a collective or another C call): ending the "
                    "rank from its signal watcher"], run.stderr[-3000:]
    assert os.path.isdir(save) and not os.path.exists(os.path.join(save, ".save_lock"))


def test_a_master_port_in_use_is_torchruns_one_line_before_any_rank_starts(prev):
    # torchrun's agent binds --master-port (MASTER_PORT) for its rendezvous store before it
    # starts a rank: a port in use stops it there with torch's message naming the port; no
    # rank runs, nothing is written.
    copy, before, dirs = prev
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(port), ENTRY,
                   *_resume(copy, 6)]
        run = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=LIMIT_S,
                             cwd=ROOT)
    assert run.returncode == 1
    assert f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE" in run.stderr
    assert "iteration " not in run.stdout
    assert _fingerprint(*dirs) == before
