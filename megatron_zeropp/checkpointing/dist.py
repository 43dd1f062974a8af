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

The calls are Megatron-LM's, whatever the data-parallel implementation: each chunk's and the
optimizer's ``sharded_state_dict``, then ``load_state_dict`` (or ``reload_model_params``). Under
ZeRO-3 they describe only each rank's primary shard of every parameter, fp32 main weight and Adam
moment (``sharding/sharded_state.py``, ``optimizer/sharded_state.py``): nothing is gathered. The
optimizer is stored as ``fully_reshardable`` (per-parameter tensors in model space) rather than
Megatron-LM's default ``dp_reshardable`` (its internal bucket layout, which differs between the two
data-parallel implementations and with TP/PP): so TP, PP, DP, ZeRO++ flags and the data-parallel
implementation may all change between save and load. Megatron-LM reads the sharding type from the
checkpoint, so it loads these at any layout. Megatron-LM's other optimizer layouts load here with
their state on both data-parallel paths: its default ``dp_reshardable`` (bucket space) at the
saving run's TP/PP and any DP (``optimizer/sharded_state.bucket_param_state``), and megatron-core's
non-distributed optimizer (without --use-distributed-optimizer) anywhere
(:mod:`.non_distributed`); tools/convert_checkpoint.py writes the latter for Megatron-LM.

The save is atomic as in the ``torch`` format (``legacy.begin_save`` / ``commit_save``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_zeropp.mcore.checkpoint import (
    fully_reshardable_params,
    init_dummy_optimizer_states,
    keeping_adam_steps,
    unshare_adam_steps,
    use_in_process_write_results,
    write_common_file,
)
from megatron_zeropp.optimizer import distributed_optimizers, is_distributed
from megatron_zeropp.optimizer.sharded_state import BUCKET_SHARDING_TYPE, SAVED_TENSORS
from megatron_zeropp.sharding.data_parallel import ZeroPPDataParallel

from . import checks, non_distributed, rank_state
from .legacy import LATEST, begin_save, commit_save, iteration_dir, latest_iteration

CHECKPOINT_VERSION = 3.0
SHARDING_TYPE = "fully_reshardable"


def is_dist_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a dist_checkpointing checkpoint (its ``metadata.json``)."""
    return os.path.exists(os.path.join(directory, "metadata.json"))


def _unwrap(chunk):
    """What Megatron-LM's ``unwrap_model`` leaves of a chunk: megatron-core's DDP and
    Float16Module come off, so their model's own methods answer; the ZeRO layer stays, and
    answers with its shards."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def _metadata(distributed: bool = True) -> dict:
    # What Megatron-LM's _build_sharded_state_dict_metadata passes with --use-distributed-optimizer
    # and --dist-ckpt-optim-fully-reshardable, or without --use-distributed-optimizer (no
    # sharding type: how a load tells the non-distributed optimizer's layout); the group is
    # dropped before it is stored.
    ps = _ps()
    sharding = {"distrib_optim_sharding_type": SHARDING_TYPE,
                "distrib_optim_fully_reshardable_mem_efficient": False} if distributed else {}
    return {**sharding, "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers of ``optimizer``; none for megatron-core's non-distributed
    optimizer (--data-parallel-impl megatron without --use-distributed-optimizer), whose
    checkpoint methods need none of this module's workarounds."""
    if optimizer is None or not is_distributed(optimizer):
        return []
    return list(distributed_optimizers(optimizer))


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
    if not checks.restorable_rng(state.get("rng_tracker_states"),
                                 tensor_parallel.get_cuda_rng_tracker().get_states()):
        return
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _model_and_optimizer(chunks, optimizer, metadata, with_optim, is_loading):
    """The ``model`` (``model0``...) and ``optimizer`` entries, as Megatron-LM's
    ``generate_state_dict`` asks for them: each chunk's and the optimizer's
    ``sharded_state_dict`` (the ZeRO layer and its optimizer answer with their shards)."""
    zero = [isinstance(c, ZeroPPDataParallel) for c in chunks]
    if any(zero) and not all(zero):
        raise ValueError("model chunks mix the ZeRO++ layer and megatron-core's DDP")
    out = {}
    for i, chunk in enumerate(chunks):
        out[_model_key(i, len(chunks))] = _unwrap(chunk).sharded_state_dict(
            prefix="", metadata=metadata)
    if with_optim:
        if is_loading:
            for opt in _distributed_optimizers(optimizer):
                if not opt.optimizer.state:
                    # megatron-core reads the Adam step from existing state first (torch Adam,
                    # without apex/TE); the dummy values are overwritten by the load.
                    init_dummy_optimizer_states(opt)
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
    metadata = _metadata(is_distributed(optimizer))
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
        _integral_steps(state.get("optimizer"))
        if save_optim and scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
        if save_rng:
            state["rng_state"] = _rng_state(_current_rng())
        # model_config.json goes in after megatron-core's save: it warns "Overwriting old
        # incomplete / corrupted checkpoint" about any directory that is not empty when it starts.
        tmp = begin_save(root, iteration, overwrite)
        use_in_process_write_results()
        with checks.writing(root, iteration):
            dist_checkpointing.save(state, tmp, content_metadata=_stored_metadata(metadata))
    with checks.writing(root, iteration):
        write_common_file(tmp)  # megatron-core 0.19 writes none; 0.16-0.18 read only that file
        if model_config is not None and dist.get_rank() == 0:
            checks.write_model_config(tmp, model_config)
        rank_state.save(tmp, model_chunks)
    return commit_save(root, iteration, checksums)


def _integral_steps(optimizer_state) -> None:
    """Store the param groups' Adam step as an integer, as megatron-core with apex/TE's fused
    Adam writes it (``int(step)``), where without them it writes torch Adam's float: a GPU
    Megatron-LM's FusedAdam then reads the step it would have written itself."""
    groups = ((optimizer_state or {}).get("optimizer") or {}).get("param_groups") or []
    for group in groups:
        step = group.get("step")
        if isinstance(step, float) and step.is_integer():
            group["step"] = int(step)


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
    chained = getattr(optimizer, "chained_optimizers", None)
    for opt in () if optimizer is None else chained if chained is not None else [optimizer]:
        inner = opt.optimizer  # torch's Adam, over fp32 main weights or their shards
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


def read_common(root: str, iteration: int) -> dict:
    """A torch_dist checkpoint's non-sharded part (args, iteration, scheduler, ...)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(iteration_dir(root, iteration))


def _check_optimizer_format(kind: Optional[str], non_distributed_: bool, same_tp_pp: bool,
                            directory: str) -> None:
    if kind == SHARDING_TYPE or non_distributed_:
        return
    if kind == BUCKET_SHARDING_TYPE:
        if same_tp_pp:
            return
        raise ValueError(
            f"{directory}: optimizer state stored as {kind!r} (megatron-core DDP's gradient "
            f"buckets of each TP/PP rank), which only the saving run's TP/PP can read: the "
            f"checkpoint records each bucket's size, not which pieces of which parameters the "
            f"saving ranks held. Load it at the saving run's TP/PP (any DP) and write it again "
            f"(tools/convert_checkpoint.py --to torch_dist stores the loadable-anywhere "
            f"{SHARDING_TYPE!r}), save it in Megatron-LM with "
            f"--dist-ckpt-optim-fully-reshardable, or load the weights alone with --no-load-optim")
    raise ValueError(
        f"{directory}: optimizer state stored as {kind!r}, which this project does not read "
        f"(it reads {SHARDING_TYPE!r}, {BUCKET_SHARDING_TYPE!r} and megatron-core's "
        f"non-distributed optimizer); save it in Megatron-LM with "
        f"--dist-ckpt-optim-fully-reshardable, or load the weights alone with --no-load-optim")


def _saved_entries(directory: str) -> dict:
    """key -> global shape of each tensor in a torch_dist checkpoint (None for objects)."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    return {k: (tuple(v.size) if hasattr(v, "size") else None) for k, v in saved.items()}


def load_checkpoint(root: str, model_chunks, optimizer, scheduler=None,
                    iteration: Optional[int] = None, load_optim: bool = True,
                    load_rng: bool = True, override_scheduler: bool = False,
                    use_checkpoint_scheduler: bool = False,
                    finetune: bool = False) -> Tuple[int, int]:
    """Load a torch_dist checkpoint (every rank calls); returns ``(iteration, consumed_samples)``.

    TP, PP and DP sizes, ZeRO++ flags and the data-parallel implementation may differ from the
    saving run's. RNG states are restored only when TP and PP are unchanged (as in Megatron-LM).
    The ZeRO++ layer's per-rank state comes back too (:mod:`.rank_state`); ``finetune``: the
    run starts counting at 0, that state anew.
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
    zero = all(isinstance(c, ZeroPPDataParallel) for c in model_chunks)
    stored = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    kind = stored.get("distrib_optim_sharding_type")
    flat = load_optim and non_distributed.is_non_distributed(common, stored)
    # megatron-core's non-distributed optimizer here: its own checkpoint methods, which read
    # only its own layout (so does Megatron-LM's without --use-distributed-optimizer)
    flat_here = load_optim and not is_distributed(optimizer)
    if flat_here and not flat:
        raise ValueError(
            f"{directory}: optimizer state stored by a distributed optimizer ({kind!r}), which "
            f"megatron-core's non-distributed optimizer (--data-parallel-impl megatron without "
            f"--use-distributed-optimizer) does not read: load it with "
            f"--use-distributed-optimizer or on the ZeRO++ layer, rewrite it with "
            f"tools/convert_checkpoint.py --optimizer-layout non-distributed, or load the weights "
            f"alone with --no-load-optim")
    if load_optim:
        _check_optimizer_format(kind, flat, same_tp_pp, directory)
    metadata = {**stored, "dp_cp_group": _metadata()["dp_cp_group"]}
    saved = _saved_entries(directory) if load_optim else {}
    if flat_here:
        flat = False  # nothing to translate: the layouts are the same
    if flat:
        # model space, as fully_reshardable: asked for under the non-distributed names
        metadata["distrib_optim_sharding_type"] = SHARDING_TYPE
    elif kind == BUCKET_SHARDING_TYPE and zero:
        metadata[SAVED_TENSORS] = saved
    request = _model_and_optimizer(model_chunks, optimizer, metadata, load_optim, True)
    if flat:
        non_distributed.rename_request(request["optimizer"], saved)
    elif load_optim and not flat_here:
        _drop_absent_grad_scaler(request["optimizer"], optimizer, directory)
    if load_rng:
        request["rng_state"] = _rng_state(_current_rng())
    loaded = dist_checkpointing.load(request, directory)
    if flat or flat_here:
        non_distributed.restore_zero_step(loaded["optimizer"])
    if flat:
        loaded["optimizer"] = non_distributed.distributed_common(loaded["optimizer"],
                                                                 SHARDING_TYPE)
    after_model = None
    if flat and not zero:
        def after_model():
            params = [p for opt in distributed_optimizers(optimizer)
                      for p in fully_reshardable_params(opt)]
            non_distributed.fill_fp32_mains(loaded["optimizer"]["param_state"], params)
    _apply(loaded, model_chunks, optimizer, load_optim, after_model)
    if load_optim and scheduler is not None and "opt_param_scheduler" in loaded:
        used = checks.load_scheduler(scheduler, loaded["opt_param_scheduler"],
                                                override_scheduler, use_checkpoint_scheduler)
        if dist.get_rank() == 0:
            print(f"> {used}", flush=True)
    if load_rng:
        _set_rng(loaded["rng_state"])
    rank_state.load(directory, model_chunks, 0 if finetune else it, fresh=finetune)
    return it, getattr(ckpt_args, "consumed_train_samples", 0)


def _drop_absent_grad_scaler(request: dict, optimizer, directory: str) -> None:
    """Leave out a ``dp_reshardable`` checkpoint's grad scaler when it has none.

    Megatron-LM's bf16 runs (no --loss-scale) have no grad scaler and save none; this project's
    bf16 optimizer keeps a constant scale of 1 (builders.adam_config: so that megatron-core skips
    a non-finite step), whose state is that constant, so nothing is lost by not reading it.
    megatron-core's bucket layout asks for it as a sharded object, which DCP refuses when absent.
    """
    if not all(getattr(opt.config, "bf16", False) for opt in _distributed_optimizers(optimizer)):
        return
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(directory).read_metadata().state_dict_metadata

    def walk(node):
        if not isinstance(node, dict):
            return
        scaler = node.get("grad_scaler")
        if isinstance(scaler, ShardedObject) and not any(
                key.startswith(scaler.key + "/") for key in saved):
            del node["grad_scaler"]
        for value in node.values():
            walk(value)

    walk(request)


def _apply(loaded, chunks, optimizer, load_optim: bool, after_model=None) -> None:
    """Put what was loaded into the model and optimizer, in Megatron-LM's order and with its
    calls (``load_state_dict`` of each chunk, then of the optimizer, or
    ``reload_model_params`` without optimizer state)."""
    for i, chunk in enumerate(chunks):
        _unwrap(chunk).load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    if after_model is not None:
        after_model()
    if load_optim:
        # no_grad: megatron-core's dp_reshardable loader copies into fp32 shard views of the
        # parameters (fp32 models) without it, which autograd refuses.
        with keeping_adam_steps(_distributed_optimizers(optimizer)), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        unshare_adam_steps(_distributed_optimizers(optimizer))
    else:
        optimizer.reload_model_params()


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
