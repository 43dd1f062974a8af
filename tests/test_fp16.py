"""fp16 trains: the loss is scaled before backward (grad_scale_func = optimizer.scale_loss, as in
Megatron-LM), on our ZeRO++ layer and on megatron-core's DDP, and an overflow on one rank skips
the step and backs the loss scale off on every rank."""

import pytest
import torch

from megatron_zeropp.simulated_nodes import run_distributed

BF16 = {"bf16": True, "loss_scale": 1.0}
FP16 = {"fp16": True}  # megatron-core's defaults: dynamic scale from 2^32, hysteresis 2
STEPS = 40


def _train(ctx, impl, dtype, opt, scale_loss=True):
    from zero3_runs import build, train

    config, wrapped, optimizer = build(ctx, 1, 1, impl, opt=opt, dtype=dtype)
    if not scale_loss:
        config.grad_scale_func = None  # the bug: gradients unscaled but never scaled
    steps = train(wrapped, optimizer, STEPS)
    return [s[0] for s in steps], [s[2] for s in steps], optimizer.get_loss_scale().item()


@pytest.mark.parametrize("impl", ["zeropp", "megatron"])
def test_fp16_with_dynamic_loss_scale_trains_like_bf16(impl):
    bf16_loss, bf16_skips, _ = run_distributed(_train, 1, 2, args=(impl, torch.bfloat16, BF16))[0]
    out = run_distributed(_train, 1, 2, args=(impl, torch.float16, FP16))
    fp16_loss, fp16_skips, scale = out[0]
    assert all(o == out[0] for o in out)  # every rank saw the same losses, skips and scale
    assert not any(bf16_skips)
    # 2^32 overflows fp16 gradients: the first steps are skipped until the scale fits.
    applied = STEPS - sum(fp16_skips)
    assert fp16_skips[0] and 10 <= applied < STEPS, fp16_skips
    assert scale < 2.0**32
    # Over the same number of applied steps, fp16 and bf16 lose about as much (measured here:
    # 4.87 -> 4.21 vs 4.87 -> 4.19 over 24-25 steps).
    fp16_drop = fp16_loss[0] - fp16_loss[-1]
    bf16_drop = bf16_loss[0] - bf16_loss[applied - 1]
    assert fp16_drop > 0.4 and abs(fp16_drop - bf16_drop) < 0.25, (fp16_drop, bf16_drop)


def test_fp16_without_loss_scaling_does_not_train():
    # Negative control: the check above fails when the loss is not scaled (the reported bug).
    losses, skips, _ = run_distributed(_train, 1, 2, args=("zeropp", torch.float16, FP16),
                                       kwargs={"scale_loss": False})[0]
    assert not any(skips)
    assert losses[0] - losses[-1] < 0.1, losses


def _overflow_on_one_rank(ctx, impl, poison_step):
    from zero3_runs import build, full_params, train

    opt = {"fp16": True, "initial_loss_scale": 4096.0, "hysteresis": 1}
    _, wrapped, optimizer = build(ctx, 1, 1, impl, opt=opt, dtype=torch.float16)
    original = wrapped.finish_grad_sync
    calls = {"n": 0}

    def finish(*args, **kwargs):
        if ctx.rank == 1 and calls["n"] == poison_step:
            wrapped.params_with_grad[3].main_grad.view(-1)[5] = float("inf")
        calls["n"] += 1
        return original(*args, **kwargs)

    wrapped.finish_grad_sync = finish
    scales, params = [], [full_params(wrapped)]

    def record(step):
        scales.append(optimizer.get_loss_scale().item())
        params.append(full_params(wrapped))

    skipped = [s[2] for s in train(wrapped, optimizer, 3, on_step=record)]
    unchanged = [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(params, params[1:])]
    return skipped, scales, unchanged


@pytest.mark.parametrize("impl", ["zeropp", "megatron"])
def test_overflow_on_one_rank_skips_and_backs_off_everywhere(impl):
    out = run_distributed(_overflow_on_one_rank, 2, 2, args=(impl, 1))
    for skipped, scales, unchanged in out:
        assert skipped == [False, True, False]
        assert scales == [4096.0, 2048.0, 2048.0]
        assert unchanged == [False, True, False]
    # Negative control: nothing poisoned, nothing skipped, the scale stays.
    clean = run_distributed(_overflow_on_one_rank, 1, 2, args=(impl, 99))
    assert all(c[:2] == ([False] * 3, [4096.0] * 3) for c in clean), clean


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)


def test_pretrain_fp16_on_megatron_ddp_scales_the_loss(tmp_path):
    # The command-line path wires grad_scale_func for --data-parallel-impl megatron too (the
    # ZeRO++ path runs in tests/test_megatron_lm_scripts.py's 175B set).
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters 30 --fp16 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 "
            f"--data-parallel-impl megatron --data-cache-path {tmp_path}").split()
    history = run_distributed(_pretrain, 1, 2, args=(argv,))[0]
    applied = [loss for loss, s in zip(history["loss"], history["skipped"]) if not s]
    assert history["skipped"][0] and 8 <= len(applied) < 30
    assert applied[-1] < applied[0] - 0.3, history["loss"]
