"""A gradient norm with one host sync per step, for megatron-core without apex or TE.

Checked: megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2. Without Transformer Engine or apex,
``megatron.core.optimizer.clip_grads`` falls back to ``megatron.core.utils.
local_multi_tensor_l2_norm``, which turns the per-tensor norms into a host list (``torch.tensor`` of
0-d device tensors: one device-to-host copy and stream sync per parameter) and then copies the
result back to the device. On the 1.3B GPT of the GPU benchmarks that is ~100 syncs per step: a
profile at 10 Gbit/s shows the GPU idle between them while the optimizer step is on the critical
path of every configuration, megatron-core's own included. apex's and TE's ``multi_tensor_l2norm``
never leave the device.

:func:`device_l2_norm` is a drop-in with the same contract (``(norm of all tensors as a
1-element fp32 tensor, None)``) and the same bits: the per-tensor norms are the fallback's own
``torch.norm`` calls, left on the device (no sync each), and the norm of those is taken on the
host, as the fallback takes it, after one device-to-host copy of all of them. That is one sync per
step where the fallback has one per parameter, and megatron-core syncs right after anyway
(``get_grad_norm_fp32`` ends in ``.item()``). (An earlier version took the second norm on the
device with ``torch._foreach_norm``: the same on CPU, but the last float32 bit differed from
megatron-core's on a GPU.) It is installed only where megatron-core chose its own fallback (with
apex or TE present, nothing changes), on CPU and GPU alike.
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
    """``amp_C.multi_tensor_l2norm``'s contract, with the bits of megatron-core's fallback.

    Returns ``(norm, None)``: ``norm`` is the L2 norm of every tensor in ``tensor_lists``, fp32,
    shape ``(1,)``, on the tensors' device. ``per_tensor`` norms are not supported (megatron-core
    never asks for them).
    """
    if per_tensor:
        raise ValueError("device_l2_norm: per-tensor norms were requested (per_tensor=True)")
    if not any(tensor_lists):
        raise ValueError("device_l2_norm: no tensors (megatron-core checks for none before)")
    device = next(t.device for tensor_list in tensor_lists for t in tensor_list)
    # the fallback's torch.tensor(l2) of 0-d device tensors: the same values and shape, one copy
    per_tensor_norms = torch.stack([torch.stack([torch.norm(t) for t in tensor_list])
                                    for tensor_list in tensor_lists]).cpu()
    total = torch.norm(per_tensor_norms)
    return total.reshape(1).to(device=device, dtype=torch.float), None


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
