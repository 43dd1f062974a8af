"""The NaN/Inf stop rule (Megatron-LM's --check-for-nan-in-loss-and-grad) as a pure function."""

import math

import pytest

from megatron_zeropp.errors import NonFiniteError
from megatron_zeropp.training.nan_check import check_finite


def test_finite_steps_and_fp16_backoff_pass():
    check_finite(1, 2.5, 1.0, False, dynamic_loss_scale=False)
    check_finite(2, 2.5, None, True, dynamic_loss_scale=True)  # fp16 scaler backing off


@pytest.mark.parametrize("loss, norm, skipped, dynamic, message", [
    (math.nan, 1.0, False, False, "the loss is not finite"),
    (math.inf, 1.0, False, True, "the loss is not finite"),
    (2.0, math.nan, False, False, "the gradients are not finite"),
    (2.0, math.inf, False, True, "the gradients are not finite"),
    (2.0, None, True, False, "step skipped: True"),
])
def test_non_finite_values_stop_with_the_iteration(loss, norm, skipped, dynamic, message):
    with pytest.raises(NonFiniteError, match=f"iteration 7: .*{message}"):
        check_finite(7, loss, norm, skipped, dynamic_loss_scale=dynamic)
