"""Stop at the first non-finite loss or gradient (Megatron-LM's --check-for-nan-in-loss-and-grad).

The loss and the gradient norm are all-reduced, so every rank sees the same values and stops at
the same iteration. A skipped step counts as non-finite gradients unless the loss scale is
dynamic (fp16 without --loss-scale), where a skip is the scaler backing off after an overflow.
"""

from __future__ import annotations

import math

from megatron_zeropp.errors import NonFiniteError


def check_finite(iteration: int, loss: float, grad_norm, skipped: bool,
                 dynamic_loss_scale: bool) -> None:
    """Raise :class:`NonFiniteError` naming the iteration and the values."""
    bad_loss = not math.isfinite(loss)
    bad_grad = (grad_norm is not None and not math.isfinite(grad_norm)) or \
        (skipped and not dynamic_loss_scale)
    if bad_loss or bad_grad:
        what = "the loss is" if bad_loss else "the gradients are"
        raise NonFiniteError(
            f"iteration {iteration}: {what} not finite (lm loss {loss}, grad norm "
            f"{grad_norm}, step skipped: {skipped}); stopping. The last checkpoint is untouched; "
            f"--no-check-for-nan-in-loss-and-grad keeps training")
