"""Data-parallel collectives: plain ZeRO-3 baselines and the ZeRO++ protocols (qwZ, hpZ, qgZ).

Every collective is shaped like ``torch.distributed``: ``(output, input, group(s),
async_op=False, *, stats=None, ...)``, returns ``None`` when sync and a :class:`CommHandle` (with
``wait()`` and ``is_completed()``) when async, and validates shapes, dtypes and sizes before any
collective starts. See :mod:`.work` for the ordering rule of async calls and :mod:`.accounting`
for the byte model.
"""

from .accounting import CommStats, StepCounts
from .baseline import zero3_all_gather, zero3_reduce_scatter
from .common import (
    LAB_TRANSPORTS,
    host_staging_forced,
    lab_transport_name,
    set_host_staging,
    set_lab_transport,
)
from .hpz import SecondaryPartition, SecondaryWeights, StaleSecondaryError
from .qgz import QgzPlan, qgz_plan, qgz_reduce_scatter, qgz_residual_input
from .qgz_feedback import QgzResidual
from .qwz import qwz_all_gather
from .qwz_diff import qwz_diff_all_gather
from .work import CommHandle, drain

__all__ = [
    "CommHandle",
    "CommStats",
    "QgzPlan",
    "QgzResidual",
    "SecondaryPartition",
    "SecondaryWeights",
    "StaleSecondaryError",
    "StepCounts",
    "drain",
    "LAB_TRANSPORTS",
    "host_staging_forced",
    "lab_transport_name",
    "qgz_plan",
    "qgz_reduce_scatter",
    "qgz_residual_input",
    "qwz_all_gather",
    "qwz_diff_all_gather",
    "set_host_staging",
    "set_lab_transport",
    "zero3_all_gather",
    "zero3_reduce_scatter",
]
