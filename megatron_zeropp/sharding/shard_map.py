"""Which part of each parameter this DP rank holds: the seam between the ZeRO layer and the code
that reads or writes its shards (the optimizer, checkpoints).

The layer builds one :class:`ParamShard` per parameter it shards; nothing else learns where the
shards are (no attributes planted on parameters or megatron-core buckets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass(frozen=True)
class ParamShard:
    """This rank's part of one parameter.

    ``start``/``end``: the element range of the flattened parameter (``start == end`` when the
    rank holds none of it); the same range megatron-core's distributed optimizer gives the
    parameter. ``primary``: a 1-D view of the 16-bit primary shard holding those elements.
    ``grad``: a 1-D fp32 view of the gradient shard (``--zeropp-shard-grads``), else ``None``
    (the gradients are in megatron-core's full buffer, where the optimizer finds them itself).
    """

    start: int
    end: int
    primary: torch.Tensor
    grad: Optional[torch.Tensor] = None

    def __post_init__(self):
        if not 0 <= self.start <= self.end or self.primary.numel() != self.end - self.start:
            raise ValueError(f"shard range [{self.start}, {self.end}) does not match its primary "
                             f"view of {self.primary.numel()} elements")
        if self.grad is not None and self.grad.numel() != self.primary.numel():
            raise ValueError(f"gradient shard of {self.grad.numel()} elements for a primary "
                             f"shard of {self.primary.numel()}")


ShardMap = Dict[torch.nn.Parameter, ParamShard]
"""Every parameter a ZeRO layer chunk shards -> this rank's :class:`ParamShard` of it."""
