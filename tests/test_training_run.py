"""pretrain_gpt.py's loop on 4 CPU processes (2 simulated nodes x 2): training with all ZeRO++
flags, and for ``--ckpt-format torch`` bit-exact resume, resume with another DP layout, and a save
killed half-way (test_checkpoint_dist.py does the same for torch_dist, the default)."""

import contextlib
import io
import os

import pytest
import torch

from megatron_zeropp.checkpointing.legacy import iteration_dir, latest_iteration
from megatron_zeropp.simulated_nodes import DistributedFailure, run_distributed

ZEROPP = ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]


def _argv(sample_dir, iters, extra=()):
    return (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            f"--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters {iters} "
            f"--log-interval 1 --eval-interval 1000 --eval-iters 0 --sample-data {sample_dir} "
            f"--ranks-per-node 2 --ckpt-format torch").split() + list(extra)


def _pretrain(ctx, argv, capture_at=(), kill_save_at=None, stdout=False):
    from megatron_zeropp.checkpointing import legacy as checkpoint
    from megatron_zeropp.training.loop import pretrain

    if stdout:  # what this rank printed, returned third
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            history, captured = _pretrain(ctx, argv, capture_at, kill_save_at)
        return history, captured, text.getvalue()

    captured = {}

    def on_iteration(iteration, chunks, optimizer):
        if iteration in capture_at:
            captured[iteration] = chunks[0].state_dict()
        if iteration == kill_save_at and ctx.rank == 1:
            def die(*args, **kwargs):
                os._exit(3)  # a node lost in the middle of writing its shard
            checkpoint.torch.save = die

    history = pretrain(argv, on_iteration=on_iteration)
    return history, captured


def test_all_flags_train_and_the_loss_falls(sample_dir):
    out = run_distributed(_pretrain, 2, 2, args=(_argv(sample_dir, 8, ZEROPP),))
    losses = out[0][0]["loss"]
    assert all(o[0]["loss"] == losses for o in out)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
    assert not any(out[0][0]["skipped"])


def test_resume_is_bit_exact(sample_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    full = run_distributed(_pretrain, 2, 2, args=(_argv(
        sample_dir, 6, ZEROPP + ["--save", save, "--save-interval", "3"]),))[0][0]
    resumed = run_distributed(_pretrain, 2, 2, args=(_argv(
        sample_dir, 6, ZEROPP + ["--load", save, "--ckpt-step", "3"]),))[0][0]
    assert resumed["iterations"] == [4, 5, 6]
    # dropout is on (0.1): equality needs the RNG states restored too
    assert resumed["loss"] == full["loss"][3:]
    assert resumed["grad_norm"] == full["grad_norm"][3:]


def test_resume_with_another_dp_layout(sample_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    # saved with qgZ's cross-node hop at INT4 (the default before 2026-12-06)
    first = run_distributed(_pretrain, 2, 2, args=(
        _argv(sample_dir, 3, ZEROPP + ["--save", save, "--zeropp-qgz-inter-bits", "4"]),),
        kwargs={"capture_at": (3,)})
    saved_params = first[0][1][3]
    # DP 4 (2 nodes x 2) -> DP 2 (1 node x 2): every rank now owns other element ranges.
    second = run_distributed(_pretrain, 1, 2, args=(
        _argv(sample_dir, 5, ZEROPP + ["--load", save, "--use-checkpoint-opt_param-scheduler"]),),
        kwargs={"capture_at": (3,), "stdout": True})
    # the last rank prints the log: the resume says which ZeRO++ flag changed
    assert ("> ZeRO++ flags differ from the run that saved it (this run's apply): "
            "--zeropp-qgz-inter-bits 4 -> 8") in second[-1][2]
    loaded = second[0][1][3]
    assert loaded.keys() == saved_params.keys()
    tensors = [k for k, v in saved_params.items() if torch.is_tensor(v)]
    assert len(tensors) > 10
    assert all(torch.equal(loaded[k], saved_params[k]) for k in tensors)
    losses = second[0][0]["loss"]
    assert second[0][0]["iterations"] == [4, 5]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < first[0][0]["loss"][0]


def test_a_killed_save_leaves_the_previous_checkpoint(sample_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    with pytest.raises(DistributedFailure):
        run_distributed(_pretrain, 2, 2, args=(
            _argv(sample_dir, 4, ["--save", save, "--save-interval", "2"]),),
            kwargs={"kill_save_at": 4}, timeout=120, collective_timeout=20)
    assert latest_iteration(save) == 2
    assert not os.path.exists(iteration_dir(save, 4))
    resumed = run_distributed(_pretrain, 2, 2, args=(
        _argv(sample_dir, 4, ["--load", save]),))[0][0]
    assert resumed["iterations"] == [3, 4]


def test_skip_train_evaluates_the_loaded_weights_and_writes_nothing(sample_dir, tmp_path):
    # The run's own validation at iteration 2 reads the validation set from its first sample,
    # as --skip-train does (Megatron-LM), with the same weights: the losses must be equal.
    save = str(tmp_path / "ckpt")
    evals = ["--eval-interval", "2", "--eval-iters", "2"]
    trained = run_distributed(_pretrain, 2, 2, args=(
        _argv(sample_dir, 2, ["--save", save] + evals),))[0][0]
    (at, in_run), = trained["val_loss"]
    assert at == 2
    before = sorted(os.listdir(save))
    exact = run_distributed(_pretrain, 2, 2, args=(
        _argv(sample_dir, 2, ["--load", save, "--skip-train"] + evals),))[0][0]
    assert exact["iterations"] == [] and exact["loss"] == []
    assert exact["final_val_loss"] == [(2, in_run)]
    assert sorted(os.listdir(save)) == before and latest_iteration(save) == 2
    # the same weights through qwZ's INT8 gathers: another loss, so the flags act on evaluation
    quantized = run_distributed(_pretrain, 2, 2, args=(
        _argv(sample_dir, 2, ["--load", save, "--skip-train"] + evals + ZEROPP[:2]),))[0][0]
    (_, q), = quantized["final_val_loss"]
    assert q != in_run and abs(q - in_run) < 0.01 * in_run
