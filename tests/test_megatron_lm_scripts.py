"""Megatron-LM's example launch scripts (tag core_v0.16.1), sizes scaled down, through
pretrain_gpt.py's command line and loop: examples/gpt3/train_gpt3_175b_distributed.sh and
examples/llama/train_llama3_8b_h100_fp8.sh. What cannot run here fails at parse time, before any
process group, with the flag and the reason; the rest trains."""

import glob
import importlib.util
import os
import re

import pytest

from megatron_zeropp.simulated_nodes import run_distributed
from megatron_zeropp.training.arguments import parse_args

ZEROPP = ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]


def gpt3_175b(ckpt, tensorboard, vocab_file, merge_file, data_path="unused",
              train_iters_as_given=False):
    """The 175B script's flags. Scaled: layers 96 -> 2, hidden 12288 -> 64, heads 96 -> 4,
    sequence 2048 -> 64, global batch 1536 -> 16 (ramp-up 16 16 5859375 -> 4 4 32), 608 samples
    (41 iterations: fp16 skips the first ~20 while its 2^32 loss scale backs off), TP 8 x PP 16
    -> PP 2 on 4 ranks, lr 6e-5 -> 6e-3 (so 2 layers learn in a few steps), intervals shortened,
    the data a small corpus preprocessed with the same vocabulary. The script gives
    --train-iters with --rampup-batch-size, which
    Megatron-LM itself rejects ("expected no batch-size rampup for iteration-based training"),
    and no --tokenizer-type (Megatron-LM's build_tokenizer fails on None): the runnable set uses
    --train-samples and --tokenizer-type GPT2BPETokenizer."""
    schedule = (["--train-iters", "24"] if train_iters_as_given
                else ["--train-samples", "608", "--tokenizer-type", "GPT2BPETokenizer"])
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "16", "--rampup-batch-size", "4", "4",
        "32", *schedule, "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
        "--lr", "6.0e-3", "--lr-decay-style", "cosine", "--min-lr", "6.0e-4",
        "--lr-warmup-fraction", ".001", "--lr-decay-samples", "600",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--data-path", data_path, "--vocab-file", vocab_file, "--merge-file", merge_file,
        "--split", "949,50,1",
        "--log-interval", "4", "--save-interval", "1000", "--eval-interval", "1000",
        "--save", ckpt, "--load", ckpt, "--eval-iters", "1", "--tensorboard-dir", tensorboard,
        "--ranks-per-node", "2",
    ]


LLAMA_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
             "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
LLAMA_NEEDS_TE = ["--attention-backend", "fused"]


def llama3_8b(ckpt, tensorboard, cpu_ready=False):
    """The llama3 8B fp8 script's flags (mock-data branch). Scaled: layers 32 -> 2, hidden
    4096 -> 64, ffn 14336 -> 224, heads 32 -> 4, groups 8 -> 2, kv-channels 128 -> 16, sequence
    8192 -> 64, vocabulary 128256 -> 256, global batch 128 -> 8, samples 1953125000 -> 128
    (decay 120, warmup 16), lr x10, 8 GPUs -> 2 ranks. ``cpu_ready`` drops what needs
    Transformer Engine (fp8, the fused attention backend)."""
    argv = [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
        "--ffn-hidden-size", "224", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "64",
        "--max-position-embeddings", "64", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
        "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "128",
        "--lr-decay-samples", "120", "--lr-warmup-samples", "16", "--lr", "0.0015",
        "--min-lr", "0.0001", "--decoupled-lr", "5.0e-3", "--decoupled-min-lr", "4.5e-4",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
        "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "255", "--data-cache-path", os.path.join(ckpt, "..", "cache"),
        "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100",
        "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
        "--profile-step-end", "6", "--distributed-timeout-minutes", "60",
        "--save", ckpt, "--load", ckpt, "--tensorboard-dir", tensorboard,
    ]
    argv += ["--ckpt-format", "torch_dist"]
    return argv if cpu_ready else argv + LLAMA_NEEDS_TE + LLAMA_FP8


@pytest.fixture()
def gpt2_files(tmp_path):
    from bpe_files import write_gpt2_files

    return write_gpt2_files(str(tmp_path))


def _gpt2_corpus(tmp_path, vocab_file, merge_file) -> str:
    """--data-path prefix of 2000 short documents tokenized with the tiny GPT-2 vocabulary (the
    949,50,1 split then gives the test split two documents)."""
    import json

    from megatron_zeropp.data.preprocess import PreprocessConfig, preprocess

    words = ["the", "cat", "in", "hat", "sat", "on", "a", "mat", "then", "ran"]
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(2000):
            text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(12 + i % 9))
            f.write(json.dumps({"text": text}) + "\n")
    result = preprocess(PreprocessConfig(
        input=str(path), output_prefix=str(tmp_path / "gpt2"), tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab_file, merge_file=merge_file, append_eod=True))
    return result.prefixes["text"]


def _parse_error(argv, world, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=world)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_175b_as_given_fails_like_megatron_lm(tmp_path, gpt2_files, capsys):
    err = _parse_error(gpt3_175b(str(tmp_path), str(tmp_path), *gpt2_files,
                                 train_iters_as_given=True), 4, capsys)
    assert "--rampup-batch-size [4, 4, 32] needs sample-based training (--train-samples)" in err
    assert "unrecognized arguments" not in err


def test_llama_fp8_fails_at_the_door_naming_each_flag(tmp_path, capsys):
    err = _parse_error(llama3_8b(str(tmp_path / "ckpt"), str(tmp_path / "tb")), 2, capsys)
    assert "--fp8-format hybrid: fp8 needs Transformer Engine, which is not importable" in err
    assert "--attention-backend fused: needs Transformer Engine" in err
    assert "unrecognized arguments" not in err
    # Negative control: the CPU-ready set parses.
    parse_args(llama3_8b(str(tmp_path / "ckpt"), str(tmp_path / "tb"), cpu_ready=True), 2)


def _pretrain(ctx, argv):
    """(history, this rank's stdout): workers come from a fork server, so pytest's capfd does
    not see their output; each captures its own."""
    import contextlib
    import io

    from megatron_zeropp.training.loop import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = pretrain(argv)
    return history, out.getvalue()


def _series(tensorboard_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(tensorboard_dir, "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _without_gpt2_tokenizer(argv):
    """The 175B set with its tokenizer and data replaced by NullTokenizer + --mock-data, for
    installs without transformers (GPT2BPETokenizer's backend): every other flag stays."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
        elif a in ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type"):
            skip = 1
        else:
            out.append(a)
    return out + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]


@pytest.mark.slow
@pytest.mark.long
def test_175b_flags_train_with_zeropp_fp16_and_batch_rampup(tmp_path, gpt2_files):
    tb = str(tmp_path / "tb")
    if importlib.util.find_spec("transformers"):
        data = _gpt2_corpus(tmp_path, *gpt2_files)
        argv = gpt3_175b(str(tmp_path / "ckpt"), tb, *gpt2_files, data_path=data)
    else:
        argv = _without_gpt2_tokenizer(gpt3_175b(str(tmp_path / "ckpt"), tb, *gpt2_files))
    argv += ZEROPP + ["--data-cache-path", str(tmp_path / "cache")]
    history, out = run_distributed(_pretrain, 2, 2, args=(argv,),
                                   env={"HF_HUB_OFFLINE": "1"})[-1]
    skipped = history["skipped"]
    assert skipped[0] and not skipped[-1]  # fp16's 2^32 start overflows, then backs off
    applied = [loss for loss, s in zip(history["loss"], skipped) if not s]
    assert len(applied) >= 8 and applied[-1] < applied[0] - 0.5, history["loss"]
    # Ramp-up 4 -> 16 by 4 over 32 samples, then 16: iterations as Megatron-LM counts them.
    sizes = [int(m) for m in re.findall(r"global batch size:\s+(\d+)", out)]
    assert sizes[0] < 16 and sizes[-1] == 16
    # One increment per 32/3 samples: sizes 4 4 4 8 8 12 (40 samples), then 35 x 16 = 560.
    assert len(history["iterations"]) == 6 + (608 - 40) // 16
    assert re.search(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +4/ +41 \|", out,
                     re.M)
    assert "on validation set" in out and "on test set" in out
    series = _series(tb)
    for name in ("lm loss", "lm loss vs samples", "learning-rate", "batch-size", "loss-scale",
                 "grad-norm", "lm loss validation"):
        assert name in series, sorted(series)
    assert series["batch-size"][:7] == [4, 4, 4, 8, 8, 12, 16]


@pytest.mark.slow
@pytest.mark.long
def test_llama3_flags_without_te_train(tmp_path):
    tb = str(tmp_path / "tb")
    os.makedirs(tmp_path / "cache")
    (history, last), (_, first) = run_distributed(_pretrain, 1, 2, args=(
        llama3_8b(str(tmp_path / "ckpt"), tb, cpu_ready=True),))[::-1]
    out = first + last
    assert len(history["iterations"]) == 128 // 8
    assert not any(history["skipped"])
    assert history["loss"][-1] < history["loss"][0] - 1.0, history["loss"]
    assert "decoupled learning rate:" in out and "throughput per GPU (TFLOP/s/GPU):" in out
    assert "--sequence-parallel disabled" in out  # TP 1: Megatron-LM disables it too
    assert os.path.exists(tmp_path / "ckpt" / "iter_0000016")
