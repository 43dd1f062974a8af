"""``--ckpt-format torch_dist``: checkpoints in megatron-core's ``dist_checkpointing`` format.

Layout and keys are Megatron-LM's (``megatron/training/checkpointing.py``, core_v0.16.1)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/  metadata.json  common.pt  .metadata  __R_I.distcp  model_config.json

    args                 the run's arguments (argparse.Namespace; consumed_train_samples in it)
    checkpoint_version   3.0
    iteration
    model                GPTModel.sharded_state_dict(): TP/PP-sharded, DP-replicated tensors
    optimizer            DistributedOptimizer state, ``fully_reshardable`` sharding type
    opt_param_scheduler
    rng_state            ShardedObject per (PP, TP) rank, DP rank 0's
    num_floating_point_operations_so_far

Under ZeRO-3 every rank writes only its primary shard's elements of each parameter, fp32 main
weight and Adam moments (``sharded_state``): nothing is gathered. With
``--data-parallel-impl megatron`` megatron-core's own ``sharded_state_dict`` methods run, as in
Megatron-LM. The optimizer is stored as ``fully_reshardable`` (per-parameter tensors in model
space) rather than Megatron-LM's default ``dp_reshardable`` (its internal bucket layout, which
differs between the two data-parallel implementations and with TP/PP): so TP, PP, DP, ZeRO++ flags
and the data-parallel implementation may all change between save and load. Megatron-LM reads the
sharding type from the checkpoint, so it loads these at any layout; its own default checkpoints
load here with ``--data-parallel-impl megatron`` and the same TP/PP, or their weights alone.

The save is atomic as in the ``torch`` format (``legacy.begin_save`` / ``commit_save``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_zeropp.optimizer import distributed_optimizers

from . import checks
from .legacy import LATEST, begin_save, commit_save, iteration_dir, latest_iteration
from .sharded_state import (
    copy_loaded,
    unwrap_model,
    zero_model_sharded_state_dict,
    zero_optimizer_param_state,
)

CHECKPOINT_VERSION = 3.0
SHARDING_TYPE = "fully_reshardable"


def is_dist_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a dist_checkpointing checkpoint (its ``metadata.json``)."""
    return os.path.exists(os.path.join(directory, "metadata.json"))


def _is_zero(chunk) -> bool:
    return hasattr(chunk, "units")


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def _metadata() -> dict:
    # What Megatron-LM's _build_sharded_state_dict_metadata passes with --use-distributed-optimizer
    # and --dist-ckpt-optim-fully-reshardable; the group is dropped before it is stored.
    ps = _ps()
    return {"distrib_optim_sharding_type": SHARDING_TYPE,
            "distrib_optim_fully_reshardable_mem_efficient": False,
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _stored_metadata(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}


def _rng_state(data):
    """Megatron-LM's RNG entry: one state per (PP, TP) rank; DP ranks hold identical states
    (same seeds, same draws), so DP rank 0's is stored."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ps = _ps()
    return ShardedObject(
        "rng_state", data,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _current_rng() -> list:
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return [state]


def _set_rng(states: list) -> None:
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _single_optimizer(optimizer):
    opts = list(distributed_optimizers(optimizer))
    if len(opts) != 1:
        raise ValueError(f"torch_dist checkpoints support one distributed optimizer, got "
                         f"{len(opts)} (a ChainedOptimizer)")
    return opts[0]


def _zero_optimizer_state(opt, chunks, templates, is_loading) -> dict:
    state = {}
    for chunk in chunks:
        state.update({len(state) + i: v for i, v in zero_optimizer_param_state(
            opt, chunk, templates[id(chunk)], allocate=is_loading).items()})
    return state


def _model_and_optimizer(chunks, optimizer, metadata, with_optim, is_loading):
    """The ``model`` (``model0``...) and ``optimizer`` entries, ZeRO or megatron-core DDP."""
    out = {}
    if all(_is_zero(c) for c in chunks):
        templates = {}
        for i, chunk in enumerate(chunks):
            out[_model_key(i, len(chunks))], templates[id(chunk)] = \
                zero_model_sharded_state_dict(chunk, metadata)
        if with_optim:
            opt = _single_optimizer(optimizer)
            param_state = _zero_optimizer_state(opt, chunks, templates, is_loading)
            common = {} if is_loading else opt.state_dict()
            out["optimizer"] = {**common, "param_state": param_state,
                                "param_state_sharding_type": SHARDING_TYPE}
        return out
    if any(_is_zero(c) for c in chunks):
        raise ValueError("model chunks mix the ZeRO++ layer and megatron-core's DDP")
    for i, chunk in enumerate(chunks):
        out[_model_key(i, len(chunks))] = unwrap_model(chunk).sharded_state_dict(
            prefix="", metadata=metadata)
    if with_optim:
        if is_loading:
            for opt in distributed_optimizers(optimizer):
                if not opt.optimizer.state:
                    # megatron-core reads the Adam step from existing state first (torch Adam,
                    # without apex/TE); the dummy values are overwritten by the load.
                    opt._init_optimizer_states_with_dummy_values()
        out["optimizer"] = optimizer.sharded_state_dict(out, is_loading=is_loading,
                                                        metadata=metadata)
    return out


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model_chunks, optimizer,
                    scheduler, args, num_floating_point_operations_so_far: float = 0,
                    overwrite: bool = False, model_config: Optional[dict] = None,
                    save_optim: bool = True, save_rng: bool = True,
                    checksums: bool = False) -> str:
    """Write a torch_dist checkpoint of this iteration (every rank calls); returns its directory.

    ``args`` is stored (with ``consumed_train_samples``, ``data_parallel_size``, ``world_size``
    set, as Megatron-LM's are); ``save_optim=False`` (--no-save-optim) leaves out the optimizer
    and LR schedule, ``save_rng=False`` (--no-save-rng) the RNG states.
    """
    from megatron.core import dist_checkpointing

    ps = _ps()
    metadata = _metadata()
    stored_args = argparse.Namespace(**vars(args))
    stored_args.consumed_train_samples = consumed_samples
    stored_args.data_parallel_size = ps.get_data_parallel_world_size()
    stored_args.world_size = dist.get_world_size()
    stored_args.no_save_optim, stored_args.no_save_rng = not save_optim, not save_rng
    state = {"args": stored_args, "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration,
             "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
    with adam_state_before_first_step(optimizer if save_optim else None):
        state.update(_model_and_optimizer(model_chunks, optimizer, metadata, save_optim, False))
        if save_optim and scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
        if save_rng:
            state["rng_state"] = _rng_state(_current_rng())
        tmp = begin_save(root, iteration, overwrite, model_config)
        _in_process_write_results()
        dist_checkpointing.save(state, tmp, content_metadata=_stored_metadata(metadata))
    return commit_save(root, iteration, checksums)


@contextlib.contextmanager
def adam_state_before_first_step(optimizer):
    """Adam's state as its first step would create it, for the parameters that have none yet.

    torch's Adam creates ``step`` = 0 and zero moments lazily, at a parameter's first real step;
    a save before it (fp16's dynamic loss scale skips the first steps by design; a save at
    iteration 0) found no state to store (``ValueError: no Adam state`` on the ZeRO layer, a
    ``KeyError`` inside megatron-core's ``sharded_state_dict``). The zeros stored are exactly the
    state that step starts from; they are removed after the save, so training goes on as if no
    save had happened.
    """
    added = []
    for opt in distributed_optimizers(optimizer) if optimizer is not None else ():
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if inner.state.get(p):
                    continue
                inner.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
                added.append((inner, p))
    try:
        yield
    finally:
        for inner, p in added:
            inner.state.pop(p, None)


def _in_process_write_results() -> None:
    """Give megatron-core's writer an in-process results queue.

    By default it makes a ``multiprocessing`` manager (a spawned server process, and with it the
    resource tracker) for a queue that only an *asynchronous* save needs. Every save here is
    synchronous: the write runs in this process, which both puts and gets the results. The
    manager, started at the first save, outlived a rank that ended with ``os._exit`` and held the
    job's stdout open (``torchrun ... | tee log`` never returned).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def _load_optimizer_common(opt, common: dict) -> None:
    # megatron-core's DistributedOptimizer.load_state_dict without 'param_state': sets the
    # param groups (lr, step) and loss scaler, allocating the Adam moments the shards load into.
    opt.load_state_dict({k: v for k, v in common.items() if k in ("optimizer", "grad_scaler")})


def _main_from_weights(opt) -> None:
    """fp32 main weights from the (just loaded) 16-bit primary shards (no optimizer state)."""
    for mains, models in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups):
        for main, p in zip(mains, models):
            main.view(-1).copy_(p.zeropp_primary)


def read_common(root: str, iteration: int) -> dict:
    """A torch_dist checkpoint's non-sharded part (args, iteration, scheduler, ...)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(iteration_dir(root, iteration))


def _check_optimizer_format(metadata: dict, zero: bool, same_tp_pp: bool, directory: str):
    kind = (metadata or {}).get("distrib_optim_sharding_type")
    if kind == SHARDING_TYPE or (kind == "dp_reshardable" and not zero and same_tp_pp):
        return
    where = "the ZeRO++ layer" if zero else "another TP/PP layout"
    raise ValueError(
        f"{directory}: optimizer state stored as {kind!r}, which {where} cannot read (it follows "
        f"megatron-core DDP's bucket layout). Load it with --data-parallel-impl megatron and the "
        f"same TP/PP, or save it in Megatron-LM with --dist-ckpt-optim-fully-reshardable, or "
        f"load the weights alone with --no-load-optim")


def load_checkpoint(root: str, model_chunks, optimizer, scheduler=None,
                    iteration: Optional[int] = None, load_optim: bool = True,
                    load_rng: bool = True, override_scheduler: bool = False,
                    use_checkpoint_scheduler: bool = False) -> Tuple[int, int]:
    """Load a torch_dist checkpoint (every rank calls); returns ``(iteration, consumed_samples)``.

    TP, PP and DP sizes, ZeRO++ flags and the data-parallel implementation may differ from the
    saving run's. RNG states are restored only when TP and PP are unchanged (as in Megatron-LM).
    """
    from megatron.core import dist_checkpointing

    it = latest_iteration(root) if iteration is None else iteration
    if it is None:
        raise ValueError(f"no {LATEST} in {root}: nothing to load")
    directory = iteration_dir(root, it)
    if not is_dist_checkpoint(directory):
        raise ValueError(f"{directory} is not a torch_dist checkpoint (no metadata.json)")
    common = read_common(root, it)
    ckpt_args = common.get("args") or argparse.Namespace()
    ps = _ps()
    same_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                  getattr(ckpt_args, "pipeline_model_parallel_size", 1)) == (
        ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    load_optim = load_optim and not getattr(ckpt_args, "no_save_optim", False)
    load_rng = load_rng and same_tp_pp and not getattr(ckpt_args, "no_save_rng", False)
    zero = all(_is_zero(c) for c in model_chunks)
    stored = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    if load_optim:
        _check_optimizer_format(stored, zero, same_tp_pp, directory)
    metadata = {**stored, "dp_cp_group": _metadata()["dp_cp_group"]}
    if load_optim and zero:
        _load_optimizer_common(_single_optimizer(optimizer), common["optimizer"])
    request = _model_and_optimizer(model_chunks, optimizer, metadata, load_optim, True)
    if load_rng:
        request["rng_state"] = _rng_state(_current_rng())
    loaded = dist_checkpointing.load(request, directory)
    _apply(loaded, request, model_chunks, optimizer, zero, load_optim)
    if load_optim and scheduler is not None and "opt_param_scheduler" in loaded:
        used = checks.load_scheduler(scheduler, loaded["opt_param_scheduler"],
                                                override_scheduler, use_checkpoint_scheduler)
        if dist.get_rank() == 0:
            print(f"> {used}", flush=True)
    if load_rng:
        _set_rng(loaded["rng_state"])
    return it, getattr(ckpt_args, "consumed_train_samples", 0)


def _apply(loaded, request, chunks, optimizer, zero: bool, load_optim: bool) -> None:
    """Put what was loaded into the model and optimizer (Megatron-LM's order)."""
    if zero:
        for i in range(len(chunks)):
            key = _model_key(i, len(chunks))
            copy_loaded(request[key], loaded[key])
        opt = _single_optimizer(optimizer)
        if load_optim:
            copy_loaded(request["optimizer"], loaded["optimizer"])
            _unshare_adam_steps(optimizer)
        else:
            _main_from_weights(opt)
        for chunk in chunks:
            chunk.start_param_sync(force_sync=True)  # new weights: hpZ copies are stale
        return
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    if load_optim:
        # no_grad: megatron-core's dp_reshardable loader copies into fp32 shard views of the
        # parameters (fp32 models) without it, which autograd refuses.
        with _keeping_adam_steps(optimizer), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    else:
        optimizer.reload_model_params()


@contextlib.contextmanager
def _keeping_adam_steps(optimizer):
    """Keep the Adam ``step`` that megatron-core 0.16.1 just set from the checkpoint's param
    groups when it then copies the per-parameter tensors. torch's Adam keeps a ``step`` per
    parameter (apex/TE's fused Adam, which megatron-core expects, does not), and those tensors
    hold none (``fully_reshardable``: ``KeyError: 'step'``) or the pre-load dummy state's
    (``dp_reshardable``: the step silently reverts to 1, and Adam's bias correction with it)."""
    patched = []
    for opt in distributed_optimizers(optimizer):
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group]["params"][order]
            step = opt.optimizer.state.get(main, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _unshare_adam_steps(optimizer) -> None:
    # megatron-core's DistributedOptimizer.load_state_dict gives every parameter the same 'step'
    # tensor; torch's Adam increments each parameter's step in place, so a shared one advances
    # once per parameter per iteration and the bias correction goes wrong after a resume.
    for opt in distributed_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def saved_args(root: str, iteration: int) -> dict:
    """The arguments stored in a torch_dist checkpoint, as a dict (--use-checkpoint-args)."""
    args = read_common(root, iteration).get("args")
    if args is None:
        raise ValueError(f"--use-checkpoint-args: {iteration_dir(root, iteration)} stores no "
                         f"arguments")
    return dict(vars(args))


def checkpoint_format(root: str, iteration: int) -> str:
    """``torch_dist`` or ``torch``: what the directory of ``iteration`` holds (as Megatron-LM
    detects it, whatever --ckpt-format says)."""
    return "torch_dist" if is_dist_checkpoint(iteration_dir(root, iteration)) else "torch"


__all__: List[str] = ["save_checkpoint", "load_checkpoint", "saved_args", "checkpoint_format",
                      "is_dist_checkpoint", "read_common"]
