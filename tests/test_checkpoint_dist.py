"""``--ckpt-format torch_dist`` through pretrain_gpt.py's loop on gloo processes (2 simulated
nodes x 2 ranks, tiny GPT): Megatron-LM's files and keys, bit-exact resume, a killed save, and
loading into other layouts (TP, PP, data-parallel implementation, ZeRO++ flags off) with the
parameters compared exactly after gathering them whole."""

import contextlib
import os

import pytest
import torch

from megatron_zeropp.checkpointing.legacy import iteration_dir, latest_iteration
from megatron_zeropp.sharded_tensors import flat_range_boxes
from megatron_zeropp.simulated_nodes import DistributedFailure, run_distributed

ZEROPP = ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]
DIST = ["--ckpt-format", "torch_dist"]


def _argv(sample_dir, iters, extra=()):
    return (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            f"--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters {iters} "
            f"--log-interval 1 --eval-interval 1000 --eval-iters 0 --sample-data {sample_dir} "
            f"--ranks-per-node 2").split() + DIST + list(extra)


def _full_params(chunk):
    """name -> whole parameter (gathered over DP by the ZeRO layer, over TP here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    gathered = getattr(chunk, "gathered_parameters", contextlib.nullcontext)
    out = {}
    with gathered():
        for name, p in chunk.module.named_parameters():
            t = p.detach().clone()
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t, group=ps.get_tensor_model_parallel_group())
                t = torch.cat(parts, dim=p.partition_dim)
            out[name] = t
    return out


def _pretrain(ctx, argv, capture_at=(), kill_save_at=None):
    from megatron_zeropp.training.loop import pretrain

    captured = {}

    def on_iteration(iteration, chunks, optimizer):
        if iteration in capture_at:
            captured[iteration] = _full_params(chunks[0])
        if iteration == kill_save_at and ctx.rank == 1:
            import megatron.core.dist_checkpointing as dc

            def die(*args, **kwargs):
                os._exit(3)  # a node lost while the others write their shards
            dc.save = die

    return pretrain(argv, on_iteration=on_iteration), captured


def test_flat_ranges_become_contiguous_boxes():
    for shape in [(7,), (5, 8), (3, 4, 5), (2, 1, 3, 4)]:
        numel = torch.Size(shape).numel()
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                marks = torch.zeros(shape, dtype=torch.int)
                pos = start
                for offset, size in flat_range_boxes(shape, start, end):
                    index = tuple(slice(o, o + s) for o, s in zip(offset, size))
                    marks[index] += 1
                    # contiguous in the flat tensor, in order: the box is the next elements
                    flat = torch.arange(numel).view(shape)[index].reshape(-1)
                    assert torch.equal(flat, torch.arange(pos, pos + flat.numel()))
                    pos += flat.numel()
                expected = torch.zeros(numel, dtype=torch.int)
                expected[start:end] = 1
                assert torch.equal(marks.view(-1), expected), (shape, start, end)
    with pytest.raises(ValueError, match=r"range \[3, 41\) outside"):
        flat_range_boxes((5, 8), 3, 41)


def test_resume_is_bit_exact_and_files_are_megatron_lm_s(sample_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    # bf16: 16-bit weights in "model", their fp32 main copies in "optimizer"
    full = run_distributed(_pretrain, 2, 2, args=(_argv(
        sample_dir, 6, ZEROPP + ["--bf16", "--save", save, "--save-interval", "3"]),))[0][0]
    files = set(os.listdir(iteration_dir(save, 3)))
    assert {"metadata.json", "common.pt", ".metadata", "model_config.json"} <= files
    assert sum(f.endswith(".distcp") for f in files) >= 4  # every rank wrote its shard
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(iteration_dir(save, 3))
    assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0
    assert common["args"].consumed_train_samples == 24
    assert {"opt_param_scheduler", "num_floating_point_operations_so_far", "optimizer"} <= \
        common.keys()
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    resumed = run_distributed(_pretrain, 2, 2, args=(_argv(
        sample_dir, 6, ZEROPP + ["--bf16", "--load", save, "--ckpt-step", "3"]),))[0][0]
    assert resumed["iterations"] == [4, 5, 6]
    # dropout is on (0.1): equality needs the RNG states and every Adam step count restored
    assert resumed["loss"] == full["loss"][3:]
    assert resumed["grad_norm"] == full["grad_norm"][3:]


def test_a_killed_save_leaves_the_previous_checkpoint(sample_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    with pytest.raises(DistributedFailure):
        run_distributed(_pretrain, 2, 2, args=(
            _argv(sample_dir, 4, ["--save", save, "--save-interval", "2"]),),
            kwargs={"kill_save_at": 4}, timeout=120, collective_timeout=20)
    assert latest_iteration(save) == 2
    assert not os.path.exists(iteration_dir(save, 4))
    resumed = run_distributed(_pretrain, 2, 2, args=(
        _argv(sample_dir, 4, ["--load", save]),))[0][0]
    assert resumed["iterations"] == [3, 4]


@pytest.fixture(scope="module")
def saved(sample_dir, tmp_path_factory):
    """DP 4 (2 nodes x 2), all ZeRO++ flags: a torch_dist checkpoint of iteration 3 and the
    whole parameters at that point."""
    save = str(tmp_path_factory.mktemp("layout") / "ckpt")
    out = run_distributed(_pretrain, 2, 2, args=(_argv(sample_dir, 3, ZEROPP + ["--save", save]),),
                          kwargs={"capture_at": (3,)})
    return save, out[0][1][3], out[0][0]["loss"]


@pytest.mark.parametrize("name,extra", [
    # The sample tokenizer's 4101-entry vocabulary (Megatron-LM's legacy SentencePiece one) pads
    # to 128 x TP: 4224 at TP 1, 4352 at TP 2 with the default 128; 64 x 2 keeps 4224.
    ("TP2 x DP2, ZeRO++", ZEROPP + ["--tensor-model-parallel-size", "2",
                                    "--sequence-parallel", "--make-vocab-size-divisible-by",
                                    "64"]),
    ("DP4, megatron-core DDP", ["--data-parallel-impl", "megatron",
                                "--use-distributed-optimizer"]),
    ("DP4, ZeRO-3 without qwZ/hpZ/qgZ", []),
])
def test_another_layout_loads_the_same_parameters_and_trains(saved, sample_dir, name, extra):
    save, params, first_losses = saved
    out = run_distributed(_pretrain, 2, 2, args=(_argv(
        sample_dir, 5, extra + ["--load", save, "--use-checkpoint-opt_param-scheduler"]),),
        kwargs={"capture_at": (3,)})
    loaded = out[0][1][3]
    assert loaded.keys() == params.keys() and len(params) > 10
    assert all(torch.equal(loaded[k], params[k]) for k in params), \
        [k for k in params if not torch.equal(loaded[k], params[k])]
    history = out[-1][0]
    assert history["iterations"] == [4, 5]
    assert all(torch.isfinite(torch.tensor(history["loss"])))
    assert history["loss"][-1] < first_losses[0]


def test_the_parameter_comparison_sees_a_wrong_load(saved, sample_dir):
    # Negative control: --finetune with a fresh model is not compared; loading nothing (another
    # seed, no --load) must give other parameters than the checkpoint's.
    save, params, _ = saved
    out = run_distributed(_pretrain, 2, 2, args=(_argv(sample_dir, 1, ["--seed", "7"]),),
                          kwargs={"capture_at": (1,)})
    fresh = out[0][1][1]
    assert fresh.keys() == params.keys()
    assert not any(torch.equal(fresh[k], params[k]) for k in params if params[k].numel() > 64)


def test_a_pipeline_layout_loads_the_same_parameters_and_trains(saved, sample_dir):
    # PP 2 x DP 2: each stage numbers its layers from 0 and the last stage holds its own copy of
    # the tied output weight (megatron-core stores it under the embedding's key).
    save, params, first_losses = saved
    out = run_distributed(_pretrain, 2, 2, args=(_argv(
        sample_dir, 5, ZEROPP + ["--pipeline-model-parallel-size", "2", "--load", save,
                                 "--use-checkpoint-opt_param-scheduler"]),),
        kwargs={"capture_at": (3,)})
    first, last = out[0][1][3], out[-1][1][3]
    renamed = {k.replace("decoder.layers.0.", "decoder.layers.1.").replace(
        "output_layer.weight", "embedding.word_embeddings.weight"): v for k, v in last.items()}
    assert set(first) | set(renamed) == set(params)
    assert all(torch.equal(first[k], params[k]) for k in first)
    assert all(torch.equal(renamed[k], params[k]) for k in renamed)
    history = out[-1][0]
    assert history["iterations"] == [4, 5]
    assert all(torch.isfinite(torch.tensor(history["loss"])))
    assert history["loss"][-1] < first_losses[0]


@pytest.mark.parametrize("optimizer", [["--use-distributed-optimizer"], []],
                         ids=["distributed", "non-distributed"])
def test_the_megatron_core_ddp_path_saves_what_zeropp_loads(sample_dir, tmp_path, optimizer):
    # --data-parallel-impl megatron saves through megatron-core's own sharded_state_dict methods
    # (the distributed optimizer gathered into fully_reshardable; without
    # --use-distributed-optimizer its non-distributed optimizer's own layout), as Megatron-LM.
    save = str(tmp_path / "ckpt")
    first = run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 2, ["--data-parallel-impl", "megatron", "--save", save] + optimizer),),
        kwargs={"capture_at": (2,)})
    second = run_distributed(_pretrain, 1, 2, args=(_argv(
        sample_dir, 3, ZEROPP + ["--load", save, "--use-checkpoint-opt_param-scheduler"]),),
        kwargs={"capture_at": (2,)})
    params, loaded = first[0][1][2], second[0][1][2]
    assert loaded.keys() == params.keys()
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    assert second[0][0]["iterations"] == [3]
    if optimizer:
        # megatron-core's non-distributed optimizer reads only its own layout (Megatron-LM's
        # without --use-distributed-optimizer too): refused at load, with the ways out.
        with pytest.raises(DistributedFailure, match="does not read: load it with "
                                                     "--use-distributed-optimizer"):
            run_distributed(_pretrain, 1, 2, args=(_argv(
                sample_dir, 3, ["--data-parallel-impl", "megatron", "--load", save]),))
