"""Which protocol each collective of a ZeRO++ layer uses: the protocol chooser.

It reads the layer's :class:`~.step_clock.StepClock` (qgZ on or off this iteration, whether the
qgZ error is measured, the stochastic-rounding keys) and writes none of it; it owns the per-phase
byte counters, the qgZ error meter and the hpZ staleness flags.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_zeropp.comm import (
    CommStats,
    QgzResidual,
    StaleSecondaryError,
    qgz_reduce_scatter,
    qgz_residual_input,
    qwz_all_gather,
    qwz_diff_all_gather,
    zero3_all_gather,
    zero3_reduce_scatter,
)
from megatron_zeropp.comm.work import run_protocol

from .config import ZeroPPConfig
from .error_meter import ErrorMeter
from .qgz_error import exact_chunk
from .step_clock import StepClock

PHASES = ("forward", "backward", "grad")


class ShardComm:
    """Which protocol each collective of the layer uses, with per-phase byte counters.

    ``stats[phase]`` counts the bytes of the weight gathers before forward (``"forward"``), before
    backward (``"backward"``) and of the gradient reductions (``"grad"``). ``clock``: the layer's
    step clock, read here, advanced by the layer.
    """

    def __init__(self, config: ZeroPPConfig, groups, topology, clock: StepClock):
        self.config = config
        self.groups = groups
        self.topology = topology
        self.clock = clock
        self.dp_group = groups.dp
        self.dp_size = len(groups.dp_ranks)
        self.dp_rank = groups.dp_ranks.index(torch.distributed.get_rank())
        if clock.dp_rank != self.dp_rank:
            raise ValueError(f"step clock of DP rank {clock.dp_rank} given to DP rank "
                             f"{self.dp_rank}")
        self.stats: Dict[str, CommStats] = {p: CommStats(topology) for p in PHASES}
        # The qgZ error diagnostic: measured on the iterations the clock picks.
        self.qgz_error = ErrorMeter("qgz") if config.qgz_error_interval else None
        self.qwz_error = ErrorMeter("qwz") if config.qwz_error_interval else None
        self._stale_flags: Dict[torch.device, torch.Tensor] = {}
        self.holders = _hpz_holders(topology, groups, config) if config.qwz_diff_bits else None

    def stale_flag(self, device: torch.device) -> torch.Tensor:
        """The device-side flag hpZ reads set when a secondary was stale (checked once a step)."""
        flag = self._stale_flags.get(device)
        if flag is None:
            flag = torch.zeros(1, dtype=torch.bool, device=device)
            self._stale_flags[device] = flag
        return flag

    def check_stale(self) -> None:
        """Raise if any hpZ read since the last check saw a stale secondary (one host read per
        device; called once per step, before the optimizer uses the gradients)."""
        for flag in self._stale_flags.values():
            if bool(flag.item()):
                flag.zero_()
                raise StaleSecondaryError(
                    "an hpZ secondary partition was read at a weight version another rank of its "
                    "group did not hold: the gradients of this step are not to be trusted"
                )

    def gather_weights(self, output, shard, phase: str, async_op: bool, segments=None,
                       bucket_id: Optional[int] = None):
        """All-gather a bucket's primary shards (qwZ or plain; plain and uncounted for
        ``phase="exact"``, used for checkpoints and ``state_dict``). ``segments``: the bucket's
        parameters (:func:`~megatron_zeropp.comm.segments.param_segments`), so qwZ blocks
        stay inside one parameter and small ones travel exactly; ``bucket_id`` keys the
        stochastic rounding (when on)."""
        if phase == "exact":
            return zero3_all_gather(output, shard, self.dp_group, async_op)
        if self.config.qwz and not self.config.qwz_diff_bits:
            return qwz_all_gather(
                output, shard, self.dp_group, async_op,
                bits=self.config.qwz_bits, block_size=self.config.qwz_block_size,
                stats=self.stats[phase], segments=segments,
                rounding_key=self.clock.qwz_key(bucket_id),
            )
        return zero3_all_gather(output, shard, self.dp_group, async_op, stats=self.stats[phase])

    def gather_exact(self, output, shard, phase: str, async_op: bool):
        """All-gather a bucket's primary shards unquantized, counted under ``phase``: the 16-bit
        weights that start (or restart) a qwZ difference reference."""
        return zero3_all_gather(output, shard, self.dp_group, async_op, stats=self.stats[phase])

    def gather_differences(self, slice_out, shard, reference, phase: str, async_op: bool,
                           segments, bucket_id: int, sent: int):
        """qwZ differences of one bucket (``qwz_diff_bits``): this rank's primary shard against
        its ŵ ``reference``, into every holder's secondary slice ``slice_out`` in place."""
        return qwz_diff_all_gather(
            slice_out, shard, self.dp_group, async_op, reference=reference,
            holders=self.holders, bits=self.config.qwz_diff_bits,
            block_size=self.config.qwz_block_size, stats=self.stats[phase], segments=segments,
            rounding_key=self.clock.diff_key(bucket_id, sent),
        )

    def reduce_gradients(self, output, input, async_op: bool, key: Optional[str] = None,
                         residual: Optional[QgzResidual] = None, segments=None,
                         bucket_id: Optional[int] = None):
        """Reduce-scatter a bucket's gradients (sum; megatron-core pre-scales them). ``key``
        names the unit for the qgZ error diagnostic; ``residual`` is the bucket's qgZ error
        feedback state; ``segments`` its parameters; ``bucket_id`` keys the stochastic
        rounding (all unused while qgZ is off)."""
        if self.clock.qgz_active:
            rounding = self.clock.qgz_key(bucket_id)
            if self.clock.measure_qgz_error and key is not None:
                return self._measured_qgz(output, input, async_op, key, residual, segments,
                                          rounding)
            return self._qgz(output, input, async_op, residual, segments, rounding)
        if residual is not None:
            self._flush_residual(input, residual, segments)
        return zero3_reduce_scatter(
            output, input, self.dp_group, "sum", async_op, stats=self.stats["grad"]
        )

    def _flush_residual(self, input, residual: QgzResidual, segments) -> None:
        """qgZ is off now: add what error feedback still carries to this (exact) reduction's
        input, once, instead of dropping it (the sum over ranks then delivers it in full)."""
        carried = qgz_residual_input(
            residual, input.numel(), self.groups.intra_node, self.groups.inter_node,
            block_size=self.config.qgz_block_size, segments=segments,
            hadamard_seed=self.config.qgz_hadamard_seed if self.config.qgz_hadamard else None,
        )
        if carried is not None:
            input.view(-1).add_(carried.to(input.dtype))
        residual.reset()

    def _qgz(self, output, input, async_op: bool, residual: Optional[QgzResidual] = None,
             segments=None, rounding_key: Optional[int] = None):
        return qgz_reduce_scatter(
            output, input, self.groups.intra_node, self.groups.inter_node, "sum", async_op,
            bits=(self.config.qgz_intra_bits, self.config.qgz_inter_bits),
            block_size=self.config.qgz_block_size, stats=self.stats["grad"], residual=residual,
            hadamard_seed=self.config.qgz_hadamard_seed if self.config.qgz_hadamard else None,
            segments=segments, rounding_key=rounding_key,
        )

    def _measured_qgz(self, output, input, async_op: bool, key: str,
                      residual: Optional[QgzResidual] = None, segments=None,
                      rounding_key: Optional[int] = None):
        """The qgZ reduction plus the diagnostic's exact fp32 reduction of the same input, in
        one call on the reduction lane (the exact copy is taken first: ``output`` may be a view
        of ``input``)."""
        meter, group, rank = self.qgz_error, self.dp_group, self.dp_rank

        def body():
            exact = exact_chunk(input, group, rank, output.numel())
            self._qgz(output, input, False, residual, segments, rounding_key)
            meter.add(key, output, exact)

        return run_protocol(body, async_op, "qgz_error_probe", input.device, lane="reduce",
                            keep=(input,))

    def reduce_and_accumulate(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool,
                              key: Optional[str] = None,
                              residual: Optional[QgzResidual] = None, segments=None,
                              bucket_id: Optional[int] = None):
        """Reduce-scatter ``full`` and add this rank's chunk, in fp32, into ``shard``.

        One call on the reduction lane (the temporary chunk lives and dies there); ``full`` is
        kept alive for the lane, so the caller may free it right after issuing.
        """
        if self.dp_size == 1:
            def body():
                shard.add_(full.view(-1))
        else:
            out_dtype = torch.float32 if self.clock.qgz_active else full.dtype

            def body():
                chunk = torch.empty(shard.numel(), dtype=out_dtype, device=full.device)
                self.reduce_gradients(chunk, full, async_op=False, key=key, residual=residual,
                                      segments=segments, bucket_id=bucket_id)
                shard.add_(chunk)

        return run_protocol(body, async_op, "grad_shard", full.device, lane="reduce", keep=(full,))


def _hpz_holders(topology, groups, config) -> tuple:
    """The hpZ slice each DP group rank holds (its index in its hpZ group), from the topology:
    where each owner's differences must go."""
    out = []
    hpz_groups = topology.hpz_groups(config.hpz_partition_size)
    for rank in groups.dp_ranks:
        group = next(g for g in hpz_groups if rank in g)
        out.append(list(group).index(rank))
    return tuple(out)
