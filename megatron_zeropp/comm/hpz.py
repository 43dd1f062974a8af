"""hpZ: a secondary weight partition inside the node, so the backward gather never leaves it.

After the forward all-gather (qwZ) every rank holds the full weights for a moment. hpZ keeps this
rank's ``1/N`` slice of them (N = hpZ group size, the DP ranks sharing the node) and rebuilds the
full tensor for the backward pass with an all-gather over the hpZ group only::

    forward:  full = qwz_all_gather(primary shard, DP group)     # crosses nodes, INT8
              secondary.refresh(full, version)                   # keep slice i of N, no comm
    backward: secondary.all_gather(full, version)                # intra-node, bit-exact copy

Staleness is the failure mode that matters: a secondary partition left from before an optimizer
step, a checkpoint load or any other weight change silently trains on old weights. So every
secondary partition carries the *weight version* it was filled at (an int the caller bumps on
every weight change, e.g. the optimizer step), and :meth:`SecondaryPartition.all_gather` takes the
version the caller expects:

* each rank sends its stored version with its slice (8 bytes: in the same collective when the
  slices are padded and go through a staging buffer, otherwise in a small all-gather just
  before the slices, which then land straight in ``output``);
* every rank checks all N versions against the expected one and raises
  :class:`StaleSecondaryError` (before touching ``output``) if any differ or was never filled.

Because the check happens on the gathered versions, every rank of the group raises together; a
local check before the collective would leave the healthy ranks hanging in it. Shapes and dtypes
are still validated before the collective.

The check has two modes. By default it reads the gathered tags on the host and raises before
touching ``output`` (a host synchronization per call). With ``stale_flag=`` (a one-element bool
tensor on the device) the comparison stays on the device and only sets the flag; the training
layer passes one flag per step and reads it once, before the optimizer step, so steady-state
gathers never wait on the host. A group of one rank (one DP rank per node) keeps the whole tensor
and copies it locally: no collective at all.

Slicing: the flattened tensor of ``numel`` elements is split into N slices of
``ceil(numel / N)`` elements; the last slices are padded with zeros in storage only, and the
gather writes exactly ``numel`` elements, bit for bit what :meth:`refresh` was given.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .accounting import CommStats
from .common import all_gather_into, check_member, check_tensor
from .work import CommHandle, run_protocol

ALLGATHER = "hpz_allgather"
_TAG_BYTES = 8  # int64 weight version appended to every rank's slice
_NEVER_FILLED = -1


class StaleSecondaryError(RuntimeError):
    """A secondary partition was read at a weight version it was not filled at."""


class SecondaryPartition:
    """This rank's slice of one flattened tensor over an hpZ (intra-node) group.

    Args:
        group: the hpZ process group (DP ranks on this node, or a divisor-sized subset).
        numel: elements of the full tensor.
        dtype: dtype of the full tensor (the compute dtype the backward pass uses).
        device: where the slice lives; defaults to CPU.
        stats: optional byte counter.
    """

    def __init__(
        self,
        group,
        numel: int,
        dtype: torch.dtype,
        device: Optional[torch.device] = None,
        *,
        stats: Optional[CommStats] = None,
    ):
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
            raise ValueError(f"SecondaryPartition numel must be a positive int, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"SecondaryPartition dtype must be a torch.dtype, got {dtype!r}")
        self.group = group
        self.ranks, self.index = check_member("hpZ group", group)
        self.size = len(self.ranks)
        self.numel = numel
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.stats = stats
        esize = torch.empty((), dtype=dtype).element_size()
        self.slice_numel = math.ceil(numel / self.size)
        self._slice_bytes = self.slice_numel * esize
        # Slice bytes followed by the version tag: one buffer, so the tag sent is always the one
        # of the slice sent (refresh waits for in-flight gathers before writing either).
        self._buf = torch.zeros(
            self._slice_bytes + _TAG_BYTES, dtype=torch.uint8, device=self.device
        )
        self._version = _NEVER_FILLED
        self._write_tag(_NEVER_FILLED)
        self._inflight: list = []

    @property
    def version(self) -> Optional[int]:
        """Weight version the slice was filled at; ``None`` if empty or invalidated."""
        return None if self._version == _NEVER_FILLED else self._version

    def is_fresh(self, version: int) -> bool:
        """Whether this rank's slice holds weights of ``version``."""
        return self._version != _NEVER_FILLED and self._version == version

    def storage_bytes(self) -> int:
        """Bytes this partition keeps allocated (slice + version tag), from the live storage."""
        return self._buf.untyped_storage().nbytes()

    @property
    def slice_range(self):
        """``(start, stop)`` element range of the full tensor this rank stores (stop exclusive)."""
        lo = min(self.index * self.slice_numel, self.numel)
        return lo, min(lo + self.slice_numel, self.numel)

    def refresh(self, full: torch.Tensor, version: int) -> None:
        """Keep this rank's slice of the gathered ``full`` tensor, tagged with ``version``.

        Local only (no collective). ``full`` must have ``numel`` elements of ``dtype``.
        """
        _check_version(version)
        check_tensor("full", full, dtypes=(self.dtype,), contiguous=False)
        if full.numel() != self.numel:
            raise ValueError(
                f"hpZ refresh: full tensor has {full.numel()} elements, the partition was built "
                f"for {self.numel}"
            )
        if full.device != self.device:
            raise ValueError(f"hpZ refresh: full is on {full.device}, partition on {self.device}")
        self._drain()
        lo, hi = self.slice_range
        piece = full.reshape(-1)[lo:hi].contiguous().view(torch.uint8)
        self._buf[: piece.numel()].copy_(piece)
        self._buf[piece.numel() : self._slice_bytes].zero_()
        self._version = int(version)
        self._write_tag(self._version)

    def slice_tensor(self) -> torch.Tensor:
        """This rank's stored slice (``slice_numel`` elements of ``dtype``), a view: what
        :func:`~megatron_zeropp.comm.qwz_diff.qwz_diff_all_gather` updates in place. Write it
        only between :meth:`begin_update` and the next gather."""
        return self._buf[: self._slice_bytes].view(self.dtype)

    def begin_update(self, version: int) -> None:
        """The slice is about to be updated in place to the weights of ``version``: wait for
        in-flight gathers that read it, then tag it (the update itself is queued before any
        later gather, in program order)."""
        _check_version(version)
        self._drain()
        self._version = int(version)
        self._write_tag(self._version)

    def track(self, handle) -> None:
        """An async call that writes the slice: later refreshes and updates wait for it."""
        if handle is not None:
            self._inflight.append(handle)

    def invalidate(self) -> None:
        """Mark the slice unusable (after an optimizer step, checkpoint load, weight change)."""
        self._drain()
        self._version = _NEVER_FILLED
        self._write_tag(_NEVER_FILLED)

    def all_gather(
        self,
        output: torch.Tensor,
        version: int,
        async_op: bool = False,
        stale_flag: Optional[torch.Tensor] = None,
        stats: Optional[CommStats] = None,
    ) -> Optional[CommHandle]:
        """Rebuild the full tensor in ``output`` from the group's slices, intra-node only.

        Raises :class:`StaleSecondaryError` on every rank of the group if any rank's slice is not
        at ``version`` (the error surfaces from ``wait()`` when async). The output is bit for bit
        the tensor given to :meth:`refresh`. With ``stale_flag`` (bool, one element, on the
        partition's device) a stale read sets the flag instead of raising, without a host sync.
        ``stats`` overrides the partition's byte counter for this call.
        """
        _check_version(version)
        check_tensor("output", output, dtypes=(self.dtype,))
        if output.numel() != self.numel:
            raise ValueError(
                f"hpZ all_gather: output has {output.numel()} elements, the partition was built "
                f"for {self.numel}"
            )
        if output.device != self.device:
            raise ValueError(
                f"hpZ all_gather: output on {output.device}, partition on {self.device}"
            )
        if stale_flag is not None and (
            stale_flag.dtype != torch.bool or stale_flag.numel() != 1
            or stale_flag.device != self.device
        ):
            raise ValueError(
                f"hpZ all_gather: stale_flag must be one bool on {self.device}, got "
                f"{stale_flag.dtype} x {stale_flag.numel()} on {stale_flag.device}"
            )
        stats = self.stats if stats is None else stats
        if stats is not None:
            stats.count_call(ALLGATHER)
            stats.record_ring(ALLGATHER, self.ranks, self._slice_bytes, _TAG_BYTES)
        send = self._buf  # read by the collective when it runs
        # Without padding the slices land straight in ``output`` (tags first, in their own small
        # gather, so a stale read still raises before ``output`` is touched); the one-buffer
        # gather needs a staging copy of the whole tensor, which on CPU cost about as much as
        # the gather itself (a fresh allocation's page faults plus a copy).
        direct = self.size > 1 and self.numel == self.size * self.slice_numel

        def check(tags: torch.Tensor) -> None:
            tags = tags.view(torch.int64).view(-1)
            if stale_flag is not None:
                stale_flag.logical_or_((tags != version).any())
            else:
                _raise_if_stale(self.ranks, tags.tolist(), version)

        def body():
            if direct:
                tags = torch.empty(self.size, _TAG_BYTES, dtype=torch.uint8, device=self.device)
                all_gather_into(tags, send[self._slice_bytes :], self.group)
                check(tags)
                all_gather_into(output.view(-1).view(torch.uint8), send[: self._slice_bytes],
                                self.group)
                return
            if self.size == 1:
                recv = send.view(1, -1)
            else:
                recv = torch.empty(self.size, send.numel(), dtype=torch.uint8, device=self.device)
                all_gather_into(recv, send, self.group)
            check(recv[:, self._slice_bytes :].clone(memory_format=torch.contiguous_format))
            nbytes = self.numel * output.element_size()
            output.view(-1).view(torch.uint8).copy_(
                recv[:, : self._slice_bytes].reshape(-1)[:nbytes]
            )

        handle = run_protocol(body, async_op, ALLGATHER, self.device, stats=stats)
        if handle is not None:
            self._inflight = [h for h in self._inflight if not h.is_completed()] + [handle]
        return handle

    def _drain(self) -> None:
        # An async gather reads the buffer when it runs on the comm thread: let pending gathers
        # finish before the buffer changes under them. Their errors stay with their handles.
        for handle in self._inflight:
            try:
                handle.wait()
            except Exception:
                pass
        self._inflight.clear()

    def _write_tag(self, version: int) -> None:
        # Filled on the device (a kernel with the value as argument): no host-to-device copy.
        tag = torch.full((1,), version, dtype=torch.int64, device=self.device)
        self._buf[self._slice_bytes :].copy_(tag.view(torch.uint8))


def _raise_if_stale(ranks, tags, version) -> None:
    bad = {ranks[i]: (None if t == _NEVER_FILLED else t) for i, t in enumerate(tags)
           if t != version}
    if bad:
        raise StaleSecondaryError(
            f"hpZ secondary partition read at weight version {version}, but rank(s) "
            f"hold version(s) {bad} (None = never filled or invalidated); refresh it from "
            "a fresh primary gather first"
        )


def _check_version(version) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"hpZ weight version must be an int >= 0, got {version!r}")


class SecondaryWeights:
    """hpZ for one gather unit: a :class:`SecondaryPartition` per flat weight buffer of the unit,
    kept and read together. The one place that decides whether a gather may stay in the node.

    A gather of a unit at weight version ``v`` reads the secondaries when :meth:`fresh` says
    every partition holds ``v`` on this rank (host-side versions: every rank runs the same
    schedule, so they agree, and the device tags check that at the step's end); otherwise it
    gathers the primary shards across nodes and :meth:`refresh` keeps this rank's slice of the
    result.
    """

    def __init__(self, group, buffers, device=None):
        self.partitions = [
            SecondaryPartition(group, b.numel(), b.dtype, b.device if device is None else device)
            for b in buffers
        ]

    def fresh(self, version: int) -> bool:
        """Whether every partition holds ``version`` on this rank (host state, no sync)."""
        return all(p.is_fresh(version) for p in self.partitions)

    def gather_into(self, outputs, version: int, async_op: bool, stale_flag, stats) -> list:
        """Rebuild each full buffer from the node's slices; returns the async handles."""
        handles = [
            p.all_gather(out, version, async_op, stale_flag=stale_flag, stats=stats)
            for p, out in zip(self.partitions, outputs)
        ]
        return [h for h in handles if h is not None]

    def refresh(self, fulls, version: int) -> None:
        """Keep this rank's slice of each freshly gathered full buffer, tagged ``version``."""
        for p, full in zip(self.partitions, fulls):
            p.refresh(full, version)

    def storage_bytes(self) -> int:
        """Bytes kept on this rank (slices and version tags), from the live storages."""
        return sum(p.storage_bytes() for p in self.partitions)

    def begin_update(self, version: int) -> None:
        """Every partition is about to be updated in place to ``version``
        (:meth:`SecondaryPartition.begin_update`)."""
        for p in self.partitions:
            p.begin_update(version)
