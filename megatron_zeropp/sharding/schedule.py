"""The order in which a rank's gather units are entered in a training step, learned from the
pipeline schedule, so that the layer can start each gather ahead of its use.

Which unit runs next is decided by megatron-core's schedule, not by the model's layer order: with
virtual pipeline stages (interleaved 1F1B) a rank alternates between its model chunks in groups of
micro-batches, warm-up forwards come before the steady forward/backward pairs, and the backward of
one micro-batch interleaves with the forward of another. So the layer does not assume an order; it
records one. A *step* is the window from the first ``zero_grad_buffer`` of a training iteration to
its first ``finish_grad_sync`` (both called on every chunk by megatron-core's schedules and
``finalize_model_grads``). Within it every *entry* — a unit's forward (its root module's pre-hook,
activation recompute included) and the start of its backward — is appended to the step's record.
At the end of the step the record becomes the learned order. In the next step, as long as the
entries repeat it, each entry prefetches the units of the next ``depth`` learned entries; at the
first entry that differs (another number of micro-batches, say) the step stops following it and
its own record is learned instead.

Outside a step (evaluation, a forward without backward) and while not following, forward entries
prefetch the next units of the same chunk in its learned forward order and backward entries the
previous ones: the order a plain pipeline runs one micro-batch in.

One :class:`UnitSchedule` serves all chunks of a rank (several ZeroPPDataParallel instances with
virtual stages); each chunk registers its units with the function that gathers one of them ahead
at that chunk's current weight version.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

Entry = Tuple[object, str]  # (unit, "forward" | "backward")


class UnitSchedule:
    """Learned entry order of a rank's units over its model chunks (see module docstring).

    Args:
        depth: how many entries ahead to prefetch (``--zeropp-prefetch-depth``; 0: none).
    """

    def __init__(self, depth: int):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.depth = depth
        self._prefetchers: Dict[int, Callable[[object, str], None]] = {}
        self._chunk_of: Dict[int, int] = {}
        self._learned: Tuple[Entry, ...] = ()
        self._record: List[Entry] = []
        self._in_step = False
        self._position: Optional[int] = 0  # next learned entry expected; None: not following
        self._forward_order: Dict[int, List[object]] = {}  # chunk -> units, first forward order

    def add_chunk(self, units: Sequence[object], prefetch: Callable[[object, str], None]) -> int:
        """Register a chunk's units; ``prefetch(unit, phase)`` starts gathering one of them
        ahead (a no-op when it is not released). Returns the chunk's index in this schedule."""
        chunk = len(self._forward_order)
        self._forward_order[chunk] = []
        for unit in units:
            if id(unit) in self._chunk_of:
                raise ValueError(f"unit {getattr(unit, 'name', unit)} registered twice")
            self._chunk_of[id(unit)] = chunk
            self._prefetchers[id(unit)] = prefetch
        return chunk

    @property
    def chunks(self) -> int:
        """How many chunks are registered."""
        return len(self._forward_order)

    @property
    def learned(self) -> Tuple[Entry, ...]:
        """The entries of the last complete training step, in order."""
        return self._learned

    def begin_step(self) -> None:
        """A training iteration starts (``zero_grad_buffer``; idempotent until the first
        entry)."""
        if self._in_step and not self._record:
            return
        self._finish_record()
        self._in_step, self._record, self._position = True, [], 0

    def end_step(self) -> None:
        """The iteration's forward and backward passes are over (``finish_grad_sync``)."""
        if self._in_step:
            self._finish_record()
            self._in_step = False

    def _finish_record(self) -> None:
        if not self._record or not any(phase == "backward" for _, phase in self._record):
            return
        self._learned = tuple(self._record)
        self._record = []
        orders: Dict[int, List[object]] = {c: [] for c in self._forward_order}
        for unit, phase in self._learned:
            order = orders[self._chunk_of[id(unit)]]
            if phase == "forward" and unit not in order:
                order.append(unit)
        self._forward_order = orders

    def entered(self, unit, phase: str) -> None:
        """``unit`` is entered for ``phase`` now: record it and prefetch what comes next."""
        if self._in_step:
            self._record.append((unit, phase))
            if self._position is not None:
                p = self._position
                if p < len(self._learned) and self._learned[p] == (unit, phase):
                    self._position = p + 1
                    self._prefetch(self._learned[p + 1 : p + 1 + self.depth])
                    return
                self._position = None
        self._prefetch(self._neighbours(unit, phase))

    def _neighbours(self, unit, phase: str) -> List[Entry]:
        order = self._forward_order.get(self._chunk_of.get(id(unit), -1), [])
        if unit not in order:
            return []
        i = order.index(unit)
        if phase == "forward":
            return [(u, phase) for u in order[i + 1 : i + 1 + self.depth]]
        return [(u, phase) for u in reversed(order[max(0, i - self.depth) : i])]

    def _prefetch(self, entries: Sequence[Entry]) -> None:
        for unit, phase in entries:
            self._prefetchers[id(unit)](unit, phase)

    def first_entries(self, chunk_units: Sequence[object]) -> List[Entry]:
        """The first ``depth`` learned entries, those of ``chunk_units`` only: what a chunk
        gathers ahead for the next step once its weights changed (``start_param_sync``)."""
        mine = {id(u) for u in chunk_units}
        return [(u, p) for u, p in self._learned[: self.depth] if id(u) in mine]
