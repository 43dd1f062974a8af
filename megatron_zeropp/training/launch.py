"""pretrain_gpt.py's entry: launch environment, and what a failing rank prints before it exits.

A rank that raises prints its traceback and then one line naming the rank and the collective (or
the line of ours) where it failed, and leaves with exit code 1 at once: ``os._exit``, because a
normal interpreter exit joins the communication thread, which may itself be blocked in a
collective that a dead or frozen peer will never join. torchrun then stops the other ranks.
Before ``os._exit`` every process the rank started is stopped and the process group destroyed
(for a bounded time); a run that completes destroys its process group before the interpreter's
teardown (:mod:`.shutdown`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable, List, Optional

from megatron_zeropp.errors import NonFiniteError, StartupError

from . import parent_watch, shutdown

RANK0_GRACE_S = 30.0
"""How long the other ranks of a node wait for its first rank to report an error all ranks
found."""
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_defaults(environ=os.environ) -> bool:
    """Make a plain ``python pretrain_gpt.py`` a one-rank job; returns True when it did.

    With none of torchrun's variables set, sets them for rank 0 of 1 on a free local port. With
    some set and others missing, raises ``ValueError`` naming them (a half-configured launch is
    more likely a broken launcher than a one-rank job).
    """
    present = [v for v in _TORCHRUN_VARS if v in environ]
    if not present:
        environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        return True
    missing = [v for v in _TORCHRUN_VARS if v not in environ]
    if missing:
        raise ValueError(f"launch environment has {', '.join(present)} but not "
                         f"{', '.join(missing)}: launch with torchrun (or set none of them for "
                         f"a one-rank job)")
    return False


def failure_site(tb) -> str:
    """Where an exception came from: the torch.distributed call, else our innermost line."""
    frames = traceback.extract_tb(tb)
    raw = [f for f, _ in traceback.walk_tb(tb)]
    for i, frame in enumerate(frames):
        if frame.filename.endswith(_C10D_FILE):
            caller = next((f for f in reversed(frames[:i]) if f.filename.startswith(_PROJECT)),
                          None)
            where = "" if caller is None else f" called from {_short(caller)}"
            return f"torch.distributed.{frame.name}{_group_ranks(raw[i])}{where}"
    ours = [f for f in frames if f.filename.startswith(_PROJECT)]
    return _short(ours[-1] if ours else frames[-1]) if frames else "unknown"


def _group_ranks(frame) -> str:
    group = frame.f_locals.get("group")
    try:
        import torch.distributed as dist

        return f" on ranks {dist.get_process_group_ranks(group or dist.group.WORLD)}"
    except Exception:  # noqa: BLE001 -- a best-effort detail of an error report
        return ""


def _short(frame) -> str:
    path = os.path.relpath(frame.filename, os.path.dirname(_PROJECT))
    return f"{path}:{frame.lineno} ({frame.name}: {frame.line})"


def failure_line(rank: str, exc: BaseException) -> str:
    """The one line a failing rank prints last."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = f"[rank {rank}] FAILED in {failure_site(exc.__traceback__)}: " \
           f"{type(exc).__name__}: {text}"
    if "timed out" in text.lower() or "timeout" in text.lower():
        line += (" -- a collective timed out: a peer rank is frozen, dead or far behind "
                 "(limit: --distributed-timeout-minutes)")
    return line


def run_guarded(fn: Callable[[], object], prog: str = "pretrain_gpt.py") -> None:
    """Run ``fn``; on an exception print it with :func:`failure_line` and exit 1 immediately.

    A :class:`StartupError` is bad input, not a crash: one line from the first rank of each node
    (``prog: error:``; each node's torchrun has its own log), exit code 2; a
    :class:`NonFiniteError` (same on every rank) is one line the same way, exit code 1. Every
    exit, failed or not, goes through :mod:`.shutdown`; a rank whose torchrun agent dies ends
    within seconds (:mod:`.parent_watch`).
    """
    shutdown.install_termination_handler()
    parent_watch.watch_agent()
    try:
        fn()
    except (shutdown.Terminated, KeyboardInterrupt) as exc:
        # An operator's or a launcher's stop, not a failure: one line, no traceback. (torchrun
        # passes the signal it got on to its ranks: Ctrl-C reaches them as SIGINT.)
        shutdown.begin_exit()
        signum = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
        why = f": {parent_watch.describe()}" if parent_watch.stopped_by_agent_death() \
            else f" by {signum.name}"
        print(f"[rank {os.environ.get('RANK', '0')}] stopped{why}", file=sys.stderr, flush=True)
        shutdown.failed_exit(128 + signum)
    except SystemExit:
        # argparse's exit (before any group) or an explicit one: the usual exit, tidied first
        shutdown.stop_writer_processes()
        shutdown.destroy_process_group(shutdown.FAILED_TEARDOWN_S)
        raise
    except (StartupError, NonFiniteError) as exc:
        if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
            shutdown.begin_exit()
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        else:
            # The launcher stops every rank of its node when the first one exits; let the
            # node's first rank, which reached the same error, print it first (the launcher's
            # SIGTERM ends this wait).
            try:
                time.sleep(RANK0_GRACE_S)
            except (shutdown.Terminated, KeyboardInterrupt):
                pass
        sys.stdout.flush()
        shutdown.failed_exit(2 if isinstance(exc, StartupError) else 1)
    except BaseException as exc:  # noqa: BLE001 -- every failure must end the process
        shutdown.begin_exit()
        rank = os.environ.get("RANK", "0")
        traceback.print_exc()
        print(failure_line(rank, exc), file=sys.stderr, flush=True)
        sys.stdout.flush()
        shutdown.failed_exit(1)
    sys.stdout.flush()
    shutdown.clean_exit()


def main(argv: Optional[List[str]] = None) -> None:
    """pretrain_gpt.py's ``__main__``: one-rank defaults, pretraining, a clean failure."""
    from .fallbacks import silence_fallback_warnings

    silence_fallback_warnings()
    try:
        single_process_defaults()
    except ValueError as exc:
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    from .loop import pretrain

    run_guarded(lambda: pretrain(argv))
    sys.stdout.flush()
