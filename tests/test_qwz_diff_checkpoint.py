"""qwZ difference references are saved with checkpoints (both formats): a resumed run with
``--zeropp-qwz-diff-bits`` is bit-exact; without the saved references it is not (its first
gathers are exact, so its weights differ from the reconstruction the first run used)."""

import os
import shutil

import pytest

from megatron_zeropp.simulated_nodes import run_distributed


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)


def _argv(sample_dir, iters, fmt, extra=(), rpn=2):
    return (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            f"--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters {iters} "
            f"--log-interval 1 --eval-interval 1000 --eval-iters 0 --sample-data {sample_dir} "
            f"--ranks-per-node {rpn} --ckpt-format {fmt} --zeropp-qwz --zeropp-hpz "
            f"--zeropp-qwz-diff-bits 4 --zeropp-qwz-stochastic-rounding "
            f"--zeropp-small-param-threshold 1000").split() + list(extra)


# 2 x 2: ranks 1 and 2 keep their own ŵ apart from the secondary, ranks 0 and 3 hold it in
# their slice; 2 x 1 (the torch format, kept small for CI): every rank holds it in its slice.
@pytest.mark.parametrize("fmt,nodes,rpn,control", [("torch_dist", 2, 2, True),
                                                   ("torch", 2, 1, False)])
def test_resume_with_differences_is_bit_exact(sample_dir, tmp_path, fmt, nodes, rpn, control):
    from megatron_zeropp.checkpointing.legacy import iteration_dir

    save = str(tmp_path / "ckpt")
    full = run_distributed(_pretrain, nodes, rpn, args=(_argv(
        sample_dir, 4, fmt, ["--save", save, "--save-interval", "2"], rpn),))[0]
    resume = _argv(sample_dir, 4, fmt, ["--load", save, "--ckpt-step", "2"], rpn)
    resumed = run_distributed(_pretrain, nodes, rpn, args=(resume,))[0]
    assert resumed["iterations"] == [3, 4]
    assert resumed["loss"] == full["loss"][2:]
    assert resumed["grad_norm"] == full["grad_norm"][2:]
    if not control:
        return
    # Negative control: without the saved references the resumed run's weights differ.
    shutil.rmtree(os.path.join(iteration_dir(save, 2), "zeropp_rank_state"))
    without = run_distributed(_pretrain, nodes, rpn, args=(resume,))[0]
    assert without["grad_norm"] != full["grad_norm"][2:]
