"""What a torch_dist save and load say: Megatron-LM's messages only (no "Overwriting old
incomplete / corrupted checkpoint" on a fresh save), and a checkpoint whose RNG states come from
another device (a GPU's 16-byte CUDA generator states, loaded on CPU) is skipped with one note
instead of failing in the first forward's dropout (gloo processes, tiny GPT)."""

import argparse
import contextlib
import io
import logging
import os

import torch

from megatron_zeropp.simulated_nodes import run_distributed

OVERWRITING = "Overwriting old incomplete / corrupted checkpoint"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _save_messages(ctx, root):
    import torch.distributed as dist
    from zero3_runs import build, train

    from megatron_zeropp.checkpointing import checks
    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp")
    train(wrapped, optimizer, 1)  # an optimizer state to save
    records = _Records()
    logger = logging.getLogger("megatron.core.dist_checkpointing")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    checkpoint_dist.save_checkpoint(root, 1, 8, [wrapped], optimizer, None, args,
                                    model_config={"num_layers": 2})
    ours = list(records.messages)
    # Negative control: the old order (model_config.json written before megatron-core's save)
    # makes megatron-core warn, and the handler sees it.
    begin_save = checkpoint_dist.begin_save

    def config_first(root, iteration, overwrite, model_config=None):
        tmp = begin_save(root, iteration, overwrite)
        if ctx.rank == 0:
            checks.write_model_config(tmp, {"num_layers": 2})
        dist.barrier()
        return tmp

    checkpoint_dist.begin_save = config_first
    records.messages.clear()
    checkpoint_dist.save_checkpoint(root, 2, 16, [wrapped], optimizer, None, args)
    checkpoint_dist.begin_save = begin_save
    return ours, list(records.messages), sorted(os.listdir(os.path.join(root, "iter_0000001")))


def test_a_torch_dist_save_prints_no_overwriting_warning(tmp_path):
    results = run_distributed(_save_messages, 1, 2, args=(str(tmp_path / "ckpt"),))
    for ours, _, files in results:
        assert not any(OVERWRITING in m for m in ours), ours
        assert "model_config.json" in files and "metadata.json" in files
    control = results[0][1]  # megatron-core warns from rank 0
    assert any(OVERWRITING in m for m in control), control


def _gpu_rng_resume(ctx, root):
    """Save with the RNG states a GPU would write, load them on CPU, train on."""
    from megatron.core import tensor_parallel
    from zero3_runs import build, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp")
    train(wrapped, optimizer, 1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    cpu_saved = checkpoint_dist._current_rng()

    def gpu_rng():  # CUDA generator states are 16 bytes (seed and offset)
        state = dict(cpu_saved[0])
        state["cuda_rng_state"] = torch.zeros(16, dtype=torch.uint8)
        state["rng_tracker_states"] = {name: torch.zeros(16, dtype=torch.uint8)
                                       for name in tracker.get_states()}
        return [state]

    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    original = checkpoint_dist._current_rng
    checkpoint_dist._current_rng = gpu_rng
    checkpoint_dist.save_checkpoint(os.path.join(root, "gpu"), 1, 8, [wrapped], optimizer, None,
                                    args)
    checkpoint_dist._current_rng = original
    checkpoint_dist.save_checkpoint(os.path.join(root, "cpu"), 1, 8, [wrapped], optimizer, None,
                                    args)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        checkpoint_dist.load_checkpoint(os.path.join(root, "gpu"), [wrapped], optimizer)
    skipped = torch.equal(torch.get_rng_state(), before)
    losses = train(wrapped, optimizer, 1)  # the first forward's dropout forks the tracker
    checkpoint_dist.load_checkpoint(os.path.join(root, "cpu"), [wrapped], optimizer)
    restored = torch.equal(torch.get_rng_state(), cpu_saved[0]["torch_rng_state"])
    # Negative control: the same states handed to the tracker unchecked fail in that forward.
    tracker.set_states(gpu_rng()[0]["rng_tracker_states"])
    try:
        train(wrapped, optimizer, 1)
        failure = None
    except RuntimeError as e:
        failure = str(e)
    return out.getvalue(), skipped, losses, restored, failure


def test_gpu_saved_rng_states_are_skipped_on_cpu_with_one_note(tmp_path):
    results = run_distributed(_gpu_rng_resume, 1, 2, args=(str(tmp_path),))
    for rank, (printed, skipped, losses, restored, failure) in enumerate(results):
        notes = [ln for ln in printed.splitlines() if "RNG states are not restored" in ln]
        assert len(notes) == (1 if rank == 0 else 0), printed
        if rank == 0:
            assert "16-byte generator state (saved on a GPU)" in notes[0]
            assert "--no-load-rng" in notes[0]
        assert skipped and restored
        assert torch.isfinite(torch.tensor(losses[0][0]))
        assert failure is not None


def test_the_rng_check_compares_form_and_size():
    from megatron_zeropp.checkpointing.checks import rng_tracker_mismatch

    here = {"model-parallel-rng": torch.get_rng_state()}
    assert rng_tracker_mismatch({"model-parallel-rng": torch.get_rng_state()}, here) is None
    gpu = rng_tracker_mismatch({"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}, here)
    assert "16-byte generator state (saved on a GPU)" in gpu
    assert f"takes {here['model-parallel-rng'].numel()} bytes" in gpu
    assert "tracker names" in rng_tracker_mismatch({"other": torch.get_rng_state()}, here)
    assert "saved on another device" in rng_tracker_mismatch(
        {"model-parallel-rng": torch.zeros(7, dtype=torch.uint8)}, here)
