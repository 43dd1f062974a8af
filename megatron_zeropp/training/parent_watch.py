"""A rank whose torchrun agent died stops within seconds, giving back the ``--save`` lock.

torchrun starts each rank in a session of its own, so when the agent itself is killed (``kill -9``,
the OOM killer, a node agent's crash) neither the kernel nor ``killpg`` of the agent's group
reaches the ranks: they were re-parented and kept training, saving and holding the ``--save``
lock while the scheduler saw the job gone. Here two things watch the agent, in every rank that
torchrun started (``TORCHELASTIC_RUN_ID`` set; a plain ``python pretrain_gpt.py`` started by a
shell that later exits, as under ``nohup``, keeps running):

* Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``): the kernel sends SIGTERM
  the moment the parent dies, and the rank ends through its SIGTERM path
  (:mod:`.shutdown`: the lock released, writer processes stopped, exit 143). With
  ``--exit-signal-handler`` that SIGTERM asks for a save after the current iteration first.
* A watchdog thread that compares ``os.getppid()`` with the agent's pid every
  :data:`POLL_S`: it covers systems without ``prctl``, an agent that died before the rank set
  the signal, and a rank whose main thread does not return to Python to take the signal (blocked
  in a collective with a frozen peer, or a save that runs long): :data:`GRACE_S` after it saw
  the agent gone it releases the lock itself and ends the process with ``os._exit(143)``.

Neither stops a rank whose agent lives: the kernel's signal comes when the thread that started the
rank ends, which for torchrun (it starts its ranks from its main thread) is the agent's end, and
the watchdog acts only on a changed parent pid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from typing import Optional

POLL_S = 1.0
"""How often the watchdog looks at the parent pid."""
GRACE_S = 20.0
"""How long after the agent's death the rank may still take to end by itself (a save under
--exit-signal-handler, the SIGTERM path's bounded teardown) before the watchdog ends it: a rank
outlives its agent by at most POLL_S + GRACE_S (plus the exit itself)."""
_PR_SET_PDEATHSIG = 1

_agent_pid: Optional[int] = None


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # no libc prctl: the watchdog alone


def agent_gone(wait_s: float = 0.0) -> bool:
    """True when this rank was watching its agent and the agent is no longer its parent; with
    ``wait_s``, looks again for up to that long (see :func:`stopped_by_agent_death`)."""
    if _agent_pid is None:
        return False
    deadline = time.monotonic() + wait_s
    while os.getppid() == _agent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stopped_by_agent_death() -> bool:
    """Whether the SIGTERM being handled came from the agent's death. The kernel signals when
    the parent *thread* ends: a killed agent's threads end one by one, and while some are left
    the rank is re-parented to one of them (the agent's pid) before it is to init, so this looks
    for up to a second."""
    return agent_gone(wait_s=1.0)


def describe() -> str:
    """Why the rank stops, for its last line."""
    return f"its torchrun agent (pid {_agent_pid}) died"


def watch_agent(environ=os.environ) -> bool:
    """Under torchrun, stop this rank when its agent dies (see the module docstring); returns
    whether it watches. Call once, early, in the main thread of the rank."""
    global _agent_pid
    if "TORCHELASTIC_RUN_ID" not in environ or _agent_pid is not None:
        return False
    _agent_pid = os.getppid()
    _set_parent_death_signal(signal.SIGTERM)
    threading.Thread(target=_watch, daemon=True, name="zeropp-agent-watch").start()
    return True


def _watch() -> None:
    stop = threading.Event()
    while not stop.wait(POLL_S):
        if agent_gone():
            break
    rank = os.environ.get("RANK", "?")
    # The kernel's SIGTERM may be on its way or taken already; one more is harmless (the
    # handler ignores it once the rank is exiting) and covers an agent that died before prctl.
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
    if stop.wait(GRACE_S):
        return
    print(f"[rank {rank}] stopped: {describe()}, and the rank did not end within {GRACE_S:.0f} s "
          f"of it: ending it now", file=sys.stderr, flush=True)
    from . import shutdown

    shutdown.begin_exit()
    shutdown.release_save_locks()
    os._exit(128 + signal.SIGTERM)
