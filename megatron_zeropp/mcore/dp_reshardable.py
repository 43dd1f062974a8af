"""megatron-core's ``dp_reshardable`` optimizer checkpoint layout, read into model space.

Megatron-LM's default distributed-optimizer checkpoint (``--use-distributed-optimizer`` without
``--dist-ckpt-optim-fully-reshardable``) stores the fp32 main weights and Adam moments as the flat
buckets of megatron-core DDP's gradient buffer, one 1-D tensor per (TP/PP rank, buffer, bucket,
state)::

    optimizer.distributed.dp_group_idx_<model-parallel rank>.gbuf_idx_<g>.dtype_<dtypes>
        .bucket_idx_<b>.<param|exp_avg|exp_avg_sq>          shape (bucket's unpadded numel,)

Inside a bucket the TP/PP-local parameters lie in reverse ``named_parameters()`` order (backprop
order), each starting on a 64-element boundary (the distributed optimizer's alignment), a bucket
closing where megatron-core's bucket size or a shared embedding closes it. That layout depends
only on the saving run's TP/PP-local parameters and bucket boundaries, not on its DP size: with
the same TP/PP the parameters are this run's, and the boundaries are read from the stored
tensors' sizes, so each parameter's range in its bucket follows (:func:`param_ranges`). At another
TP/PP the saved ranks held other parameter pieces, in an order and with a padding the checkpoint
does not record per parameter; that is refused by the caller.

Checked: 0.16.1 and 0.17.1 (``_ParamAndGradBuffer.__init__``), 0.18.2 and 0.19.2
(``DistributedOptimizer._compute_per_buffer_param_layout``): the same rule.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Sequence, Tuple

import torch

PARAM_ALIGNMENT = 64
"""Elements: every parameter starts on this boundary in the distributed optimizer's buffers."""

_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                  r"\.bucket_idx_(\d+)\.(\w+)$")


def prefix(dp_group_idx: int) -> str:
    """The key prefix of one TP/PP rank's entries."""
    return f"optimizer.distributed.dp_group_idx_{dp_group_idx}"


def bucket_key(dp_group_idx: int, gbuf_idx: int, dtype: str, bucket_idx: int, name: str) -> str:
    return (f"{prefix(dp_group_idx)}.gbuf_idx_{gbuf_idx}.dtype_{dtype}"
            f".bucket_idx_{bucket_idx}.{name}")


def dp_group_idx() -> int:
    """This rank's ``data_parallel_group_idx`` (megatron-core's ``get_megatron_optimizer``
    passes the rank in the model-parallel group: the same on every DP rank of a TP/PP rank)."""
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group().rank()


def stored_buffers(tensor_sizes: Dict[str, Sequence[int]], group_idx: int
                   ) -> Dict[int, Tuple[str, List[int], List[str]]]:
    """``gbuf_idx -> (dtype string, unpadded numel per bucket, state names)`` of TP/PP rank
    ``group_idx``, from the checkpoint's tensor keys and sizes."""
    found: Dict[int, dict] = {}
    for key, size in tensor_sizes.items():
        m = _KEY.match(key)
        if not m or int(m.group(1)) != group_idx:
            continue
        g, dtype, b, name = int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        entry = found.setdefault(g, {"dtype": dtype, "buckets": {}, "names": set()})
        if entry["dtype"] != dtype:
            raise ValueError(f"buffer {g} stored with dtypes {entry['dtype']} and {dtype}")
        entry["buckets"][b] = int(size[0])
        entry["names"].add(name)
    out = {}
    for g, entry in sorted(found.items()):
        buckets = entry["buckets"]
        if sorted(buckets) != list(range(len(buckets))):
            raise ValueError(f"buffer {g}: buckets {sorted(buckets)} stored, not 0..n-1")
        out[g] = (entry["dtype"], [buckets[b] for b in range(len(buckets))],
                  sorted(entry["names"]))
    return out


def buffer_params(chunks: Sequence[torch.nn.Module]) -> List[Tuple[torch.dtype, list]]:
    """The parameters of each megatron-core DDP buffer for the model ``chunks`` (data-parallel
    wrappers; DDP lays out its ``module``'s parameters), in megatron-core's buffer order: chunk
    by chunk, grouped by dtype in order of first appearance, each group in
    ``named_parameters()`` order (the buffer lays them out reversed)."""
    out = []
    for chunk in chunks:
        groups: Dict[torch.dtype, list] = {}
        for _, p in getattr(chunk, "module", chunk).named_parameters():
            if p.requires_grad:
                groups.setdefault(p.dtype, []).append(p)
        out += list(groups.items())
    return out


def param_ranges(params: Sequence[torch.nn.Parameter], bucket_numels: Sequence[int]
                 ) -> Dict[torch.nn.Parameter, Tuple[int, int, int]]:
    """``param -> (bucket index, start, end)`` inside its bucket, for one buffer's ``params``
    (``named_parameters()`` order) and the stored unpadded size of each bucket.

    Parameters are laid out reversed, each start rounded up to :data:`PARAM_ALIGNMENT`; a bucket
    ends exactly where its stored unpadded size ends (after a parameter), and the next starts at
    its own offset 0 (megatron-core pads a bucket's end to a multiple of 128 and of the DP size,
    which is a multiple of the alignment). Raises when the parameters do not fill the buckets."""
    out = {}
    bucket, start = 0, 0
    for p in reversed(list(params)):
        start = math.ceil(start / PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        if bucket < len(bucket_numels) and start and start == bucket_numels[bucket]:
            # a bucket closed before a shared embedding ends after the aligned start
            bucket, start = bucket + 1, 0
        if bucket >= len(bucket_numels):
            raise ValueError(f"parameters do not fit the stored buckets {list(bucket_numels)}")
        end = start + math.prod(p.shape)
        if end > bucket_numels[bucket]:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} ends at {end}, past the "
                             f"stored bucket {bucket} of {bucket_numels[bucket]} elements")
        out[p] = (bucket, start, end)
        if end == bucket_numels[bucket]:
            bucket, start = bucket + 1, 0
        else:
            start = end
    if bucket != len(bucket_numels) or start:
        raise ValueError(f"this model's parameters fill buckets of other sizes than the stored "
                         f"{list(bucket_numels)} (other parameters or another order)")
    return out
