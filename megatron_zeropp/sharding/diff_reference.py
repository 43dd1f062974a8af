"""The state behind qwZ differences for one unit (``ZeroPPConfig.qwz_diff_bits``).

Two halves of one reconstruction ŵ, which must agree bit for bit:

* the **receivers' half** is the hpZ secondary: slice j of every bucket, updated in place by each
  step's differences (:func:`~megatron_zeropp.comm.qwz_diff.qwz_diff_all_gather`) and then read
  as usual by the step's gathers (forward, backward, later micro-batches);
* the **owner's half** is ŵ of this rank's primary shard, which the owner differences against.
  Where the rank's own chunk lies in its own secondary slice (always with one DP rank per node)
  that part of the slice is the reference and nothing extra is kept; otherwise a copy of the
  shard's size (2M/Z bytes over the model).

The pair is valid from an exact 16-bit gather (both halves = w) until the weights are replaced
from outside the optimizer (load, broadcast: :meth:`DiffReference.drop`), and is rebuilt from a
checkpoint's saved owner halves with one exact gather of them, which the unit runs through its own
gather (:meth:`~.unit.ShardedUnit.load_diff_reference_state`).
``base`` is the secondary's version tag while it holds the reference; a difference is sent only
if the secondary still holds that version (so nothing else overwrote it).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron_zeropp.comm.qwz_diff import own_row_in_slice


class DiffReference:
    """ŵ bookkeeping of one unit: owner copies, the base version, step counters."""

    def __init__(self, unit, holders, exact_interval: int):
        self.unit = unit
        self.holders = tuple(holders)
        self.exact_interval = exact_interval
        comm = unit.comm
        self.own_in_slice = own_row_in_slice(self.holders, comm.dp_rank)
        self.rows = comm.dp_size // (max(self.holders) + 1)
        self.copies: List[Optional[torch.Tensor]] = [
            None if self.own_in_slice else torch.zeros_like(s) for s in unit.shards]
        self.base: Optional[int] = None
        self.since_exact = 0  # first gathers since the last exact one (that one included)
        self.sent = 0  # differences sent, ever: keys the stochastic rounding across resumes

    # -- when to send what ---------------------------------------------------------------
    def ready(self) -> bool:
        """Whether this step's first gather may send differences (else: an exact gather)."""
        if self.base is None or not self.unit.secondary.fresh(self.base):
            return False
        return not (self.exact_interval and self.since_exact >= self.exact_interval)

    def exact_gathered(self, version: int) -> None:
        """An exact gather of the primary shards at ``version`` was issued (the secondary is
        refreshed from it after the wait): the owner's ŵ is the shard itself."""
        for copy, shard in zip(self.copies, self.unit.shards):
            if copy is not None:
                copy.copy_(shard)
        self.base, self.since_exact = version, 1

    def differences_sent(self, version: int) -> None:
        self.base = version
        self.since_exact += 1
        self.sent += 1

    def drop(self) -> None:
        """Weights replaced from outside (load, broadcast): the next first gather is exact."""
        self.base = None

    # -- the owner's half ------------------------------------------------------------------
    def reference(self, k: int) -> Optional[torch.Tensor]:
        """The owner's ŵ of bucket ``k`` as the protocol takes it (``None``: in the slice)."""
        return self.copies[k]

    def owner_half(self, k: int) -> torch.Tensor:
        """ŵ of this rank's chunk of bucket ``k``, wherever it lives (a view)."""
        if self.copies[k] is not None:
            return self.copies[k]
        comm = self.unit.comm
        part = self.unit.secondary.partitions[k]
        n = self.unit.shards[k].numel()
        j = self.holders[comm.dp_rank]
        return part.slice_tensor()[: self.rows * n].view(self.rows, n)[
            comm.dp_rank - j * self.rows]

    def nbytes(self) -> int:
        """Bytes of the owner copies (0 where the secondary holds them)."""
        return sum(c.untyped_storage().nbytes() for c in self.copies if c is not None)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self, weight_version: int) -> dict:
        """The owner's half and the counters (all a resume needs: the receivers' half is the
        concatenation of the owners' halves), with no gather in flight. ``current``: ŵ already
        belongs to the layer's ``weight_version`` (the optimizer step prefetched this unit's
        next gather), so the resumed forward must read it as it is rather than send another
        difference."""
        valid = self.base is not None and self.unit.secondary.fresh(self.base)
        return {"valid": valid, "since_exact": self.since_exact, "sent": self.sent,
                "current": valid and self.base == weight_version,
                "owner": [self.owner_half(k).detach().cpu().clone() if valid else None
                          for k in range(len(self.unit.shards))]}

    def load_state(self, state: dict, weight_version: int):
        """Take the counters of a saved :meth:`state_dict`; returns ``(base version, saved owner
        halves)`` for the unit to gather (``(None, None)``: nothing valid was saved, the
        reference is dropped). The base is ``weight_version`` when the saved ŵ was already the
        next step's, else one below it, a version the next forward does not read at: it then
        sends differences."""
        self.since_exact, self.sent = state["since_exact"], state["sent"]
        base_version = weight_version if state["current"] else weight_version - 1
        if base_version < 0:
            raise ValueError(f"restoring a qwZ difference reference at weight version "
                             f"{weight_version}: the layer must have loaded weights first")
        if not state["valid"]:
            self.drop()
            return None, None
        return base_version, state["owner"]

    def restored(self, owner: List[torch.Tensor], base_version: int) -> None:
        """The unit gathered every rank's saved ŵ into the secondaries at ``base_version``: the
        owner's half is this rank's saved one."""
        for copy, own in zip(self.copies, owner):
            if copy is not None:
                copy.copy_(own)
        self.base = base_version
