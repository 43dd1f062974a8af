"""tools/project_measured.py: the per-step byte model, the
compute arithmetic and the byte check, on hand-checked inputs."""

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import project_measured as PM  # noqa: E402

M = 16384  # one bucket, 2 nodes x 2 ranks: shard 4096 (see test_bench_projection.py)


def _inter(config, m):
    return PM.inter_bytes(PM.step_phases(config, [M], 2, 2, m))


def test_bytes_per_step_hand_checked():
    ring = 3 * 4096 * 2  # bf16 ring over 4 ranks: 3 shards of 4096 elements = 24576 bytes
    qwz = 3 * 4096 + 3 * 16 * 4  # INT8 shard + fp32 scales (blocks of 256) to 3 peers
    qgz = 4096 + 32 * 4  # hop 2: one INT8 row (the default) + its scales to the other node
    assert _inter("megatron", 8) == 2 * ring  # one all-gather + one reduce-scatter per step
    assert _inter("zero3", 1) == 3 * ring
    assert _inter("zero3", 8) == 16 * ring + ring  # gathers every micro-batch, grads once
    assert _inter("qwz_hpz", 8) == qwz + ring  # one cross-node gather per step (hpZ)
    assert _inter("all3", 8) == qwz + qgz
    assert _inter("all3_shard", 8) == qwz + 8 * qgz  # gradients reduced every micro-batch
    assert _inter("qwz_qgz", 8) == 16 * qwz + qgz  # no hpZ: every gather crosses nodes


def test_tied_embedding_is_gathered_for_the_logits_too():
    # The same bucket as the layers' stands in for the tied embedding unit: forward twice
    # (lookup, logits), backward once (logits) per micro-batch.
    ring = 3 * 4096 * 2
    qwz = 3 * 4096 + 3 * 16 * 4

    def inter(config, m):
        return PM.inter_bytes(PM.step_phases(config, [M], 2, 2, m, tied_embedding=M))

    assert inter("zero3", 2) == (2 * 2 + 2 * 3) * ring + 2 * ring  # layers 4, embedding 6, grads
    assert inter("megatron", 2) == 2 * 2 * ring  # megatron-core: both buckets once per step
    assert inter("qwz_hpz", 2) == 2 * qwz + 2 * ring  # hpZ: one cross-node gather per unit


def test_compute_and_comm_time_hand_checked():
    # 1 layer, hidden 4, seq 2, ffn 16, vocab 8: per layer 4*(4+8) + 16 + 4*16 + 16*4 = 192
    # weight elements, logits 32; matmul 2*(192+32) = 448 and causal attention (halved, as in
    # Megatron-LM's formula) 2*2*2*4 / 2 = 16 FLOP per token, x3 for forward + backward = 1392.
    model = PM.Model("toy", layers=1, hidden=4, heads=1, seq=2, ffn=16, vocab=8)
    assert model.flops(1) == 1392
    # DP 4 = 2 nodes x 2, PP 2: replica tokens 10 * 3 micro-batches * 4 ranks = 120 tokens,
    # 167040 FLOP over 8 GPUs = 20880 each at 1e-9 TFLOP/s = 20.88 s, bubble 1 + 1/3 -> 27.84 s.
    t = PM.Target("toy", model, tp=1, pp=2, dp=4, dp_per_node=2, groups_per_node=1,
                  micro_batch_tokens=10, micro_batches=3, inter_gbit=8e-9)
    rows = PM.project_target(t, 1e-9, 1e-9, ["megatron"], 0.0, 0.0)
    assert rows[0].compute_s == pytest.approx(27.84, rel=1e-12)
    # Params: per layer 4*(4+8) + 16 + 2*4*16 + 13*4 = 244, + 8*4 embedding = 276; PP 2 ->
    # chunk 138, one bucket padded to 140 (multiple of DP 4), shard 35: each ring moves 3 shards
    # of bf16 = 210 bytes, two per step (megatron) = 420 bytes at 1 byte/s per node link.
    assert model.params() == 276
    assert rows[0].inter_bytes == 420
    assert rows[0].comm_s == pytest.approx(420, rel=1e-12)
    assert rows[0].step_s(False) == pytest.approx(447.84, rel=1e-12)
    assert rows[0].step_s(True) == pytest.approx(420, rel=1e-12)
    with pytest.raises(ValueError, match="tflops"):
        PM.project_target(t, 0.0, 1.0, ["megatron"])


def test_the_70b_target_is_the_shipped_recipe():
    with open(os.path.join(ROOT, "examples", "llama_70b_tp8_pp4.sh")) as f:
        script = f.read()

    def flag(name):
        return int(re.search(rf"{name} (\d+)", script).group(1))

    m = PM.LLAMA_70B
    assert (m.layers, m.hidden, m.heads, m.query_groups, m.ffn, m.seq) == (
        flag("--num-layers"), flag("--hidden-size"), flag("--num-attention-heads"),
        flag("--num-query-groups"), flag("--ffn-hidden-size"), flag("--seq-length"))
    assert m.swiglu and "--swiglu" in script and m.untied
    t70 = [t for t in PM.targets(400.0) if t.model is m]
    assert {(t.tp, t.pp, t.micro_batches) for t in t70} == {
        (flag("--tensor-model-parallel-size"), flag("--pipeline-model-parallel-size"),
         flag("--global-batch-size") // t70[0].dp // flag("--micro-batch-size"))}
    assert "--zeropp-qwz --zeropp-qgz" in script and "--zeropp-hpz" not in script.split(
        "exec")[1]  # the shipped flags = the qwz_qgz row
    assert sorted(t.inter_gbit for t in t70) == [400.0, 3200.0]


def _results(tmp_path, measured_factor=1.0, date="2026-12-07 10:00 UTC", as_if=None):
    meta = {"model": "tiny", "gpus": 2, "machine": "test box", "date": date,
            "model_flags": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                            "4", "--seq-length", "64", "--micro-batch-size", "2",
                            "--vocab-size", "50257"]}
    model, _ = PM.measured_model(meta)
    buckets, tied = PM._buckets(model, 1, 1, 2)
    assert tied == 50304 * 64 + 64 * 64  # word + learned position embeddings, DP-padded
    runs = [{"link": "nvlink", "config": "megatron", "micro_batches": mb, "status": "ok",
             "tflops_median": rate} for mb, rate in ((1, 150.0), (8, 180.0))]
    runs.append({"link": "nvlink", "config": "megatron", "micro_batches": 2, "status": "failed",
                 "tflops_median": 900.0})
    for config in ("zero3", "all3"):
        spec = PM.spec_as_recorded(config, as_if or date)
        expected = PM.inter_bytes(PM.step_phases(config, buckets, 2, 1, 8, tied, spec))
        runs.append({"link": "10gbit", "config": config, "micro_batches": 8, "status": "ok",
                     "inter_bytes_median": expected * measured_factor})
    data = {"meta": meta, "probes": {"nvlink": {"recv_gbit_per_rank": 1600.0}}, "runs": runs}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return data, path


def test_measurement_inputs_and_byte_check(tmp_path):
    data, _ = _results(tmp_path)
    assert PM.compute_rate(data) == 180.0  # best ok megatron NVLink run; the failed one ignored
    assert [(c["config"], c["ratio"]) for c in PM.byte_check(data)] == [("zero3", 1.0),
                                                                       ("all3", 1.0)]
    off, _ = _results(tmp_path, measured_factor=2.0)
    assert [c["ratio"] for c in PM.byte_check(off)] == [2.0, 2.0]  # the check can fail
    data["runs"] = [r for r in data["runs"] if r["config"] != "megatron"]
    with pytest.raises(ValueError, match="pass --tflops"):
        PM.report(data, 400.0)


def test_byte_check_reads_a_run_with_the_defaults_of_its_day(tmp_path):
    # qgZ's cross-node hop: INT8 since 2026-12-06, INT4 before (records of then don't name it)
    assert PM.spec_as_recorded("all3", "2026-11-30 15:03 UTC")[0].qgz_inter_bits == 4
    assert PM.spec_as_recorded("all3", "2026-12-06 21:00 UTC")[0].qgz_inter_bits == 8
    assert PM.spec_as_recorded("qwz_hpz", "2026-11-30") == PM.CONFIGS["qwz_hpz"]
    old, _ = _results(tmp_path, date="2026-11-30 15:03 UTC")
    assert [c["ratio"] for c in PM.byte_check(old)] == [1.0, 1.0]
    # negative control: an INT4-hop record read as if made today no longer matches its bytes
    mixed, _ = _results(tmp_path, date="2026-12-07 10:00 UTC", as_if="2026-11-30")
    assert [c["ratio"] == 1.0 for c in PM.byte_check(mixed)] == [True, False]
    # the 2 H200 runs of 2026-11-30 (docs/benchmarks.md): measured = model once more
    with open(os.path.join(ROOT, "docs", "gpu_shaped_results.json")) as f:
        real = json.load(f)
    ratios = [c["ratio"] for c in PM.byte_check(real)]
    assert ratios and all(abs(r - 1) < 0.002 for r in ratios), ratios


def test_cli(tmp_path, capsys):
    _, path = _results(tmp_path)
    assert PM.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "- compute: 180.0 TFLOP/s per GPU (measured" in out
    assert "- intra-node: 200 GB/s per GPU (the NVLink probe)" in out
    assert out.count("| megatron |") == 6 and "Llama 70B TP8 PP4" in out
    assert PM.main([str(path), "--tflops", "50", "--ib-link-gbit", "100"]) == 0
    assert "- compute: 50.0 TFLOP/s per GPU (given by --tflops)" in capsys.readouterr().out
