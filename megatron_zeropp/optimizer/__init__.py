"""What ZeRO-3 needs on top of megatron-core's DistributedOptimizer (nothing else lives here)."""

from .zero3 import (
    distributed_optimizers,
    get_zeropp_optimizer,
    is_distributed,
    reload_model_params,
)

__all__ = [
    "distributed_optimizers",
    "get_zeropp_optimizer",
    "is_distributed",
    "reload_model_params",
]
