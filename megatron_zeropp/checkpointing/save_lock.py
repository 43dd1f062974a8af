"""A ``--save`` directory is written by one job at a time: a lease file, ``SAVE/.save_lock``.

Two jobs saving into one directory (a Slurm requeue while the old allocation is still tearing
down; a copy-pasted job script) deleted each other's ``iter_XXXXXXX.tmp`` and one of them
*exited 0* after publishing a checkpoint whose ``common.pt`` was the other job's. Now rank 0
takes the lock at start (before the first collective; the verdict reaches every rank through the
start-up agreement) and checks that it still holds it before each save and each commit.

* The lock names its holder (host, pid, Slurm / torchrun job id, start time) for the message.
* It is a lease: the holder refreshes the file's mtime every ``LEASE_S / 4`` seconds from a
  daemon thread. A holder that died stops refreshing; its lock is taken over once it is older
  than :data:`LEASE_S`, or at once when it names a process of this host that no longer exists.
* ``--break-save-lock`` takes it over regardless (the other job is known to be gone).
* Taking a stale lock over renames it away only if it is still the one judged stale, then
  creates the new one with ``O_EXCL``: of two jobs racing for it, one wins.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Dict, Optional

from megatron_zeropp.errors import StartupError

LOCK = ".save_lock"
LEASE_S = 120.0
"""How long a lock whose holder stopped refreshing it keeps other jobs out."""

_held: Dict[str, dict] = {}  # abspath(root) -> {"token", "stop": Event}


def _path(root: str) -> str:
    return os.path.join(root, LOCK)


def _read(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # being written, or garbage: judged by its age alone


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _age(path: str) -> float:
    return time.time() - os.path.getmtime(path)


def _stale(path: str, info: Optional[dict]) -> Optional[str]:
    """Why the lock at ``path`` no longer keeps anyone out, or None while its holder lives."""
    age = _age(path)
    if age > LEASE_S:
        return f"not refreshed for {age:.0f} s"
    if info and info.get("host") == socket.gethostname() and not _pid_alive(int(info["pid"])):
        return f"its process {info['pid']} on this host is gone"
    return None


def _holder(info: Optional[dict]) -> str:
    if not info:
        return "an unknown job (unreadable lock file)"
    job = f", job {info['job']}" if info.get("job") else ""
    return f"host {info.get('host')} pid {info.get('pid')}{job}, started {info.get('started')}"


def acquire(root: str, take_over: bool = False) -> None:
    """Take ``root``'s lock for this process (rank 0, at start); raise StartupError naming the
    holder when another live job has it."""
    os.makedirs(root, exist_ok=True)
    path = _path(root)
    token = uuid.uuid4().hex
    info = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            other = _read(path)
            if other is not None and other.get("token") == _held.get(_key(root), {}).get(
                    "token"):
                return  # this process holds it already (pretrain called again)
            try:
                reason = "--break-save-lock" if take_over else _stale(path, other)
            except FileNotFoundError:
                continue  # released meanwhile
            if reason is None:
                raise StartupError(
                    f"--save {root} is in use by another job: {_holder(other)} (lock {path}, "
                    f"refreshed {_age(path):.0f} s ago; a job that died stops refreshing it "
                    f"and it expires {LEASE_S:.0f} s after). Wait for that job, save "
                    f"elsewhere, or pass --break-save-lock if it is gone") from None
            _take_away(path, other, token)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        stop = threading.Event()
        _held[_key(root)] = {"token": token, "stop": stop}
        threading.Thread(target=_refresh, args=(path, token, stop), daemon=True,
                         name="zeropp-save-lock").start()
        return
    raise StartupError(f"--save {root}: could not take its lock {path}: other jobs keep "
                       f"taking it at the same moment")


def _key(root: str) -> str:
    return os.path.abspath(root)


def _take_away(path: str, judged: Optional[dict], token: str) -> None:
    # Rename, not remove, and only the lock that was judged stale (a racing job may have
    # replaced it meanwhile); whatever was renamed is then deleted.
    current = _read(path)
    if (current or {}).get("token") != (judged or {}).get("token"):
        return
    aside = f"{path}.stale.{token}"
    try:
        os.rename(path, aside)
        os.remove(aside)
    except FileNotFoundError:
        pass


def _refresh(path: str, token: str, stop: threading.Event) -> None:
    while not stop.wait(LEASE_S / 4):
        if (_read(path) or {}).get("token") != token:
            return  # taken over: check_held reports it at the next save
        try:
            os.utime(path)
        except OSError:
            return


def check_held(root: str) -> None:
    """Before writing into ``root`` (rank 0): raise RuntimeError when another job holds its lock
    (or took over this process's)."""
    path = _path(root)
    mine = _held.get(_key(root))
    info = _read(path) if os.path.exists(path) else None
    if mine is not None:
        if (info or {}).get("token") != mine["token"]:
            raise RuntimeError(f"this job's lock on --save {root} was taken over by "
                               f"{_holder(info)}: another job is writing into it")
        return
    if info is not None and os.path.exists(path) and _stale(path, info) is None:
        raise RuntimeError(f"--save {root} is in use by another job: {_holder(info)} "
                           f"(lock {path})")


def seen(root: str):
    """``(token, description)`` of the lock in ``root`` as this rank sees it: every rank of a job
    must see rank 0's (one shared --save directory)."""
    path = _path(root)
    info = _read(path) if os.path.exists(path) else None
    if info is None:
        return None, f"no lock in --save {root} (not the directory rank 0 writes)"
    return info.get("token"), f"the lock of {_holder(info)} in --save {root}"


def release(root: str) -> None:
    """Give ``root``'s lock back if this process holds it."""
    mine = _held.pop(_key(root), None)
    if mine is None:
        return
    mine["stop"].set()
    path = _path(root)
    if (_read(path) or {}).get("token") == mine["token"]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def release_all() -> None:
    """Every lock this process holds (the launcher's exit paths)."""
    for key in list(_held):
        release(key)
