"""A sharded unit: the parameters gathered and released together (about one transformer layer).

Storage of one unit, per (param dtype, grad dtype) buffer::

    persistent:  primary shard  = chunk r of every bucket (16-bit, numel/Z)   [ZeRO-3]
                 secondary      = slice j of every bucket over the hpZ group   [hpZ only, numel/N]
                 grad buffer    = megatron-core's main_grad views (full size, like its DDP)
                 or grad shard  = chunk r of every bucket, fp32 (numel/Z)      [shard_grads]
    transient:   param storage  = the full bucket, allocated for a gather, freed on release
                 grad storage   = the full bucket's gradients while its backward runs
                                  [shard_grads only; otherwise persistent]

The parameters keep pointing at views of the buffer's ``param_data``; releasing resizes that
storage to zero bytes, so a parameter read outside a gather fails loudly instead of reading stale
data, and a gather resizes it back and fills it in place (the views stay valid; autograd's saved
tensors see the re-gathered values). ``main_grad`` views work the same way with ``shard_grads``.

Where a gather reads from (:meth:`ShardedUnit.start_gather`): the hpZ secondary whenever it holds
the current weight version, the primary shards over the whole DP group otherwise (qwZ when on),
which then refreshes the secondary. So with hpZ the first gather of a unit in an optimizer step
crosses nodes and every later one (its backward, the other micro-batches) stays in the node, and
all of them see the same bits. With ``qwz_diff_bits`` that first gather sends weight differences
against the secondary, which then holds the new reconstruction (``comm/qwz_diff.py``).

The unit is the one owner of its state machine: storage (released / gathering / gathered), who
uses the weights (forward users, a running backward), which gradients are still to come, and the
gradient reduction in flight.
"""

from __future__ import annotations

import enum
from typing import Dict, List, Optional

import torch

from megatron_zeropp.comm import QgzResidual, SecondaryWeights
from megatron_zeropp.comm.segments import param_segments

from .diff_reference import DiffReference
from .shard_comm import ShardComm
from .shard_map import ParamShard, ShardMap
from .unit_grads import FullGradients, ShardedGradients


def bucket_segments(buffers, exact_below: int) -> List[tuple]:
    """Per bucket of ``buffers`` (in order), its parameters as ``(start, end, exact)`` segments
    (:func:`~megatron_zeropp.comm.segments.param_segments`), from megatron-core's
    ``param_index_map`` (buffer coordinates) and each bucket's ``offset``."""
    out = []
    for buf in buffers:
        ranges: Dict[int, list] = {i: [] for i in range(len(buf.buckets))}
        for start, end, bucket_id in buf.param_index_map.values():
            off = buf.buckets[bucket_id].offset
            ranges[bucket_id].append((start - off, end - off))
        for i, bucket in enumerate(buf.buckets):
            out.append(param_segments(ranges[i], bucket.param_data.numel(), exact_below))
    return out


class UnitState(enum.Enum):
    """Where a unit's full weights are."""

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedUnit:
    """One gather/release unit over one or more megatron-core ``_ParamAndGradBuffer``s."""

    def __init__(self, name: str, root: torch.nn.Module, buffers: list, comm: ShardComm):
        self.name = name
        self.root = root
        self.buffers = buffers
        self.comm = comm
        self.buckets = [b for buf in buffers for b in buf.buckets]
        self.params = [p for buf in buffers for p in buf.params]
        z, r = comm.dp_size, comm.dp_rank
        self.shards: List[torch.Tensor] = []
        for bucket in self.buckets:
            n = bucket.param_data.numel()
            if n % z:
                raise ValueError(f"unit {name}: bucket of {n} elements is not divisible by DP {z}")
            # The primary shard: this rank's chunk r, the slice megatron-core's distributed
            # optimizer updates (it owns chunk r of every bucket).
            chunk = n // z
            self.shards.append(bucket.param_data.view(-1)[r * chunk : (r + 1) * chunk].clone())
        self.secondary: Optional[SecondaryWeights] = None
        if comm.config.hpz:
            self.secondary = SecondaryWeights(
                comm.groups.hpz, [b.param_data for b in self.buckets]
            )
        self._nbytes = [buf.param_data.untyped_storage().nbytes() for buf in buffers]
        # Each bucket's parameters as segments: qwZ and qgZ blocks never span two of them, and
        # those below the threshold travel exactly. Param and grad buckets share the layout.
        self.segments = bucket_segments(buffers, comm.config.small_param_threshold)
        self.bucket_ids = [comm.clock.register_bucket() for _ in self.buckets]
        # Chosen once: megatron-core's full gradient buffers, or fp32 gradient shards.
        self.grads = (ShardedGradients if comm.config.shard_grads else FullGradients)(self)
        # qgZ error feedback: one residual per bucket (allocated by its first qgZ reduction).
        self._qgz_residuals: Optional[List[QgzResidual]] = (
            [QgzResidual() for _ in self.buckets] if comm.config.qgz_error_feedback else None
        )
        self.diff: Optional[DiffReference] = None
        if comm.config.qwz_diff_bits:
            self.diff = DiffReference(self, comm.holders, comm.config.qwz_diff_exact_interval)
        self.state = UnitState.GATHERED
        self.version: Optional[int] = None  # weight version of the gathered data
        self._handles: list = []
        self._refresh_after_wait = False
        self._gather_phase: Optional[str] = None
        self.users = 0
        self.in_backward = False  # acquired by a backward pass, released by its last grad
        self.grads_pending: set = set()

    # -- weight storage --------------------------------------------------------------------
    def _alloc(self) -> None:
        for buf, nbytes in zip(self.buffers, self._nbytes):
            storage = buf.param_data.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def release(self) -> None:
        """Free the full weights (waits for an in-flight gather first)."""
        self.wait()
        for buf in self.buffers:
            buf.param_data.untyped_storage().resize_(0)
        self.state = UnitState.RELEASED
        self.version = None
        self.users = 0
        self.in_backward = False
        self.grads_pending = set()

    def qgz_residual(self, bucket_index: int) -> Optional[QgzResidual]:
        """Bucket ``bucket_index``'s qgZ error-feedback state (``None`` without the flag)."""
        if self._qgz_residuals is None:
            return None
        return self._qgz_residuals[bucket_index]

    def qgz_residual_states(self) -> Optional[List[dict]]:
        """Copies of the qgZ residuals, per bucket (``None`` without error feedback); call with
        no reduction in flight."""
        if self._qgz_residuals is None:
            return None
        return [{k: v.detach().clone() for k, v in r.state_dict().items()}
                for r in self._qgz_residuals]

    def load_qgz_residual_states(self, states: Optional[List[dict]]) -> None:
        """Hold ``states`` (:meth:`qgz_residual_states`) as the residuals; ``None``: forget them
        (weights of another run loaded; when qgZ switches off they are flushed into the next
        exact reduction instead, :meth:`ShardComm.reduce_gradients`)."""
        if self._qgz_residuals is None:
            return
        self.finish_grad_reduce()  # a reduction in flight may still write them
        if states is not None and len(states) != len(self._qgz_residuals):
            raise ValueError(f"unit {self.name}: {len(states)} saved qgZ residuals for "
                             f"{len(self._qgz_residuals)} buckets")
        device = self.buckets[0].grad_data.device
        for k, r in enumerate(self._qgz_residuals):
            r.reset()
            if states is not None:
                r.load_state_dict(states[k], device)

    def diff_reference_state(self, weight_version: int) -> dict:
        """The qwZ difference reference's saved form (:meth:`DiffReference.state_dict`), once
        no gather writes the secondary any more (a prefetched difference may be in flight)."""
        self.wait()
        return self.diff.state_dict(weight_version)

    def load_diff_reference_state(self, state: dict, weight_version: int) -> None:
        """Rebuild the qwZ difference reference from ``state`` (:meth:`diff_reference_state`,
        saved by every rank of the DP group): the counters, the owner's half from this rank's
        saved ŵ, the receivers' half (the secondaries) from one exact gather of every rank's
        through this unit's own gather. Collective over the DP group."""
        self.release()
        base, owner = self.diff.load_state(state, weight_version)
        if owner is None:
            return
        device = self.buckets[0].param_data.device
        owner = [o.to(device) for o in owner]
        self.start_gather(base, "exact", async_op=False, sources=owner)
        self.wait()  # the secondaries now hold every owner's ŵ, tagged ``base``
        self.diff.restored(owner, base)
        self.release()

    def persistent_bytes(self) -> Dict[str, int]:
        """Bytes this unit keeps between uses: primary shards, secondary slices, gradients
        (and qgZ residuals with error feedback), read from the live storages (a freed gradient
        buffer counts 0)."""
        out = {
            "primary": sum(s.untyped_storage().nbytes() for s in self.shards),
            "secondary": self.secondary.storage_bytes() if self.secondary is not None else 0,
            "grad": sum(buf.grad_data.untyped_storage().nbytes() for buf in self.buffers)
            + sum(g.untyped_storage().nbytes() for g in self.grad_shards),
        }
        if self._qgz_residuals is not None:
            out["qgz_residual"] = sum(r.nbytes() for r in self._qgz_residuals)
        if self.diff is not None:
            out["qwz_diff_reference"] = self.diff.nbytes()
        return out

    def gathered_bytes(self) -> int:
        """Bytes of full weights currently allocated (0 when released)."""
        return sum(buf.param_data.untyped_storage().nbytes() for buf in self.buffers)

    # -- gathers ---------------------------------------------------------------------------
    def start_gather(self, version: int, phase: str, async_op: bool,
                     sources: Optional[List[torch.Tensor]] = None) -> None:
        """Allocate and start filling the full weights for ``phase`` at weight ``version``.

        Reads the hpZ secondary (intra-node) when it holds ``version``; otherwise the primary
        shards over the whole DP group, through qwZ when it is on, and then keeps this rank's
        slice as the new secondary. Both give the same bits, so autograd sees one set of weights
        and every micro-batch of a step computes with the same weights. ``phase="exact"`` always
        reads the primary shards unquantized and leaves the secondary alone. With
        ``qwz_diff_bits`` the cross-node gather sends differences into the secondary in place
        and then reads it (:class:`~.diff_reference.DiffReference`), or, without a reference,
        gathers the 16-bit weights exactly. ``sources``: every rank's chunk of each bucket to
        gather exactly instead of the primary shards, refreshing the secondary from them (a
        restored qwZ difference reference: :meth:`load_diff_reference_state`).
        """
        if self.state is not UnitState.RELEASED:
            raise RuntimeError(f"unit {self.name}: gather started while {self.state.value}")
        self._alloc()
        outputs = [b.param_data for b in self.buckets]
        sec = self.secondary
        from_secondary = phase != "exact" and sec is not None and sec.fresh(version)
        refresh = False
        if sources is not None:
            handles = [self.comm.gather_weights(out, src, "exact", async_op)
                       for out, src in zip(outputs, sources)]
            self._handles = [h for h in handles if h is not None]
            refresh = True
        elif from_secondary:
            self._handles = sec.gather_into(
                outputs, version, async_op, self.comm.stale_flag(outputs[0].device),
                self.comm.stats[phase],
            )
        elif phase != "exact" and self.diff is not None and self.diff.ready():
            self._handles = self._gather_differences(version, phase, async_op, outputs)
        elif phase != "exact" and self.diff is not None:
            # No reference yet (first step, after a load or broadcast) or the guard interval:
            # the 16-bit weights, exactly; they become both halves of the reference.
            handles = [self.comm.gather_exact(out, shard, phase, async_op)
                       for out, shard in zip(outputs, self.shards)]
            self._handles = [h for h in handles if h is not None]
            self.diff.exact_gathered(version)
            refresh = True
        else:
            handles = [self.comm.gather_weights(out, shard, phase, async_op, segments, bid)
                       for out, shard, segments, bid in zip(outputs, self.shards, self.segments,
                                                            self.bucket_ids)]
            self._handles = [h for h in handles if h is not None]
            refresh = sec is not None and phase != "exact"
        self._refresh_after_wait = refresh
        self._gather_phase = phase
        self.state = UnitState.GATHERING
        self.version = version

    def _gather_differences(self, version: int, phase: str, async_op: bool, outputs) -> list:
        """This step's differences into every holder's secondary slice (in place, then tagged
        ``version``), then the full weights from the node's slices (hpZ gather)."""
        sec, diff = self.secondary, self.diff
        sec.begin_update(version)
        handles = []
        for k, (part, shard) in enumerate(zip(sec.partitions, self.shards)):
            h = self.comm.gather_differences(part.slice_tensor(), shard, diff.reference(k),
                                             phase, async_op, self.segments[k],
                                             self.bucket_ids[k], diff.sent)
            if h is not None:
                part.track(h)
                handles.append(h)
        diff.differences_sent(version)
        return handles + sec.gather_into(outputs, version, async_op,
                                         self.comm.stale_flag(outputs[0].device),
                                         self.comm.stats[phase])

    def wait(self) -> None:
        """Finish an in-flight gather (on CUDA: order the current stream after it); refresh the
        hpZ secondaries after a primary gather."""
        if self.state is not UnitState.GATHERING:
            return
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()
        self.state = UnitState.GATHERED
        if self._refresh_after_wait:
            self._refresh_after_wait = False
            self.secondary.refresh([b.param_data for b in self.buckets], self.version)
        self._measure_qwz_error()

    def _measure_qwz_error(self) -> None:
        # qwz_error_interval: this rank's chunk of what the forward computes with (every gather
        # of a step gives the same bits: the first one measured is the step's) against the
        # primary shard it came from; reads only.
        meter = self.comm.qwz_error
        if (meter is None or self._gather_phase != "forward"
                or not self.comm.clock.measure_qwz_error or self.name in meter.measured()):
            return
        r = self.comm.dp_rank
        for bucket, shard in zip(self.buckets, self.shards):
            n = shard.numel()
            meter.add(self.name, bucket.param_data.view(-1)[r * n : (r + 1) * n], shard)

    def ensure(self, version: int, phase: str) -> None:
        """Make the full weights of ``version`` present (gather now if needed)."""
        if self.state is not UnitState.RELEASED and self.version != version:
            raise RuntimeError(
                f"unit {self.name} holds weights of version {self.version}, needs {version}: "
                "a weight change happened while it was gathered"
            )
        if self.state is UnitState.RELEASED:
            self.start_gather(version, phase, async_op=False)
        self.wait()

    # -- users ------------------------------------------------------------------------------
    def acquire(self, version: int, phase: str) -> None:
        """A forward call starts using the weights."""
        self.ensure(version, phase)
        self.users += 1

    def release_use(self) -> None:
        """A forward call is done with the weights; free them unless a backward holds them."""
        self.users -= 1
        if self.users == 0 and not self.in_backward:
            self.release()

    def begin_backward(self, version: int) -> bool:
        """The backward pass reached this unit's outputs: make the weights present and expect
        every trainable parameter's gradient. Returns False if this backward already began
        (another output of the same call), True the first time."""
        if self.in_backward:
            self.wait()
            return False
        # Prefetched, or still gathered from forward: the same bits either way, reuse them.
        self.ensure(version, "backward")
        self.in_backward = True
        self.grads_pending = {p for p in self.params if p.requires_grad}
        self.grads.begin_backward()
        return True

    def grad_ready(self, param) -> bool:
        """``param``'s gradient of this backward is in ``main_grad``. Returns True when it was
        the last one: the weights are released (if no forward uses them) and the caller may
        reduce the unit's gradients (:attr:`.unit_grads.FullGradients.reduces_every_microbatch`)."""
        self.grads_pending.discard(param)
        if not self.in_backward or self.grads_pending:
            return False
        if self.users == 0:
            self.release()
        else:
            self.in_backward = False
        return True

    # -- this rank's chunks ------------------------------------------------------------------
    def _chunk_ranges(self):
        """(parameter, bucket index k, [lo, hi) in the parameter, offset of lo in chunk k) for
        every parameter: its part of chunk r of its bucket (empty when it lies outside)."""
        for buf in self.buffers:
            for p, (start, end, bucket_id) in buf.param_index_map.items():
                bucket = buf.buckets[bucket_id]
                k = self.buckets.index(bucket)
                c = bucket.param_data.numel() // self.comm.dp_size
                lo_chunk = bucket.offset + self.comm.dp_rank * c
                lo, hi = max(start, lo_chunk), min(end, lo_chunk + c)
                hi = max(lo, hi)
                yield p, k, (lo - start, hi - start), lo - lo_chunk

    def chunk_views(self, chunks: List[torch.Tensor]) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """Each parameter's part of chunk r of its bucket, as a 1-D view of ``chunks[k]`` (this
        rank's chunk of bucket k: the primary shards or the fp32 gradient shards); empty when
        the parameter lies outside chunk r. The same range megatron-core's distributed
        optimizer gives the parameter (``gbuf_world_in_bucket``)."""
        return {p: chunks[k][at : at + hi - lo]
                for p, k, (lo, hi), at in self._chunk_ranges()}

    def shard_map(self) -> ShardMap:
        """This rank's :class:`ParamShard` of every parameter of the unit."""
        grads = self.grads.shard_views()
        return {p: ParamShard(lo, hi, self.shards[k][at : at + hi - lo], grads.get(p))
                for p, k, (lo, hi), at in self._chunk_ranges()}

    # -- gradients (the unit's strategy: .grads) ---------------------------------------------
    @property
    def grad_shards(self) -> List[torch.Tensor]:
        """This rank's fp32 gradient chunk of every bucket (``shard_grads``; else empty)."""
        return self.grads.shards

    def reduction_pending(self) -> bool:
        """Whether :meth:`start_grad_reduce` would issue a reduction now."""
        return self.grads.pending()

    def start_grad_reduce(self, async_op: bool) -> None:
        """Scale and reduce-scatter this unit's gradients (every DP rank issues the same calls in
        the same order: units reduce as their backward ends, leftovers in
        :meth:`ZeroPPDataParallel.finish_grad_sync`), as the unit's gradient strategy does
        (:mod:`.unit_grads`)."""
        self.grads.start_reduce(async_op)

    def finish_grad_reduce(self) -> None:
        """Wait for this unit's gradient reduction in flight (stream wait on CUDA)."""
        self.grads.finish_reduce()

    def grads_synced(self) -> None:
        """After the step's last reduction: ``main_grad`` points where the optimizer reads
        the reduced gradients."""
        self.grads.synced()

    def zero_grads(self) -> None:
        """Zero this unit's gradients (start of a step)."""
        self.grads.zero()

    def scale_grads(self, factor: float) -> None:
        """Scale this unit's (reduced) gradients, wherever they live."""
        self.grads.scale(factor)

    # -- weight updates outside the optimizer ----------------------------------------------
    def write_back(self) -> None:
        """Copy this rank's chunk of the (gathered, possibly modified) full weights into the
        primary shards, e.g. after ``load_state_dict`` wrote the full parameters."""
        if self.state is not UnitState.GATHERED:
            raise RuntimeError(f"unit {self.name}: write_back needs gathered weights")
        z, r = self.comm.dp_size, self.comm.dp_rank
        for bucket, shard in zip(self.buckets, self.shards):
            n = bucket.param_data.numel() // z
            shard.copy_(bucket.param_data.view(-1)[r * n : (r + 1) * n])
