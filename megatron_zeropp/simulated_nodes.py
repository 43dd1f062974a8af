"""Run a function on W gloo processes on one CPU host, simulating ``nodes x ranks_per_node``
nodes.

Tests and CPU benchmarks use this to exercise the multi-node code paths (intra- vs inter-node
groups, qgZ's two hops, hpZ's node-local gather) without real nodes: the topology is *told* the
node size, nothing is inferred from the hardware.

Workers are forked from a forkserver that has already imported torch, megatron-core and this
project's training stack, so a process costs tens of milliseconds instead of seconds. A rank
that raises makes the whole run fail with its traceback; a run that does not finish within
``timeout`` seconds (a hung collective) is killed and raises :class:`DistributedTimeout`, so CI
never hangs; before the kill each rank still running writes the Python stacks of all its
threads, which the exception carries (where a rank hung, also inside C: the dump is
faulthandler's, from a signal).

Usage::

    def work(ctx, n):                      # module-level, so it can be pickled
        t = torch.full((n,), float(ctx.rank))
        torch.distributed.all_reduce(t)
        return t

    results = run_distributed(work, nodes=2, ranks_per_node=4, args=(3,))
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from .topology import Topology, build_topology

# What every worker would otherwise import for itself: torch, megatron-core's model, optimizer,
# DDP and schedules, and this project's training stack (which pulls in the sharding layer,
# comm and quant) and data path. Imported once in the forkserver, they cost a worker nothing;
# imported by each worker they took ~0.4 s of CPU per rank, and the README's test command's
# pytest ran 875 s instead of 713 s on 2 cores (2026-12-07). ``env`` is applied after the fork,
# so what these imports read from the environment is the forkserver's (run_distributed says so).
_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state",
            "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
            "megatron.core.pipeline_parallel", "megatron_zeropp.training.loop",
            "megatron_zeropp.data.datasets", "megatron_zeropp.data.tokenizers",
            "megatron_zeropp.mcore.cpu_patches"]
_CTX = None
_STACKS_SIGNAL = signal.SIGUSR2
"""Sent to the ranks still running at the timeout: each dumps its threads' stacks to a file."""


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


class DistributedTimeout(RuntimeError):
    """The run did not finish in time; usually a collective that some rank never joined."""


class DistributedFailure(RuntimeError):
    """A rank raised; the message holds its traceback."""


@dataclass(frozen=True)
class WorkerContext:
    """What a worker function is told about its place in the simulated cluster."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes."""
    nodes: int
    """Simulated node count."""
    ranks_per_node: int
    """Simulated ranks per node."""
    store_path: str
    """FileStore path the process group was initialised from (for re-initialisation)."""
    scratch_dir: str
    """A directory shared by all ranks of this run, removed afterwards."""

    @property
    def node(self) -> int:
        """Simulated node of this rank."""
        return self.rank // self.ranks_per_node

    def topology(
        self, tensor_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1
    ) -> Topology:
        """The topology of this run for the given model-parallel sizes."""
        return build_topology(
            self.world_size,
            tensor_parallel,
            pipeline_parallel,
            context_parallel,
            ranks_per_node=self.ranks_per_node,
        )


def _worker(fn, args, kwargs, rank, world, nodes, rpn, store_path, scratch, timeout_s, env, q):
    try:
        # Its own process group, so that cleanup also reaches what it started (megatron-core's
        # checkpoint writer forks per file and keeps a manager process).
        os.setpgid(0, 0)
        import faulthandler

        # Kept open for the process's life: faulthandler writes from the signal handler.
        stacks = open(_stacks_path(os.path.dirname(store_path), rank), "w")
        faulthandler.register(_STACKS_SIGNAL, file=stacks, all_threads=True)
        os.environ.update(env)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import warnings

        # Deprecation chatter from torch/megatron-core, repeated by every rank, buries real errors.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not")
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        import torch
        import torch.distributed as dist

        # W processes share a few cores: more threads per process only adds contention.
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        ctx = WorkerContext(rank, world, nodes, rpn, store_path, scratch)
        try:
            result = fn(ctx, *args, **kwargs)
        finally:
            try:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            except Exception:
                pass
        dist.destroy_process_group()
        # Plain pickle copies tensors by value; the queue's own reducer would share them through
        # file descriptors that die with this process.
        q.put((rank, True, pickle.dumps(result)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    nodes: int = 1,
    ranks_per_node: int = 2,
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = 180.0,
    collective_timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``nodes * ranks_per_node`` gloo processes.

    Returns the per-rank results (index = rank). ``timeout`` bounds the whole run;
    ``collective_timeout`` (default: ``timeout``) is gloo's per-collective timeout, so a rank stuck
    in a collective raises instead of waiting for the kill. ``env`` is applied in each worker,
    after the fork: a variable read at import by a preloaded module (``TRITON_INTERPRET``, read
    by Triton's decorators, which the training stack imports) must be set in this process
    before its first run instead.
    """
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes and ranks_per_node must be >= 1, got {nodes} x {ranks_per_node}")
    world = nodes * ranks_per_node
    ctx = _context()
    q = ctx.Queue()
    ctimeout = timeout if collective_timeout is None else collective_timeout
    with tempfile.TemporaryDirectory(prefix="zeropp-sim-") as tmp:
        store_path = os.path.join(tmp, "store")
        scratch = os.path.join(tmp, "scratch")
        os.makedirs(scratch)
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn, tuple(args), dict(kwargs or {}), rank, world, nodes, ranks_per_node,
                    store_path, scratch, ctimeout, dict(env or {}), q,
                ),
                # Not daemonic: megatron-core's checkpoint writer forks a process per file, which
                # a daemonic process may not do. Workers are killed below, whatever happens.
                daemon=False,
            )
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, q, world, timeout, tmp)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
                _kill_group(p.pid)
            q.close()


def _stacks_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"stacks.rank{rank}")


def _dump_stacks(procs, ranks: Sequence[int], run_dir: str) -> str:
    """The Python stacks of ``ranks``, each dumped by the rank itself on a signal (the ones that
    have exited or do not answer within a few seconds are named as such)."""
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, _STACKS_SIGNAL)
            except ProcessLookupError:
                pass
    time.sleep(2.0)
    parts = []
    for r in ranks:
        try:
            with open(_stacks_path(run_dir, r)) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        parts.append(f"--- rank {r} ---\n{text or '(no stacks: the rank did not answer)'}")
    return "\n".join(parts)


def _kill_group(pid: int) -> None:
    """Kill what is left of a worker's process group (children of a worker that was killed)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(procs, q, world, timeout, run_dir) -> List[Any]:
    deadline = time.monotonic() + timeout
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    failure = None
    while len(results) < world:
        remaining = deadline - time.monotonic()
        if failure is not None:
            # Give the other ranks a moment to report their own errors, then stop waiting:
            # they are most likely blocked in a collective the failed rank will never join.
            remaining = min(remaining, failure[1] + 3.0 - time.monotonic())
        if remaining <= 0:
            break
        try:
            rank, ok, payload = q.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
            if dead and failure is None:
                # A rank died without reporting (segfault, OOM kill): don't wait for the timeout.
                time.sleep(0.5)
                if q.empty():
                    codes = {i: procs[i].exitcode for i in dead}
                    raise DistributedFailure(
                        f"rank(s) exited without a result: {codes}"
                    ) from None
            continue
        results[rank] = pickle.loads(payload) if ok else payload
        if not ok:
            errors[rank] = payload
            if failure is None:
                failure = (rank, time.monotonic())
    if failure is not None:
        first = failure[0]
        others = sorted(set(errors) - {first})
        raise DistributedFailure(
            f"rank {first} failed (other failing ranks: {others}):\n{errors[first]}"
        )
    if len(results) < world:
        missing = sorted(set(range(world)) - set(results))
        raise DistributedTimeout(
            f"ranks {missing} did not finish within {timeout:.0f}s (hung collective?); "
            f"their stacks:\n{_dump_stacks(procs, missing, run_dir)}"
        )
    return [results[r] for r in range(world)]
