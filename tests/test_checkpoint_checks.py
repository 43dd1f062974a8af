"""Resume safety rules, as pure functions over a checkpoint directory (no process group)."""

import argparse
import os

import pytest
import torch

from megatron_zeropp.checkpointing import checks as cc
from megatron_zeropp.errors import StartupError
from megatron_zeropp.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()


def _fake_checkpoint(root, iterations, latest=None):
    for it in iterations:
        os.makedirs(os.path.join(root, f"iter_{it:07d}"))
    if latest is not None:
        with open(os.path.join(root, cc._LATEST), "w") as f:
            f.write(str(latest))


def test_load_resolves_latest_or_the_asked_step(tmp_path):
    root = str(tmp_path)
    _fake_checkpoint(root, (10, 20), latest=20)
    assert cc.resolve_load(root, None, False) == 20
    assert cc.resolve_load(root, 10, False) == 10
    assert cc.resolve_load(None, None, False) is None


@pytest.mark.parametrize("case, message", [
    ("typo", "does not exist: no checkpoint to resume from (pass --load-optional"),
    ("empty", "has no latest_checkpointed_iteration.txt"),
    ("step", "--ckpt-step 15: no"),
    ("dangling", "names iteration 30, but"),
])
def test_load_that_names_no_checkpoint_fails(tmp_path, case, message):
    root = str(tmp_path / "ckpt")
    _fake_checkpoint(root, (10, 20), latest=30 if case == "dangling" else 20)
    load, step = {"typo": (root + "x", None), "empty": (str(tmp_path), None),
                  "step": (root, 15), "dangling": (root, None)}[case]
    with pytest.raises(StartupError, match=message.replace("(", r"\(")):
        cc.resolve_load(load, step, False)


def test_load_optional_starts_fresh_only_when_empty(tmp_path):
    assert cc.resolve_load(str(tmp_path / "new"), None, True) is None
    # Megatron-LM's --load $CKPT --save $CKPT: the first run of that directory starts fresh...
    assert cc.resolve_load(str(tmp_path / "new"), None, False, str(tmp_path / "new")) is None
    # ...a --load elsewhere that names nothing is still an error
    with pytest.raises(StartupError, match="--load-optional"):
        cc.resolve_load(str(tmp_path / "new"), None, False, str(tmp_path / "other"))
    with pytest.raises(StartupError, match="--ckpt-step 5"):
        cc.resolve_load(str(tmp_path / "new"), 5, True)  # an explicit step must exist
    # ...unless --exit-on-missing-checkpoint (Megatron-LM's flag) asks for the checkpoint there
    with pytest.raises(StartupError, match="--exit-on-missing-checkpoint asks to stop"):
        cc.resolve_load(str(tmp_path / "new"), None, False, str(tmp_path / "new"), True)


def test_saves_never_go_backwards_without_the_flag(tmp_path):
    root = str(tmp_path)
    _fake_checkpoint(root, (10, 20), latest=20)
    cc.check_save_target(root, 20, False)  # resuming from the latest
    cc.check_save_target(str(tmp_path / "fresh"), 0, False)
    with pytest.raises(StartupError, match=r"iteration\(s\) \[10, 20\] after this run's start"):
        cc.check_save_target(root, 0, False)
    with pytest.raises(StartupError, match=r"\[20\]"):
        cc.check_save_target(root, 10, False)
    cc.check_save_target(root, 0, True)
    with pytest.raises(RuntimeError, match="is already 20"):
        cc.check_save_iteration(root, 15, False)
    with pytest.raises(RuntimeError, match="refusing to replace"):
        cc.check_save_iteration(root, 20, False)
    cc.check_save_iteration(root, 25, False)
    cc.check_save_iteration(root, 10, True)


def test_model_config_mismatch_lists_both_values(tmp_path):
    saved = parse_args(BASE, world_size=1)
    saved.padded_vocab_size = 128
    os.makedirs(tmp_path / "iter_0000005")
    cc.write_model_config(str(tmp_path / "iter_0000005"), cc.model_config(saved))
    cc.check_model_config(str(tmp_path), 5, cc.model_config(saved))  # same model: fine
    other = parse_args([a if a != "2" else "1" for a in BASE] + ["--bf16"], world_size=1)
    other.padded_vocab_size = 256
    with pytest.raises(StartupError) as e:
        cc.check_model_config(str(tmp_path), 5, cc.model_config(other))
    text = str(e.value)
    assert "--num-layers checkpoint 2 vs this run 1" in text
    assert "padded vocabulary size checkpoint 128 vs this run 256" in text
    assert "dtype checkpoint 'fp32' vs this run 'bf16'" in text
    assert "--hidden-size" not in text
    with pytest.raises(StartupError, match="neither model_config.json nor rank files"):
        cc.check_model_config(str(tmp_path), 6, cc.model_config(saved))


def test_checkpoints_without_model_config_are_checked_from_their_arguments(tmp_path):
    saved = parse_args(BASE, world_size=1)
    saved.padded_vocab_size = 128
    os.makedirs(tmp_path / "iter_0000003")
    torch.save({"extra": {"args": vars(saved)}},
               str(tmp_path / "iter_0000003" / "mp_rank_00_000_dp_000.pt"))
    cc.check_model_config(str(tmp_path), 3, cc.model_config(saved))
    wider = parse_args([a if a != "64" else "128" for a in BASE], world_size=1)
    wider.padded_vocab_size = 128
    with pytest.raises(StartupError, match="--hidden-size checkpoint 64 vs this run 128"):
        cc.check_model_config(str(tmp_path), 3, cc.model_config(wider))


def test_megatron_lm_torch_dist_checkpoints_are_checked_from_common_pt(tmp_path):
    # Megatron-LM writes no model_config.json: its argparse.Namespace sits in common.pt. TP/PP
    # may differ for torch_dist (it reshards); the model may not.
    saved = parse_args(BASE + ["--tensor-model-parallel-size", "1"], world_size=1)
    saved.padded_vocab_size = 128
    directory = tmp_path / "iter_0000004"
    os.makedirs(directory)
    with open(directory / "metadata.json", "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                '"common_backend": "torch", "common_backend_version": 1}')
    torch.save({"args": argparse.Namespace(**vars(saved))}, str(directory / "common.pt"))
    two_tp = parse_args(BASE + ["--tensor-model-parallel-size", "2"], world_size=2)
    two_tp.padded_vocab_size = 128
    cc.check_model_config(str(tmp_path), 4, cc.model_config(two_tp), layout_free=True)
    with pytest.raises(StartupError, match="--tensor-model-parallel-size checkpoint 1 vs"):
        cc.check_model_config(str(tmp_path), 4, cc.model_config(two_tp))
    deeper = parse_args([a if a != "2" else "3" for a in BASE], world_size=1)
    deeper.padded_vocab_size = 128
    with pytest.raises(StartupError, match="--num-layers checkpoint 2 vs this run 3"):
        cc.check_model_config(str(tmp_path), 4, cc.model_config(deeper), layout_free=True)


def _scheduler(train_iters):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = argparse.Namespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=0.0,
                                   lr_warmup_steps=0, lr_decay_steps=train_iters,
                                   lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=train_iters, wd_incr_style="constant")


def test_lr_schedule_on_resume_follows_megatron_rules():
    saved = _scheduler(10)
    saved.step(increment=5)
    state = saved.state_dict()
    same = _scheduler(10)
    assert "equals" in cc.load_scheduler(same, state, False, False)
    with pytest.raises(StartupError, match="--use-checkpoint-opt_param-scheduler"):
        cc.load_scheduler(_scheduler(20), state, False, False)
    kept = _scheduler(20)
    assert "checkpoint's" in cc.load_scheduler(kept, state, False, True)
    assert kept.lr_decay_steps == 10
    overridden = _scheduler(20)
    assert "command line's" in cc.load_scheduler(overridden, state, True, False)
    assert overridden.lr_decay_steps == 20 and overridden.num_steps == 5
    assert overridden.get_lr(overridden.optimizer.param_groups[0]) == pytest.approx(1e-3 * 15 / 20)
    assert torch.tensor(kept.get_lr(kept.optimizer.param_groups[0])).item() == \
        pytest.approx(1e-3 * 5 / 10)
