"""torch_dist checkpoints exchanged with Megatron-LM, both ways, with their optimizer state
(gloo processes, tiny GPT, no dropout).

"Megatron-LM" here is megatron-core driven exactly as Megatron-LM's ``save_checkpoint`` /
``load_checkpoint`` (megatron/training/checkpointing.py, core_v0.16.1) drive it for
``--ckpt-format torch_dist``, with or without ``--use-distributed-optimizer`` and
``--dist-ckpt-optim-fully-reshardable``: the same state-dict keys, metadata and calls, written
out in this file so that none of this project's checkpoint code is involved, and nothing added
that Megatron-LM lacks. On CPU megatron-core runs torch's Adam; there Megatron-LM's own loader
fails for every distributed-optimizer checkpoint (:func:`test_megatron_lm_on_torch_adam_...`), so
the loads a GPU Megatron-LM does with apex/TE's fused Adam run megatron-core with its fused-Adam
code paths and a stand-in optimizer of FusedAdam's state layout (``fused_adam.py``).

With flags off and one unit per chunk the ZeRO-3 layer trains bit-identically to megatron-core's
DDP (test_zero3_exact.py), so a checkpoint handed over must continue with exactly the losses and
gradient norms the other program's uninterrupted run had.
"""

import argparse
import contextlib
import os
import traceback

import megatron_lm_saves
import pytest
import torch

from megatron_zeropp.simulated_nodes import DistributedFailure, run_distributed

# CI's second pass (pytest -m slow): the Megatron-LM checkpoint matrix, about 70 s, which the
# README's command leaves out to stay short.
pytestmark = pytest.mark.slow

STEPS = 2
LAYOUTS = ("dp_reshardable", "fully_reshardable", None)  # None: no --use-distributed-optimizer


def _exact():
    from megatron_zeropp.sharding import ZeroPPConfig

    return ZeroPPConfig(unit="chunk")  # megatron-core's buffer layout: bit-identical training


def _dtype(bf16):
    return torch.bfloat16 if bf16 else torch.float32


def _fused(fused):
    from fused_adam import megatron_core_with_fused_adam

    return megatron_core_with_fused_adam() if fused else contextlib.nullcontext()


def adam_state(wrapped, optimizer):
    """name -> {param (fp32 main), exp_avg, exp_avg_sq: whole tensors; step}: the Adam state
    of a ZeRO layer, megatron-core's distributed or its non-distributed optimizer, gathered."""
    import torch.distributed as dist

    from megatron_zeropp.optimizer.sharded_state import _mains_and_models

    names = {p: n for n, p in wrapped.module.named_parameters()}
    shards = getattr(wrapped, "shard_map", None)
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            mains = {p: m for m, p in _mains_and_models(opt)}
            ranges = {p: (s.start, s.end) for p, s in shards.items()} if shards else {
                p: (r.start, r.stop) for p in mains
                for r in [__import__("megatron_zeropp.mcore.optimizer", fromlist=["x"]
                                     ).param_range(opt, p)]}
        elif hasattr(opt, "fp32_from_float16_groups"):
            mains = {p: m for gp, gm in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                     for p, m in zip(gp, gm)}
            ranges = None
        else:
            mains = {p: p for g in opt.optimizer.param_groups for p in g["params"]}
            ranges = None
        group_steps = {id(m): g["step"] for g in opt.optimizer.param_groups if "step" in g
                       for m in g["params"]}
        for p, name in names.items():
            main = mains.get(p)
            state = opt.optimizer.state.get(main, {}) if main is not None else {}
            entry = {}
            for k in ("param", "exp_avg", "exp_avg_sq"):
                t = main if k == "param" else state.get(k)
                if ranges is None:
                    entry[k] = t.detach().float().reshape(-1).clone()
                    continue
                full = torch.zeros(p.shape.numel(), dtype=torch.float32)
                if t is not None:
                    a, b = ranges[p]
                    full[a:b] = t.detach().reshape(-1)
                dist.all_reduce(full, group=opt.data_parallel_group)
                entry[k] = full
            # torch's Adam keeps a step per parameter, FusedAdam (and its stand-in) per group
            step = state.get("step", group_steps.get(id(main)))
            step = float(step) if step is not None else -1.0
            if ranges is not None:  # a rank holding none of the parameter has no state for it
                step = torch.tensor(step)
                dist.all_reduce(step, op=dist.ReduceOp.MAX, group=opt.data_parallel_group)
                step = step.item()
            entry["step"] = step if step >= 0 else None
            out[name] = entry
    return out


def _megatron_lm_build(ctx, distributed, bf16):
    """megatron-core DDP and optimizer as Megatron-LM builds them; ``bf16``: --bf16 without
    --loss-scale, which has no grad scaler (a loss scale of 0 gives megatron-core the same)."""
    from zero3_runs import build

    dtype = _dtype(bf16)
    opt = {"dtype": dtype, "use_distributed_optimizer": distributed,
           **({"loss_scale": 0.0} if bf16 else {})}
    _, wrapped, optimizer = build(ctx, 1, 1, "megatron", dtype=dtype, opt=opt,
                                  ddp={"use_distributed_optimizer": distributed})
    assert not bf16 or all(o.grad_scaler is None for o in getattr(
        optimizer, "chained_optimizers", [optimizer]))
    return wrapped, optimizer


def _megatron_lm_write(ctx, root, wrapped, optimizer, sharding_type):
    meta = megatron_lm_saves.metadata(sharding_type)
    state = {"args": argparse.Namespace(tensor_model_parallel_size=1,
                                        pipeline_model_parallel_size=1,
                                        use_distributed_optimizer=sharding_type is not None,
                                        consumed_train_samples=16),
             "checkpoint_version": 3.0, "iteration": STEPS,
             "num_floating_point_operations_so_far": 0.0}
    state["model"] = wrapped.module.sharded_state_dict(metadata=meta)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=meta)
    megatron_lm_saves.write(root, STEPS, state, meta)


def _megatron_lm_save(ctx, root, layouts, bf16=False, fused=False):
    """Megatron-LM trains, saves the same state in each of ``layouts`` (``root/<layout>``; all
    sharding types of the distributed optimizer, or ``(None,)``), and trains on: the reference."""
    from zero3_runs import full_params, train

    with _fused(fused):
        wrapped, optimizer = _megatron_lm_build(ctx, layouts[0] is not None, bf16)
        train(wrapped, optimizer, STEPS)
        for layout in layouts:
            _megatron_lm_write(ctx, os.path.join(root, str(layout)), wrapped, optimizer, layout)
        state = adam_state(wrapped, optimizer)
        return full_params(wrapped), train(wrapped, optimizer, STEPS, data_seed=1), state


def _megatron_lm_load(ctx, root, distributed, bf16=False, fused=False):
    """Megatron-LM's load_checkpoint for a torch_dist checkpoint: the content metadata read
    from the checkpoint, each model's and the optimizer's sharded_state_dict(is_loading=True),
    dist_checkpointing.load, then model and optimizer load_state_dict. Nothing else."""
    from megatron.core import dist_checkpointing
    from zero3_runs import full_params, train

    with _fused(fused):
        wrapped, optimizer = _megatron_lm_build(ctx, distributed, bf16)
        directory = os.path.join(root, f"iter_{STEPS:07d}")
        common = dist_checkpointing.load_common_state_dict(directory)
        meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
        meta["dp_cp_group"] = megatron_lm_saves.metadata(None)["dp_cp_group"]
        request = {"model": wrapped.module.sharded_state_dict(metadata=meta)}
        request["optimizer"] = optimizer.sharded_state_dict(request, is_loading=True,
                                                            metadata=meta)
        loaded = dist_checkpointing.load(request, directory)
        wrapped.load_state_dict(loaded["model"], strict=True)
        optimizer.load_state_dict(loaded["optimizer"])
        params, state = full_params(wrapped), adam_state(wrapped, optimizer)
        return common["iteration"], params, train(wrapped, optimizer, STEPS, data_seed=1), state


def _megatron_lm_load_failures(ctx, roots):
    """Megatron-LM's load of each distributed-optimizer checkpoint on torch's Adam: the
    exception's type and traceback frames (file, function) per checkpoint."""
    out = []
    for root in roots:
        try:
            _megatron_lm_load(ctx, root, True)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append((type(e).__name__, [(f.filename, f.name)
                                           for f in traceback.extract_tb(e.__traceback__)]))
    return out


def _zeropp_build(ctx, zeropp, bf16):
    from zero3_runs import build

    dtype = _dtype(bf16)
    return build(ctx, 1, 1, "zeropp", zeropp, dtype=dtype, opt={"dtype": dtype})[1:]


def _zeropp_load(ctx, roots, zeropp, bf16=False, load_optim=True):
    """Our ZeRO++ layer loads each checkpoint (a fresh model each) and trains on."""
    from zero3_runs import full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    out = []
    for root in roots:
        wrapped, optimizer = _zeropp_build(ctx, zeropp, bf16)
        it = checkpoint_dist.load_checkpoint(root, [wrapped], optimizer, load_optim=load_optim,
                                             load_rng=False)
        params, state = full_params(wrapped), adam_state(wrapped, optimizer)
        out.append((it, params, train(wrapped, optimizer, STEPS, data_seed=1), state))
    return out


def _megatron_impl_load(ctx, roots, bf16=False, distributed=True):
    """This project's loader with --data-parallel-impl megatron (megatron-core's DDP and
    DistributedOptimizer; bf16: this project's bf16 optimizer, a constant loss scale of 1)."""
    from zero3_runs import build, full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    out = []
    for root in roots:
        dtype = _dtype(bf16)
        _, wrapped, optimizer = build(ctx, 1, 1, "megatron", dtype=dtype, opt={"dtype": dtype})
        checkpoint_dist.load_checkpoint(root, [wrapped], optimizer, load_rng=False)
        params, state = full_params(wrapped), adam_state(wrapped, optimizer)
        out.append((params, train(wrapped, optimizer, STEPS, data_seed=1), state))
    return out


def _zeropp_save(ctx, root, bf16):
    from zero3_runs import full_params, train

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    wrapped, optimizer = _zeropp_build(ctx, _exact(), bf16)
    train(wrapped, optimizer, STEPS)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              bf16=bf16, use_distributed_optimizer=True)
    checkpoint_dist.save_checkpoint(root, STEPS, 16, [wrapped], optimizer, None, args)
    state = adam_state(wrapped, optimizer)
    return full_params(wrapped), train(wrapped, optimizer, STEPS, data_seed=1), state


def _to_non_distributed(ctx, pairs):
    from megatron_zeropp.training.convert import to_non_distributed

    return [to_non_distributed(src, dst) for src, dst in pairs]


def _same(a, b):
    assert a.keys() == b.keys() and len(a) > 10
    return all(torch.equal(a[k], b[k]) for k in a)


def _same_state(a, b):
    assert a.keys() == b.keys() and len(a) > 10
    return all(a[n]["step"] == b[n]["step"] and all(torch.equal(a[n][k], b[n][k]) for k in (
        "param", "exp_avg", "exp_avg_sq")) for n in a)


def _continues(saved, loaded, non_distributed=False):
    """``saved``: (params, reference continuation, Adam state) of one program; ``loaded``:
    (params, continuation, Adam state) of the other after loading. Exact: the weights, the
    Adam state (fp32 main weights, moments, step) and the continued losses and grad norms.
    ``non_distributed``: one side runs megatron-core's non-distributed optimizer; its gradient
    norm sums the full gradients where the distributed optimizers sum shard norms, which moves
    the clipping factor in the last float bits from the first step on, whoever loaded what: so
    there the state is compared, and the first continued loss (computed from it) exactly."""
    (params, reference, state), (loaded_params, losses, loaded_state) = saved, loaded
    assert _same(loaded_params, params)
    assert _same_state(loaded_state, state)
    if non_distributed:
        assert losses[0][0] == reference[0][0] and losses != [] and len(losses) == STEPS
    else:
        assert losses == reference


def _megatron_lm_checkpoints(root, bf16, fused=False):
    """layout -> (root, (params at the save, the reference continuation, Adam state))."""
    dist_saved = run_distributed(_megatron_lm_save, 1, 2, args=(
        root, LAYOUTS[:2], bf16, fused))[0]
    flat_saved = run_distributed(_megatron_lm_save, 1, 2, args=(
        root, LAYOUTS[2:], bf16, fused))[0]
    out = {layout: (os.path.join(root, str(layout)), dist_saved) for layout in LAYOUTS[:2]}
    out[None] = (os.path.join(root, "None"), flat_saved)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def megatron_lm(request, tmp_path_factory):
    bf16 = request.param
    return bf16, _megatron_lm_checkpoints(str(tmp_path_factory.mktemp("mlm")), bf16)


def test_megatron_lm_checkpoints_load_into_zeropp_and_continue_exactly(megatron_lm):
    bf16, saved = megatron_lm
    out = run_distributed(_zeropp_load, 1, 2, args=(
        [saved[layout][0] for layout in LAYOUTS], _exact(), bf16))[0]
    for layout, (it, *loaded) in zip(LAYOUTS, out):
        assert it == (STEPS, 16), layout
        _continues(saved[layout][1], loaded, non_distributed=layout is None)


def test_megatron_lm_checkpoints_load_with_megatron_impl_and_continue_exactly(megatron_lm):
    bf16, saved = megatron_lm  # bf16: our constant loss scale of exactly 1 changes no bit
    out = run_distributed(_megatron_impl_load, 1, 2, args=(
        [saved[layout][0] for layout in LAYOUTS], bf16))[0]
    for layout, loaded in zip(LAYOUTS, out):
        _continues(saved[layout][1], loaded, non_distributed=layout is None)


def test_the_exact_comparisons_can_fail(megatron_lm):
    # Negative control: weights alone (--no-load-optim) give the same parameters but fresh Adam
    # moments: the state comparison and the continued losses must then both fail.
    bf16, saved = megatron_lm
    root, (params, reference, state) = saved["dp_reshardable"]
    (_, loaded, losses, loaded_state), = run_distributed(_zeropp_load, 1, 2, args=(
        [root], _exact(), bf16, False))[0]
    assert _same(loaded, params)
    assert not _same_state(loaded_state, state)
    assert losses != reference
    with pytest.raises(AssertionError):
        _continues((params, reference, state), (loaded, losses, loaded_state))


def test_dp_reshardable_loads_into_zeropp_at_another_dp(megatron_lm):
    # DP 2 -> DP 4 (2 nodes x 2): the ZeRO layer reads the buckets at other ranges, and
    # continues exactly as megatron-core's own dp_reshardable loader at DP 4 (which reshards
    # DP itself); the two train bit-identically at the same DP.
    bf16, saved = megatron_lm
    if not bf16:
        pytest.skip("fp32 at DP 4: test_megatron_lm_checkpoint_loads_into_all_zeropp_flags")
    root, (params, _, state) = saved["dp_reshardable"]
    (_, *zero), = run_distributed(_zeropp_load, 2, 2, args=([root], _exact(), bf16))[0]
    (mcore,) = run_distributed(_megatron_impl_load, 2, 2, args=([root], bf16))[0]
    assert _same(zero[0], params) and _same_state(zero[2], state)
    assert zero[1] == mcore[1] and _same_state(mcore[2], state)


def test_megatron_lm_checkpoint_loads_into_all_zeropp_flags(megatron_lm):
    from megatron_zeropp.sharding import ZeroPPConfig

    bf16, saved = megatron_lm
    if bf16:
        pytest.skip("one dtype is enough here")
    root, (params, reference, state) = saved["dp_reshardable"]
    (_, loaded, losses, loaded_state), = run_distributed(_zeropp_load, 2, 2, args=(
        [root], ZeroPPConfig(qwz=True, hpz=True, qgz=True)))[0]
    assert _same(loaded, params) and _same_state(loaded_state, state)  # DP 2 -> 4, 2 nodes
    # quantized from then on: within qwZ/qgZ's error (test_zero3_quantized.py)
    assert all(abs(a[0] - b[0]) < 0.05 for a, b in zip(losses, reference)), (losses, reference)


def _tp2_load(ctx, root, load_optim):
    from zero3_runs import build

    from megatron_zeropp.checkpointing import dist as checkpoint_dist

    _, wrapped, optimizer = build(ctx, 2, 1, "zeropp", _exact())
    checkpoint_dist.load_checkpoint(root, [wrapped], optimizer, load_optim=load_optim,
                                    load_rng=False)
    return True


def test_dp_reshardable_at_another_tp_is_refused_with_the_way_out(megatron_lm):
    bf16, saved = megatron_lm
    if bf16:
        pytest.skip("one dtype is enough here")
    root = saved["dp_reshardable"][0]
    with pytest.raises(DistributedFailure, match="only the saving run's TP/PP can read"):
        run_distributed(_tp2_load, 1, 2, args=(root, True))
    assert run_distributed(_tp2_load, 1, 2, args=(root, False)) == [True, True]  # weights


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def ours(request, tmp_path_factory):
    """This project's checkpoint and its non-distributed rewrite (tools/convert_checkpoint.py
    --optimizer-layout non-distributed), with our uninterrupted continuation."""
    bf16 = request.param
    base = tmp_path_factory.mktemp("ours")
    root, flat = str(base / "ckpt"), str(base / "flat")
    saved = run_distributed(_zeropp_save, 1, 2, args=(root, bf16))[0]
    run_distributed(_to_non_distributed, 1, 1, args=([(root, flat)],))
    return bf16, root, flat, saved


def _megatron_lm_loads_ours(ctx, root, flat, bf16):
    """A GPU Megatron-LM with --use-distributed-optimizer (fused Adam) loads ours; Megatron-LM
    without it (torch's Adam, as on CPU: that path works there) loads the rewrite."""
    return [_megatron_lm_load(ctx, root, True, bf16, fused=True),
            _megatron_lm_load(ctx, flat, False, bf16)]


def test_zeropp_checkpoints_load_into_megatron_lm_and_continue_exactly(ours):
    bf16, root, flat, saved = ours
    out = run_distributed(_megatron_lm_loads_ours, 1, 2, args=(root, flat, bf16))[0]
    for (it, *loaded), non_distributed in zip(out, (False, True)):
        assert it == STEPS
        _continues(saved, loaded, non_distributed)


def test_the_non_distributed_rewrite_loads_here_too(ours):
    bf16, root, flat, saved = ours
    (_, *loaded), = run_distributed(_zeropp_load, 1, 2, args=([flat], _exact(), bf16))[0]
    _continues(saved, loaded)  # both sides distributed: exact throughout


def test_megatron_lm_on_torch_adam_cannot_load_distributed_optimizer_checkpoints(
        megatron_lm, ours):
    # Megatron-LM's own failure, not this project's: it happens for Megatron-LM's own
    # checkpoints as for ours, inside megatron-core, with no frame of this project's code
    # between Megatron-LM's call and the assert (megatron-core's DistributedOptimizer.state_dict
    # takes torch Adam's per-parameter steps, which a fresh optimizer does not have yet).
    bf16, saved = megatron_lm
    if bf16 or ours[0]:
        pytest.skip("one dtype is enough here")
    roots = [saved["dp_reshardable"][0], saved["fully_reshardable"][0], ours[1]]
    for failure in run_distributed(_megatron_lm_load_failures, 1, 2, args=(roots,))[0]:
        assert failure is not None
        kind, frames = failure
        assert kind == "AssertionError"
        assert frames[-1][0].endswith(os.path.join("megatron", "core", "optimizer",
                                                   "distrib_optimizer.py"))
        assert frames[-1][1] == "state_dict"
        call = [i for i, (_, name) in enumerate(frames) if name == "_megatron_lm_load"][-1]
        assert not any("megatron_zeropp" in f for f, _ in frames[call + 1:]), frames


@pytest.fixture(scope="module")
def gpu_format(tmp_path_factory):
    # What a GPU Megatron-LM (fused Adam: the step in the param groups, none per parameter)
    # writes, bf16
    return _megatron_lm_checkpoints(str(tmp_path_factory.mktemp("gpu")), True, fused=True)


def test_fused_adam_checkpoints_load_into_zeropp_and_continue_exactly(gpu_format):
    out = run_distributed(_zeropp_load, 1, 2, args=(
        [gpu_format[layout][0] for layout in LAYOUTS], _exact(), True))[0]
    for layout, (_, *loaded) in zip(LAYOUTS, out):
        _continues(gpu_format[layout][1], loaded, non_distributed=layout is None)


def test_bucket_layout_rejects_buckets_the_parameters_do_not_fill():
    from megatron_zeropp.mcore.dp_reshardable import param_ranges

    params = [torch.nn.Parameter(torch.empty(n)) for n in (10, 100, 3)]
    # reversed: 3 at 0, 100 at 64, 10 at 192 -> 202 elements, one bucket
    assert [param_ranges(params, [202])[p] for p in params] == [(0, 192, 202), (0, 64, 164),
                                                                (0, 0, 3)]
    assert param_ranges(params, [164, 10])[params[0]] == (1, 0, 10)
    for wrong in ([201], [203], [100, 102], [164, 11]):
        with pytest.raises(ValueError):
            param_ranges(params, wrong)
