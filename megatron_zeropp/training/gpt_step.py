"""One GPT training (or evaluation) step through megatron-core's pipeline schedules.

The forward step and loss follow Megatron-LM's ``pretrain_gpt.py`` (masked token mean per
micro-batch, averaged over micro-batches by the schedule). The same function drives megatron-core's
own DDP and our ZeRO++ layer, which is what makes the bit-exact comparisons in the tests meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """Masked mean of the per-token losses of one micro-batch, and its report ``[sum, tokens]``.

    ``per_token`` (``--calculate-per-token-loss``): the masked sum and the token count instead,
    as Megatron-LM returns them; megatron-core then divides the gradients by the tokens of the
    whole global batch rather than averaging per micro-batch.
    """
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    if per_token:
        total = torch.sum(losses.view(-1) * mask)
        tokens = mask.sum().detach().to(torch.int)
        return total, tokens, {"lm loss": torch.stack([total.detach(), mask.sum().detach()])}
    total = torch.sum(losses.view(-1) * mask)
    loss = total / mask.sum().clamp(min=1.0)
    # Reported as Megatron-LM reports it: [masked sum, tokens], summed over the micro-batches and
    # DP ranks, then divided (a token-weighted mean; its printed digits are Megatron-LM's).
    return loss, {"lm loss": torch.stack([total.detach(), mask.sum().detach()])}


def forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model):
    """Megatron-core forward step: batch dict -> (per-token losses, loss function)."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
    )
    per_token = getattr(getattr(model, "config", None), "calculate_per_token_loss", False)
    return output, partial(loss_func, batch["loss_mask"], per_token=per_token)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports; identical on every rank."""

    loss: float
    """Mean LM loss over the global batch (NaN when the loss itself was not finite)."""
    grad_norm: Optional[float]
    """Global gradient norm before clipping (None when the step was skipped)."""
    skipped: bool
    """True when the optimizer skipped the step (non-finite gradients)."""
    num_zeros: Optional[float] = None
    """Zeros in the gradient, when the optimizer counts them."""


def loss_sums(losses: List[Dict[str, torch.Tensor]], dp_group, pp_group) -> torch.Tensor:
    """``[masked loss sum, tokens]`` (fp32) of the global batch, on every rank, as Megatron-LM's
    train_step and evaluate reduce them: stacked over micro-batches and summed, then summed over
    DP (and over PP, where only the last stage has losses and the others add zeros)."""
    if losses:
        local = torch.vstack([d["lm loss"].float().view(-1) for d in losses]).sum(dim=0)
    else:
        local = torch.zeros(2, device=_device())
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(local, group=pp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(local, group=dp_group)
    return local


def mean_of(sums: torch.Tensor) -> float:
    """The token-weighted mean loss of :func:`loss_sums` (as Megatron-LM divides it, in fp32)."""
    return float((sums[0] / sums[1].clamp(min=1)).item())


def _device():
    from megatron_zeropp.backend import default_device

    return default_device()


def run_microbatches(
    model_chunks,
    data_iterator,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
):
    """Run megatron-core's forward/backward schedule for this parallel layout."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(
    model_chunks,
    optimizer,
    data_iterator,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    dp_group=None,
    pp_group=None,
) -> StepResult:
    """Zero grads, forward/backward over ``num_microbatches``, optimizer step."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_microbatches(
        model_chunks, data_iterator, num_microbatches, seq_length, micro_batch_size, False
    )
    ok, grad_norm, num_zeros = optimizer.step()
    loss = mean_of(loss_sums(losses, dp_group, pp_group))
    return StepResult(
        loss=loss,
        grad_norm=None if grad_norm is None else float(grad_norm),
        skipped=not ok,
        num_zeros=None if num_zeros is None else float(num_zeros),
    )


@torch.no_grad()
def eval_step(
    model_chunks, data_iterator, num_microbatches, seq_length, micro_batch_size,
    dp_group=None, pp_group=None,
) -> torch.Tensor:
    """Forward-only pass; returns :func:`loss_sums` ``[loss sum, tokens]`` of the batch."""
    losses = run_microbatches(
        model_chunks, data_iterator, num_microbatches, seq_length, micro_batch_size, True
    )
    return loss_sums(losses, dp_group, pp_group)
