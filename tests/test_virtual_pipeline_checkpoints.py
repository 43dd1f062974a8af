"""Checkpoints with virtual pipeline stages (several model chunks per pipeline rank).

torch_dist stores each chunk under Megatron-LM's keys ``model0``, ``model1``, ...; the tensors in
them carry global layer numbers, so a checkpoint saved with virtual stages loads without them and
the other way round, and at another TP/PP/DP. The torch format (one file per rank) is read at its
own layout only, virtual stages included, and says so.

"Megatron-LM" below is megatron-core driven exactly as Megatron-LM's ``save_checkpoint``
(megatron/training/checkpointing.py, ``generate_state_dict``) drives it for ``--ckpt-format
torch_dist`` with virtual stages: one ``model<i>`` entry per chunk from each chunk's
``sharded_state_dict``, then the optimizer's over that state, as in tests/test_checkpoint_interop.py
(Megatron-LM's own training loop needs CUDA).
"""

import argparse

import megatron_lm_saves
import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 2
MICRO, GLOBAL = 1, 8


def _megatron_lm_save(ctx, root, sharding_type):
    """Megatron-LM (megatron-core's DDP with 2 virtual stages) trains, saves and trains on."""
    from zero3_runs import build, full_params, train

    _, chunks, optimizer = build(ctx, 1, 2, "megatron", vp=2)
    train(chunks, optimizer, STEPS, micro=MICRO, global_batch=GLOBAL)
    meta = megatron_lm_saves.metadata(sharding_type)
    state = {"args": argparse.Namespace(tensor_model_parallel_size=1,
                                        pipeline_model_parallel_size=2,
                                        virtual_pipeline_model_parallel_size=2,
                                        use_distributed_optimizer=True,
                                        consumed_train_samples=STEPS * GLOBAL),
             "checkpoint_version": 3.0, "iteration": STEPS,
             "num_floating_point_operations_so_far": 0.0}
    for i, chunk in enumerate(chunks):
        state[f"model{i}"] = chunk.module.sharded_state_dict(metadata=meta)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=meta)
    megatron_lm_saves.write(root, STEPS, state, meta)
    params = full_params(chunks)
    return params, train(chunks, optimizer, STEPS, data_seed=1, micro=MICRO,
                         global_batch=GLOBAL)


def _zeropp_load(ctx, root, tp, pp, vp):
    """The ZeRO layer (flags off, one unit per chunk) at TP/PP/VP loads ``root`` and trains on;
    returns (iteration, full params, continuation)."""
    from zero3_runs import build, full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    _, wrapped, optimizer = build(ctx, tp, pp, "zeropp", ZeroPPConfig(unit="chunk"), vp=vp)
    chunks = wrapped if isinstance(wrapped, list) else [wrapped]
    it, _ = checkpoint_dist.load_checkpoint(root, chunks, optimizer, load_rng=False)
    params = full_params(wrapped)
    return it, params, train(wrapped, optimizer, STEPS, data_seed=1, micro=MICRO,
                             global_batch=GLOBAL)


@pytest.mark.parametrize("sharding_type", ["dp_reshardable", "fully_reshardable"])
def test_a_megatron_lm_checkpoint_with_virtual_stages_continues_exactly(tmp_path, sharding_type):
    root = str(tmp_path / "megatron_lm")
    saved = run_distributed(_megatron_lm_save, 2, 2, args=(root, sharding_type))
    loaded = run_distributed(_zeropp_load, 2, 2, args=(root, 1, 2, 2))
    for rank, ((params, reference), (it, loaded_params, continued)) in enumerate(
            zip(saved, loaded)):
        assert it == STEPS
        assert loaded_params.keys() == params.keys() and len(params) > 4
        assert all(torch.equal(loaded_params[k], params[k]) for k in params), rank
        assert continued == reference, (rank, continued, reference)


def test_a_megatron_lm_checkpoint_with_virtual_stages_loads_without_them(tmp_path):
    # fully_reshardable holds the optimizer in model space: PP 2 with 2 chunks per rank ->
    # PP 1 on 4 ranks (DP 4). The weights are compared through the continuation's first loss,
    # which they alone decide (DP 4 sums the same tokens in another order: fp32 rounding).
    root = str(tmp_path / "megatron_lm")
    saved = run_distributed(_megatron_lm_save, 2, 2, args=(root, "fully_reshardable"))
    loaded = run_distributed(_zeropp_load, 2, 2, args=(root, 1, 1, None))
    reference = saved[-1][1]
    continued = loaded[0][2]
    assert loaded[0][0] == STEPS
    assert abs(continued[0][0] - reference[0][0]) <= 1e-5 * reference[0][0], (continued,
                                                                              reference)
    assert continued[-1][0] < continued[0][0]


ZEROPP = ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]


def _argv(sample_dir, extra):
    return (f"--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            f"--micro-batch-size {MICRO} --global-batch-size {GLOBAL} --lr 3e-3 --train-iters 4 "
            f"--log-interval 1 --eval-interval 1000 --eval-iters 0 --sample-data {sample_dir} "
            f"--ranks-per-node 2 --pipeline-model-parallel-size 2").split() + list(extra)


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    history = pretrain(argv)
    return history["iterations"], history["loss"], history["grad_norm"]


def _train(sample_dir, *extra):
    return run_distributed(_pretrain, 2, 2, args=(_argv(sample_dir, extra),))[-1]


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("torch", marks=pytest.mark.slow)])
def test_resume_with_virtual_stages_is_bit_exact(sample_dir, tmp_path, fmt):
    # All three switches with their defaults (qgZ stochastic rounding), dropout on.
    save = str(tmp_path / "ckpt")
    flags = ZEROPP + VIRTUAL + ["--ckpt-format", fmt]
    _, losses, norms = _train(sample_dir, *flags, "--save", save, "--save-interval", "2")
    iterations, resumed, resumed_norms = _train(sample_dir, *flags, "--load", save,
                                                "--ckpt-step", "2")
    assert iterations == [3, 4]
    assert resumed == losses[2:] and resumed_norms == norms[2:]


@pytest.mark.slow
def test_a_torch_format_checkpoint_is_read_with_its_own_virtual_stages(sample_dir, tmp_path):
    from megatron_zeropp.simulated_nodes import DistributedFailure

    save = str(tmp_path / "ckpt")
    _train(sample_dir, *VIRTUAL, "--ckpt-format", "torch", "--save", save)
    with pytest.raises(DistributedFailure, match="virtual pipeline stages per rank checkpoint 2 "
                                                 "vs this run None"):
        _train(sample_dir, "--ckpt-format", "torch", "--load", save)


@pytest.mark.slow
@pytest.mark.parametrize("saved_with, loaded_with", [([], VIRTUAL), (VIRTUAL, [])],
                         ids=["into-virtual", "out-of-virtual"])
def test_virtual_stages_and_a_plain_pipeline_continue_each_other(sample_dir, tmp_path,
                                                                 saved_with, loaded_with):
    # The same weights, data and micro-batches compute the same losses whichever chunks hold
    # the layers: without dropout (its masks follow the schedule's order) and with nearest
    # rounding (stochastic rounding keys follow each rank's bucket numbering), all three
    # switches continue bit for bit. The gradient norm sums per-parameter norms in chunk order:
    # equal up to fp32 reassociation (a few ulps); with clipping off it feeds nothing.
    save = str(tmp_path / "ckpt")
    common = ZEROPP + ["--no-zeropp-qgz-stochastic-rounding", "--hidden-dropout", "0",
                       "--attention-dropout", "0", "--clip-grad", "0"]
    _, losses, norms = _train(sample_dir, *common, *saved_with, "--save", save,
                              "--save-interval", "2")
    iterations, continued, continued_norms = _train(sample_dir, *common, *loaded_with,
                                                    "--load", save, "--ckpt-step", "2")
    assert iterations == [3, 4]
    assert continued == losses[2:]
    assert continued_norms == pytest.approx(norms[2:], rel=1e-6)
