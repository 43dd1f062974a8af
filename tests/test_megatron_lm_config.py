"""The model a Megatron-LM launch line builds here is the one Megatron-LM builds, and a
Megatron-LM checkpoint's stored arguments are read under its own names: against Megatron-LM's
own code (the checkout of the installed megatron-core's release in ../shared/megatron-lm, its
parser, ``validate_args``, tokenizer build and ``core_transformer_config_from_args``, run on CPU
by ``tests/megatron_lm_args.py``).

- the FFN size with ``--swiglu`` and no ``--ffn-hidden-size`` (Megatron-LM truncates 8h/3 to a
  multiple of 64: 640 at hidden 256, where rounding up gave 704);
- the bias + activation fusion (``--no-bias-swiglu-fusion``, ``--no-bias-gelu-fusion``) as
  TransformerConfig's ``bias_activation_fusion``, on a CUDA machine (on CPU nothing is fused);
- a checkpoint's arguments as Megatron-LM stores them (``args``, saved by the installed
  megatron-core's ``dist_checkpointing.save``: with 0.19 no ``common.pt``) pass the startup checks
  of the run they came from and name the difference for another (``add_bias_linear`` is
  Megatron-LM's dest of ``--disable-bias-linear``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys

import pytest
import torch
from megatron_lm_snapshots import SNAPSHOTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE = {(0, 16): "core_v0.16.1", (0, 19): "core_v0.19.0"}

BASE = ("--num-layers 2 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 1 --global-batch-size 1 --train-iters 10 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 1000")
# The GPU comparison's model: GQA, SwiGLU, RMSNorm, RoPE, untied embeddings, no biases, bf16
# (RoPE fusion needs Transformer Engine: Megatron-LM refuses it without).
ISSUE = ("--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm "
         "--position-embedding-type rope --no-rope-fusion "
         "--untie-embeddings-and-output-weights --disable-bias-linear --bf16")
CASES = {
    "issue": f"--hidden-size 256 {ISSUE}",
    "issue, --no-bias-swiglu-fusion": f"--hidden-size 256 {ISSUE} --no-bias-swiglu-fusion",
    "issue, --no-bias-gelu-fusion": f"--hidden-size 256 {ISSUE} --no-bias-gelu-fusion",
    "issue with biases": "--hidden-size 256 " + ISSUE.replace(" --disable-bias-linear", ""),
    "gelu": "--hidden-size 256",
    "gelu, --no-bias-gelu-fusion": "--hidden-size 256 --no-bias-gelu-fusion",
    "gelu, no biases": "--hidden-size 256 --disable-bias-linear",
    "swiglu, hidden 64": "--hidden-size 64 --swiglu",
    "swiglu, hidden 96": "--hidden-size 96 --swiglu",
    "swiglu, hidden 200": "--hidden-size 200 --swiglu",
    "swiglu, hidden 384": "--hidden-size 384 --swiglu",
}


def _line(case: str) -> str:
    return f"{BASE} {CASES[case]}"


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """case -> {"args": Megatron-LM's argument namespace, "config": its TransformerConfig's
    fields}, from one process running the checkout of the installed release (~15 s)."""
    from megatron_zeropp.mcore.version import mcore_version

    release = RELEASE.get(mcore_version()[:2])
    snapshot = os.path.join(SNAPSHOTS, release or "none")
    if release is None or not os.path.isfile(os.path.join(snapshot, "pretrain_gpt.py")):
        pytest.skip(f"no Megatron-LM checkout for megatron-core {mcore_version()}")
    out = tmp_path_factory.mktemp("mlm") / "args.pkl"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "megatron_lm_args.py"),
                          snapshot, str(out), *(_line(c) for c in CASES)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out, "rb") as f:
        return dict(zip(CASES, pickle.load(f)))


def _ours(case: str):
    from megatron_zeropp.training.arguments import parse_args

    return parse_args(_line(case).split(), world_size=1)


def _truncated(hidden):  # Megatron-LM's own rule, for the negative control's wording only
    return int((4 * hidden * 2 / 3) / 64) * 64


def test_swiglu_ffn_size_is_megatron_lms(megatron_lm):
    for case, theirs in megatron_lm.items():
        ours = _ours(case).ffn_hidden_size
        assert ours == theirs["args"].ffn_hidden_size == theirs["config"]["ffn_hidden_size"], \
            (case, ours, theirs["config"]["ffn_hidden_size"])
    # The issue's numbers, and the earlier rule (8h/3 rounded up) as the negative control: it
    # differs from Megatron-LM's at hidden 256 and 200, where this comparison would fail.
    assert megatron_lm["issue"]["args"].ffn_hidden_size == 640
    for case, hidden in (("issue", 256), ("swiglu, hidden 200", 200)):
        rounded_up = ((int(8 * hidden / 3) + 63) // 64) * 64
        assert rounded_up != megatron_lm[case]["args"].ffn_hidden_size == _truncated(hidden)


def _transformer_config_on_cuda(monkeypatch, args):
    # What model.transformer_config builds on a CUDA machine: builders.py decides the fused
    # kernels from torch.cuda.is_available(); nothing here touches a device.
    from megatron_zeropp.training.model import transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        return transformer_config(args)
    finally:
        monkeypatch.undo()


def test_activation_fusion_is_megatron_lms_on_cuda_and_off_on_cpu(megatron_lm, monkeypatch):
    from megatron_zeropp.training.model import transformer_config

    for case, theirs in megatron_lm.items():
        args = _ours(case)
        ours = _transformer_config_on_cuda(monkeypatch, args)
        got = (ours.bias_activation_fusion, ours.gated_linear_unit, ours.activation_func.__name__,
               ours.add_bias_linear, ours.ffn_hidden_size)
        want = tuple(theirs["config"][k] for k in (
            "bias_activation_fusion", "gated_linear_unit", "activation_func", "add_bias_linear",
            "ffn_hidden_size"))
        assert got == want, (case, got, want)
        assert transformer_config(args).bias_activation_fusion is False  # this CPU
    # Not vacuous: Megatron-LM fuses some and not others, and fuses the issue's bias-free SwiGLU
    # (where this project used not to fuse any SwiGLU).
    fused = {c: t["config"]["bias_activation_fusion"] for c, t in megatron_lm.items()}
    assert fused["issue"] and fused["issue, --no-bias-gelu-fusion"] and fused["gelu"]
    assert not fused["issue, --no-bias-swiglu-fusion"] and not fused["gelu, no biases"]


def _saved_by_megatron_core(ctx, directory, args):
    # The common part of a Megatron-LM torch_dist checkpoint, written by the installed
    # megatron-core's dist_checkpointing.save as Megatron-LM's save_checkpoint calls it (0.19:
    # inside the shards, no common.pt), with one sharded tensor beside it.
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_zeropp.backend import apply_cpu_patches
    from megatron_zeropp.mcore.checkpoint import use_in_process_write_results

    apply_cpu_patches()  # megatron-core's writer synchronizes CUDA
    if ctx.rank == 0:
        os.makedirs(directory)
    dist.barrier()
    use_in_process_write_results()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 1,
             "w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    dist_checkpointing.save(state, directory, content_metadata={"singleton_local_shards": False})
    return sorted(os.listdir(directory))


def test_megatron_lm_checkpoint_arguments_are_read_under_its_names(megatron_lm, tmp_path):
    from megatron_zeropp.checkpointing import checks, integrity
    from megatron_zeropp.data.tokenizers import (
        build_tokenizer,
        megatron_lm_vocab_size,
        padded_vocab_size,
    )
    from megatron_zeropp.mcore.checkpoint import reads_common_state_object
    from megatron_zeropp.simulated_nodes import run_distributed
    from megatron_zeropp.training.megatron_lm_flags import CHECKPOINT_ARGS

    def ours(case):
        args = _ours(case)
        vocab = megatron_lm_vocab_size(build_tokenizer(tokenizer_type="NullTokenizer",
                                                       vocab_size=args.vocab_size),
                                       "NullTokenizer")
        args.padded_vocab_size = padded_vocab_size(vocab, args.make_vocab_size_divisible_by, 1)
        return checks.model_config(args)

    root = tmp_path / "mlm"
    for case in ("issue", "issue with biases", "gelu, no biases"):
        theirs = megatron_lm[case]["args"]
        # Every argument this project reads from a checkpoint is there under Megatron-LM's
        # name, no default filling in (an absent --disable-bias-linear read as False was the
        # refusal of every bias-free checkpoint).
        named = argparse.Namespace(**checks.with_this_projects_names(vars(theirs)))
        assert checks.model_config(named) == ours(case), case
        # ... and so is every one --use-checkpoint-args takes from it
        assert not [n for n in CHECKPOINT_ARGS if not hasattr(named, n)], case
        directory = root / f"iter_{len(os.listdir(root)) if root.exists() else 0:07d}"
        files = run_distributed(_saved_by_megatron_core, 1, 1, args=(str(directory), theirs))[0]
        assert ("common.pt" in files) != reads_common_state_object(), files  # 0.19: none
        integrity.check_files(str(directory))
        checks.check_model_config(str(root), int(directory.name[5:]), ours(case))
    # Negative control: a bias-free Megatron-LM checkpoint against a run with biases names
    # that one difference, in this project's flag, both ways.
    with pytest.raises(Exception) as e:
        checks.check_model_config(str(root), 0, ours("issue with biases"))
    assert str(e.value).endswith("holds another model: --disable-bias-linear checkpoint True vs "
                                 "this run False"), e.value
    with pytest.raises(Exception, match="--disable-bias-linear checkpoint False vs this run True"):
        checks.check_model_config(str(root), 1, ours("issue"))
