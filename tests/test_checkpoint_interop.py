"""torch_dist checkpoints exchanged with Megatron-LM, both ways (gloo processes, tiny GPT, no
dropout).

"Megatron-LM" here is megatron-core driven as Megatron-LM's ``save_checkpoint`` /
``load_checkpoint`` (megatron/training/checkpointing.py, core_v0.16.1) drive it for
``--ckpt-format torch_dist --use-distributed-optimizer``: the same state-dict keys, metadata and
calls, written out in this file so that none of this project's checkpoint code is involved. With
flags off and one unit per chunk, the ZeRO-3 layer trains bit-identically to megatron-core's DDP
(test_zero3_exact.py), so a checkpoint handed over must continue with exactly the losses and
gradient norms the other side would have seen.
"""

import argparse
import os

import pytest
import torch

from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 2


def _exact():
    from megatron_zeropp.sharding import ZeroPPConfig

    return ZeroPPConfig(unit="chunk")  # megatron-core's buffer layout: bit-identical training


def _metadata(sharding_type):
    from megatron.core import parallel_state as ps

    meta = {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if sharding_type == "fully_reshardable":
        meta["distrib_optim_fully_reshardable_mem_efficient"] = False
    return meta


def _megatron_lm_save(ctx, root, sharding_type, bf16=False):
    """Train megatron-core DDP, save as Megatron-LM does, train on (the reference).

    ``bf16``: as Megatron-LM's --bf16 without --loss-scale, which has no grad scaler (a loss
    scale of 0 gives megatron-core's get_megatron_optimizer the same: none). ``sharding_type``
    None: without --use-distributed-optimizer (megatron-core's non-distributed optimizer, and no
    sharding type in the metadata, as Megatron-LM writes it).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from zero3_runs import build, full_params, train

    dtype = torch.bfloat16 if bf16 else torch.float32
    opt = {"dtype": dtype, **({"loss_scale": 0.0} if bf16 else {})}
    distributed = sharding_type is not None
    if not distributed:
        opt["use_distributed_optimizer"] = False
    _, wrapped, optimizer = build(ctx, 1, 1, "megatron", dtype=dtype, opt=opt,
                                  ddp={"use_distributed_optimizer": distributed})
    assert not bf16 or all(o.grad_scaler is None for o in getattr(
        optimizer, "chained_optimizers", [optimizer]))
    train(wrapped, optimizer, STEPS)
    meta = _metadata(sharding_type) if distributed else {
        "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    state = {"args": argparse.Namespace(tensor_model_parallel_size=1,
                                        pipeline_model_parallel_size=1,
                                        consumed_train_samples=16),
             "checkpoint_version": 3.0, "iteration": STEPS,
             "num_floating_point_operations_so_far": 0.0}
    state["model"] = wrapped.module.sharded_state_dict(metadata=meta)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=meta)
    state["rng_state"] = ShardedObject(
        "rng_state", [{"torch_rng_state": torch.get_rng_state()}], (1, 1), (0, 0),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    directory = os.path.join(root, f"iter_{STEPS:07d}")
    if ctx.rank == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(state, directory, content_metadata={
        k: v for k, v in meta.items() if k != "dp_cp_group"})
    dist.barrier()
    if ctx.rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(STEPS))
    params = full_params(wrapped)
    return params, train(wrapped, optimizer, STEPS, data_seed=1)


def _zeropp_load(ctx, root, zeropp, load_optim=True):
    """Our ZeRO++ layer loads the checkpoint and trains on."""
    from zero3_runs import build, full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    it, consumed = checkpoint_dist.load_checkpoint(root, [wrapped], optimizer,
                                                   load_optim=load_optim, load_rng=False)
    params = full_params(wrapped)
    return (it, consumed), params, train(wrapped, optimizer, STEPS, data_seed=1)


def _megatron_impl_load(ctx, root, bf16=False):
    """This project's loader with --data-parallel-impl megatron (megatron-core's DDP); ``bf16``:
    this project's bf16 optimizer (a constant loss scale of 1)."""
    from zero3_runs import build, full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    dtype = torch.bfloat16 if bf16 else torch.float32
    _, wrapped, optimizer = build(ctx, 1, 1, "megatron", dtype=dtype, opt={"dtype": dtype})
    assert not bf16 or all(o.grad_scaler is not None for o in getattr(
        optimizer, "chained_optimizers", [optimizer]))
    checkpoint_dist.load_checkpoint(root, [wrapped], optimizer, load_rng=False)
    return full_params(wrapped), train(wrapped, optimizer, STEPS, data_seed=1)


def _zeropp_save(ctx, root, zeropp):
    from zero3_runs import build, full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    train(wrapped, optimizer, STEPS)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    checkpoint_dist.save_checkpoint(root, STEPS, 16, [wrapped], optimizer, None, args)
    params = full_params(wrapped)
    return params, train(wrapped, optimizer, STEPS, data_seed=1)


def _megatron_lm_load(ctx, root):
    """Megatron-LM's load_checkpoint for a torch_dist checkpoint, into megatron-core's DDP."""
    from megatron.core import dist_checkpointing
    from zero3_runs import build, full_params, train

    from megatron_zeropp.mcore.checkpoint import keeping_adam_steps

    _, wrapped, optimizer = build(ctx, 1, 1, "megatron")
    directory = os.path.join(root, f"iter_{STEPS:07d}")
    common = dist_checkpointing.load_common_state_dict(directory)
    meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    meta["dp_cp_group"] = _metadata("unused")["dp_cp_group"]
    request = {"model": wrapped.module.sharded_state_dict(metadata=meta)}
    # On CPU megatron-core runs torch's Adam (no apex/TE): its DistributedOptimizer needs an
    # allocated state before sharded_state_dict(is_loading=True) and a kept 'step' on load.
    optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
    request["optimizer"] = optimizer.sharded_state_dict(request, is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load(request, directory)
    wrapped.module.load_state_dict(loaded["model"])
    with keeping_adam_steps(optimizer.chained_optimizers):
        optimizer.load_state_dict(loaded["optimizer"])
    for state in optimizer.chained_optimizers[0].optimizer.state.values():
        state["step"] = state["step"].clone()  # see mcore.checkpoint.unshare_adam_steps
    params = full_params(wrapped)
    return common["iteration"], params, train(wrapped, optimizer, STEPS, data_seed=1)


def _same(a, b):
    assert a.keys() == b.keys() and len(a) > 10
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def megatron_lm_checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mlm") / "ckpt")
    out = run_distributed(_megatron_lm_save, 1, 2, args=(root, "fully_reshardable"))
    return root, out[0][0], out[0][1]


def test_megatron_lm_checkpoint_loads_into_zeropp_and_continues_exactly(megatron_lm_checkpoint):

    root, params, reference = megatron_lm_checkpoint
    out = run_distributed(_zeropp_load, 1, 2, args=(root, _exact()))
    (it, consumed), loaded, losses = out[0]
    assert (it, consumed) == (STEPS, 16)
    assert _same(loaded, params)
    assert losses == reference  # Adam moments and step counts came over exactly


def test_megatron_lm_checkpoint_loads_into_all_zeropp_flags(megatron_lm_checkpoint):
    from megatron_zeropp.sharding import ZeroPPConfig

    root, params, reference = megatron_lm_checkpoint
    out = run_distributed(_zeropp_load, 2, 2, args=(
        root, ZeroPPConfig(qwz=True, hpz=True, qgz=True)))
    _, loaded, losses = out[0]
    assert _same(loaded, params)  # DP 2 -> DP 4 over 2 nodes
    assert all(abs(a[0] - b[0]) < 0.05 for a, b in zip(losses, reference)), (losses, reference)


def test_megatron_lm_default_optimizer_format_is_refused_with_the_way_out(tmp_path):
    from megatron_zeropp.simulated_nodes import DistributedFailure

    root = str(tmp_path / "ckpt")
    params, reference = run_distributed(_megatron_lm_save, 1, 2, args=(root, "dp_reshardable"))[0]
    with pytest.raises(DistributedFailure, match="--dist-ckpt-optim-fully-reshardable"):
        run_distributed(_zeropp_load, 1, 2, args=(root, _exact()))
    _, loaded, _ = run_distributed(_zeropp_load, 1, 2, args=(root, _exact(), False))[0]
    assert _same(loaded, params)  # --no-load-optim: the weights alone
    # --data-parallel-impl megatron at the same layout reads the bucket format (megatron-core's
    # own loader) and continues exactly
    loaded, losses = run_distributed(_megatron_impl_load, 1, 2, args=(root,))[0]
    assert _same(loaded, params)
    assert losses == reference


def test_zeropp_checkpoint_loads_into_megatron_lm_and_continues_exactly(tmp_path):

    root = str(tmp_path / "ckpt")
    saved = run_distributed(_zeropp_save, 1, 2, args=(root, _exact()))
    params, reference = saved[0]
    it, loaded, losses = run_distributed(_megatron_lm_load, 1, 2, args=(root,))[0]
    assert it == STEPS
    assert _same(loaded, params)
    assert losses == reference


def test_the_exact_comparisons_can_fail(megatron_lm_checkpoint):
    # Negative control: weights alone (--no-load-optim) give the same parameters but fresh Adam
    # moments, and the continued losses must then differ from the reference.

    root, params, reference = megatron_lm_checkpoint
    _, loaded, losses = run_distributed(_zeropp_load, 1, 2, args=(root, _exact(),
                                                                  False))[0]
    assert _same(loaded, params)
    assert losses != reference


def test_megatron_lm_bf16_default_format_loads_with_megatron_impl_and_continues_exactly(tmp_path):
    # Megatron-LM's bf16 checkpoints hold no grad scaler; this project's bf16 optimizer has a
    # constant one (scale 1), which megatron-core's dp_reshardable request asked for.
    root = str(tmp_path / "ckpt")
    params, reference = run_distributed(_megatron_lm_save, 1, 2,
                                        args=(root, "dp_reshardable", True))[0]
    loaded, losses = run_distributed(_megatron_impl_load, 1, 2, args=(root, True))[0]
    assert _same(loaded, params)
    assert losses == reference  # a scale of exactly 1 changes no bit


def test_a_non_distributed_optimizer_checkpoint_is_refused_for_what_it_is(tmp_path):
    from megatron_zeropp.simulated_nodes import DistributedFailure

    root = str(tmp_path / "ckpt")
    params, _ = run_distributed(_megatron_lm_save, 1, 2, args=(root, None))[0]
    for load in (_zeropp_load, _megatron_impl_load):
        args = (root, _exact()) if load is _zeropp_load else (root,)
        with pytest.raises(DistributedFailure,
                           match="saved without --use-distributed-optimizer") as failure:
            run_distributed(load, 1, 2, args=args)
        assert "bucket layout" not in str(failure.value)
    _, loaded, _ = run_distributed(_zeropp_load, 1, 2, args=(root, _exact(), False))[0]
    assert _same(loaded, params)  # --no-load-optim: the weights alone
