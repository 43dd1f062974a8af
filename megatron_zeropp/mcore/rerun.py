"""megatron-core's rerun state machine, as the ZeRO++ layer's step clock needs it."""

from __future__ import annotations


def reruns_current_iteration() -> bool:
    """Whether megatron-core's rerun state machine is running the current iteration's
    forward/backward a second time, in place (Megatron-LM's ``train_step`` loops on
    ``should_run_forward_backward``, calling ``zero_grad_buffer`` each time; ``--rerun-mode
    validate_results`` re-runs an iteration whose result was rejected, to see if it reproduces).

    Reads the machine without creating one (``get_rerun_state_machine`` would make one, with a
    warning, in a loop that never set it up). Only ``RERUNNING_IN_PLACE`` repeats an iteration
    in the same job; ``RERUNNING_FROM_CHECKPOINT`` runs, in a new job, the iteration the
    checkpoint stopped before. Checked: 0.16.1, 0.19.1 (``_GLOBAL_RERUN_STATE_MACHINE``,
    ``RerunState``, the same in both).
    """
    from megatron.core import rerun_state_machine as rsm

    machine = rsm._GLOBAL_RERUN_STATE_MACHINE
    return machine is not None and machine.state == rsm.RerunState.RERUNNING_IN_PLACE


def may_rerun_iterations() -> bool:
    """Whether megatron-core's rerun state machine exists and may re-run an iteration in place
    (any mode but ``DISABLED``: ``validate_results``, ``report_determinism_stats``). Checked:
    0.16.1, 0.19.1 (``_GLOBAL_RERUN_STATE_MACHINE``, ``RerunMode``)."""
    from megatron.core import rerun_state_machine as rsm

    machine = rsm._GLOBAL_RERUN_STATE_MACHINE
    return machine is not None and machine.mode != rsm.RerunMode.DISABLED
