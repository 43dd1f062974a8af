"""Argument errors: one short line naming flag and value, from rank 0 only, before any group."""

import subprocess
import sys

import pytest

from megatron_zeropp.training.arguments import parse_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()


@pytest.mark.parametrize("extra, world, message", [
    (["--zeropp-hpz", "--zeropp-hpz-partition-size", "3", "--ranks-per-node", "2"], 4,
     "--zeropp-hpz-partition-size: hpZ partition size 3 must be >= 1 and divide the DP ranks "
     "per node (2)"),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "101"], 2,
     "--ffn-hidden-size 101 is not divisible by --tensor-model-parallel-size 2"),
    (["--group-query-attention", "--num-query-groups", "3"], 1, "--num-query-groups 3 must"),
    (["--zeropp-prefetch-depth", "-1"], 1, "--zeropp-prefetch-depth must be an int >= 0, got -1"),
    (["--zeropp-small-param-threshold", "-1"], 1,
     "--zeropp-small-param-threshold must be an int >= 0, got -1"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 1,
     "mutually exclusive"),
    (["--load-optional"], 1, "--load-optional needs --load"),
    (["--lr-warmup-iters", "10"], 1, "the LR warm-up (10 iterations) must be shorter than the "
     "LR decay (10 iterations: --lr-decay-iters, default the whole run)"),
    (["--lr-warmup-iters", "4", "--lr-decay-iters", "3"], 1, "LR warm-up (4 iterations)"),
])
def test_layout_errors_name_the_flag_before_any_group(extra, world, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + extra, world_size=world)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "usage:" not in err  # one line, no 70-line usage


TE_REFUSAL = ("--transformer-impl transformer_engine (Megatron-LM's default) needs CUDA and the "
              "transformer_engine package, which this machine lacks; use --transformer-impl "
              "local (megatron-core's own layers)")


def test_transformer_engine_without_it_is_refused_at_start(monkeypatch, capsys):
    from megatron_zeropp.training import megatron_lm_flags

    te = ["--transformer-impl", "transformer_engine"]
    monkeypatch.setattr(megatron_lm_flags, "torch_cuda_available", lambda: False)
    monkeypatch.setattr(megatron_lm_flags.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else object())
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + te, world_size=1)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"pretrain_gpt.py: error: {TE_REFUSAL} (--help lists the " \
        "flags)\n"
    monkeypatch.setenv("RANK", "1")  # the other ranks stay silent
    with pytest.raises(SystemExit):
        parse_args(BASE + te, world_size=2)
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")
    # With CUDA only the package is missing; local (the advice) starts.
    monkeypatch.setattr(megatron_lm_flags, "torch_cuda_available", lambda: True)
    with pytest.raises(SystemExit):
        parse_args(BASE + te, world_size=1)
    assert "needs the transformer_engine package, which" in capsys.readouterr().err
    assert parse_args(BASE + ["--transformer-impl", "local"], world_size=1).transformer_impl == \
        "local"


def test_transformer_engine_where_it_is_there_is_not_refused(monkeypatch):
    # Negative control: the refusal depends on what is missing, not on the flag alone.
    from megatron_zeropp.training import megatron_lm_flags

    monkeypatch.setattr(megatron_lm_flags, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(megatron_lm_flags.importlib.util, "find_spec", lambda name, *a: object())
    args = parse_args(BASE + ["--transformer-impl", "transformer_engine"], world_size=1)
    assert args.transformer_impl == "transformer_engine"


def test_transformer_engine_stops_a_real_start_in_one_line():
    # As launched: pretrain_gpt.py on this machine (no CUDA, no Transformer Engine) stops
    # before building anything, with the one line and no traceback.
    cmd = [sys.executable, "pretrain_gpt.py", *BASE, "--transformer-impl", "transformer_engine"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == \
        f"pretrain_gpt.py: error: {TE_REFUSAL} (--help lists the flags)"
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout


def test_only_rank_0_prints(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--zeropp-turbo"], world_size=4)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--zeropp-turbo"], world_size=4)
    assert "unrecognized arguments: --zeropp-turbo" in capsys.readouterr().err


def test_plain_python_is_a_one_rank_job(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    cmd = [sys.executable, "pretrain_gpt.py", "--num-layers", "1", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
           "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "iteration        2/       2" in out.stdout
    # megatron-core's apex/TE fallback warnings: one line instead of one per module
    assert "not installed" not in out.stderr
    assert sum("not installed" in line for line in out.stdout.splitlines()) == 1


def test_a_half_set_launch_environment_says_torchrun():
    from megatron_zeropp.training.launch import single_process_defaults

    with pytest.raises(ValueError, match="has RANK but not WORLD_SIZE, LOCAL_RANK, MASTER_ADDR"):
        single_process_defaults({"RANK": "0"})
    env = {}
    assert single_process_defaults(env) and env["WORLD_SIZE"] == "1" and env["RANK"] == "0"
