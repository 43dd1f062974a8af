"""megatron-core's batch-size ramp-up (``--rampup-batch-size``), where the installed release has it.

0.16.1 and 0.17.1 ship ``RampupBatchsizeNumMicroBatchesCalculator``; 0.18.2 and 0.19.2 removed it
(their ``init_num_microbatches_calculator`` ignores ``rampup_batch_size`` with a deprecation
warning, and Megatron-LM core_v0.19.0 has no ``--rampup-batch-size`` flag). Checked: 0.16.1,
0.17.1, 0.18.2, 0.19.2.
"""

from __future__ import annotations

from typing import Optional


def rampup_calculator() -> Optional[type]:
    """megatron-core's ramp-up calculator class, or None where the release removed it."""
    from megatron.core import num_microbatches_calculator as calculators

    return getattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator", None)


def installed_version() -> str:
    """The installed megatron-core, as a user reads it."""
    from .version import mcore_version

    return ".".join(map(str, mcore_version()))
