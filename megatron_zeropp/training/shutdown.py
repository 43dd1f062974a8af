"""Every way a rank ends: nothing it started outlives it, and the process group goes down in order.

* megatron-core's checkpoint writer keeps its results queue in a multiprocessing *manager*, a
  spawned server process (plus multiprocessing's resource tracker) that inherits the job's
  stdout/stderr. A rank that ends with ``os._exit`` (as a failing rank must, see launch.py) skips
  the manager's shutdown, so both were re-parented to PID 1 and kept ``torchrun ... | tee log``
  from ever returning. Our saves are synchronous, so :mod:`megatron_zeropp.checkpointing.dist`
  gives megatron-core an in-process queue instead and no such process is started; what is shut
  down here covers the case where one exists anyway (another caller of megatron-core's writer).
* A complete run that left ``torch.distributed`` to the interpreter's teardown sometimes ended
  with SIGABRT ("terminate called without an active exception", a C++ thread destroyed while
  joinable): :func:`clean_exit` destroys the process group first.
* Python runs a signal handler only when the main thread returns to the interpreter. A rank
  blocked in C (a gloo rendezvous or collective waiting for a peer that died before it could
  take the signal itself) sat out torchrun's SIGTERM until its SIGKILL 30 s later, still holding
  the --save lock. The C-level handler writes each signal's number to a wakeup fd at once, so a
  thread watching it ends such a rank :data:`STUCK_GRACE_S` after the signal.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading

FAILED_TEARDOWN_S = 5.0
"""How long a failing rank waits for the process group to be destroyed before it exits anyway:
a peer may be frozen inside a collective that the destruction would wait for."""


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stopping the job after another rank failed, an operator's
    ``kill``, a scheduler): the rank ends through :func:`failed_exit` instead of dying on the
    spot with its --save lock held. A BaseException, like KeyboardInterrupt: no ``except
    Exception`` of the training code swallows it."""


STUCK_GRACE_S = 5.0
"""How long after a SIGTERM or SIGINT the main thread may take to return to Python and begin its
exit before the signal watcher ends the rank itself (torchrun's SIGKILL comes 30 s after its
SIGTERM)."""

_exiting = threading.Event()
"""Set once the rank has begun to end (:func:`begin_exit`)."""
_wakeup = None


def _terminate(signum, frame) -> None:
    if not _exiting.is_set():  # already on the way out: let that finish
        raise Terminated(signal.Signals(signum).name)


def install_termination_handler() -> None:
    """SIGTERM raises :class:`Terminated` in the main thread (the launcher's ranks). Python runs
    it between bytecodes: a rank blocked in a collective takes it when the collective returns
    or fails (a dead peer's closed connection fails it at once); one that stays blocked is
    ended by the signal watcher (module docstring). --exit-signal-handler replaces the handler
    while training (run_control.SignalExit), and the watcher then leaves SIGTERM to the loop.
    Call from the main thread."""
    signal.signal(signal.SIGTERM, _terminate)
    global _wakeup
    if _wakeup is not None:
        return
    _wakeup = socket.socketpair()  # (reader, writer), open for the life of the process
    _wakeup[1].setblocking(False)
    signal.set_wakeup_fd(_wakeup[1].fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watch_signals, args=(_wakeup[0],), daemon=True,
                     name="zeropp-signal-watch").start()


def _ours(signum: int) -> bool:
    """Whether ``signum`` still ends the rank through this module (not SignalExit's record)."""
    handler = signal.getsignal(signum)
    return handler is _terminate or (signum == signal.SIGINT
                                     and handler is signal.default_int_handler)


def _watch_signals(reader) -> None:
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        stops = [n for n in data if n in (signal.SIGTERM, signal.SIGINT) and _ours(n)]
        if not stops:
            continue
        if _exiting.wait(STUCK_GRACE_S) or not _ours(stops[0]):
            continue  # the main thread took it (or --exit-signal-handler now owns SIGTERM)
        begin_exit()
        name = signal.Signals(stops[0]).name
        print(f"[rank {os.environ.get('RANK', '0')}] stopped by {name}: the main thread did not "
              f"return to Python within {STUCK_GRACE_S:.0f} s of it (blocked in a collective or "
              f"another C call): ending the rank from its signal watcher", file=sys.stderr,
              flush=True)
        release_save_locks()
        os._exit(128 + stops[0])


def begin_exit() -> None:
    """From here on a SIGTERM no longer interrupts: the rank is already ending."""
    _exiting.set()


def stop_writer_processes() -> None:
    """Shut down megatron-core's writer manager (if one was started) and end every child process
    of this one (forked checkpoint writers of a save cut short)."""
    from megatron_zeropp.mcore.checkpoint import stop_write_results_manager

    stop_write_results_manager()
    for child in multiprocessing.active_children():
        child.terminate()
    for child in multiprocessing.active_children():
        child.join(timeout=FAILED_TEARDOWN_S)
        if child.is_alive():
            child.kill()


def destroy_process_group(wait_s: float = None) -> None:
    """Destroy the default process group if one exists; with ``wait_s``, give up after that many
    seconds (on a failing rank, whose peers may never answer)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if wait_s is None:
        dist.destroy_process_group()
        return
    worker = threading.Thread(target=_quietly_destroy, daemon=True)
    worker.start()
    worker.join(wait_s)


def _quietly_destroy() -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- the rank is failing already; its error was printed
        pass


def release_save_locks() -> None:
    """Give back every --save lock this process holds (never raises)."""
    try:
        from megatron_zeropp.checkpointing import save_lock

        save_lock.release_all()
    except Exception:  # noqa: BLE001 -- an unreleased lock expires by itself (its lease)
        pass


def failed_exit(code: int) -> None:
    """End a failing rank now: give back --save's lock, stop the writer processes, try to
    destroy the process group for a bounded time, then ``os._exit(code)`` (no interpreter
    teardown, which would join threads blocked in collectives)."""
    begin_exit()
    try:
        release_save_locks()
        stop_writer_processes()
        destroy_process_group(FAILED_TEARDOWN_S)
    finally:
        os._exit(code)


def clean_exit() -> None:
    """After a run that completed: the writer processes, then the process group, in that order
    (the interpreter's own teardown then has no thread of torch.distributed left to destroy)."""
    release_save_locks()
    stop_writer_processes()
    destroy_process_group()
