"""The ZeRO-3 layer with qwZ / hpZ / qgZ beneath megatron-core modules."""

from .config import ZeroPPConfig
from .data_parallel import ZeroPPDataParallel
from .schedule import UnitSchedule

__all__ = ["UnitSchedule", "ZeroPPConfig", "ZeroPPDataParallel"]
