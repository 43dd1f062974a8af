"""benchmarks/convergence.py --gpu without GPUs: the job command lines, input checks, reading
resumed logs back, the comparison table, and one end-to-end run of the driver on CPU (gloo,
tiny model) that must show hpZ identical to ZeRO-3."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import _convergence_gpu as G  # noqa: E402
import convergence as C  # noqa: E402


def _data(tmp_path):
    prefix = str(tmp_path / "d")
    for name in ("d.idx", "v.idx"):
        (tmp_path / name).write_bytes(b"")
    return prefix, str(tmp_path / "v")


def _run(tmp_path, **kw):
    base = dict(configs={"zero3": (), "hpz": ("--zeropp-hpz",)}, data_prefix=_data(tmp_path),
                vocab_size=8192, run_dir=str(tmp_path / "run"), gpus=2, train_iters=100,
                micro_batch_size=8, global_batch_size=32, eval_interval=50, eval_iters=10,
                minutes=8.0)
    base.update(kw)
    return G.GpuRun(**base)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_job_argv_two_nodes_resumable_fp32_grads(tmp_path):
    run = _run(tmp_path, gpus=4)
    argv = G.job_argv(run, "hpz")
    assert _flag(argv, "--ranks-per-node") == "2"
    ckpt = os.path.join(run.run_dir, "hpz", "ckpt")
    assert _flag(argv, "--save") == _flag(argv, "--load") == ckpt
    assert _flag(argv, "--exit-duration-in-mins") == "8"
    assert _flag(argv, "--seed") == "1234"
    assert "--accumulate-allreduce-grads-in-fp32" in argv and argv[-1] == "--zeropp-hpz"
    assert _flag(argv, "--hidden-size") == "896"
    cmd = G.job_command(run, "zero3", 12345)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in cmd and _flag(cmd, "--nproc-per-node") == "4"
    seeded = _run(tmp_path, configs={"s": ("--seed", "7")})
    assert G.job_argv(seeded, "s").count("--seed") == 1


@pytest.mark.parametrize("kw, message", [
    (dict(gpus=3), "even number of GPUs"),
    (dict(global_batch_size=24), "not a multiple"),
    (dict(minutes=0), "--minutes"),
    (dict(model="huge"), "model must be"),
])
def test_bad_settings(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, **kw)


def test_missing_data_is_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        _run(tmp_path, data_prefix=(str(tmp_path / "nowhere"), str(tmp_path / "v")))


def _line(i, loss, gn=1.0):
    return (f" [2026-11-30 10:00:00] iteration {i:8d}/     100 | elapsed time per iteration (ms): "
            f"{100 + i:.1f} | lm loss: {loss:.6E} | grad norm: {gn:.3f} |\n")


def test_collect_reads_resumed_logs_and_the_table_compares(tmp_path):
    run_dir = tmp_path / "run"
    for name, losses in (("zero3", [3.0, 2.5, 2.0, 1.5]), ("hpz", [3.0, 2.5, 2.0, 1.5]),
                         ("qgz", [3.0, 2.6, 2.1, 1.5])):
        os.makedirs(run_dir / name)
        lines = [_line(i + 1, loss) for i, loss in enumerate(losses[:3])]
        # The job stopped after iteration 3 and was resumed from iteration 2's checkpoint: the
        # replayed iteration 3 and the new 4 come later in the same file; the later line wins.
        lines += ["### resumed\n", _line(3, losses[2]), _line(4, losses[3]),
                  " validation loss at iteration 4 | lm loss value: "
                  f"{losses[3] + (0.1 if name == 'qgz' else 0):.6E} | lm loss PPL: 1 |\n",
                  " validation loss at iteration 4 on validation set | lm loss value: "
                  f"{losses[3] + 0.05:.6E} | lm loss PPL: 1 |\n"]
        (run_dir / name / "train.log").write_text("".join(lines))
    (run_dir / "qgz" / "qgz_error.jsonl").write_text(
        json.dumps({"iteration": 1, "units": {"a": 0.1}, "total": 0.1}) + "\n")
    res = G.collect(str(run_dir), ["zero3", "hpz", "qgz"])
    assert res["zero3"]["iterations"] == [1, 2, 3, 4]
    assert res["qgz"]["loss"] == [3.0, 2.6, 2.1, 1.5]
    assert res["qgz"]["val_loss"] == [(4, 1.6)] and res["qgz"]["qgz_error"][0]["total"] == 0.1
    assert res["zero3"]["final_val_loss"] == [(4, 1.55)]  # the closing evaluation, apart
    table = C._table_gpu(res)
    rows = {r.split(" | ")[0].strip("| "): r for r in table.splitlines()[2:]}
    assert "none (identical)" in rows["hpz"]
    assert "| 2 |" in rows["qgz"]  # first differing iteration
    assert "+6.667 %" in rows["qgz"]  # (1.6 - 1.5) / 1.5
    # The check can fail: one changed loss anywhere shows up.
    res["hpz"]["loss"][-1] += 1e-6
    assert "none (identical)" not in C._table_gpu(res).splitlines()[3]


@pytest.mark.slow
@pytest.mark.long
def test_end_to_end_on_cpu_hpz_identical_to_zero3(tmp_path, capsys):
    from megatron_zeropp.data.sample_corpus import prepare_sample_data

    data_dir = str(tmp_path / "data")
    prepare_sample_data(data_dir)
    C.main(["--gpu", "--gpus", "2", "--model", "tiny", "--data-dir", data_dir,
            "--run-dir", str(tmp_path / "run"), "--iters", "4", "--eval-interval", "2",
            "--eval-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--minutes", "3", "--configs", "zero3", "hpz", "--out", str(tmp_path / "c.png"),
            "--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    res = json.load(open(tmp_path / "c.json"))
    assert res["zero3"]["iterations"] == [1, 2, 3, 4]
    assert res["hpz"]["loss"] == res["zero3"]["loss"]
    assert [v[0] for v in res["zero3"]["val_loss"]] == [2, 4]
    assert "none (identical)" in out and os.path.getsize(tmp_path / "c.png") > 0


def test_every_job_has_its_own_index_cache(tmp_path):
    # Concurrent jobs sharing megatron-core's default cache next to the data raced on its .npy
    # files (one read a file another was writing: EOFError in build_gpt_datasets).
    run = _run(tmp_path, configs={"zero3": (), "hpz": ("--zeropp-hpz",)})
    caches = {name: _flag(G.job_argv(run, name), "--data-cache-path") for name in run.configs}
    assert len(set(caches.values())) == len(caches)
    assert all(c.startswith(run.run_dir) for c in caches.values())


def test_qgz_error_diagnostic_only_where_qgz_runs(tmp_path):
    run = _run(tmp_path, configs={"zero3": (), "all3": ("--zeropp-qwz", "--zeropp-qgz")},
               qgz_error_interval=20)
    assert "--zeropp-qgz-error-interval" not in G.job_argv(run, "zero3")
    argv = G.job_argv(run, "all3")
    assert _flag(argv, "--zeropp-qgz-error-interval") == "20"
    assert _flag(argv, "--zeropp-qgz-error-log") == os.path.join(run.run_dir, "all3",
                                                                 "qgz_error.jsonl")
