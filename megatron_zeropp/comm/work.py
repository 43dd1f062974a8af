"""Async handles and the per-process FIFO communication thread.

A protocol call is a Python function that issues one or more blocking collectives and some local
math (quantize, dequantize, sum). ``async_op=True`` runs that function on a single background
thread per process and returns a :class:`CommHandle`; ``async_op=False`` runs it in the caller's
thread (or, when async work is still queued, queues it behind that work and waits).

Ordering rule
-------------
Collectives must be issued in the same order on every rank of a group. Every call made through
this module, sync or async, is executed in *program order* on each rank: one FIFO thread, and a
sync call waits for the queued async calls to run first. So the caller must respect one rule:

    While a call from this module is pending (async handle not yet waited on), do not issue any
    other collective on the same process groups by other means (raw ``torch.distributed`` calls,
    other threads), because it could overtake or be overtaken by the queued one on some ranks.

Collectives on *other* groups may be issued freely. ``wait()`` every handle before reading the
output or modifying the input (the thread reads the input when the call runs, not when it is
queued).

On CUDA the queued call runs on the caller's current device and stream at the time of the call,
so it is ordered after the kernels that produced its input (even on a side stream). The CI tests
run on gloo/CPU; the CUDA path was checked by hand on one H200 (NCCL with one rank, gloo with two
ranks on CUDA tensors), not on several GPUs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from typing import Callable, Optional

import torch


class CommHandle:
    """Handle of an async protocol call, shaped like ``torch.distributed.Work``."""

    def __init__(self, future: concurrent.futures.Future, name: str):
        self._future = future
        self.name = name

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the call finished (output written); re-raise its exception if any."""
        self._future.result(timeout=timeout)
        return True

    def is_completed(self) -> bool:
        """Whether the call finished (successfully or not); the output is valid only if it did
        without error, which :meth:`wait` tells."""
        return self._future.done()

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"CommHandle({self.name}, {state})"


class _CommThread:
    """One worker thread; ``pending`` counts calls queued or running on it."""

    def __init__(self):
        self.pid = os.getpid()
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zeropp-comm"
        )
        self.lock = threading.Lock()
        self.pending = 0

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        with self.lock:
            self.pending += 1
        fut = self.executor.submit(fn)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut) -> None:
        with self.lock:
            self.pending -= 1

    def busy(self) -> bool:
        with self.lock:
            return self.pending > 0


_THREAD: Optional[_CommThread] = None
_THREAD_LOCK = threading.Lock()


def _comm_thread() -> _CommThread:
    global _THREAD
    with _THREAD_LOCK:
        # A forked child inherits the object but not the thread: start a fresh one.
        if _THREAD is None or _THREAD.pid != os.getpid():
            _THREAD = _CommThread()
        return _THREAD


def _queued_busy() -> bool:
    t = _THREAD
    return t is not None and t.pid == os.getpid() and t.busy()


def _device_context(device: Optional[torch.device]):
    """Context reproducing the caller's CUDA device and stream in the comm thread."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext
    stream = torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def ctx():
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    return ctx


def run_protocol(
    fn: Callable[[], None],
    async_op: bool,
    name: str,
    device: Optional[torch.device] = None,
) -> Optional[CommHandle]:
    """Run a validated protocol body now (sync) or on the FIFO comm thread (async).

    ``fn`` must be fully validated already: it is the part that issues collectives. Returns
    ``None`` when sync, a :class:`CommHandle` when async.
    """
    dev_ctx = _device_context(device)

    def body():
        # Grad mode is thread-local and on by default in a new thread; collectives never need it.
        with torch.no_grad(), dev_ctx():
            fn()

    if async_op:
        return CommHandle(_comm_thread().submit(body), name)
    if _queued_busy():
        # Keep program order: this call must not overtake async calls queued before it.
        _comm_thread().submit(body).result()
    else:
        body()
    return None
