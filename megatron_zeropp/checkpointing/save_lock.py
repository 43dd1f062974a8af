"""A ``--save`` directory is written by one job at a time: a lease file, ``SAVE/.save_lock``.

Two jobs saving into one directory (a Slurm requeue while the old allocation is still tearing
down; a copy-pasted job script) deleted each other's ``iter_XXXXXXX.tmp`` and one of them
*exited 0* after publishing a checkpoint whose ``common.pt`` was the other job's. Now rank 0
takes the lock at start (before the first collective; the verdict reaches every rank through the
start-up agreement) and checks that it still holds it before each save and each commit.

* The lock names its holder (host, pid and that process's start time, Slurm / torchrun job id,
  start time) for the messages, and a random token that only the holder writes.
* It is a lease: the holder rewrites it every :data:`REFRESH_S` from a daemon thread, counting
  its refreshes in the file. A holder that died stops. Its lock is taken over at once when it
  names a process of this host that no longer runs (or whose pid another process reuses), else
  once it is judged expired (below). Each takeover logs one line naming the old holder.
* Expiry does not trust any clock but this host's monotonic one: a lock whose file time is
  within :data:`LEASE_S` of this host's clock is live (a clock behind the file's can only keep a
  dead holder's lock for longer, by the skew; the message shows the age it computed). One that
  looks older, or newer than this host's clock allows, is watched for :data:`CONFIRM_S`: if the
  holder's refresh counter moves, it is live and the clocks disagree (said so in the refusal);
  if it does not, it is taken over. So clock skew between hosts, or between a host and the file
  server, never takes a live holder's lock.
* ``--break-save-lock`` takes it over regardless (the other job is known to be gone).
* Taking a lock over renames it away only if it is still the one judged stale, then creates the
  new one with ``O_EXCL``: of two jobs racing for it, one wins.
* A lock file deleted while the run holds it (a cleanup script, an operator) is not a takeover:
  the holder re-creates it with ``O_EXCL`` and goes on, logging one line. One that cannot be
  parsed (not something a live job leaves: the holder writes the whole file in one write) is
  replaced the same way. Only a file holding another job's token proves a takeover.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Dict, Optional, Tuple

from megatron_zeropp.errors import StartupError

LOCK = ".save_lock"
LEASE_S = 120.0
"""How long a lock whose holder stopped refreshing it keeps other jobs out (by this host's clock
against the file's time)."""
REFRESH_S = 10.0
"""How often the holder rewrites its lock."""
CONFIRM_S = 3 * REFRESH_S
"""How long a lock that looks expired is watched for its holder's next refresh before it is
taken over: three refreshes missed on this host's monotonic clock."""
_REREAD_S = 1.0
"""How long an unparsable lock is read again before it is judged: a live holder's rewrite is one
write, so a read torn by it parses on the next read."""
_COUNTER_DIGITS = 12  # the refresh counter is fixed-width: each rewrite has the same length

_held: Dict[str, dict] = {}  # abspath(root) -> {"token", "info", "stop": Event}
_guard = threading.Lock()  # one writer of this process's lock files at a time (main, refresher)


def _path(root: str) -> str:
    return os.path.join(root, LOCK)


def _log(message: str) -> None:
    print(f"> {message}", flush=True)  # rank 0, which holds the lock; also from the refresher


def _parse(data: bytes) -> Optional[dict]:
    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) and "token" in info else None


def _load(path: str, reread_s: float = _REREAD_S) -> Tuple[bool, Optional[dict]]:
    """``(exists, info)`` of the lock at ``path``; ``info`` is None for a file that does not parse
    (read again for up to ``reread_s`` first)."""
    deadline = time.monotonic() + reread_s
    while True:
        try:
            with open(path, "rb") as f:
                info = _parse(f.read())
        except FileNotFoundError:
            return False, None
        if info is not None or time.monotonic() >= deadline:
            return True, info
        time.sleep(0.05)


def _observe(path: str):
    """What changes when the holder refreshes: the file's bytes and time (None when gone)."""
    try:
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_mtime_ns
    except FileNotFoundError:
        return None


def _process_started(pid: int) -> Optional[float]:
    """Start time of process ``pid`` of this host, None when there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return float("nan")  # another user's live process: alive, start unknown


def _age(path: str) -> float:
    return time.time() - os.path.getmtime(path)


def _local_verdict(info: dict) -> Optional[str]:
    """For a lock of this host: why its holder is gone, or None while it runs."""
    try:
        pid = int(info["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    started = _process_started(pid)
    if started is None:
        return f"its process {pid} on this host is gone"
    recorded = info.get("pid_started")
    if isinstance(recorded, (int, float)) and started == started and abs(started - recorded) > 1:
        return (f"pid {pid} on this host is now another process (started "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(started))})")
    return None


def _judge(path: str, info: Optional[dict]) -> Tuple[Optional[str], str]:
    """``(why the lock no longer keeps anyone out, or None while its holder lives; what was
    seen, for the refusal)``."""
    if info is None:
        return ("its lock file does not parse (a live holder writes it whole every "
                f"{REFRESH_S:.0f} s)"), ""
    if info.get("host") == socket.gethostname():
        verdict = _local_verdict(info)
        if verdict is not None:
            return verdict, ""
    age = _age(path)
    if -REFRESH_S <= age <= LEASE_S:
        return None, f"refreshed {max(age, 0):.0f} s ago"
    # Expired by this host's clock, or stamped in its future: only the holder's own refreshes,
    # timed on this host's monotonic clock, decide.
    before = _observe(path)
    deadline = time.monotonic() + CONFIRM_S
    while time.monotonic() < deadline:
        time.sleep(min(0.5, CONFIRM_S / 10))
        now = _observe(path)
        if now is None:
            raise FileNotFoundError(path)  # released meanwhile: acquire tries again
        if now != before:
            return None, (f"its file time is {age:.0f} s from this host's clock, yet its holder "
                          f"refreshed it meanwhile: the clocks of this host and of the holder "
                          f"or the file server disagree, or its refreshes were late")
    return (f"not refreshed for {CONFIRM_S:.0f} s of watching (its file time is {age:.0f} s "
            f"from this host's clock)"), ""


def _holder(info: Optional[dict]) -> str:
    if not info:
        return "an unknown job (unparsable lock file)"
    job = f", job {info['job']}" if info.get("job") else ""
    return f"host {info.get('host')} pid {info.get('pid')}{job}, started {info.get('started')}"


def _encode(info: dict) -> bytes:
    return json.dumps(info).encode("utf-8")


def _create(path: str, info: dict) -> bool:
    """Create the lock with ``O_EXCL`` holding ``info``, in one write; False when one exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, _encode(info))
    finally:
        os.close(fd)
    return True


def acquire(root: str, take_over: bool = False) -> None:
    """Take ``root``'s lock for this process (rank 0, at start); raise StartupError naming the
    holder when another live job has it."""
    os.makedirs(root, exist_ok=True)
    path = _path(root)
    token = uuid.uuid4().hex
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "pid_started": _process_started(os.getpid()), "token": token,
            "job": os.environ.get("SLURM_JOB_ID") or _torchrun_job(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "refreshes": "0" * _COUNTER_DIGITS}
    taken = None  # (old holder, why): logged once this job's lock is in place
    for _ in range(3):
        if _create(path, info):
            stop = threading.Event()
            _held[_key(root)] = {"token": token, "info": info, "stop": stop}
            threading.Thread(target=_refresh, args=(root, stop), daemon=True,
                             name="zeropp-save-lock").start()
            if taken is not None:
                _log(f"--save {root}: took over the lock of {_holder(taken[0])}: {taken[1]}")
            return
        exists, other = _load(path)
        if not exists:
            continue  # released meanwhile
        if other is not None and other.get("token") == _held.get(_key(root), {}).get("token"):
            return  # this process holds it already (pretrain called again)
        try:
            reason, seen = ("--break-save-lock", "") if take_over else _judge(path, other)
        except FileNotFoundError:
            continue  # released meanwhile
        if reason is None:
            raise StartupError(
                f"--save {root} is in use by another job: {_holder(other)} (lock {path}, "
                f"{seen}; a job that died stops refreshing it and it expires {LEASE_S:.0f} s "
                f"after). Wait for that job, save elsewhere, or pass --break-save-lock if it "
                f"is gone") from None
        if _take_away(path, other, token):
            taken = (other, reason)
    raise StartupError(f"--save {root}: could not take its lock {path}: other jobs keep "
                       f"taking it at the same moment")


def _torchrun_job() -> Optional[str]:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id == "none" else run_id  # torchrun's default without --rdzv-id


def _key(root: str) -> str:
    return os.path.abspath(root)


def _take_away(path: str, judged: Optional[dict], token: str) -> bool:
    # Rename, not remove, and only the lock that was judged stale (a racing job may have
    # replaced it meanwhile); whatever was renamed is then deleted.
    _, current = _load(path, reread_s=0)
    if (current or {}).get("token") != (judged or {}).get("token"):
        return False
    aside = f"{path}.stale.{token}"
    try:
        os.rename(path, aside)
        os.remove(aside)
    except FileNotFoundError:
        return False
    return True


def _mine(root: str) -> Optional[dict]:
    return _held.get(_key(root))


def _restore(root: str, mine: dict, why: str) -> None:
    """Put this job's lock back (``why`` it was not there), exclusively: a job that created one
    meanwhile keeps it, and the next check reports the takeover."""
    if _create(_path(root), mine["info"]):
        _log(f"--save {root}: its lock {_path(root)} {why}; re-created it (this job, host "
             f"{mine['info']['host']} pid {mine['info']['pid']}, still holds --save)")


def _ensure_mine(root: str) -> Optional[dict]:
    """Rank 0's lock in ``root`` as it should be: a deleted or unparsable file is put back
    (logged); returns the info of another job holding it, else None."""
    mine = _mine(root)
    path = _path(root)
    exists, info = _load(path)
    if not exists:
        if not os.path.isdir(root):
            raise RuntimeError(f"--save {root} is gone (deleted during the run)")
        _restore(root, mine, "was deleted")
        exists, info = _load(path)
    elif info is None:
        aside = f"{path}.unparsable.{mine['token']}"
        try:
            os.rename(path, aside)
            os.remove(aside)
        except FileNotFoundError:
            pass
        _restore(root, mine, "no longer parsed")
        exists, info = _load(path)
    if info is not None and info.get("token") != mine["token"]:
        return info
    return None


def _refresh(root: str, stop: threading.Event) -> None:
    path = _path(root)
    while not stop.wait(REFRESH_S):
        mine = _mine(root)
        if mine is None or mine["stop"] is not stop:
            return
        try:
            with _guard:
                if stop.is_set():
                    return  # released meanwhile
                if _ensure_mine(root) is not None:
                    return  # taken over: check_held reports it at the next save
                _rewrite(path, mine["info"])
        except (OSError, RuntimeError):
            continue  # check_held, at the next save, says what is wrong


def _rewrite(path: str, info: dict) -> None:
    count = int(info["refreshes"]) + 1
    info["refreshes"] = str(count % 10 ** _COUNTER_DIGITS).zfill(_COUNTER_DIGITS)
    fd = os.open(path, os.O_WRONLY)
    try:
        # The same length each time, in place, in one write: a reader sees the old bytes or the
        # new (or, torn, reads again), and a job that renamed this file away to take over has a
        # new one, which this write never reaches.
        os.pwrite(fd, _encode(info), 0)
    finally:
        os.close(fd)


def check_held(root: str) -> None:
    """Before writing into ``root`` (rank 0): raise RuntimeError when another job holds its lock
    (or took over this process's); a deleted lock is re-created."""
    path = _path(root)
    if _mine(root) is not None:
        with _guard:
            other = _ensure_mine(root)
        if other is not None:
            raise RuntimeError(f"this job's lock on --save {root} was taken over by "
                               f"{_holder(other)}: another job is writing into it")
        return
    exists, info = _load(path)
    if exists and info is not None and _judge_quick(path, info) is None:
        raise RuntimeError(f"--save {root} is in use by another job: {_holder(info)} "
                           f"(lock {path})")


def _judge_quick(path: str, info: dict) -> Optional[str]:
    """:func:`_judge` without the watch (a save of a job that took no lock: tests, tools)."""
    if info.get("host") == socket.gethostname() and _local_verdict(info) is not None:
        return "gone"
    return None if _age(path) <= LEASE_S else "expired"


def seen(root: str):
    """``(token, description)`` of the lock in ``root`` as this rank sees it: every rank of a job
    must see rank 0's (one shared --save directory)."""
    path = _path(root)
    exists, info = _load(path)
    if info is None:
        what = "an unparsable lock" if exists else "no lock"
        return None, f"{what} in --save {root} (not the directory rank 0 writes)"
    return info.get("token"), f"the lock of {_holder(info)} in --save {root}"


def release(root: str) -> None:
    """Give ``root``'s lock back if this process holds it."""
    mine = _held.pop(_key(root), None)
    if mine is None:
        return
    mine["stop"].set()
    path = _path(root)
    # After a refresh in flight; bounded, as a rank ending on its own may call this while its
    # main thread is stuck inside a check
    guarded = _guard.acquire(timeout=2 * _REREAD_S)
    try:
        _, info = _load(path, reread_s=0)
        if (info or {}).get("token") == mine["token"]:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    finally:
        if guarded:
            _guard.release()


def release_all() -> None:
    """Every lock this process holds (the launcher's exit paths)."""
    for key in list(_held):
        release(key)
