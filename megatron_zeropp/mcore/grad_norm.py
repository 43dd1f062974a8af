"""A gradient norm without one host sync per parameter, for megatron-core without apex or TE.

Checked: megatron-core 0.16.1 and 0.19.1. Without Transformer Engine or apex,
``megatron.core.optimizer.clip_grads`` falls back to ``megatron.core.utils.
local_multi_tensor_l2_norm``, which turns the per-tensor norms into a host list (``torch.tensor`` of
0-d device tensors: one device-to-host copy and stream sync per parameter) and then copies the
result back to the device. On the 1.3B GPT of the GPU benchmarks that is ~100 syncs per step: a
profile at 10 Gbit/s shows the GPU idle between them while the optimizer step is on the critical
path of every configuration, megatron-core's own included. apex's and TE's ``multi_tensor_l2norm``
never leave the device.

:func:`device_l2_norm` is a drop-in with the same contract (``(norm of all tensors as a
1-element fp32 tensor, None)``) that stays on the device: per-tensor norms by
``torch._foreach_norm``, then the norm of those. It is installed only where megatron-core
chose its own fallback (with apex or TE present, nothing changes), on CPU and GPU alike.
Numerically it is the same two-level norm; on CPU ``_foreach_norm`` runs the same per-tensor
kernel, so CPU results are bit-identical to the fallback's (tested).
"""

from __future__ import annotations

import importlib
from typing import List

import torch

from .version import mcore_version

# megatron-core modules that bound the fallback at import: module -> attribute holding it.
_USERS = {"megatron.core.optimizer.clip_grads": "l2_norm_impl"}

_applied = False


def device_l2_norm(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], per_tensor,
                   *args):
    """``amp_C.multi_tensor_l2norm``'s contract without leaving the device.

    Returns ``(norm, None)``: ``norm`` is the L2 norm of every tensor in ``tensor_lists``, fp32,
    shape ``(1,)``, on the tensors' device. ``per_tensor`` norms are not supported (megatron-core
    never asks for them).
    """
    if per_tensor:
        raise ValueError("device_l2_norm: per-tensor norms were requested (per_tensor=True)")
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        raise ValueError("device_l2_norm: no tensors (megatron-core checks for none before)")
    norms = torch._foreach_norm(tensors)
    stacked = torch.stack([n.to(torch.float32) for n in norms])
    return torch.linalg.vector_norm(stacked).reshape(1), None


def apply() -> bool:
    """Install :func:`device_l2_norm` where megatron-core uses its host-syncing fallback.

    Returns True when it is installed. Raises when a module that should hold the fallback no
    longer has the attribute (a newer megatron-core moved it).
    """
    global _applied
    if _applied:
        return True
    from megatron.core import utils as mcore_utils

    fallback = getattr(mcore_utils, "local_multi_tensor_l2_norm", None)
    installed = False
    for name, attr in _USERS.items():
        module = importlib.import_module(name)
        if not hasattr(module, attr):
            raise RuntimeError(
                f"megatron_zeropp/mcore/grad_norm.py: {name}.{attr} does not exist in "
                f"megatron-core {'.'.join(map(str, mcore_version()))}")
        if fallback is not None and getattr(module, attr) is fallback:
            setattr(module, attr, device_l2_norm)
            installed = True
    _applied = installed
    return installed
