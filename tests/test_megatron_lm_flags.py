"""The Megatron-LM flags one by one: schedule arithmetic, the FLOPs formula, the log line, and
the loop behaviours (exit after N minutes, --no-save-optim, --finetune, per-token loss)."""

import argparse
import os
import re

import pytest
import torch

from megatron_zeropp.simulated_nodes import run_distributed
from megatron_zeropp.training import megatron_lm_flags as flags
from megatron_zeropp.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128").split()


def _ramp_up_removed() -> bool:
    from megatron_zeropp.mcore.microbatches import rampup_calculator

    return rampup_calculator() is None


@pytest.mark.skipif(_ramp_up_removed(), reason="megatron-core >= 0.18 removed the ramp-up "
                                               "(refused: test_ramp_up_is_refused_where_...)")
def test_sample_based_schedule_with_rampup_counts_iterations_like_megatron_lm():
    args = parse_args(BASE + "--train-samples 1000 --global-batch-size 32 --rampup-batch-size "
                      "8 8 300 --lr-warmup-fraction 0.1".split(), world_size=4)
    # One increment per 100 samples: 8 below 100 (13 steps, to 104), 16 below 200 (6, to 200),
    # 24 (5, to 320: the ramp ends once past 300), then (1000 - 320) // 32 = 21 full batches.
    assert args.train_iters == 13 + 6 + 5 + 21
    assert flags.lr_schedule_steps(args) == {
        "lr_warmup_steps": 0.1 * 1000, "lr_decay_steps": 1000, "wd_incr_steps": 1000,
        "wsd_decay_steps": None}
    ramp = flags.batch_size_schedule(args, dp=4)
    assert [ramp(c) for c in (0, 96, 100, 199, 200, 299, 301)] == [8, 8, 16, 16, 24, 24, 32]


def test_iteration_based_schedule_in_samples():
    args = parse_args(BASE + "--train-iters 10 --lr-warmup-iters 2 --global-batch-size 8".split(),
                      world_size=2)
    assert flags.lr_schedule_steps(args) == {
        "lr_warmup_steps": 16, "lr_decay_steps": 80, "wd_incr_steps": 80,
        "wsd_decay_steps": None}
    assert flags.iterations_for_samples(argparse.Namespace(
        train_samples=100, global_batch_size=8, rampup_batch_size=None)) == 12


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "give exactly one of --train-iters and --train-samples"),
        (["--train-iters", "5", "--lr-decay-samples", "9"], "--lr-decay-samples 9 needs"),
        (["--train-samples", "64", "--lr-warmup-iters", "2"], "--lr-warmup-iters need"),
        (["--train-samples", "64", "--rampup-batch-size", "3", "1", "8", "--global-batch-size",
          "8"], "START and INCREMENT must be multiples of --micro-batch-size x DP = 4"),
        (["--train-iters", "5", "--num-layers-per-virtual-pipeline-stage", "1"],
         "2 virtual pipeline stages per rank need a pipeline: --pipeline-model-parallel-size "
         ">= 2, got 1"),
        (["--train-iters", "5", "--num-layers-per-virtual-pipeline-stage", "3"],
         "--num-layers-per-virtual-pipeline-stage 3 must divide the layers of a pipeline stage "
         "(--num-layers 2 / --pipeline-model-parallel-size 1)"),
        (["--train-iters", "5", "--fp8-param-gather"], "--fp8-param-gather: fp8 needs"),
        (["--train-iters", "5", "--async-save", "--ckpt-format", "torch"],
         "--async-save needs --ckpt-format torch_dist"),
        (["--train-iters", "5", "--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
        (["--train-iters", "5", "--tokenizer-type", "GPT2BPETokenizer"],
         "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
        (["--train-iters", "5", "--exit-duration-in-mins", "0"],
         "--exit-duration-in-mins must be a finite number > 0, got 0.0"),
    ],
)
def test_flags_that_cannot_work_fail_by_name(extra, message, capsys):
    # The GPT2BPE case replaces the NullTokenizer of BASE (its last four words).
    argv = BASE[:-4] if "--tokenizer-type" in extra else BASE
    with pytest.raises(SystemExit):
        parse_args(argv + extra, world_size=2)
    err = capsys.readouterr().err
    assert message in err, err


def test_flops_follow_megatron_lm_formula_with_causal_attention_halved():
    from megatron_zeropp.training.model import num_floating_point_operations

    args = argparse.Namespace(hidden_size=64, num_layers=2, seq_length=32, num_attention_heads=4,
                              group_query_attention=False, num_query_groups=None,
                              ffn_hidden_size=256, swiglu=False, padded_vocab_size=128,
                              kv_channels=None)
    # per token and layer: QKV 64*192 + attention 64*32 (two GEMMs over half the keys)
    # + projection 64*64 + MLP 2*64*256 = 51200; logits 64*128; x 6 (3 GEMMs x 2 FLOPs).
    assert num_floating_point_operations(args, 1) == 6 * (2 * 51200 + 64 * 128)
    gqa = argparse.Namespace(**{**vars(args), "group_query_attention": True,
                                "num_query_groups": 2, "kv_channels": 8, "swiglu": True})
    # q = 8*4 = 32, kv = 8*2 = 16: 64*64 + 32*32 + 32*64 + 3*64*256
    assert num_floating_point_operations(gqa, 1) == 6 * (2 * (4096 + 1024 + 2048 + 49152)
                                                         + 64 * 128)


def test_log_line_has_megatron_lm_fields_in_order():
    from megatron_zeropp.training.logging_utils import IntervalStats, training_log_line

    stats = IntervalStats(iterations=2, loss_sum=7.0, loss_count=2, seconds=0.5)
    line = training_log_line(10, 100, 320, stats, 1e-4, 32, 65536.0, 1.5, 1e12, 2, 4096,
                             log_throughput=True, num_zeros=3.0, params_norm=12.25)
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +10/ +100 \| "
                    r"consumed samples: +320 \| elapsed time per iteration \(ms\): 250\.0 \| "
                    r"throughput per GPU \(TFLOP/s/GPU\): 2\.0 \| learning rate: 1\.000000E-04 \| "
                    r"global batch size: +32 \| lm loss: 3\.500000E\+00 \| loss scale: 65536\.0 \| "
                    r"grad norm: 1\.500 \| num zeros: 3\.0 \| params norm: 12\.250 \| "
                    r"number of skipped iterations: +0 \| number of nan iterations: +0 \|", line)
    quiet = training_log_line(10, 100, 320, stats, 1e-4, 32, 1.0, None, 1e12, 2, 4096,
                              log_throughput=False)
    assert "throughput" not in quiet and "num zeros" not in quiet and "params norm" not in quiet


def test_learning_rate_is_printed_through_float32_as_megatron_lm():
    # Megatron-LM prints (and writes to TensorBoard) the learning rate after a float32
    # all-reduce; this cosine-schedule rate (3e-4, iteration 4 of 20) rounds there to the
    # other last digit.
    import math

    from megatron_zeropp.training.logging_utils import (
        IntervalStats,
        through_float32,
        training_log_line,
    )

    lr = 3e-4 * 0.5 * (1 + math.cos(math.pi * 4 / 20))
    stats = IntervalStats(iterations=1, loss_sum=7.0, loss_count=1, seconds=0.5)
    line = training_log_line(3, 20, 48, stats, lr, 16, 1.0, 1.5, 1e12, 1, 4096)
    assert "| learning rate: 2.713526E-04 |" in line
    assert f"{lr:.6E}" == "2.713525E-04"  # the float64 print: the check above can fail
    assert through_float32(lr) == torch.tensor([lr], dtype=torch.float32).item() != lr
    assert through_float32(None) is None


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)


def _argv(tmp, extra):
    return BASE + f"--train-iters 6 --global-batch-size 8 --log-interval 1 --eval-iters 1 "\
                  f"--eval-interval 100 --data-cache-path {tmp}/cache".split() + extra


def test_exit_duration_saves_and_stops_then_finetune_starts_at_zero(tmp_path):
    from megatron_zeropp.checkpointing.legacy import iteration_dir, latest_iteration

    save = str(tmp_path / "ckpt")
    # A limit already passed after the first step: every rank stops there, after saving.
    first = run_distributed(_pretrain, 1, 2, args=(_argv(tmp_path, [
        "--save", save, "--exit-duration-in-mins", "1e-9", "--no-save-optim",
        "--ckpt-format", "torch"]),))[0]
    assert first["iterations"] == [1]
    assert latest_iteration(save) == 1
    state = torch.load(os.path.join(iteration_dir(save, 1), "mp_rank_00_000_dp_000.pt"),
                       weights_only=False)
    entry = next(iter(state["params"].values()))
    assert "main" in entry and "exp_avg" not in entry and state["scheduler"] is None
    # --finetune: the weights, iteration 0, a fresh optimizer.
    tuned = run_distributed(_pretrain, 1, 2, args=(_argv(tmp_path, [
        "--load", save, "--finetune"]),))[0]
    assert tuned["iterations"] == [1, 2, 3, 4, 5, 6]
    scratch = run_distributed(_pretrain, 1, 2, args=(_argv(tmp_path, []),))[0]
    assert tuned["loss"][0] < scratch["loss"][0]  # it did start from the trained weights
    assert tuned["test_loss"][0][0] == tuned["final_val_loss"][0][0] == 6  # final evaluation
    # --use-checkpoint-args: the saved shape (2 layers, hidden 64) replaces the command line's;
    # without it, loading 2 layers into this 3-layer, hidden-128 model fails.
    other_shape = [a for a in _argv(tmp_path, ["--load", save, "--finetune"])]
    other_shape[other_shape.index("--num-layers") + 1] = "3"
    other_shape[other_shape.index("--hidden-size") + 1] = "128"
    from megatron_zeropp.simulated_nodes import DistributedFailure

    with pytest.raises(DistributedFailure):
        run_distributed(_pretrain, 1, 2, args=(other_shape,), timeout=120)
    reused = run_distributed(_pretrain, 1, 2, args=(other_shape + ["--use-checkpoint-args"],))[0]
    assert reused["loss"][0] == tuned["loss"][0]


def test_eod_masking_and_resets_train(tmp_path):
    history = run_distributed(_pretrain, 1, 2, args=(_argv(tmp_path, [
        "--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]),))[0]
    assert history["loss"][-1] < history["loss"][0]
    assert not any(history["skipped"])


def _per_token(ctx, per_token):
    from zero3_runs import build, train

    config, wrapped, optimizer = build(ctx, 1, 1, "zeropp",
                                       model={"calculate_per_token_loss": per_token})
    return train(wrapped, optimizer, 3)


def test_per_token_loss_equals_mean_loss_with_full_masks():
    # With every token counted, sum / all tokens of the batch == mean of per-micro-batch means:
    # same losses; gradients agree to rounding (one division by the batch's tokens instead of
    # per micro-batch and DP rank).
    mean = run_distributed(_per_token, 1, 2, args=(False,))[0]
    per_token = run_distributed(_per_token, 1, 2, args=(True,))[0]
    for (l1, g1, _), (l2, g2, _) in zip(mean, per_token):
        assert l1 == pytest.approx(l2, rel=1e-6) and g1 == pytest.approx(g2, rel=1e-5)
    assert mean[-1][0] < mean[0][0]


def test_missing_te_and_apex_are_reported_once_per_job(tmp_path):
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformer_engine") and importlib.util.find_spec("apex"):
        pytest.skip("both installed: nothing to report")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(root, "pretrain_gpt.py"), *BASE, "--train-iters", "1",
           "--eval-iters", "0", "--data-cache-path", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    text = run.stdout + run.stderr
    lines = [ln for ln in text.splitlines() if "not installed" in ln]
    assert len(lines) == 1 and lines[0].startswith("> note:"), lines


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centered_norm_scales_by_one_plus_weight(normalization):
    from megatron_zeropp.training.zero_centered_norm import ZeroCenteredNorm

    config = argparse.Namespace(normalization=normalization, params_dtype=torch.float32,
                                sequence_parallel=False)
    norm = ZeroCenteredNorm(config, 8, eps=1e-5)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    F = torch.nn.functional
    plain = (F.layer_norm(x, (8,), eps=1e-5) if normalization == "LayerNorm"
             else F.rms_norm(x, (8,), eps=1e-5))
    assert torch.equal(norm(x), plain)  # gamma starts at 1: zero weight
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    scaled = (F.layer_norm(x, (8,), 1 + norm.weight, norm.bias, 1e-5)
              if normalization == "LayerNorm" else F.rms_norm(x, (8,), 1 + norm.weight, 1e-5))
    assert torch.equal(norm(x), scaled) and not torch.equal(scaled, plain)


def test_tensorboard_series_follow_the_flags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_zeropp.training.logging_utils import TensorBoard

    def series(extra):
        directory = tmp_path / "-".join(extra or ["plain"])
        args = parse_args(BASE + ["--train-iters", "4", "--tensorboard-dir", str(directory),
                                  *extra], world_size=1)
        board = TensorBoard(str(directory), args)
        for it in (1, 2):
            board.training(it, 8 * it, loss=5.0, lr=1e-3, batch_size=8, loss_scale=1.0,
                           grad_norm=0.5, world_size=1, seconds=0.25, throughput=1.5)
        board.validation(2, 16, 4.0)
        board.flush()
        acc = EventAccumulator(str(directory))
        acc.Reload()
        return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    plain = series([])
    assert plain["lm loss"] == [5.0, 5.0] and plain["lm loss vs samples"] == [5.0, 5.0]
    assert plain["loss-scale"] == [1.0, 1.0] and plain["lm loss validation"] == [4.0]
    assert not {"iteration-time", "throughput", "lm loss validation ppl", "world-size",
                "mem-max-allocated-bytes", "num-zeros", "params-norm"} & set(plain)
    full = series(["--log-timers-to-tensorboard", "--log-throughput",
                   "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
                   "--log-memory-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
                   "--tensorboard-log-interval", "2"])
    assert full["lm loss"] == [5.0]  # iteration 2 only
    assert full["iteration-time"] == [0.25] and full["throughput"] == [1.5]
    assert full["lm loss validation ppl"] == [pytest.approx(54.59815, rel=1e-6)]
    assert full["world-size"] == [1.0] and "mem-max-allocated-bytes" in full
    assert "loss-scale" not in full


def test_use_distributed_optimizer_is_honoured_on_megatron_core_ddp(capsys):
    # As Megatron-LM: megatron-core's non-distributed optimizer (all-reduced gradients) unless
    # --use-distributed-optimizer; the ZeRO++ layer always shards, and says so at start.
    from megatron_zeropp.training.arguments import parse_args
    from megatron_zeropp.training.model import ddp_config, optimizer_config

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 1 --train-iters 4 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 128").split()
    mcore = ["--data-parallel-impl", "megatron"]
    for argv, distributed in ((mcore, False), (mcore + ["--use-distributed-optimizer"], True),
                              ([], True), (["--use-distributed-optimizer"], True)):
        capsys.readouterr()
        args = parse_args(base + argv, world_size=2)
        assert ddp_config(args).use_distributed_optimizer is distributed, argv
        assert optimizer_config(args).use_distributed_optimizer is distributed, argv
        noted = "shards the optimizer state over the data-parallel group with or without " \
                "--use-distributed-optimizer" in capsys.readouterr().out
        assert noted is (argv == []), argv
    with pytest.raises(SystemExit):
        parse_args(base + mcore + ["--overlap-grad-reduce", "--overlap-param-gather"], 2)
    assert "--overlap-param-gather needs --use-distributed-optimizer" in capsys.readouterr().err


def test_ramp_up_is_refused_where_megatron_core_removed_it(capsys):
    argv = BASE + "--train-samples 1000 --global-batch-size 32 --rampup-batch-size 8 8 300".split()
    if not _ramp_up_removed():
        assert parse_args(argv, world_size=4).rampup_batch_size == [8, 8, 300]  # the control
        return
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=4)
    assert "--rampup-batch-size: megatron-core 0.1" in capsys.readouterr().err
