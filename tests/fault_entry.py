"""pretrain_gpt.py with one injected fault, for tests/test_faults.py (run under torchrun).

``ZEROPP_TEST_FAULT`` picks it: ``freeze:RANK:ITER`` (RANK stops responding after iteration
ITER, as a hung kernel or a stopped process would), ``kill:RANK:ITER`` (RANK dies),
``kill_save:RANK:ITER`` (RANK dies while writing ITER's checkpoint), ``nan:ITER`` (the
loss of iteration ITER+1 becomes NaN on every rank), ``exit_at_start:RANK`` (RANK exits with
code 1 a few seconds after start, before it joins the process group, while the others wait for
it there). Without it, and in ranks torchrun restarted (``--max-restarts``), this is
pretrain_gpt.py.

``ZEROPP_TEST_RANK_ARGV=RANK`` with ``ZEROPP_TEST_ARGV_FROM`` / ``ZEROPP_TEST_ARGV_TO``: on that
rank only, the command-line value FROM reads TO (a node-local path that differs between nodes).
"""

import os
import sys
import time


def _hook():
    spec = os.environ.get("ZEROPP_TEST_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None  # (torchrun --max-restarts: the restarted ranks run without it)
    kind, *nums = spec.split(":")
    nums = [int(n) for n in nums]
    rank = int(os.environ["RANK"])

    def on_iteration(iteration, chunks, optimizer):
        if kind == "freeze" and (rank, iteration) == tuple(nums):
            time.sleep(3600)
        if kind == "kill" and (rank, iteration) == tuple(nums):
            os._exit(9)
        if kind == "kill_save" and (rank, iteration) == tuple(nums):
            from megatron_zeropp.checkpointing import legacy as checkpoint

            def die(*args, **kwargs):
                os._exit(9)
            checkpoint.torch.save = die  # --ckpt-format torch
            import megatron.core.dist_checkpointing as dc

            dc.save = die  # torch_dist (the default)
        if kind == "nan" and iteration == nums[0]:
            from megatron_zeropp.training import gpt_step

            clean = gpt_step.loss_func

            def nan_loss(loss_mask, output_tensor, **kwargs):
                loss, report = clean(loss_mask, output_tensor, **kwargs)
                return loss * float("nan"), {"lm loss": report["lm loss"] * float("nan")}
            gpt_step.loss_func = nan_loss
    return on_iteration


if __name__ == "__main__":
    from megatron_zeropp.training.fallbacks import silence_fallback_warnings

    silence_fallback_warnings()  # as pretrain_gpt.py does, before megatron-core is imported
    from megatron_zeropp.training.launch import run_guarded, single_process_defaults
    from megatron_zeropp.training.loop import pretrain

    single_process_defaults()
    argv = sys.argv[1:]
    spec = os.environ.get("ZEROPP_TEST_FAULT", "")
    if spec.startswith("exit_at_start:") and os.environ["RANK"] == spec.split(":")[1]:
        time.sleep(8)  # the other ranks are past their start-up checks, rank 0 holds the lock
        os._exit(1)
    if os.environ.get("ZEROPP_TEST_RANK_ARGV") == os.environ["RANK"]:
        old, new = os.environ["ZEROPP_TEST_ARGV_FROM"], os.environ["ZEROPP_TEST_ARGV_TO"]
        argv = [new if a == old else a for a in argv]
    run_guarded(lambda: pretrain(argv, on_iteration=_hook()))
