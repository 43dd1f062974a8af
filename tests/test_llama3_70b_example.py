"""examples/llama3_70b_cpu.sh, the Llama-3-70B recipe scaled down to 8 CPU ranks (TP 2 x PP 2 x
2 virtual stages x DP 2, 2 simulated nodes of 4, qwZ + hpZ + qgZ), run for a few iterations;
the run also checks tools/memory_per_gpu.py against the ZeRO layer's own ``memory_bytes()`` at
the recipe's shapes (every chunk of every rank) and its gathered-weights bound against the peak
measured in training.
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from megatron_zeropp.simulated_nodes import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "llama3_70b_cpu.sh")
sys.path.insert(0, os.path.join(REPO, "tools"))

import memory_per_gpu as tool  # noqa: E402

SHORT = ["--train-iters", "3", "--lr-decay-iters", "3", "--eval-interval", "3",
         "--eval-iters", "1", "--vocab-size", "16384"]
"""A few iterations instead of the example's 20 (CI's slow pass): a first step, one with
prefetch and hpZ secondaries in use, an evaluation and the final save. The vocabulary is cut
from 128,256 to 16,384 (the embedding and output layer stay the largest units, 5x a layer's
weights): on a CPU without AVX512-BF16, torch multiplies bf16 matrices by a scalar fallback
(7.9 GFLOP/s against 41 for fp32 on one idle AVX2 core here), the output layer is 90 % of the
last stage's work, and with the full vocabulary the test ran past 420 s on such a CPU
(2026-12-07, an AMD EPYC with AVX2 only; 102 s with this cut)."""


def example_args() -> list:
    out = subprocess.run(["bash", SCRIPT], check=True, capture_output=True, text=True,
                         env=dict(os.environ, PRINT_ARGS="1"))
    return out.stdout.split()


def _train_and_measure(ctx, argv):
    """pretrain() on this rank; per iteration the layer's persistent bytes; the most full
    weights gathered at once inside a training step."""
    import contextlib
    import io

    from megatron.core import parallel_state as ps

    from megatron_zeropp.sharding.unit import ShardedUnit
    from megatron_zeropp.training import loop
    from megatron_zeropp.training.model_chunks import memory_bytes as layer_memory

    live = {"held": set(), "peak": 0, "on": False}
    start, release, step = ShardedUnit.start_gather, ShardedUnit.release, loop.train_step

    def start_gather(self, *a, **k):
        start(self, *a, **k)
        live["held"].add(self)
        if live["on"]:
            live["peak"] = max(live["peak"], sum(sum(u._nbytes) for u in live["held"]))

    def release_(self):  # (construction releases units it never gathered)
        live["held"].discard(self)
        release(self)

    def train_step(*a, **k):  # evaluation and checkpoints gather too; only steps count here
        live["on"] = True
        try:
            return step(*a, **k)
        finally:
            live["on"] = False

    ShardedUnit.start_gather, ShardedUnit.release, loop.train_step = \
        start_gather, release_, train_step
    memory = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = loop.pretrain(argv, on_iteration=lambda i, chunks, opt: memory.append(
            layer_memory(chunks)))
    return {"history": history, "stdout": out.getvalue(), "memory": memory,
            "peak_gathered": live["peak"], "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True)}


@pytest.mark.slow
def test_cpu_example_trains_and_matches_the_memory_tool(tmp_path):
    argv = example_args() + SHORT + ["--save", str(tmp_path / "ckpt")]
    assert "--num-virtual-stages-per-pipeline-rank" in argv
    # 8 ranks on 2 cores, the checkpoint's fsync'd writes included (SHORT's time: its
    # docstring); 30-70 s with the full vocabulary on the CPUs CI ran on before.
    # Past the limit the error carries every rank's stack.
    results = run_distributed(_train_and_measure, 2, 4, args=(argv,), timeout=420)
    last = results[-1]
    losses = last["history"]["loss"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), last["stdout"][-2000:]
    assert not any(last["history"]["skipped"])
    assert "validation loss at iteration 3" in last["stdout"]
    assert "in 2 model chunks (virtual pipeline stages)" in results[0]["stdout"]
    assert os.path.exists(tmp_path / "ckpt" / "iter_0000003")
    args, vp = tool.parse_launch(argv, 8)
    shapes = tool.shapes_from_args(args)
    lay = tool.Layout(8, 2, 2, vp, 1, 4)
    settings = tool.zero_settings(args, True)
    for r in results:
        want = tool.zero_memory(shapes, lay, r["pp_rank"], r["dp_rank"], settings)
        for seen in r["memory"]:
            assert (seen["primary"], seen["secondary"], seen["grad"]) == \
                (want.weights, want.secondary, want.grads)
        # The most full weights training gathered at once: within the tool's bound for virtual
        # stages (the 1 + depth largest units, which the interleaved order may put side by
        # side), and at least the largest window of consecutive units of one chunk, which every
        # step enters in that order.
        units = tool.zero_units(shapes, lay, r["pp_rank"], settings)
        full = [sum(b.numel for b in bl) for bl in units]
        in_chunk_order = tool.gathered_units(full, settings.prefetch_depth, False)
        assert in_chunk_order * shapes.param_bytes <= r["peak_gathered"] \
            <= want.detail["gathered_weights"], (r["pp_rank"], r["peak_gathered"])
    # Negative control: one unit fewer in the window (no prefetch) would be less.
    nothing_ahead = tool.zero_memory(shapes, lay, 0, 0, dataclasses.replace(
        settings, prefetch_depth=0))
    assert nothing_ahead.detail["gathered_weights"] < results[0]["peak_gathered"]
