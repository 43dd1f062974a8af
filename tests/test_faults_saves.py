"""Saves that work at any iteration: before the optimizer's first real step (fp16's dynamic loss
scale skips the first steps by design), on the ZeRO++ layer and on megatron-core's DDP; the
resumed run continues exactly as the uninterrupted one (2 gloo ranks, tiny GPT)."""

import pytest

from megatron_zeropp.simulated_nodes import run_distributed


def _argv(tmp_path, iters, extra=()):
    return (f"--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            f"--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --train-iters {iters} "
            f"--log-interval 1 --eval-iters 0 --mock-data --tokenizer-type NullTokenizer "
            f"--vocab-size 64 --fp16 --initial-loss-scale 524288 --ckpt-format torch_dist "
            f"--data-cache-path {tmp_path / 'cache'}").split() + list(extra)


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)


@pytest.mark.parametrize("impl", ["zeropp", "megatron", "megatron-non-distributed"])
def test_a_save_before_the_first_optimizer_step_resumes_exactly(impl, tmp_path):
    # (the last: megatron-core's non-distributed optimizer, without --use-distributed-optimizer)
    save = str(tmp_path / "ckpt")
    extra = ["--data-parallel-impl", impl.split("-")[0]] + (
        ["--use-distributed-optimizer"] if impl == "megatron" else [])
    full = run_distributed(_pretrain, 1, 2, args=(_argv(
        tmp_path, 5, extra + ["--save", save, "--save-interval", "3"]),))[0]
    # Loss scales 2^19..2^17 overflow these fp16 gradients (2^16 does not, measured): iterations
    # 1-3 are skipped, so no Adam state exists at the save of iteration 3; real steps follow.
    assert full["skipped"][:3] == [True, True, True], full["skipped"]
    assert not all(full["skipped"][3:]), full["skipped"]
    resumed = run_distributed(_pretrain, 1, 2, args=(_argv(
        tmp_path, 5, extra + ["--load", save, "--ckpt-step", "3"]),))[0]
    assert resumed["iterations"] == [4, 5]
    assert resumed["skipped"] == full["skipped"][3:]
    assert resumed["loss"] == full["loss"][3:]
    assert resumed["grad_norm"] == full["grad_norm"][3:]


def _logged(ctx, argv, delete_lock_at=None):
    """pretrain's history and what the ranks printed (the last rank logs the training lines);
    ``delete_lock_at``: rank 0 deletes --save's lock after that iteration (a cleanup script)."""
    import contextlib
    import io
    import os

    from megatron_zeropp.training.loop import pretrain

    def on_iteration(iteration, chunks, optimizer):
        if iteration == delete_lock_at and ctx.rank == 0:
            os.remove(os.path.join(argv[argv.index("--save") + 1], ".save_lock"))

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = pretrain(argv, on_iteration=on_iteration)
    return history, out.getvalue()


def _fp32_argv(tmp_path, iters, extra=()):
    return [a for a in _argv(tmp_path, iters) if a not in ("--fp16", "--initial-loss-scale",
                                                           "524288")] + list(extra)


def _loss_lines(out):
    import re

    return {int(m.group(1)): m.group(2) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", out)}


def test_a_lock_deleted_during_the_run_is_put_back_and_every_save_happens(tmp_path):
    import os

    save = str(tmp_path / "ckpt")
    history, out = run_distributed(_logged, 1, 2, args=(_fp32_argv(
        tmp_path, 4, ["--save", save, "--save-interval", "2"]),), kwargs={
        "delete_lock_at": 1})[0]
    # the save of iteration 2 used to fail: "taken over by an unknown job (unreadable lock
    # file)", losing the interval
    assert history["iterations"] == [1, 2, 3, 4]
    lines = [x for x in out.splitlines() if "re-created it" in x]
    assert len(lines) == 1 and lines[0].startswith(
        f"> --save {save}: its lock {save}/.save_lock was deleted; re-created it"), out[-2000:]
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]  # lock given back


def test_the_first_line_after_a_resume_logs_its_own_iterations(tmp_path):
    save = str(tmp_path / "ckpt")
    full = run_distributed(_logged, 1, 2, args=(_fp32_argv(
        tmp_path, 6, ["--save", save, "--save-interval", "3"]),))[1][1]
    resumed = run_distributed(_logged, 1, 2, args=(_fp32_argv(
        tmp_path, 6, ["--load", save, "--ckpt-step", "3"]),))[1][1]
    full, resumed = _loss_lines(full), _loss_lines(resumed)
    assert sorted(resumed) == [4, 5, 6]
    # Megatron-LM's line 5 here is the mean of iterations 4 and 5 (not reset after a run's first
    # line); ours is iteration 5's, as in the run that was not interrupted
    assert all(resumed[i] == full[i] for i in (4, 5, 6)), (full, resumed)
    assert full[4] != full[5]  # (a mean of 4 and 5 would differ: the check can fail)
