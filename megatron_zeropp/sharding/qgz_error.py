"""qgZ error diagnostic: how far each unit's quantized gradient reduction is from the exact sum.

On a measured iteration every qgZ reduction of a unit also runs an fp32 all-reduce of the very
same input (a copy taken before qgZ may overwrite it) and accumulates, per unit, on the device,
``||qgz - exact||^2`` and ``||exact||^2`` over this rank's chunk. :meth:`QgzErrorMeter.report`
sums both over the DP group (one all-reduce for all units) and returns
``sqrt(sum err^2 / sum exact^2)`` per unit and over all units.

With ``shard_grads`` a unit is reduced once per micro-batch; the sums then run over the
micro-batches too, so a unit's figure is the norm-weighted aggregate of the step's reductions
(a micro-batch with larger gradients weighs more), not the last micro-batch's.

The extra all-reduce is issued inside the same protocol call as the qgZ reduction it checks, and
the report's all-reduce through the same comm lane (so both keep program order on every
rank), with raw ``torch.distributed``, outside the byte counters:
the modelled and handed inter-node bytes per iteration do not include it. The qgZ result used
for the update is the one the call would produce without the diagnostic (only made synchronous
within its lane, which changes timing, not values).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_zeropp.comm.work import run_protocol


def exact_chunk(input: torch.Tensor, group, dp_rank: int, chunk_numel: int) -> torch.Tensor:
    """Chunk ``dp_rank`` of the fp32 sum of ``input`` over ``group`` (zero-padded to
    ``group size * chunk_numel`` elements, as qgZ pads). Copies ``input`` first."""
    z = dist.get_world_size(group)
    full = torch.zeros(z * chunk_numel, dtype=torch.float32, device=input.device)
    full[: input.numel()].copy_(input.reshape(-1))
    # all_reduce, not reduce_scatter: gloo has no reduce-scatter and this runs rarely.
    dist.all_reduce(full, group=group)
    return full[dp_rank * chunk_numel : (dp_rank + 1) * chunk_numel]


class QgzErrorMeter:
    """Per-unit sums of squared qgZ error and squared exact result, kept on the device."""

    def __init__(self):
        self._sums: Dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget what was accumulated (start of a measured iteration)."""
        self._sums = {}

    def add(self, key: str, qgz_out: torch.Tensor, exact: torch.Tensor) -> None:
        """Accumulate one reduction's ``||qgz_out - exact||^2`` and ``||exact||^2`` under
        ``key`` (fp64, no host read)."""
        if qgz_out.numel() != exact.numel():
            raise ValueError(
                f"qgZ error of {key}: result has {qgz_out.numel()} elements, exact {exact.numel()}"
            )
        q = qgz_out.reshape(-1).to(torch.float64)
        e = exact.reshape(-1).to(torch.float64)
        pair = torch.stack(((q - e).square().sum(), e.square().sum()))
        acc = self._sums.get(key)
        if acc is None:
            self._sums[key] = pair
        else:
            acc.add_(pair)

    def measured(self) -> List[str]:
        """Keys with something accumulated, in first-measured order."""
        return list(self._sums)

    def report(self, keys: List[str], group) -> Optional[dict]:
        """``{"units": {key: rel_err}, "total": rel_err, "sums": (err^2, exact^2)}`` over the
        DP ``group`` (a collective: every rank of the group calls it with the same ``keys``);
        ``None`` if no key was measured. A unit whose exact gradient is zero reports 0.0 (its
        qgZ result is zero too: zeros quantize to zero). ``sums`` lets reports of several model
        chunks be combined (:func:`combined_report`)."""
        keys = [k for k in keys if k in self._sums]
        if not keys:
            return None
        sums = torch.stack([self._sums[k] for k in keys])  # (U, 2)
        # Through the comm lane, not a raw all-reduce from this thread: on CPU the next step's
        # prefetch gathers may still be queued on the comm thread, and a collective issued
        # here would overtake them on some ranks and not others (a hang).
        run_protocol(lambda: dist.all_reduce(sums, group=group), False, "qgz_error_report",
                     sums.device, lane="reduce")
        values = sums.cpu().tolist()
        self.reset()
        units = {k: _ratio(err, ref) for k, (err, ref) in zip(keys, values)}
        sums = (sum(v[0] for v in values), sum(v[1] for v in values))
        return {"units": units, "total": _ratio(*sums), "sums": sums}


def combined_report(reports: List[Optional[dict]]) -> Optional[dict]:
    """One report for a rank's model chunks (virtual pipeline stages): each chunk's units under
    ``chunk<i>/`` (when there are several), the total over all of them; ``None`` if no chunk
    measured anything."""
    present = [(i, r) for i, r in enumerate(reports) if r is not None]
    if not present:
        return None
    if len(reports) == 1:
        return present[0][1]
    units = {f"chunk{i}/{k}": v for i, r in present for k, v in r["units"].items()}
    sums = (sum(r["sums"][0] for _, r in present), sum(r["sums"][1] for _, r in present))
    return {"units": units, "total": _ratio(*sums), "sums": sums}


def _ratio(err2: float, ref2: float) -> float:
    if ref2 == 0.0:
        return 0.0 if err2 == 0.0 else math.inf
    return math.sqrt(err2 / ref2)
