"""The numerics lab's shared-buffer transport: the layer's collectives as copies between the
ranks' own buffers, on one GPU (CUDA IPC) or one host (shared memory).

The lab (``--ranks-share-gpu``) runs Z ranks as processes on one GPU. Host staging
(``comm/common.py``) moves every collective device -> host -> gloo -> host -> device; this
transport moves it device -> device instead. Each rank owns two **slots** (double-buffered
byte buffers, one per call parity) that every other rank of the group has mapped: on CUDA a
device buffer shared by its IPC handle (``torch.multiprocessing.reductions``), on CPU a file in
``/dev/shm``. A collective is:

1. wait until the peers have read my slot of this parity in the call before the last one
   (CUDA: their ``read`` events, a stream wait, no host wait);
2. copy my input into my slot; record my ``written`` event (CUDA);
3. publish the call (kind, bytes, uneven splits, the slot's handle when it grew) in the group's
   **control block** (host shared memory) and wait at a host barrier for every member;
4. check the members made the same call, map any slot that grew, wait for their ``written``
   events (CUDA: a stream wait), and read: copy the peers' bytes (all-gather, all-to-all) or add
   their chunks in group-rank order (reduce-scatter);
5. record my ``read`` event (CUDA).

Nothing in it waits on the GPU from the host: the host barrier only orders the *issuing* of
copies, the CUDA IPC events order their execution, as NCCL's own stream semantics do. The slot
of parity ``p`` is rewritten two calls later, after the next barrier, which every peer reaches
only after issuing its reads and recording its ``read`` event; the writer waits for those
events, so a reader never sees a half-rewritten slot, and an event is never re-recorded before
its waiters issued their waits (the barrier in between), so each wait sees the intended record.

The bytes moved are the caller's bytes, so all-gathers and all-to-alls are bit-identical to
gloo's (every quantized code, scale and weight of qwZ, hpZ and qgZ travels that way). A
reduce-scatter adds the members' chunks left to right in group-rank order in the input dtype;
gloo and NCCL use their own orders (rounding-level differences in fp32, exactly equal at two
ranks, where addition order cannot matter). ``tests/test_lab_transport.py`` runs the same code
on CPU: every collective against gloo, the whole layer against the direct path, and a corrupted
transfer caught.
"""

from __future__ import annotations

import atexit
import mmap
import os
import pickle
import platform
import secrets
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy
import torch
import torch.distributed as dist

# Control block, per member: a line of int64s, then a handle area per slot parity.
# Everything a call publishes is per parity: a member may be one call ahead of a reader (past
# the barrier, publishing the next call) but never two (that needs the reader at the next one).
_INTS = ("seq", "gen0", "gen1", "hlen0", "hlen1", "kind0", "kind1", "nbytes0", "nbytes1")
_LINE = 128  # bytes of the int64 line (two cache lines)
_HANDLE = 4096  # bytes per published slot handle
_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_to_all": 3, "all_to_all_v": 4}
_MIN_SLOT = 1 << 20
# The barrier reads other processes' plain stores; x86's total store order makes a store seen
# after the stores before it (the slot bytes on CPU, the control fields). Elsewhere it would
# need fences Python cannot issue.
_ORDERED_MACHINES = ("x86_64", "AMD64", "i686", "i386")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PhaseTimes:
    """Host seconds, calls and bytes per phase of the lab's transports (``--lab-timers``):
    where a rank's host time goes. On CUDA the shared transport's phases are issue times only
    (its copies run on the device, ordered by events)."""

    def __init__(self):
        self.phases: Dict[str, List[float]] = {}

    def add(self, phase: str, seconds: float, nbytes: int = 0) -> None:
        entry = self.phases.setdefault(phase, [0.0, 0, 0])
        entry[0] += seconds
        entry[1] += 1
        entry[2] += nbytes

    def snapshot(self) -> Dict[str, Dict[str, float]]:
        return {k: {"s": v[0], "calls": v[1], "bytes": v[2]} for k, v in self.phases.items()}


TIMES = PhaseTimes()


class _Shm:
    """One shared file mapped into this process (a control block or a CPU slot)."""

    def __init__(self, path: str, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path


class _Member:
    """What this rank knows of one member's slots: per parity, (generation, mapped bytes)."""

    def __init__(self):
        self.gen = [0, 0]
        self.slot: List[Optional[torch.Tensor]] = [None, None]
        self.written = None  # CUDA: its two IPC events
        self.read = None


class SharedExchange:
    """The shared-buffer state of one process group on this rank: the control block, my slots,
    the members' mapped slots and (CUDA) events. Created collectively at the group's first call
    (every member makes that call; its names travel by ``all_gather_object``)."""

    def __init__(self, group, device: torch.device, timeout_s: float):
        if platform.machine() not in _ORDERED_MACHINES:
            raise RuntimeError(f"the lab's shared transport needs x86's store order, this is "
                               f"{platform.machine()!r}; use --lab-transport host")
        self.group = group
        self.ranks = list(dist.get_process_group_ranks(group))
        self.size = len(self.ranks)
        self.me = self.ranks.index(dist.get_rank())
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.timeout_s = timeout_s
        self.calls = 0
        self.splits = numpy.zeros(0, dtype=numpy.int64)
        self._area = _LINE + 16 * self.size + 2 * _HANDLE  # per member: ints, splits, handles
        token = secrets.token_hex(8) if self.me == 0 else None
        names = [None] * self.size
        dist.all_gather_object(names, token, group=group)
        self.prefix = os.path.join(_shm_dir(), f"zeropp-lab-{names[0]}")
        size = self.size * self._area
        if self.me == 0:
            self.control = _Shm(self.prefix + ".ctl", size, create=True)
        dist.barrier(group=group)
        if self.me != 0:
            self.control = _Shm(self.prefix + ".ctl", size, create=False)
        self.ints = numpy.frombuffer(self.control.map, dtype=numpy.int64)
        self._seq_at = numpy.array([m * self._area // 8 for m in range(self.size)])
        dist.barrier(group=group)
        if self.me == 0:
            os.unlink(self.control.path)  # every member has it mapped: nothing left to find
        self.members = [_Member() for _ in range(self.size)]
        self.mine: List[Optional[torch.Tensor]] = [None, None]
        self._retired: List[object] = []  # grown-out slots: peers may still hold them mapped
        self._unlink: List[Tuple[int, str]] = []  # (call, path) of CPU slots published
        if self.cuda:
            self._events()
        atexit.register(self.close)

    def close(self) -> None:
        """Unlink the CPU slot files not unlinked yet (those published in the group's last
        calls); the mappings stay valid. Idempotent."""
        for _, path in self._unlink:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._unlink = []

    # -- control block fields ------------------------------------------------------------
    def _int(self, member: int, name: str) -> int:
        return member * self._area // 8 + _INTS.index(name)

    def _splits_at(self, member: int, parity: int) -> int:
        return (member * self._area + _LINE) // 8 + parity * self.size

    def _handle_bytes(self, member: int, parity: int) -> memoryview:
        start = member * self._area + _LINE + 16 * self.size + parity * _HANDLE
        return memoryview(self.control.map)[start:start + _HANDLE]

    # -- CUDA events ---------------------------------------------------------------------
    def _events(self) -> None:
        mine = {kind: [torch.cuda.Event(interprocess=True) for _ in range(2)]
                for kind in ("written", "read")}
        handles = {kind: [e.ipc_handle() for e in evs] for kind, evs in mine.items()}
        everyone = [None] * self.size
        dist.all_gather_object(everyone, handles, group=self.group)
        for m, member in enumerate(self.members):
            if m == self.me:
                member.written, member.read = mine["written"], mine["read"]
                continue
            member.written, member.read = (
                [torch.cuda.Event.from_ipc_handle(self.device, h) for h in everyone[m][kind]]
                for kind in ("written", "read"))

    # -- slots ---------------------------------------------------------------------------
    def _my_slot(self, parity: int, nbytes: int) -> torch.Tensor:
        slot = self.mine[parity]
        if slot is not None and slot.numel() >= nbytes:
            return slot
        capacity = max(_MIN_SLOT, nbytes, 2 * (slot.numel() if slot is not None else 0))
        capacity = -(-capacity // _MIN_SLOT) * _MIN_SLOT
        gen = int(self.ints[self._int(self.me, f"gen{parity}")]) + 1
        if self.cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            new = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            handle = pickle.dumps(reduce_tensor(new))
        else:
            path = f"{self.prefix}.r{self.me}.p{parity}.g{gen}"
            shm = _Shm(path, capacity, create=True)
            self._retired.append(shm)
            new = torch.frombuffer(shm.map, dtype=torch.uint8)
            self._unlink.append((self.calls, path))
            handle = path.encode()
        if len(handle) > _HANDLE:
            raise RuntimeError(f"a slot handle of {len(handle)} bytes does not fit the control "
                               f"block's {_HANDLE}")
        if slot is not None:
            self._retired.append(slot)
        self._handle_bytes(self.me, parity)[:len(handle)] = handle
        self.ints[self._int(self.me, f"hlen{parity}")] = len(handle)
        self.ints[self._int(self.me, f"gen{parity}")] = gen  # after the handle it names
        self.mine[parity] = new
        self.members[self.me].slot[parity] = new
        self.members[self.me].gen[parity] = gen
        return new

    def _peer_slot(self, m: int, parity: int) -> torch.Tensor:
        member = self.members[m]
        gen = int(self.ints[self._int(m, f"gen{parity}")])
        if gen != member.gen[parity]:
            start = time.perf_counter()
            n = int(self.ints[self._int(m, f"hlen{parity}")])
            handle = bytes(self._handle_bytes(m, parity)[:n])
            if self.cuda:
                rebuild, args = pickle.loads(handle)
                member.slot[parity] = rebuild(*args)
            else:
                size = os.path.getsize(handle.decode())
                shm = _Shm(handle.decode(), size, create=False)
                self._retired.append(shm)
                member.slot[parity] = torch.frombuffer(shm.map, dtype=torch.uint8)
            member.gen[parity] = gen
            TIMES.add("shared.open", time.perf_counter() - start)
        return member.slot[parity]

    # -- one call ------------------------------------------------------------------------
    def begin(self, kind: str, data: torch.Tensor, splits: Optional[Sequence[int]] = None
              ) -> Tuple[int, List[torch.Tensor]]:
        """Steps 1-4 of a call: publish ``data`` (flat bytes) and return the call's parity and
        every member's slot, ready to read (CUDA: the current stream waits for the writes)."""
        start = time.perf_counter()
        self.calls += 1
        parity = self.calls % 2
        nbytes = data.numel()
        slot = self._my_slot(parity, nbytes)
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            # Mine too: my own reads of this slot two calls ago may have run on another lane.
            for member in self.members:
                stream.wait_event(member.read[parity])
        slot[:nbytes].copy_(data)
        if self.cuda:
            self.members[self.me].written[parity].record(stream)
        self.ints[self._int(self.me, f"kind{parity}")] = _KINDS[kind]
        self.ints[self._int(self.me, f"nbytes{parity}")] = nbytes
        if splits is not None:
            at = self._splits_at(self.me, parity)
            self.ints[at:at + self.size] = numpy.asarray(splits, dtype=numpy.int64)
        TIMES.add("shared.write", time.perf_counter() - start, nbytes)
        self._barrier()
        start = time.perf_counter()
        self._check_same_call(kind, nbytes, parity, splits is not None)
        slots = [self._peer_slot(m, parity) if m != self.me else slot
                 for m in range(self.size)]
        if self.cuda:
            for m, member in enumerate(self.members):
                if m != self.me:
                    stream.wait_event(member.written[parity])
        self._parity = parity
        self._read_start = start
        return parity, slots

    def end(self, nbytes: int) -> None:
        """Step 5: my reads of this call are issued (CUDA: record the ``read`` event)."""
        if self.cuda:
            self.members[self.me].read[self._parity].record(
                torch.cuda.current_stream(self.device))
        TIMES.add("shared.read", time.perf_counter() - self._read_start, nbytes)

    def member_splits(self, m: int) -> numpy.ndarray:
        at = self._splits_at(m, self._parity)
        return self.ints[at:at + self.size].copy()

    def _barrier(self) -> None:
        start = time.perf_counter()
        k = self.calls
        self.ints[self._seq_at[self.me]] = k  # after everything this call published
        spins = 0
        while True:
            seqs = self.ints[self._seq_at]
            if seqs.min() >= k:
                break
            spins += 1
            if spins < 200:
                continue
            # A peer is behind (computing, or the CPU is shared): stop taking its core.
            time.sleep(0 if spins < 2000 else 1e-4)
            if spins % 1000 == 0 and time.perf_counter() - start > self.timeout_s:
                late = [self.ranks[m] for m in range(self.size) if seqs[m] < k]
                raise RuntimeError(
                    f"lab transport: ranks {late} of group {self.ranks} did not reach call "
                    f"{k} within {self.timeout_s:.0f} s (their calls: "
                    f"{[int(seqs[m]) for m in range(self.size)]})")
        TIMES.add("shared.barrier", time.perf_counter() - start)
        # CPU slots published before the previous barrier are mapped by every member now.
        done = [p for c, p in self._unlink if c < k]
        for path in done:
            os.unlink(path)
        self._unlink = [(c, p) for c, p in self._unlink if c >= k]

    def _check_same_call(self, kind: str, nbytes: int, parity: int, uneven: bool) -> None:
        kinds = [int(self.ints[self._int(m, f"kind{parity}")]) for m in range(self.size)]
        sizes = [int(self.ints[self._int(m, f"nbytes{parity}")]) for m in range(self.size)]
        names = {v: k for k, v in _KINDS.items()}
        if len(set(kinds)) != 1 or (not uneven and len(set(sizes)) != 1):
            raise RuntimeError(
                f"lab transport: call {self.calls} of group {self.ranks} differs between ranks: "
                f"{[names.get(k, k) for k in kinds]} of {sizes} bytes (this rank: {kind}, "
                f"{nbytes})")


class SharedTransport:
    """The four collectives of ``comm/common.py`` over :class:`SharedExchange` (one per process
    group, made at its first call)."""

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.exchanges: Dict[object, SharedExchange] = {}

    def close(self) -> None:
        """:meth:`SharedExchange.close` of every group (also run at exit)."""
        for ex in self.exchanges.values():
            ex.close()

    def exchange(self, group, device) -> SharedExchange:
        key = group if group is not None else dist.group.WORLD
        ex = self.exchanges.get(key)
        if ex is None:
            ex = SharedExchange(key, device, self.timeout_s)
            self.exchanges[key] = ex
        return ex

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        ex = self.exchange(group, input.device)
        data = _bytes(input)
        n = data.numel()
        _, slots = ex.begin("all_gather", data)
        out = _bytes(output)
        for m, slot in enumerate(slots):
            self._read(out[m * n:(m + 1) * n], slot[:n])
        ex.end(out.numel())

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op, group) -> None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the lab's shared transport reduces with SUM only (as gloo), got "
                             f"{op}")
        ex = self.exchange(group, input.device)
        _, slots = ex.begin("reduce_scatter", _bytes(input))
        n = output.numel() * output.element_size()
        out = output.view(-1)
        chunk = slice(ex.me * n, (ex.me + 1) * n)
        # Left to right in group-rank order, in the input dtype: one fixed order.
        self._read(out, slots[0][chunk].view(output.dtype))
        for slot in slots[1:]:
            out.add_(slot[chunk].view(output.dtype))
        ex.end(n * ex.size)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        ex = self.exchange(group, input.device)
        data = _bytes(input)
        n = data.numel() // ex.size
        _, slots = ex.begin("all_to_all", data)
        out = _bytes(output)
        for m, slot in enumerate(slots):
            self._read(out[m * n:(m + 1) * n], slot[ex.me * n:(ex.me + 1) * n])
        ex.end(out.numel())

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor,
                     output_splits: Sequence[int], input_splits: Sequence[int], group) -> None:
        ex = self.exchange(group, input.device)
        _, slots = ex.begin("all_to_all_v", _bytes(input), splits=input_splits)
        out = _bytes(output)
        at = 0
        for m, slot in enumerate(slots):
            theirs = ex.member_splits(m)
            if int(theirs[ex.me]) != output_splits[m]:
                raise RuntimeError(
                    f"lab transport: rank {ex.ranks[m]} sends {int(theirs[ex.me])} bytes to rank "
                    f"{ex.ranks[ex.me]}, which expects {output_splits[m]} (output splits "
                    f"{list(output_splits)})")
            start = int(theirs[:ex.me].sum())
            self._read(out[at:at + output_splits[m]], slot[start:start + output_splits[m]])
            at += output_splits[m]
        ex.end(at)

    @staticmethod
    def _read(dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every copy out of a member's slot (the one place a transfer lands; the tests corrupt
        one here to prove the comparison catches it)."""
        dst.copy_(src)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's flat bytes (a view)."""
    return t.view(-1).view(torch.uint8)
