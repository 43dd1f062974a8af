"""``--zeropp-eval-weights``: evaluations with the exact 16-bit weights beside (or instead of)
the weights training's forward gathers (qwZ-quantized when qwZ is on), through pretrain_gpt.py's
loop at 2 nodes x 2 ranks on CPU. Training must compute the same bits whatever the evaluations
gathered; the exact evaluation must differ from the gathered one exactly when the gather is
quantized."""

import pytest

from megatron_zeropp.simulated_nodes import run_distributed

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters 6 --log-interval 1 "
        "--eval-interval 2 --eval-iters 2 --ranks-per-node 2 --bf16 "
        "--zeropp-small-param-threshold 0 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128").split()
CONFIGS = {
    "zero3": [],
    "qwz+hpz": ["--zeropp-qwz", "--zeropp-hpz"],
    "all3+diff4": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz", "--zeropp-qwz-diff-bits", "4"],
}
KEYS = ("loss", "grad_norm", "val_loss", "val_loss_exact", "final_val_loss",
        "final_val_loss_exact")


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    history = pretrain(argv)
    return {k: list(history[k]) for k in KEYS}


def _run(config, weights):
    argv = TINY + ["--zeropp-eval-weights", weights] + CONFIGS[config]
    out = run_distributed(_pretrain, 2, 2, args=(argv,))
    return out[-1]  # the last rank logs the losses


@pytest.fixture(scope="module")
def runs():
    wanted = {"zero3": ("both",), "qwz+hpz": ("gathered", "both", "exact"),
              "all3+diff4": ("gathered", "both", "exact")}
    return {(c, w): _run(c, w) for c, ws in wanted.items() for w in ws}


@pytest.mark.parametrize("config, other", [("qwz+hpz", "both"), ("qwz+hpz", "exact"),
                                           ("all3+diff4", "both"), ("all3+diff4", "exact")])
def test_training_computes_the_same_bits_whatever_the_evaluation_gathered(runs, config, other):
    base, run = runs[(config, "gathered")], runs[(config, other)]
    assert len(base["loss"]) == 6 and run["loss"] == base["loss"]
    assert run["grad_norm"] == base["grad_norm"]


@pytest.mark.parametrize("config", ["qwz+hpz", "all3+diff4"])
def test_both_logs_the_gathered_loss_and_the_exact_one_beside_it(runs, config):
    base, both = runs[(config, "gathered")], runs[(config, "both")]
    assert both["val_loss"] == base["val_loss"] and [i for i, _ in both["val_loss"]] == [2, 4, 6]
    assert both["final_val_loss"] == base["final_val_loss"]
    assert base["val_loss_exact"] == [] and len(both["val_loss_exact"]) == 3
    # quantized weights in the gathered evaluation: every exact loss differs from it
    assert all(e != g for (_, e), (_, g) in zip(both["val_loss_exact"], both["val_loss"]))
    assert both["final_val_loss_exact"][0][1] != both["final_val_loss"][0][1]


@pytest.mark.parametrize("config", ["qwz+hpz", "all3+diff4"])
def test_exact_evaluates_what_both_logs_as_exact(runs, config):
    both, exact = runs[(config, "both")], runs[(config, "exact")]
    assert exact["val_loss"] == both["val_loss_exact"]
    assert exact["final_val_loss"] == both["final_val_loss_exact"]


def test_without_qwz_the_exact_evaluation_is_the_gathered_one(runs):
    both = runs[("zero3", "both")]
    assert both["val_loss_exact"] == both["val_loss"] and len(both["val_loss"]) == 3


def test_megatron_ddp_refuses_another_evaluation(capsys):
    from megatron_zeropp.training.arguments import parse_args

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
            "--train-iters 2 --lr 1e-3 --data-parallel-impl megatron").split()
    assert parse_args(argv).zeropp_eval_weights == "gathered"  # control: the default passes
    with pytest.raises(SystemExit):
        parse_args(argv + ["--zeropp-eval-weights", "exact"])
    assert ("--zeropp-eval-weights exact needs --data-parallel-impl zeropp"
            in capsys.readouterr().err)
