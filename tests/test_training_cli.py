"""pretrain_gpt.py's command line: the flag set is fixed, bad input fails before any collective."""

import pytest

from megatron_zeropp.training.arguments import build_parser, parse_args

SUPPORTED_FLAGS = sorted("""
--accumulate-allreduce-grads-in-fp32 --adam-beta1 --adam-beta2 --adam-eps --attention-dropout
--bf16 --ckpt-step --clip-grad --context-parallel-size --data-cache-path --data-parallel-impl
--data-path --disable-bias-linear --distributed-backend --distributed-timeout-minutes
--eval-interval --eval-iters --exit-interval --ffn-hidden-size --fp16 --global-batch-size
--group-query-attention --help --hidden-dropout --hidden-size --init-method-std
--initial-loss-scale --load --log-interval --loss-scale --lr --lr-decay-iters --lr-decay-style
--lr-warmup-iters --make-vocab-size-divisible-by --max-position-embeddings --micro-batch-size
--min-lr --mock-data --no-load-optim --no-load-rng --norm-epsilon --normalization
--num-attention-heads --num-layers --num-query-groups --optimizer --overlap-grad-reduce
--overlap-param-gather --pipeline-model-parallel-size --position-embedding-type --profile
--profile-dir --profile-ranks --profile-step-end --profile-step-start --ranks-per-node
--ranks-share-gpu --lab-transport
--recompute-granularity --recompute-method --recompute-num-layers --rotary-base --sample-data
--save --save-interval --load-optional --overwrite-checkpoints --break-save-lock --ckpt-checksums
--exit-signal-handler
--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler
--no-check-for-nan-in-loss-and-grad --seed --seq-length --sequence-parallel --split --swiglu
--tensor-model-parallel-size --tensorboard-dir --test-data-path --tokenizer-model
--tokenizer-type --train-data-path --train-iters --transformer-impl
--untie-embeddings-and-output-weights --use-cpu-initialization --use-pytorch-profiler
--valid-data-path --vocab-size
--weight-decay
--zeropp-hpz --zeropp-hpz-partition-size --zeropp-prefetch-depth --zeropp-qgz
--zeropp-qgz-block-size --zeropp-qgz-error-feedback --zeropp-qgz-error-interval
--zeropp-qgz-error-log --zeropp-qgz-fraction --zeropp-qgz-hadamard --zeropp-qgz-inter-bits
--zeropp-qgz-intra-bits --zeropp-qwz --zeropp-qwz-bits --zeropp-qwz-block-size
--zeropp-shard-grads --zeropp-small-param-threshold --zeropp-unit
--zeropp-qgz-stochastic-rounding --no-zeropp-qgz-stochastic-rounding
--zeropp-qwz-stochastic-rounding --zeropp-rounding-seed
--zeropp-qwz-diff-bits --zeropp-qwz-diff-exact-interval --zeropp-qgz-hadamard-seed
--zeropp-eval-weights --zeropp-qwz-error-interval --zeropp-qwz-error-log
""".split())

MEGATRON_LM_FLAGS = sorted("""
--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --log-num-zeros-in-grad
--log-memory-to-tensorboard --timing-log-level --log-params-norm --log-throughput --ckpt-format
--async-save --vocab-file --merge-file --tiktoken-pattern --no-create-attention-mask-in-dataloader
--use-mcore-models --attention-softmax-in-fp32 --attention-backend --rotary-percent
--apply-query-key-layer-scaling --kv-channels --no-gradient-accumulation-fusion
--use-distributed-optimizer --overlap-param-gather --num-layers-per-virtual-pipeline-stage
--num-virtual-stages-per-pipeline-rank
--lr-warmup-fraction --lr-warmup-samples --fp8-format --fp8-param-gather --fp8-amax-history-len
--fp8-amax-compute-algo --calculate-per-token-loss --manual-gc
--train-samples --lr-decay-samples --rampup-batch-size --eod-mask-loss --reset-position-ids
--reset-attention-mask --finetune --use-checkpoint-args --no-save-optim --no-load-optim
--no-load-rng --exit-duration-in-mins --hysteresis
--apply-layernorm-1p --cross-entropy-loss-fusion --decoupled-lr --decoupled-min-lr
--empty-unused-memory-level --grad-reduce-in-bf16 --log-batch-size-to-tensorboard
--log-world-size-to-tensorboard --loss-scale-window --lr-warmup-init --manual-gc-interval
--min-loss-scale --no-log-learning-rate-to-tensorboard --no-log-loss-scale-to-tensorboard
--no-manual-gc-eval --no-mmap-bin-files --no-save-rng --num-workers --profile
--profile-step-end --profile-step-start --tensorboard-log-interval
""".split())
"""Megatron-LM flags (the issue's list first); --no-load-optim / --no-load-rng were core."""

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()


def test_the_set_of_flags_is_fixed():
    from megatron_zeropp.training.megatron_lm_rules import specs

    # Beside this project's own: every option of Megatron-LM core_v0.16.1 and core_v0.19.0
    # (tests/test_megatron_lm_all_flags.py derives that list from their arguments.py).
    every_megatron_lm = {o for entry in specs() for o in entry["options"]}
    parser = build_parser()
    flags = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--"))
    assert flags == sorted(set(SUPPORTED_FLAGS) | set(MEGATRON_LM_FLAGS) | every_megatron_lm)


def test_a_valid_command_line_fills_megatron_defaults():
    args = parse_args(BASE + ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"], world_size=8)
    assert args.global_batch_size == 2 * 8
    assert args.ffn_hidden_size == 4 * 64
    assert args.max_position_embeddings == 32
    assert args.lr_decay_iters == 10
    swiglu = parse_args(BASE + ["--swiglu"], world_size=1)
    assert swiglu.ffn_hidden_size == 128  # 8/3 * 64 = 170.7, truncated to a multiple of 64


def test_changed_zeropp_flags_name_what_a_resume_changes():
    from megatron_zeropp.sharding.config_flags import changed_flags

    now = parse_args(BASE + ["--zeropp-qgz"], world_size=4)
    saved = vars(parse_args(BASE + ["--zeropp-qgz", "--zeropp-qgz-inter-bits", "4"],
                            world_size=4))
    # a checkpoint of the INT4 hop, the default before 2026-12-06, resumed with today's
    assert changed_flags(saved, now) == ["--zeropp-qgz-inter-bits 4 -> 8"]
    assert changed_flags(vars(now), now) == []  # negative control: the same flags
    # a checkpoint that stores no ZeRO++ flags (Megatron-LM's): nothing to compare
    assert changed_flags({k: v for k, v in saved.items() if not k.startswith("zeropp_")},
                         now) == []


def test_qgz_rounds_stochastically_by_default_and_nearest_when_asked(capsys):
    from megatron_zeropp.sharding import ZeroPPConfig
    from megatron_zeropp.sharding.config_flags import config_from_args

    def config(*flags):
        return config_from_args(parse_args(BASE + list(flags), world_size=4))

    assert config("--zeropp-qgz").qgz_rounds_stochastically
    assert config("--zeropp-qgz", "--zeropp-qgz-stochastic-rounding").qgz_rounds_stochastically
    nearest = config("--zeropp-qgz", "--no-zeropp-qgz-stochastic-rounding")
    assert nearest.qgz_stochastic_rounding is False and not nearest.qgz_rounds_stochastically
    assert "nearest rounding" in nearest.describe()
    assert not config().qgz_rounds_stochastically  # nothing to round without qgZ
    # an explicit False without qgZ is what older releases' checkpoints hold: accepted
    assert not config("--no-zeropp-qgz-stochastic-rounding").qgz_rounds_stochastically
    with pytest.raises(SystemExit):
        config("--zeropp-qgz-stochastic-rounding")
    assert "--zeropp-qgz-stochastic-rounding=True needs qgZ" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be None .* got 1"):
        ZeroPPConfig(qgz=True, qgz_stochastic_rounding=1)


def test_zeropp_flags_are_the_same_here_and_in_a_patched_megatron_lm():
    import argparse

    from megatron_zeropp import megatron_lm

    def options(parser):
        return {o: (a.type, a.default, a.choices, a.const) for a in parser._actions
                for o in a.option_strings if o.startswith("--zeropp-")}

    ours = options(build_parser())
    theirs = options(megatron_lm.add_arguments(argparse.ArgumentParser()))
    shared = set(ours) & set(theirs)
    assert len(shared) >= 20 and all(ours[o] == theirs[o] for o in shared)
    # only the entry points' own extras differ (Megatron-LM's evaluate() is its own)
    assert set(ours) - shared == {"--zeropp-qgz-error-log", "--zeropp-qwz-error-log",
                                  "--zeropp-eval-weights"}
    assert set(theirs) - shared == {"--zeropp-zero3"}
    assert ours["--zeropp-qwz-bits"] == (int, 8, (4, 8), None)


def test_zeropp_flag_help_is_the_config_fields_docstring():
    import dataclasses
    from dataclasses import dataclass

    from megatron_zeropp.sharding import config_flags
    from megatron_zeropp.sharding.config import ZeroPPConfig

    docs = config_flags.field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(ZeroPPConfig)}  # every field has one
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions
             if a.option_strings and a.option_strings[0].startswith("--zeropp-")}
    diff = helps["--zeropp-qwz-diff-exact-interval"]
    assert diff.startswith("With --zeropp-qwz-diff-bits: every this many steps")
    assert "`" not in "".join(h for h in helps.values() if h)
    assert "each --zeropp-unit" not in helps["--zeropp-shard-grads"]  # plain words stay words

    @dataclass
    class Undocumented:
        a: int = 1
        """A."""
        b: int = 2

    assert config_flags.field_docs(Undocumented) == {"a": "A."}  # a missing docstring shows


def test_bf16_reduces_gradients_in_fp32_unless_asked_as_megatron_lm():
    assert parse_args(BASE + ["--bf16"], world_size=1).accumulate_allreduce_grads_in_fp32
    assert not parse_args(BASE + ["--bf16", "--grad-reduce-in-bf16"],
                          world_size=1).accumulate_allreduce_grads_in_fp32
    assert not parse_args(BASE + ["--bf16", "--grad-reduce-in-bf16",
                                  "--accumulate-allreduce-grads-in-fp32"],
                          world_size=1).accumulate_allreduce_grads_in_fp32
    assert not parse_args(BASE + ["--fp16"], world_size=1).accumulate_allreduce_grads_in_fp32


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (["--bf16", "--fp16"], 1, "mutually exclusive"),
        (["--tensor-model-parallel-size", "3"], 4, "world size 4 is not divisible by TP x PP x CP"),
        (["--global-batch-size", "6"], 4, "--global-batch-size 6 is not a multiple"),
        (["--data-parallel-impl", "megatron", "--zeropp-qgz"], 1, "conflicts with --zeropp-qgz"),
        (["--ranks-per-node", "3"], 4, "--ranks-per-node 3 does not divide world size 4"),
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible"),
        (["--zeropp-qwz-block-size", "100"], 1, "--zeropp-qwz-block-size must be a power of two"),
        (["--zeropp-qgz-fraction", "0"], 1, "--zeropp-qgz-fraction must be in"),
        (["--zeropp-qgz-error-interval", "5"], 1,
         "--zeropp-qgz-error-interval=5 measures qgZ, which is off"),
        (["--zeropp-qgz", "--zeropp-qgz-error-interval", "-1"], 1,
         "--zeropp-qgz-error-interval must be an int >= 0, got -1"),
        (["--zeropp-qgz-error-feedback"], 1,
         "--zeropp-qgz-error-feedback=True needs qgZ, which is off"),
        (["--zeropp-qgz-hadamard"], 1, "--zeropp-qgz-hadamard=True needs qgZ, which is off"),
        (["--zeropp-qgz", "--zeropp-qgz-error-log", "e.jsonl"], 1,
         "--zeropp-qgz-error-log e.jsonl needs --zeropp-qgz-error-interval > 0, got 0"),
        (["--zeropp-qwz-error-interval", "5"], 1,
         "--zeropp-qwz-error-interval=5 measures qwZ, which is off"),
        (["--zeropp-qwz", "--zeropp-qwz-error-log", "w.jsonl"], 1,
         "--zeropp-qwz-error-log w.jsonl needs --zeropp-qwz-error-interval > 0, got 0"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--data-path", "x"], 1, "exactly one data source"),
        (["--ranks-share-gpu", "--distributed-backend", "nccl"], 2,
         "--ranks-share-gpu needs --distributed-backend gloo (NCCL allows one rank per GPU), "
         "got nccl"),
        (["--ranks-share-gpu", "--tensor-model-parallel-size", "2"], 4,
         "--ranks-share-gpu runs data parallelism only, got --tensor-model-parallel-size 2"),
        (["--ranks-share-gpu", "--data-parallel-impl", "megatron"], 2,
         "--ranks-share-gpu runs the ZeRO++ layer"),
    ],
)
def test_conflicts_fail_with_the_values(extra, world, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + extra, world_size=world)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_flags_fail(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--zeropp-turbo"], world_size=1)
    assert "unrecognized arguments: --zeropp-turbo" in capsys.readouterr().err


def test_abbreviations_are_not_accepted(capsys):
    # argparse would otherwise accept --zeropp-q as --zeropp-qwz (ambiguous in spirit).
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-it", "5"], world_size=1)
