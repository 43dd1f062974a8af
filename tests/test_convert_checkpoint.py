"""tools/convert_checkpoint.py: torch -> torch_dist -> torch keeps weights, optimizer state,
schedule, data position and (same layout) RNG states, so a run resumed from the converted
checkpoint continues bit-exactly."""

import os
import subprocess
import sys

import pytest
import torch
from test_checkpoint_dist import _argv, _pretrain

from megatron_zeropp.simulated_nodes import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = ["--ckpt-format", "torch"]


def _convert(ctx, *args):
    from megatron_zeropp.training.convert import convert

    return convert(*args)


@pytest.mark.slow
def test_torch_to_torch_dist_and_back(sample_dir, tmp_path):
    torch_ckpt, dist_ckpt, back = (str(tmp_path / n) for n in ("torch", "dist", "back"))
    full = run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 5, ["--save", torch_ckpt, "--save-interval", "3"] + TORCH),),
        kwargs={"capture_at": (3,)})
    params = full[0][1][3]
    run_distributed(_convert, 1, 2, args=(torch_ckpt, dist_ckpt, "torch_dist", 3))
    assert os.path.exists(os.path.join(dist_ckpt, "iter_0000003", "metadata.json"))
    resumed = run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 5, ["--load", dist_ckpt]),), kwargs={"capture_at": (3,)})
    assert all(torch.equal(resumed[0][1][3][k], params[k]) for k in params)
    assert resumed[0][0]["iterations"] == [4, 5]
    assert resumed[0][0]["loss"] == full[0][0]["loss"][3:]  # dropout on: RNG carried over
    # back to torch, as one process (DP 1): the tool end to end
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                          "--input", dist_ckpt, "--output", back, "--to", "torch"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert os.path.exists(os.path.join(back, "iter_0000003", "mp_rank_00_000_dp_000.pt"))
    again = run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 5, ["--load", back] + TORCH),), kwargs={"capture_at": (3,)})
    assert all(torch.equal(again[0][1][3][k], params[k]) for k in params)
    assert again[0][0]["iterations"] == [4, 5]


def test_a_torch_checkpoint_is_not_read_into_another_tp(tmp_path, sample_dir):
    torch_ckpt = str(tmp_path / "torch")
    run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 1, ["--save", torch_ckpt] + TORCH),))
    from megatron_zeropp.simulated_nodes import DistributedFailure

    with pytest.raises(DistributedFailure, match="convert it to torch_dist first"):
        run_distributed(_convert, 1, 2, args=(torch_ckpt, str(tmp_path / "x"), "torch", None, 2))


@pytest.mark.slow
@pytest.mark.long
def test_non_distributed_rewrite_end_to_end(tmp_path, sample_dir):
    # pretrain_gpt.py's torch_dist checkpoint rewritten for Megatron-LM without
    # --use-distributed-optimizer (tests/test_checkpoint_interop.py loads such rewrites into
    # Megatron-LM); it still loads here, and the run resumes bit-exactly from it.
    dist_ckpt, flat = str(tmp_path / "dist"), str(tmp_path / "flat")
    full = run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 5, ["--save", dist_ckpt, "--save-interval", "3"]),))
    tool = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--to",
            "torch_dist", "--optimizer-layout", "non-distributed", "--ckpt-step", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(tool + ["--input", dist_ckpt, "--output", flat], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    directory = os.path.join(flat, "iter_0000003")
    keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    assert not any(k.startswith("optimizer.state.param.") for k in keys)  # fp32: none
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert "param_groups" in dist_checkpointing.load_common_state_dict(directory)["optimizer"]
    resumed = run_distributed(_pretrain, 1, 2, args=(_argv(sample_dir, 5, ["--load", flat]),))
    assert resumed[0][0]["iterations"] == [4, 5]
    assert resumed[0][0]["loss"] == full[0][0]["loss"][3:]
    # a second rewrite of the rewrite is refused: it reads the distributed layout only
    again = subprocess.run(tool + ["--input", flat, "--output", str(tmp_path / "again")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode != 0 and "optimizer stored as None" in again.stdout + again.stderr
