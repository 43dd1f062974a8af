"""Where protocol calls run: CUDA streams with events, or one FIFO thread on CPU.

A protocol call is a Python function ``fn`` that issues one or more collectives and some local
math (quantize, dequantize, sum) on tensors of one device. :func:`run_protocol` runs it on one of
two backends, chosen by that device; this docstring is the one place the design is described.

CUDA: streams and events, all from the calling thread
------------------------------------------------------
Every call runs *now*, on the calling (main) thread, with the current stream switched to the
call's **lane**: a dedicated stream per device for weight gathers (``"gather"``) and one for
gradient reductions (``"reduce"``). Ordering is by CUDA events in both directions:

* before ``fn`` the lane waits for the caller's current stream (the gather starts only after the
  kernels that last wrote its input, e.g. the optimizer's update of the primary shard);
* after ``fn`` an event is recorded on the lane; ``handle.wait()`` makes the caller's current
  stream wait for it (compute starts only after the gather landed). ``async_op=False`` does that
  wait at once. Neither blocks the host: NCCL collectives issued with ``async_op=False`` are
  stream-ordered, so the host never waits in the steady state.

Tensors that ``fn`` reads or writes and that the caller allocated on another stream stay alive
until the lane is done with them: the caller either holds them until after ``wait()`` (the
unit's full weights, the persistent shards) or lists them in ``keep`` so the caching allocator
does not reuse their memory before the lane's work on them finishes (``record_stream``).
Temporaries that ``fn`` allocates are allocated and freed on the lane.

CPU (gloo): one FIFO thread
---------------------------
``async_op=True`` queues ``fn`` on a single background thread per process and returns a handle;
``async_op=False`` runs it in the caller's thread (or, when async work is still queued, queues it
behind that work and waits). gloo collectives block their thread, so this is what lets CPU runs
overlap communication with compute.

Ordering rule (both backends)
-----------------------------
Collectives must be issued in the same order on every rank of a group. Every call made through
this module is issued in *program order* on each rank (CUDA: by the calling thread; CPU: one FIFO
thread, and a sync call waits for the queued calls first). While a call is pending (handle not yet
waited on), do not issue another collective on the same process groups by other means (raw
``torch.distributed`` calls, other threads): on CPU it could overtake the queued one. ``wait()``
every handle before reading the output or modifying the input.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from .common import CURRENT_CALL

LANES = ("gather", "reduce")


class CommHandle:
    """Handle of an async protocol call on CPU, shaped like ``torch.distributed.Work``."""

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


class CudaCommHandle:
    """Handle of an async protocol call on a CUDA lane: an event, never a host wait."""

    def __init__(self, event: "torch.cuda.Event", name: str):
        self.event = event
        self.name = name

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Make the caller's current stream wait for the call (no host synchronization)."""
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        """Whether the lane has finished the call (queries the event; does not block)."""
        return self.event.query()

    def __repr__(self) -> str:
        return f"CudaCommHandle({self.name})"


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


def drain() -> None:
    """Wait until every call queued on this process's CPU comm thread has run.

    A call's modelled bytes are counted when it is issued, the bytes it hands to
    ``torch.distributed`` when it runs; a per-step count taken while a prefetch queued at the end
    of the step is still waiting would put the two in different steps. CUDA calls run when
    issued: nothing to wait for there."""
    if _queued_busy() and not _on_comm_thread():
        _comm_thread().submit(lambda: None).result()  # FIFO: runs after everything queued


def _on_comm_thread() -> bool:
    t = _THREAD
    return t is not None and t.pid == os.getpid() and threading.current_thread().name.startswith(
        "zeropp-comm"
    )


_LANE_STREAMS: Dict[Tuple[int, str], "torch.cuda.Stream"] = {}


def lane_stream(device: torch.device, lane: str) -> "torch.cuda.Stream":
    """The dedicated stream of ``lane`` (``"gather"`` or ``"reduce"``) on a CUDA ``device``."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (index, lane)
    stream = _LANE_STREAMS.get(key)
    if stream is None:
        # High priority, as FSDP2 gives its all-gather streams: when a compute kernel frees SMs,
        # the lane's short kernels (quantize, NCCL, dequantize) go first, so the gather the
        # next layer waits for is not queued behind the current layer's GEMMs.
        stream = torch.cuda.Stream(device=index, priority=-1)
        _LANE_STREAMS[key] = stream
    return stream


def _run_on_lane(fn, async_op, name, device, lane, keep):
    stream = lane_stream(device, lane)
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        fn()
    for t in keep:
        t.record_stream(stream)
    done = torch.cuda.Event()
    done.record(stream)
    if not async_op:
        caller.wait_event(done)
        return None
    return CudaCommHandle(done, name)


def run_protocol(
    fn: Callable[[], None],
    async_op: bool,
    name: str,
    device: Optional[torch.device] = None,
    lane: str = "gather",
    keep: Iterable[torch.Tensor] = (),
    stats=None,
):
    """Run a validated protocol body on its device's backend (see the module docstring).

    ``fn`` must be fully validated already: it is the part that issues collectives. ``lane``
    picks the CUDA stream (``"gather"`` or ``"reduce"``); ``keep`` lists caller-owned tensors
    the body uses that the caller may free before waiting. ``stats`` (a ``CommStats``) receives
    the bytes of every tensor the body hands to ``torch.distributed``, under ``name``. Returns
    ``None`` when sync, a handle (:class:`CudaCommHandle` on CUDA, :class:`CommHandle` on CPU)
    when async.
    """
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")

    def body():
        # Grad mode is thread-local and on by default in a new thread; collectives never need it.
        token = CURRENT_CALL.set((name, stats) if stats is not None else None)
        try:
            with torch.no_grad():
                fn()
        finally:
            CURRENT_CALL.reset(token)

    if device is not None and torch.device(device).type == "cuda":
        return _run_on_lane(body, async_op, name, torch.device(device), lane, tuple(keep))

    if _on_comm_thread():
        # A protocol composed of others (e.g. reduce then accumulate) already runs on the FIFO
        # thread: its inner calls run inline, in order.
        body()
        return None
    if async_op:
        return CommHandle(_comm_thread().submit(body), name)
    if _queued_busy():
        # Keep program order: this call must not overtake async calls queued before it.
        _comm_thread().submit(body).result()
    else:
        body()
    return None
