"""A CPU stand-in for apex's FusedAdam, to run megatron-core as a GPU Megatron-LM runs it.

Megatron-LM on GPUs runs apex's or Transformer Engine's fused Adam, whose state differs from
torch's Adam in one respect megatron-core's checkpoint code depends on: ``exp_avg`` and
``exp_avg_sq`` per parameter, the ``step`` once per param group (``group["step"]``), where
torch's Adam keeps a ``step`` tensor per parameter. megatron-core picks its code paths at import
(``HAVE_APEX_OR_TE``, ``USING_APEX_OPTIMIZER``, ``USING_PYTORCH_OPTIMIZER`` and the ``Adam``
class it instantiates); without apex/TE, as on CPU, it takes the torch-Adam paths, on which
Megatron-LM's ``load_checkpoint`` fails for a distributed optimizer (``assert len(steps) == 1``).

:func:`megatron_core_with_fused_adam` sets those module-level names to what megatron-core's own
import binds on a machine with apex, with :class:`FusedAdamStandIn` as ``Adam``; megatron-core's
code is not changed. The stand-in keeps FusedAdam's state layout and computes each step with
torch's AdamW (``adam_w_mode``, megatron-core's default), so its numbers are torch's bit for bit
and a run with it can be compared exactly with one on torch's Adam.
"""

from __future__ import annotations

import contextlib

import torch


class FusedAdamStandIn(torch.optim.AdamW):
    """torch's AdamW with apex FusedAdam's state layout: ``group["step"]``, no per-parameter
    ``step``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False):
        if not adam_w_mode or not bias_correction or amsgrad or capturable:
            raise ValueError("the stand-in covers adam_w_mode with bias correction, not "
                             "captured (CUDA-graph) steps")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def __setstate__(self, state):
        # torch's Adam insists on a per-parameter step when it loads state; FusedAdam has none
        stepless = [s for s in state.get("state", {}).values() if s and "step" not in s]
        for s in stepless:
            s["step"] = torch.tensor(0.0)
        super().__setstate__(state)
        for s in stepless:
            s.pop("step")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            # FusedAdam advances the group's step before its kernel, every call
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                state = self.state[p]
                if state:  # torch's AdamW increments its own copy of the step
                    state["step"] = torch.tensor(float(group["step"] - 1))
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].pop("step", None)
        return loss


@contextlib.contextmanager
def megatron_core_with_fused_adam():
    """megatron-core's optimizer modules as imported with apex present (see the module
    docstring); restored afterwards."""
    import megatron.core.optimizer as optimizer_module
    from megatron.core.optimizer import distrib_optimizer

    names = [(optimizer_module, "Adam", FusedAdamStandIn),
             (optimizer_module, "USING_PYTORCH_OPTIMIZER", False),
             (distrib_optimizer, "Adam", FusedAdamStandIn),
             (distrib_optimizer, "HAVE_APEX_OR_TE", True),
             (distrib_optimizer, "USING_APEX_OPTIMIZER", True)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in names]
    for m, n, v in names:
        setattr(m, n, v)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)
