"""benchmarks/convergence_lab.py and tools/numerics_lab.py without a GPU: the lab's command
lines, input checks, the seeded summary, and one end-to-end run of the driver on CPU."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import convergence_lab as L  # noqa: E402
import numerics_lab as N  # noqa: E402


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def _run(tmp_path, **kw):
    for name in ("d.idx", "v.idx"):
        (tmp_path / name).write_bytes(b"")
    base = dict(configs={L.job_name(c, s): L.LAB_CONFIGS[c] + ("--seed", str(s))
                         for c in ("zero3", "all3") for s in (1, 2)},
                data_prefix=(str(tmp_path / "d"), str(tmp_path / "v")), vocab_size=8192,
                run_dir=str(tmp_path / "run"), nodes=8, ranks_per_node=8, train_iters=100,
                micro_batch_size=1, global_batch_size=64, eval_interval=50, eval_iters=10,
                minutes=8.0)
    base.update(kw)
    return L.LabRun(**base)


def test_lab_command_shapes_z_ranks_on_one_gpu():
    cmd = N.lab_command(8, 8, ["--lr", "1e-3"], python="py", master_port=5)
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert _flag(cmd, "--nproc-per-node") == "64" and _flag(cmd, "--master-port") == "5"
    tail = cmd[cmd.index(N.PRETRAIN):]
    assert tail == [N.PRETRAIN, "--ranks-share-gpu", "--ranks-per-node", "8", "--lr", "1e-3"]
    assert "--standalone" in N.lab_command(2, 1, [])


@pytest.mark.parametrize("nodes, rpn, argv, message", [
    (0, 2, [], "nodes must be an int >= 1, got 0"),
    (2, True, [], "ranks_per_node must be an int >= 1, got True"),
    (2, 2, ["--ranks-per-node", "4"], "the lab sets"),
    (2, 2, ["--distributed-backend=nccl"], "the lab sets"),
])
def test_lab_command_refuses(nodes, rpn, argv, message):
    with pytest.raises(ValueError, match=message):
        N.lab_command(nodes, rpn, argv)


def test_tool_dry_run_prints_the_command(capsys):
    assert N.main(["--nodes", "2", "--ranks-per-node", "2", "--dry-run", "--", "--lr", "1"]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node 4" in out and "--ranks-share-gpu --ranks-per-node 2 --lr 1" in out


def test_tool_says_pretrain_flags_go_after_the_double_dash(capsys):
    with pytest.raises(SystemExit) as e:
        N.main(["--nodes", "2", "--ranks-per-node", "2", "--num-layers", "2", "--lr", "1e-3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "numerics_lab.py: error: unrecognized arguments: --num-layers 2 --lr 1e-3: "
        "pretrain_gpt.py's flags go after '--' (numerics_lab.py --nodes 2 --ranks-per-node 2 "
        "-- --num-layers 2 --lr 1e-3)")


def test_job_command_is_the_lab_over_the_study_flags(tmp_path):
    run = _run(tmp_path)
    cmd = L.job_command(run, "all3@seed2", 1234)
    assert _flag(cmd, "--nproc-per-node") == "64" and "--ranks-share-gpu" in cmd
    assert _flag(cmd, "--ranks-per-node") == "8" and _flag(cmd, "--seed") == "2"
    assert cmd.count("--seed") == 1 and cmd[-6:-2] == [
        "--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz", "--no-zeropp-qgz-stochastic-rounding"]
    ckpt = os.path.join(run.run_dir, "all3@seed2", "ckpt")
    assert _flag(cmd, "--save") == _flag(cmd, "--load") == ckpt
    assert "NCCL_NVLS_ENABLE=0" in cmd  # the device hosts' rule, kept for every job
    old = L.LAB_CONFIGS["all3-old"]
    assert _flag(list(old), "--zeropp-small-param-threshold") == "0"
    assert _flag(list(old), "--zeropp-qgz-intra-bits") == "4"


@pytest.mark.parametrize("kw, message", [
    (dict(nodes=1, ranks_per_node=1), "need DP >= 2"),
    (dict(global_batch_size=60), "not a multiple"),
    (dict(minutes=0), "--minutes"),
    (dict(model="huge"), "model must be"),
])
def test_bad_settings(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, **kw)


def test_summary_mean_spread_and_gap():
    def h(val):
        return {"iterations": [1, 2], "val_loss": [(2, val)]}
    results = {"zero3@seed1": h(2.0), "zero3@seed2": h(2.2), "all3@seed1": h(2.2),
               "all3@seed2": h(2.4)}
    s = L.summary(results, [1, 2])
    assert s["zero3"]["mean"] == pytest.approx(2.1) and s["zero3"]["spread"] == pytest.approx(0.2)
    assert s["all3"]["gap_pct"] == pytest.approx(100 * 0.2 / 2.1)
    assert "+9.524 %" in L.table(s)
    # paired: each seed against zero3 of the same seed
    assert s["all3"]["paired_gap_pct"] == {1: pytest.approx(10.0),
                                           2: pytest.approx(100 * 0.2 / 2.2)}
    assert "+10.000 %, +9.091 %" in L.table(s)
    mean = (10.0 + 100 * 0.2 / 2.2) / 2
    se = abs(10.0 - 100 * 0.2 / 2.2) / 2  # the stdev of two values is |a - b| / sqrt(2)
    assert s["all3"]["paired_gap_mean_pct"] == pytest.approx(mean)
    assert s["all3"]["paired_gap_se_pct"] == pytest.approx(se)
    assert f"{mean:+.3f} +- {se:.3f} %" in L.table(s)
    # A configuration run on fewer seeds is compared with zero3 on those seeds only: zero3's
    # other seed (far lower here) must not enter its gap.
    more = dict(results, **{"zero3@seed3": h(1.0), "all3@seed3": h(1.0)})
    more.pop("all3@seed3")
    s3 = L.summary(more, [1, 2, 3])
    assert s3["zero3"]["mean"] == pytest.approx(5.2 / 3)
    assert s3["all3"]["gap_pct"] == pytest.approx(100 * 0.2 / 2.1)
    # an explicit validation iteration; a job that did not reach it has no value there
    results["all3@seed1"] = {"iterations": [1, 2, 3], "val_loss": [(2, 2.2), (3, 2.0)]}
    s = L.summary(results, [1, 2], at=3)
    assert s["all3"]["val_loss"] == {1: 2.0, 2: None} and s["zero3"]["mean"] is None
    assert s["all3"]["paired_gap_pct"] == {} and s["all3"]["gap_pct"] is None
    # The gap can be negative and is read at the last validation every job reached.
    results["all3@seed2"] = {"iterations": [1, 2, 3], "val_loss": [(2, 1.8), (3, 1.0)]}
    s = L.summary(results, [1, 2])
    assert s["all3"]["at"] == 2 and s["all3"]["gap_pct"] == pytest.approx(-100 * 0.1 / 2.1)


@pytest.mark.slow
@pytest.mark.long
def test_end_to_end_on_cpu(tmp_path, capsys):
    from megatron_zeropp.data.sample_corpus import prepare_sample_data

    data_dir = str(tmp_path / "data")
    prepare_sample_data(data_dir)
    assert L.main(["--data-dir", data_dir, "--run-dir", str(tmp_path / "run"), "--model",
                   "tiny", "--iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                   "--micro-batch-size", "2", "--global-batch-size", "4", "--nodes", "2",
                   "--ranks-per-node", "1", "--configs", "zero3", "--seeds", "1",
                   "--minutes", "3", "--json", str(tmp_path / "c.json")]) == 0
    res = json.load(open(tmp_path / "c.json"))
    assert res["dp"] == 2 and sorted(res["runs"]) == ["zero3@seed1"]
    assert res["runs"]["zero3@seed1"]["iterations"] == [1, 2, 3, 4]
    assert [i for i, _ in res["runs"]["zero3@seed1"]["val_loss"]] == [2, 4]
    assert res["summary"]["zero3"]["mean"] == res["runs"]["zero3@seed1"]["val_loss"][-1][1]
    log = open(tmp_path / "run" / "zero3@seed1" / "train.log").read()
    assert "> numerics lab: 2 ranks share cpu" in log
    assert "| zero3 |" in capsys.readouterr().out


def test_eval_command_reads_zero3s_checkpoint_and_writes_nothing(tmp_path):
    run = _run(tmp_path)
    run = L.dataclasses.replace(run, configs={
        L.eval_name("qwz+hpz", 2): L.LAB_CONFIGS["qwz+hpz"] + ("--seed", "2")})
    cmd = L.eval_command(run, L.eval_name("qwz+hpz", 2), 7, eval_iters=40)
    assert _flag(cmd, "--load") == os.path.join(run.run_dir, "zero3@seed2", "ckpt")
    assert "--save" not in cmd and "--exit-duration-in-mins" not in cmd
    assert "--skip-train" in cmd and cmd.count("--eval-iters") == 1
    assert _flag(cmd, "--eval-iters") == "40" and _flag(cmd, "--seed") == "2"
    assert "--zeropp-qwz" in cmd and "--zeropp-hpz" in cmd


def test_merge_earlier_calls_and_plot(tmp_path, capsys):
    # zero3 ran in an earlier call: its runs come from that call's JSON, and the gaps use them
    def h(vals):
        return {"iterations": [1, 2], "loss": [3.0, 2.0], "grad_norm": [1.0, 1.0],
                "ms": [1.0, 1.0], "val_loss": [[1, vals[0]], [2, vals[1]]], "qgz_error": []}
    earlier = tmp_path / "a.json"
    earlier.write_text(json.dumps({"runs": {"zero3@seed1": h([3.0, 2.0]),
                                            "zero3@seed2": h([3.2, 2.2])}}))
    data = tmp_path / "data"
    data.mkdir()
    for name in ("t.idx", "v.idx"):
        (data / name).write_bytes(b"")
    (data / "sample_data.json").write_text(json.dumps({"data": {
        "train_data_prefix": "/elsewhere/t", "valid_data_prefix": "/elsewhere/v",
        "vocab_size": 128}}))
    run_dir = tmp_path / "run"
    for seed, vals in ((1, (3.1, 2.1)), (2, (3.2, 2.2))):
        d = run_dir / f"all3@seed{seed}"
        d.mkdir(parents=True)
        (d / "train.log").write_text("".join(
            f" validation loss at iteration {i} | lm loss value: {v:.6E} | lm loss PPL: 1 |\n"
            for i, v in ((1, vals[0]), (2, vals[1]))))
    png = tmp_path / "c.png"
    assert L.main(["--data-dir", str(data), "--run-dir", str(run_dir), "--configs", "all3",
                   "--seeds", "1", "2", "--collect-only", "--merge", str(earlier),
                   "--plot", str(png), "--json", str(tmp_path / "b.json"),
                   "--global-batch-size", "64"]) == 0
    summ = json.load(open(tmp_path / "b.json"))["summary"]
    assert summ["all3"]["paired_gap_pct"] == {"1": pytest.approx(5.0), "2": 0.0}
    assert png.stat().st_size > 10000
    with pytest.raises(SystemExit):
        L.main(["--data-dir", str(data), "--configs", "all3", "--evaluate-zero3-as", "zero3",
                "--global-batch-size", "64", "--dry-run"])
    assert "must include zero3" in capsys.readouterr().err
