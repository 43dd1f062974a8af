"""benchmarks/exposed_comm.py on small synthetic Chrome traces with known answers."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import exposed_comm as X  # noqa: E402


def _kernel(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
            "dur": dur, "args": {"device": 0, "stream": stream, "correlation": corr}}


def _launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
            "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _step(k, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": 1, "tid": 1,
            "ts": ts, "dur": dur}


def _trace():
    """Step 10 (CPU 0-100 us) launches: compute 1000-3000 and 4000-6000 on stream 7, NCCL
    2500-5000 and 7000-8000 on stream 20 (all in us). Step 11 (CPU 100-200 us) launches one
    compute kernel that runs at 9000-9500, long after its CPU range: the correlation id, not the
    time, puts it into step 11. A GPU-side ProfilerStep mirror and a CPU op are ignored."""
    ev = [_step(10, 0, 100), _step(11, 100, 100),
          {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#10", "pid": 0,
           "tid": 7, "ts": 0, "dur": 99999},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 5, "dur": 3}]
    for corr, (name, ts, dur, stream) in enumerate([
            ("sm90_xmma_gemm_bf16", 1000, 2000, 7), ("triton_quantize", 4000, 2000, 7),
            ("ncclDevKernel_AllGather_RING_LL", 2500, 2500, 20),
            ("ncclDevKernel_ReduceScatter_Sum_bf16", 7000, 1000, 20)]):
        ev += [_launch(10 + corr, corr), _kernel(name, ts, dur, stream, corr)]
    ev += [_launch(150, 99), _kernel("elementwise", 9000, 500, 7, 99)]
    return ev


def test_known_answer(tmp_path):
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    s10, s11 = X.analyze(str(path))
    # Window 1000-8000 = 7 ms; compute 4 ms; NCCL 2.5 + 1 = 3.5 ms; overlapped 2500-3000 and
    # 4000-5000 = 1.5 ms; exposed 3000-4000 and 7000-8000 = 2 ms; idle 6000-7000 = 1 ms.
    assert s10 == X.StepStats(10, 7.0, 4.0, 3.5, 1.5, 2.0, 1.0)
    assert s11 == X.StepStats(11, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0)


def test_fully_hidden_communication_is_not_exposed():
    acts = [X.Activity("gemm", 0, 100, 7, False), X.Activity("nccl", 10, 90, 20, True),
            X.Activity("ncclKernel_x", 20, 100, 21, True)]
    s = X.step_stats(1, acts)
    assert (s.comm_ms, s.overlapped_ms, s.exposed_ms, s.idle_ms) == (0.09, 0.09, 0.0, 0.0)


def test_interval_helpers():
    assert X.union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]
    assert X.intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert X.length([(0, 2), (1, 3)]) == 3
    assert X.is_comm("ncclDevKernel_AllReduce") and not X.is_comm("gemm_nccl_like")


def test_traces_without_steps_or_gpu_work_are_rejected(tmp_path):
    no_steps = tmp_path / "a.json"
    no_steps.write_text(json.dumps([_kernel("gemm", 0, 1, 7, 1)]))
    with pytest.raises(ValueError, match="no ProfilerStep"):
        X.analyze(str(no_steps))
    cpu_only = tmp_path / "b.json"
    cpu_only.write_text(json.dumps({"traceEvents": [_step(3, 0, 10)]}))
    with pytest.raises(ValueError, match="launched no GPU activity"):
        X.analyze(str(cpu_only))


def test_cli_table_json_and_timeline(tmp_path, capsys):
    for name in ("10gbit_mb1_megatron", "10gbit_mb1_all3"):
        d = tmp_path / "profiles" / name
        d.mkdir(parents=True)
        (d / "host_1.123.pt.trace.json").write_text(json.dumps({"traceEvents": _trace()}))
    png, js = tmp_path / "t.png", tmp_path / "e.json"
    assert X.main([str(tmp_path / "profiles"), "--json", str(js), "--png", str(png),
                   "--timeline", "10gbit_mb1_megatron,10gbit_mb1_all3"]) == 0
    out = capsys.readouterr().out
    assert "| 10gbit_mb1_all3 | 2 | 3.8 | 2.2 | 1.8 | 0.8 | **1.0** |" in out
    assert json.loads(js.read_text())["10gbit_mb1_megatron"]["mean"]["exposed_ms"] == 1.0
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no such trace"):
        X.find_traces([str(tmp_path / "missing")])
