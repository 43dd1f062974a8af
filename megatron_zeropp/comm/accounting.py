"""Byte accounting for the data-parallel collectives: who sends how much, over which links.

Every protocol in :mod:`megatron_zeropp.comm` accepts ``stats=CommStats(...)`` and records, per
call, the bytes *this rank sends*, split by

* protocol name (``"zero3_allgather"``, ``"zero3_reduce_scatter"``, ``"qwz_allgather"``,
  ``"hpz_allgather"``, ``"qgz_reduce_scatter"``),
* locality: ``"intra"`` (to ranks on this node) or ``"inter"`` (to other nodes),
* part: ``"payload"`` (values, quantized or not) or ``"scales"`` (side data: quantization scales,
  hpZ's version tag).

Accounting model
----------------
The counts are a model of the bytes the algorithm puts on the wire, not a measurement of what a
backend does internally; they are computed from sizes alone, before the collective starts, so
the same call is charged the same on every backend.

* **All-gather and reduce-scatter** over a group of ``g`` ranks: each rank sends ``(g - 1) / g`` of
  the full payload (the ring model; the full payload is the gathered output, or the reduce-scatter
  input), i.e. ``(g - 1)`` times its shard. This is the paper's "M per collective". The whole
  amount is charged as **inter-node when the group spans more than one node** (a ring runs at the
  speed of its slowest link, so every step of it is paced by the cross-node hop), intra-node
  otherwise.
* **All-to-all**: exact per destination. The bytes addressed to a peer on another node are
  inter-node, those to a peer on this node intra-node, those to oneself are not sent.
* A group of one rank sends nothing.

The node of a global rank is ``rank // ranks_per_node``; the group's global ranks come from
``torch.distributed.get_process_group_ranks`` (never from "consecutive ranks"), so the
classification stays right under any TP/PP/CP layout.

Counted at the call
-------------------
Besides that model, every collective the protocols issue records the tensor it actually hands to
``torch.distributed`` (``record_handed``, called from :mod:`.common`'s collective helpers while a
counted protocol call runs): its byte size, the kind of collective and the group. Converted with
the same conventions (ring: ``(g - 1)`` x the send buffer of an all-gather, ``(g - 1) / g`` of a
reduce-scatter's input; all-to-all: the send buffer's equal splits by destination), these
"handed" bytes must equal the model's bytes per protocol and locality; the tests check that, so
the model cannot drift from what is sent (packing, padding, scales, tags included).

Usage::

    stats = CommStats(topology)            # or CommStats(ranks_per_node=8)
    qwz_all_gather(full, shard, dp_group, stats=stats)
    counts = stats.step()                  # returns this step's counts and resets
    counts.total(locality="inter")         # bytes this rank sent cross-node
    print(counts.table())
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

LOCALITIES = ("intra", "inter")
PARTS = ("payload", "scales")

Key = Tuple[str, str, str]  # (protocol, locality, part)


@dataclass(frozen=True)
class StepCounts:
    """Bytes this rank sent during one step, by (protocol, locality, part)."""

    bytes_by_key: Mapping[Key, int] = field(default_factory=dict)
    """Bytes per ``(protocol, locality, part)``; keys with zero bytes may be absent."""
    calls: Mapping[str, int] = field(default_factory=dict)
    """Number of protocol calls per protocol name (a call may issue several collectives)."""
    handed_by_key: Mapping[Tuple[str, str], float] = field(default_factory=dict)
    """Bytes per ``(protocol, locality)`` derived from the tensors handed to
    ``torch.distributed`` (see "Counted at the call" in the module docstring)."""

    @staticmethod
    def combined(counts: "Sequence[StepCounts]") -> "StepCounts":
        """The sum of several counts (e.g. of a rank's model chunks in one step)."""
        out: Dict[str, dict] = {"bytes_by_key": {}, "calls": {}, "handed_by_key": {}}
        for c in counts:
            for name, table in (("bytes_by_key", c.bytes_by_key), ("calls", c.calls),
                                ("handed_by_key", c.handed_by_key)):
                for key, n in table.items():
                    out[name][key] = out[name].get(key, 0) + n
        return StepCounts(**out)

    def handed_total(self, protocol: Optional[str] = None,
                     locality: Optional[str] = None) -> float:
        """Sum of handed bytes over the keys matching the given filters."""
        return sum(n for (p, loc), n in self.handed_by_key.items()
                   if (protocol is None or p == protocol)
                   and (locality is None or loc == locality))

    @property
    def protocols(self) -> Tuple[str, ...]:
        """Protocol names that were called this step, sorted."""
        return tuple(sorted(set(self.calls) | {k[0] for k in self.bytes_by_key}))

    def total(
        self,
        protocol: Optional[str] = None,
        locality: Optional[str] = None,
        part: Optional[str] = None,
    ) -> int:
        """Sum of bytes over the keys matching every given filter (``None`` matches all)."""
        if locality is not None and locality not in LOCALITIES:
            raise ValueError(f"locality must be one of {LOCALITIES}, got {locality!r}")
        if part is not None and part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        return sum(
            n
            for (p, loc, prt), n in self.bytes_by_key.items()
            if (protocol is None or p == protocol)
            and (locality is None or loc == locality)
            and (part is None or prt == part)
        )

    def table(self, unit_bytes: Optional[float] = None, unit_name: str = "B") -> str:
        """A fixed-width table, one row per protocol plus a total row.

        ``unit_bytes`` divides every count (e.g. ``2 * M`` to express bytes as multiples of a
        16-bit model of M elements, with ``unit_name="M"``).
        """
        div = 1.0 if unit_bytes is None else float(unit_bytes)
        cols = [(loc, prt) for loc in LOCALITIES for prt in PARTS]
        head = f"{'protocol':<22}{'calls':>6}" + "".join(
            f"{loc + ' ' + prt:>18}" for loc, prt in cols
        )
        rows = [head + f"  [{unit_name}]"]

        def fmt(v: float) -> str:
            return f"{v:>18.6g}" if unit_bytes is not None else f"{int(v):>18d}"

        for p in self.protocols:
            vals = [self.total(p, loc, prt) / div for loc, prt in cols]
            rows.append(f"{p:<22}{self.calls.get(p, 0):>6}" + "".join(fmt(v) for v in vals))
        vals = [self.total(None, loc, prt) / div for loc, prt in cols]
        rows.append(f"{'total':<22}{sum(self.calls.values()):>6}" + "".join(fmt(v) for v in vals))
        return "\n".join(rows)


class CommStats:
    """Per-rank byte counter for the comm protocols; see the module docstring for the model.

    Built from the node size (an int, or a :class:`~megatron_zeropp.topology.Topology`, whose
    ``ranks_per_node`` is used). Thread-safe: async protocols may record from the comm thread.
    """

    def __init__(self, ranks_per_node: Union[int, "object"]):
        rpn = getattr(ranks_per_node, "ranks_per_node", ranks_per_node)
        if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        self.ranks_per_node = rpn
        self._lock = threading.Lock()
        self._bytes: Dict[Key, int] = {}
        self._calls: Dict[str, int] = {}
        self._handed: Dict[Tuple[str, str], float] = {}

    def node_of(self, rank: int) -> int:
        """Node index of a global rank."""
        return rank // self.ranks_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        """Whether a group of global ranks touches more than one node."""
        return len({self.node_of(r) for r in ranks}) > 1

    def count_call(self, protocol: str) -> None:
        """Count one call of ``protocol`` (the byte records of a call may be several)."""
        with self._lock:
            self._calls[protocol] = self._calls.get(protocol, 0) + 1

    def record_ring(
        self, protocol: str, ranks: Sequence[int], shard_payload: int, shard_scales: int = 0
    ) -> None:
        """Record an all-gather or reduce-scatter over global ``ranks``.

        ``shard_payload`` / ``shard_scales`` are the bytes of *one rank's shard* (all-gather input,
        reduce-scatter output); this rank is charged ``(g - 1)`` times them, i.e. ``(g - 1) / g`` of
        the full payload.
        """
        _check_sizes(protocol, shard_payload, shard_scales)
        g = len(ranks)
        loc = "inter" if self.spans_nodes(ranks) else "intra"
        self._add(protocol, loc, (g - 1) * shard_payload, (g - 1) * shard_scales)

    def record_all_to_all(
        self,
        protocol: str,
        ranks: Sequence[int],
        me: int,
        payload_per_peer: int,
        scales_per_peer: int = 0,
    ) -> None:
        """Record an all-to-all with equal splits: ``payload_per_peer`` bytes to each peer.

        ``me`` is this rank's global rank; bytes to itself are not charged.
        """
        _check_sizes(protocol, payload_per_peer, scales_per_peer)
        if me not in ranks:
            raise ValueError(f"rank {me} is not in the all-to-all group {tuple(ranks)}")
        mine = self.node_of(me)
        for r in ranks:
            if r == me:
                continue
            loc = "intra" if self.node_of(r) == mine else "inter"
            self._add(protocol, loc, payload_per_peer, scales_per_peer)

    def record_all_to_all_v(self, protocol: str, ranks: Sequence[int], me: int,
                            payload_by_peer: Sequence[int],
                            scales_by_peer: Optional[Sequence[int]] = None) -> None:
        """Record an all-to-all with uneven splits: ``payload_by_peer[i]`` bytes to ``ranks[i]``
        (the entry for ``me`` is not charged)."""
        scales_by_peer = scales_by_peer or [0] * len(ranks)
        if me not in ranks or len(payload_by_peer) != len(ranks) != len(scales_by_peer):
            raise ValueError(f"{protocol}: {len(payload_by_peer)} sizes for the all-to-all group "
                             f"{tuple(ranks)} (rank {me})")
        mine = self.node_of(me)
        for r, payload, scales in zip(ranks, payload_by_peer, scales_by_peer):
            _check_sizes(protocol, payload, scales)
            if r != me:
                loc = "intra" if self.node_of(r) == mine else "inter"
                self._add(protocol, loc, payload, scales)

    def record_handed(self, protocol: str, kind: str, ranks: Sequence[int], me: int,
                      nbytes: int, splits: Optional[Sequence[int]] = None) -> None:
        """Record a tensor of ``nbytes`` handed to a ``torch.distributed`` collective of
        ``kind`` (``"all_gather"``: the send buffer; ``"reduce_scatter"``: the input;
        ``"all_to_all"``: the send buffer, equal splits unless ``splits`` gives the bytes per
        destination) over global ``ranks``."""
        g = len(ranks)
        if g < 2:
            return
        if kind == "all_to_all" and splits is not None:
            mine = self.node_of(me)
            for r, n in zip(ranks, splits):
                if r != me:
                    self._add_handed(protocol,
                                     "intra" if self.node_of(r) == mine else "inter", n)
            return
        if kind == "all_gather":
            self._add_handed(protocol, self._ring_locality(ranks), (g - 1) * nbytes)
        elif kind == "reduce_scatter":
            self._add_handed(protocol, self._ring_locality(ranks), (g - 1) * nbytes / g)
        elif kind == "all_to_all":
            mine = self.node_of(me)
            for r in ranks:
                if r != me:
                    loc = "intra" if self.node_of(r) == mine else "inter"
                    self._add_handed(protocol, loc, nbytes / g)
        else:
            raise ValueError(f"unknown collective kind {kind!r}")

    def _ring_locality(self, ranks) -> str:
        return "inter" if self.spans_nodes(ranks) else "intra"

    def _add_handed(self, protocol: str, locality: str, n: float) -> None:
        with self._lock:
            key = (protocol, locality)
            self._handed[key] = self._handed.get(key, 0) + n

    def peek(self) -> StepCounts:
        """The counts so far this step, without resetting."""
        with self._lock:
            return StepCounts(dict(self._bytes), dict(self._calls), dict(self._handed))

    def step(self) -> StepCounts:
        """Return the counts of this step and reset them."""
        with self._lock:
            out = StepCounts(dict(self._bytes), dict(self._calls), dict(self._handed))
            self._bytes.clear()
            self._calls.clear()
            self._handed.clear()
        return out

    def _add(self, protocol: str, locality: str, payload: int, scales: int) -> None:
        with self._lock:
            for part, n in (("payload", payload), ("scales", scales)):
                if n:
                    key = (protocol, locality, part)
                    self._bytes[key] = self._bytes.get(key, 0) + n


def _check_sizes(protocol: str, payload: int, scales: int) -> None:
    if not isinstance(protocol, str) or not protocol:
        raise ValueError(f"protocol must be a non-empty string, got {protocol!r}")
    if payload < 0 or scales < 0:
        raise ValueError(f"{protocol}: byte counts must be >= 0, got {payload} and {scales}")
