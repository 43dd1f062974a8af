"""The failure checks one by one, without launching a job: bad values in one line, a --save that
cannot be written, the --save lock's lease, and corrupt checkpoint files named (a stand-in
torch_dist directory written with torch.distributed.checkpoint alone)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron_zeropp.checkpointing import checks, integrity, save_lock
from megatron_zeropp.errors import StartupError
from megatron_zeropp.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 64").split()


def _set(argv, flag, value):
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


@pytest.mark.parametrize("flag, value, message", [
    ("--micro-batch-size", "0", "--micro-batch-size must be >= 1, got 0"),
    ("--num-attention-heads", "0", "--num-attention-heads must be >= 1, got 0"),
    ("--tensor-model-parallel-size", "0", "--tensor-model-parallel-size must be >= 1, got 0"),
    ("--pipeline-model-parallel-size", "0", "--pipeline-model-parallel-size must be >= 1, got 0"),
    ("--num-layers", "0", "--num-layers must be >= 1, got 0"),
    ("--lr", "-0.001", "--lr must be a finite number >= 0.0, got -0.001"),
    ("--lr", "nan", "--lr must be a finite number >= 0.0, got nan"),
    ("--hidden-dropout", "1.5", "--hidden-dropout must be a finite number in [0.0, 1.0], got 1.5"),
    ("--adam-beta2", "inf", "--adam-beta2 must be a finite number in [0.0, 1.0], got inf"),
    ("--distributed-timeout-minutes", "0", "--distributed-timeout-minutes must be a finite "
                                           "number > 0, got 0.0"),
    ("--distributed-timeout-minutes", "-1", "got -1.0"),
    ("--global-batch-size", "0", "--global-batch-size must be >= 1, got 0"),
    ("--split", "nan,1,1", "--split: split must be 1-3 comma-separated finite weights"),
])
def test_a_bad_value_is_one_line_naming_flag_and_value(flag, value, message, capsys):
    argv = _set(BASE, flag, value)
    if flag == "--split":
        argv = [a for a in argv if a != "--mock-data"] + ["--data-path", "/d/x_text_document"]
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=1)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bad_blend_weights_are_refused(capsys):
    argv = [a for a in BASE if a != "--mock-data"] + ["--data-path", "-1", "/a", "1", "/b"]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    assert "--data-path: blend weights must be finite, >= 0" in capsys.readouterr().err


def test_good_values_pass():
    args = parse_args(BASE + ["--hidden-dropout", "0", "--lr", "0"], world_size=1)
    assert args.hidden_dropout == 0.0 and args.lr == 0.0


def test_a_save_that_cannot_be_written_is_found(tmp_path, monkeypatch):
    checks.check_save_writable(str(tmp_path / "new" / "ckpt"))  # creatable: fine
    assert not os.path.exists(tmp_path / "new")  # and the check creates nothing
    (tmp_path / "f").write_text("x")
    with pytest.raises(StartupError, match="exists and is not a directory"):
        checks.check_save_writable(str(tmp_path / "f"))
    with pytest.raises(StartupError, match=f"{tmp_path / 'f'} is not a directory, so"):
        checks.check_save_writable(str(tmp_path / "f" / "ckpt"))
    real_open = open

    def read_only(path, *args, **kwargs):  # root writes through permission bits: mock EROFS
        if ".zeropp_write_probe" in str(path):
            raise OSError(30, "Read-only file system")
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", read_only)
    with pytest.raises(StartupError, match=f"--save {tmp_path}: cannot write files in it: "
                                           "Read-only file system"):
        checks.check_save_writable(str(tmp_path))


def test_a_non_utf8_latest_file_is_named(tmp_path):
    (tmp_path / checks._LATEST).write_bytes(b"\xff\xfe4")
    with pytest.raises(StartupError, match=f"{tmp_path / checks._LATEST} is unreadable "
                                           "\\(UnicodeDecodeError"):
        checks.latest_iteration(str(tmp_path))


def _acquire_elsewhere(root):
    """Another job (a process) trying to take ``root``'s lock: (exit code, stderr)."""
    code = ("import sys\nfrom megatron_zeropp.checkpointing import save_lock\n"
            "try:\n    save_lock.acquire(sys.argv[1])\nexcept Exception as e:\n"
            "    print(e, file=sys.stderr); sys.exit(3)\n")
    run = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True,
                         timeout=120)
    return run.returncode, run.stderr


def test_the_save_lock_keeps_a_second_job_out_and_is_given_back(tmp_path):
    root = str(tmp_path / "ckpt")
    save_lock.acquire(root)
    try:
        code, err = _acquire_elsewhere(root)
        assert code == 3
        assert f"is in use by another job: host {socket.gethostname()} pid {os.getpid()}" in err
        assert "--break-save-lock" in err
        save_lock.check_held(root)  # ours
    finally:
        save_lock.release(root)
    assert not os.path.exists(os.path.join(root, save_lock.LOCK))
    code, err = _acquire_elsewhere(root)  # free now; that process took and left it (its
    assert code == 0, err                 # lock names a dead pid of this host: stale)
    save_lock.acquire(root)
    save_lock.release(root)


def test_a_save_reached_through_a_symlink_is_held_too(tmp_path):
    # Two jobs whose --save paths differ but name one directory (a symlink): the lock is a file
    # in that directory, so the second is refused like any other.
    real, link = tmp_path / "ckpt", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    save_lock.acquire(str(real))
    try:
        code, err = _acquire_elsewhere(str(link))
        assert code == 3 and f"--save {link} is in use by another job" in err, err
    finally:
        save_lock.release(str(real))
    code, err = _acquire_elsewhere(str(link))  # negative control: free, the link takes it
    assert code == 0, err


def test_a_dead_or_silent_holder_loses_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(save_lock, "CONFIRM_S", 0.5)  # the watch of an expired lock
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = root / save_lock.LOCK
    lock.write_text(json.dumps({"host": "node-3", "pid": 1, "token": "t"}))
    with pytest.raises(StartupError, match="host node-3 pid 1"):
        save_lock.acquire(str(root))  # alive as far as we can tell (another host, fresh)
    old = time.time() - save_lock.LEASE_S - 5
    os.utime(lock, (old, old))  # not refreshed for longer than the lease: taken over
    save_lock.acquire(str(root))
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    # another job breaks it (--break-save-lock): this job's next save refuses to write
    lock.write_text(json.dumps({"host": "node-4", "pid": 7, "token": "u"}))
    with pytest.raises(RuntimeError, match="taken over by host node-4 pid 7"):
        save_lock.check_held(str(root))
    save_lock.release(str(root))
    assert lock.exists()  # not ours any more: left alone
    save_lock.acquire(str(root), take_over=True)
    save_lock.release(str(root))


def _lines(out, text):
    return [x for x in out.splitlines() if text in x]


def test_a_deleted_lock_is_put_back_and_only_another_token_is_a_takeover(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    lock = tmp_path / "ckpt" / save_lock.LOCK
    save_lock.acquire(root)
    try:
        token = json.loads(lock.read_text())["token"]
        lock.unlink()  # a cleanup script; the next save used to fail, "taken over by unknown"
        save_lock.check_held(root)
        assert json.loads(lock.read_text())["token"] == token
        host = socket.gethostname()
        assert _lines(capsys.readouterr().out, "re-created") == [
            f"> --save {root}: its lock {lock} was deleted; re-created it (this job, host {host} "
            f"pid {os.getpid()}, still holds --save)"]
        lock.write_text("")  # nothing a job writes (the holder writes the whole file at once)
        save_lock.check_held(root)
        assert json.loads(lock.read_text())["token"] == token
        assert len(_lines(capsys.readouterr().out, "no longer parsed; re-created it")) == 1
        lock.write_text(json.dumps({"host": "node-4", "pid": 7, "token": "u"}))
        with pytest.raises(RuntimeError, match="taken over by host node-4 pid 7"):
            save_lock.check_held(root)  # another job's token: that is a takeover
    finally:
        save_lock.release(root)


def test_the_refresher_counts_and_puts_a_deleted_lock_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(save_lock, "REFRESH_S", 0.05)
    root = str(tmp_path / "ckpt")
    lock = tmp_path / "ckpt" / save_lock.LOCK
    save_lock.acquire(root)
    try:
        first = json.loads(lock.read_text())
        lock.unlink()
        for _ in range(400):  # bounded (20 s); a refresh is due every 0.05 s
            if lock.exists() and json.loads(lock.read_text())["refreshes"] > first["refreshes"]:
                break
            time.sleep(0.05)
        now = json.loads(lock.read_text())
        assert now["token"] == first["token"] and now["refreshes"] > first["refreshes"]
        assert len(_lines(capsys.readouterr().out, "was deleted; re-created it")) == 1
    finally:
        save_lock.release(root)
    assert not lock.exists()


def _stale_lock(root, **fields):
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, save_lock.LOCK)
    info = {"host": "node-3", "pid": 1, "job": "8812", "token": "t",
            "started": "2026-12-01T09:00:00Z", **fields}
    with open(path, "w") as f:
        json.dump(info, f)
    return path


def test_every_takeover_logs_its_old_holder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(save_lock, "CONFIRM_S", 0.5)
    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    dead = int(gone.stdout)
    cases = [  # (lock fields, age in s, why the log gives)
        ({}, save_lock.LEASE_S + 5, "not refreshed for 0 s of watching (its file time is "
                                     f"{save_lock.LEASE_S + 5:.0f} s from this host's clock)"),
        ({"host": host, "pid": dead}, 0, f"its process {dead} on this host is gone"),
        ({"host": host, "pid": os.getpid(), "pid_started": 1.0}, 0,
         f"pid {os.getpid()} on this host is now another process"),
    ]
    for i, (fields, age, why) in enumerate(cases):
        root = str(tmp_path / f"ckpt{i}")
        path = _stale_lock(root, **fields)
        os.utime(path, (time.time() - age, time.time() - age))
        save_lock.acquire(root)
        save_lock.release(root)
        pid = fields.get("pid", 1)
        lines = _lines(capsys.readouterr().out, "took over the lock of")
        assert len(lines) == 1 and lines[0].startswith(
            f"> --save {root}: took over the lock of host {fields.get('host', 'node-3')} pid "
            f"{pid}, job 8812, started 2026-12-01T09:00:00Z: {why}"), lines
    root = str(tmp_path / "empty")
    os.makedirs(root)
    open(os.path.join(root, save_lock.LOCK), "w").close()  # an empty lock file (touch)
    save_lock.acquire(root)  # it used to refuse for 120 s: "in use by an unknown job"
    save_lock.release(root)
    assert _lines(capsys.readouterr().out, "took over") == [
        f"> --save {root}: took over the lock of an unknown job (unparsable lock file): its lock "
        f"file does not parse (a live holder writes it whole every {save_lock.REFRESH_S:.0f} s)"]


def test_clock_skew_cannot_take_a_live_holders_lock(tmp_path, monkeypatch):
    # The holder's host (or the file server) stamps times an hour behind this host's clock: by
    # file time alone its lock looks expired. Its refreshes, watched here, prove it alive.
    monkeypatch.setattr(save_lock, "CONFIRM_S", 1.0)
    root = str(tmp_path / "ckpt")
    path = _stale_lock(root, refreshes="0" * 12)
    stop = threading.Event()

    def refresh(n):  # the holder's bytes and its skewed file time, together
        with open(path + ".next", "w") as f:
            json.dump({**json.load(open(path)), "refreshes": str(n).zfill(12)}, f)
        os.utime(path + ".next", (time.time() - 3600, time.time() - 3600))
        os.replace(path + ".next", path)

    def holder():
        n = 0
        while not stop.wait(0.05):
            n += 1
            refresh(n)
    refresh(0)
    worker = threading.Thread(target=holder, daemon=True)
    worker.start()
    try:
        with pytest.raises(StartupError, match="yet its holder refreshed it meanwhile: the "
                                               "clocks of this host and of the holder or the "
                                               "file server disagree"):
            save_lock.acquire(root)
    finally:
        stop.set()
        worker.join()
    assert json.load(open(path))["token"] == "t"  # still the holder's
    save_lock.acquire(root)  # holder silent now: the same lock is taken over after the watch
    save_lock.release(root)


@pytest.fixture
def dist_dir(tmp_path):
    """A torch_dist-shaped directory: DCP shards and .metadata, metadata.json, common.pt."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "iter_0000004"
    state = {"w": torch.arange(20000, dtype=torch.float32), "v": torch.ones(3000)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"iteration": 4}, d / "common.pt")
    integrity.check_files(str(d))  # whole: passes
    return d


def _shard(d):
    return d / sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]


@pytest.mark.parametrize("damage, message", [
    ("missing shard", "is missing (listed in"),
    ("cut shard", "the file is cut"),
    ("cut metadata.json", "metadata.json is unreadable"),
    ("cut common.pt", "common.pt is unreadable"),
    ("cut .metadata", ".metadata is unreadable"),
])
def test_every_corrupt_file_is_named(dist_dir, damage, message):
    target = {"missing shard": _shard(dist_dir), "cut shard": _shard(dist_dir),
              "cut metadata.json": dist_dir / "metadata.json",
              "cut common.pt": dist_dir / "common.pt",
              "cut .metadata": dist_dir / ".metadata"}[damage]
    if damage == "missing shard":
        target.unlink()
    else:
        os.truncate(target, os.path.getsize(target) // 2)
    with pytest.raises(StartupError) as e:
        integrity.check_files(str(dist_dir))
    assert str(target) in str(e.value) and message in str(e.value), str(e.value)


def test_the_converter_names_itself_in_its_errors(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, os.path.join(root, "tools", "convert_checkpoint.py"),
                          "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "o"),
                          "--to", "torch"], capture_output=True, text=True, timeout=300,
                         cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"convert_checkpoint.py: error: --input {tmp_path / 'nothing'}: no checkpoint")
    assert "pretrain_gpt.py" not in run.stderr and "Traceback" not in run.stderr


def test_the_common_state_is_common_pt_or_megatron_core_0_19s_object(dist_dir):
    # megatron-core 0.17+ (Megatron-LM core_v0.19.0's saves) writes no common.pt: the common
    # state is the 'common_state' object in the shards. Accepted where the installed
    # megatron-core reads it, refused with the way out where it does not (0.16.1); a checkpoint
    # with neither is refused (tests/test_megatron_lm_config.py writes the real 0.19 layout).
    import io

    import torch.distributed.checkpoint as dcp

    from megatron_zeropp.mcore.checkpoint import reads_common_state_object

    (dist_dir / "common.pt").unlink()
    with pytest.raises(StartupError, match="common.pt is missing, and .*lists no 'common_state'"):
        integrity.check_files(str(dist_dir))
    d = dist_dir.parent / "iter_0000005"
    state = {"w": torch.ones(3), "common_state/shard_0_1": io.BytesIO(b"common")}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    if reads_common_state_object():
        integrity.check_files(str(d))
    else:
        with pytest.raises(StartupError, match="written with megatron-core 0.17 or newer .* "
                                               "Load it under megatron-core 0.19"):
            integrity.check_files(str(d))


def test_the_flag_agreement_names_differing_flags_and_skips_per_node_ones():
    from megatron_zeropp.training import flag_agreement

    def rank(argv):
        return {"host": "node", "flags": flag_agreement.compared(parse_args(argv, 1))}

    same = [rank(BASE + ["--save", "/a", "--data-cache-path", "/c0"]),
            rank(BASE + ["--save", "/b", "--data-cache-path", "/c1"])]  # per node: may differ
    flag_agreement.check(same)
    other = rank(_set(BASE, "--lr", "2e-3") + ["--override-opt_param-scheduler"])
    assert flag_agreement.differences(same + [other]) == [
        "--lr (ranks [0, 1] (node): 0.001; rank 2 (node): 0.002)",
        "--override-opt_param-scheduler (ranks [0, 1] (node): False; rank 2 (node): True)"]
    with pytest.raises(StartupError, match="the ranks were started with different flags: --lr"):
        flag_agreement.check(same + [other])


def _fake_input(tmp_path, iteration=3):
    """A directory that names a checkpoint without holding one: anything that tried to load it
    would fail on its files, so an error about the output proves the output came first."""
    root = tmp_path / "input"
    (root / f"iter_{iteration:07d}").mkdir(parents=True, exist_ok=True)
    (root / checks._LATEST).write_text(str(iteration))
    return str(root)


@pytest.mark.parametrize("layout", ["distributed", "non-distributed"])
def test_the_converter_checks_its_output_before_loading(tmp_path, layout):
    from megatron_zeropp.training import convert

    def run(output):
        if layout == "distributed":
            convert.convert(_fake_input(tmp_path), output, "torch_dist")
        else:
            convert.to_non_distributed(_fake_input(tmp_path), output)

    taken = tmp_path / "taken"
    (taken / "iter_0000003").mkdir(parents=True)
    with pytest.raises(StartupError) as e:
        run(str(taken))
    # it used to load the whole checkpoint, then suggest --overwrite-checkpoints, a flag the
    # converter does not have
    assert str(e.value) == (f"--output {taken} already holds iteration 3 "
                            f"({taken / 'iter_0000003'}): convert into another directory, or "
                            f"remove that one first")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StartupError, match=f"^--output {tmp_path / 'file'} exists and is not a "
                                           f"directory$"):
        run(str(tmp_path / "file"))
    later = tmp_path / "later"
    later.mkdir()
    (later / checks._LATEST).write_text("5")
    with pytest.raises(StartupError, match="names iteration 5, after 3"):
        run(str(later))


def test_sigint_is_a_stop_of_one_line_like_sigterm():
    # torchrun passes Ctrl-C's SIGINT on to its ranks: it used to print a KeyboardInterrupt
    # traceback and "[rank 0] FAILED in ...", exit 1
    script = ("import sys, time\nfrom megatron_zeropp.training.launch import run_guarded\n"
              "def wait():\n    print('ready', flush=True)\n    time.sleep(300)\n"
              "run_guarded(wait)\n")
    # (a shell without job control starts background jobs with SIGINT ignored, and Python then
    # leaves it ignored: the child gets the default disposition back, as a terminal's job has)
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert job.stdout.readline() == "ready\n"
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 130  # 128 + SIGINT, as a shell reports Ctrl-C
    assert err == "[rank 0] stopped by SIGINT\n"


def test_a_save_that_runs_out_of_space_says_so(tmp_path):
    # A full disk surfaced as torch's "[enforce fail at inline_container.cc:672] . unexpected
    # pos 128 vs 0"; a file size limit (ulimit -f) fails the same way and is cheaper to set up
    script = ("import resource, sys, torch\n"
              "from megatron_zeropp.checkpointing import checks\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
              "with checks.writing(sys.argv[1], 4):\n"
              "    torch.save(torch.zeros(100000), sys.argv[1] + '/rank.pt')\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: saving iteration 4 into {tmp_path} failed with ")
    assert " MiB free of " in last and "a file size limit (ulimit -f) of 0.1 MiB: " in last, last


def test_a_vocabulary_padded_for_another_tp_names_the_flag_that_loads_it(tmp_path):
    # resuming a TP 1 checkpoint at TP 2 (torch_dist reshards) failed naming the rows only
    it = tmp_path / "iter_0000004"
    it.mkdir()
    saved = {"padded vocabulary size": 128, "--tensor-model-parallel-size": 1, "--num-layers": 2}
    checks.write_model_config(str(it), saved)
    at_tp2 = {**saved, "padded vocabulary size": 256, "--tensor-model-parallel-size": 2}
    with pytest.raises(StartupError) as e:
        checks.check_model_config(str(tmp_path), 4, at_tp2, layout_free=True)
    assert str(e.value) == (
        f"checkpoint {it} holds another model: padded vocabulary size checkpoint 128 vs this "
        f"run 256 (the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x "
        f"TP, and this run's TP is 2, the checkpoint's 1: pass --padded-vocab-size 128 to load "
        f"it)")
    with pytest.raises(StartupError) as e:  # the same TP: other rows are another vocabulary
        checks.check_model_config(str(tmp_path), 4, {**saved, "padded vocabulary size": 256},
                                  layout_free=True)
    assert "--padded-vocab-size" not in str(e.value)
