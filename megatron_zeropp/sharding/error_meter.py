"""Relative error of a quantized result per unit: the sums behind the qgZ and qwZ diagnostics.

Each rank accumulates, per unit and on the device, ``||result - exact||^2`` and ``||exact||^2``
over its own part (its chunk of a reduction, its shard of the weights); :meth:`ErrorMeter.report`
sums both over the DP group (one all-reduce for all units) and returns
``sqrt(sum err^2 / sum exact^2)`` per unit and over all units.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_zeropp.comm.work import run_protocol


class ErrorMeter:
    """Per-unit sums of squared error and squared exact value, kept on the device.

    Args:
        what: what is measured, for messages and the report's collective (``"qgz"``,
            ``"qwz"``).
    """

    def __init__(self, what: str):
        self.what = what
        self._sums: Dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget what was accumulated (start of a measured iteration)."""
        self._sums = {}

    def add(self, key: str, result: torch.Tensor, exact: torch.Tensor) -> None:
        """Accumulate ``||result - exact||^2`` and ``||exact||^2`` under ``key`` (fp64, no
        host read)."""
        if result.numel() != exact.numel():
            raise ValueError(
                f"{self.what} error of {key}: result has {result.numel()} elements, exact "
                f"{exact.numel()}"
            )
        q = result.reshape(-1).to(torch.float64)
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
        ``None`` if no key was measured. A unit whose exact value is zero reports 0.0 (its
        quantized one is zero too: zeros quantize to zero). ``sums`` lets reports of several model
        chunks be combined (:func:`combined_report`)."""
        keys = [k for k in keys if k in self._sums]
        if not keys:
            return None
        sums = torch.stack([self._sums[k] for k in keys])  # (U, 2)
        # Through the comm lane, not a raw all-reduce from this thread: on CPU the next step's
        # prefetch gathers may still be queued on the comm thread, and a collective issued
        # here would overtake them on some ranks and not others (a hang).
        run_protocol(lambda: dist.all_reduce(sums, group=group), False, f"{self.what}_error_report",
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
