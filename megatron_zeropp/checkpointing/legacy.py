"""Sharded, atomic, reshardable checkpoints in Megatron-LM's directory layout.

Layout (what Megatron-LM users' job scripts expect)::

    SAVE/latest_checkpointed_iteration.txt        "100"
    SAVE/iter_0000100/mp_rank_TT_PPP_dp_DDD.pt    one file per rank

Each rank writes only what it owns: for every parameter, the element range ``[start, end)`` of the
flattened parameter that its DistributedOptimizer shard holds, with the fp32 main weights and the
Adam moments, plus the LR scheduler, loss scaler, RNG states and data position. The 16-bit weights
are the fp32 main weights rounded, so they are not stored twice.

Atomicity: ranks write into ``iter_XXXXXXX.tmp``; once every rank is done, rank 0 renames the
directory and only then rewrites ``latest_checkpointed_iteration.txt`` (write + rename). A save
killed at any point leaves the previous checkpoint and the ``latest`` file intact.

Resharding: a checkpoint written with another data-parallel size or node layout (same TP and PP)
is loaded by assembling each parameter from all DP ranks' ranges and slicing this rank's new range.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_zeropp.mcore.optimizer import copy_main_params_to_model_params, param_range
from megatron_zeropp.optimizer import distributed_optimizers

from . import checks, rank_state

FORMAT_VERSION = 1
LATEST = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory name for an iteration."""
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(tp: int, pp: int, dp: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}_dp_{dp:03d}.pt"


def _layout() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
    }


def _param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    names = {}
    for c, chunk in enumerate(model_chunks):
        for name, p in chunk.module.named_parameters():
            names[p] = f"chunk{c}.{name}"
    return names


def _owned(optimizer, model_chunks):
    """(name, model param, fp32 main shard, element range) for everything this rank owns."""
    names = _param_names(model_chunks)
    for opt in distributed_optimizers(optimizer):
        for mains, models in (
            (opt.shard_fp32_from_float16_groups, opt.model_float16_groups),
            (opt.shard_fp32_groups, opt.model_fp32_groups),
        ):
            for main_group, model_group in zip(mains, models):
                for main, p in zip(main_group, model_group):
                    r = param_range(opt, p)
                    yield opt, names[p], p, main, (r.start, r.stop)


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    if not checks.restorable_rng(state.get("tracker"),
                                 tensor_parallel.get_cuda_rng_tracker().get_states()):
        return
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rank_state(iteration, consumed_samples, model_chunks, optimizer, scheduler, extra,
                save_optim=True, save_rng=True) -> dict:
    params = {}
    for opt, name, p, main, (start, end) in _owned(optimizer, model_chunks):
        adam = opt.optimizer.state.get(main, {}) if save_optim else {}
        params[name] = {
            "shape": tuple(p.shape), "start": start, "end": end,
            "main": main.detach().cpu().clone(),
            **{k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
               for k, v in adam.items()},
        }
    scalers = [opt.grad_scaler.state_dict() if opt.grad_scaler is not None else None
               for opt in distributed_optimizers(optimizer)]
    return {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": _layout(),
        "params": params,
        "scheduler": scheduler.state_dict() if scheduler is not None and save_optim else None,
        "grad_scalers": scalers if save_optim else [None] * len(scalers),
        "rng": _rng_state() if save_rng else None,
        "extra": extra or {},
    }


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model_chunks, optimizer,
                    scheduler=None, extra: Optional[dict] = None, overwrite: bool = False,
                    model_config: Optional[dict] = None, save_optim: bool = True,
                    save_rng: bool = True, checksums: bool = False) -> str:
    """Write this iteration's checkpoint collectively (every rank calls); returns its directory.

    Refuses (on every rank, before any collective) to move ``latest`` back or to replace an
    iteration unless ``overwrite``. ``model_config`` is stored for the check on load.
    ``save_optim=False`` (--no-save-optim) leaves out the Adam moments, LR scheduler and loss
    scaler (the fp32 main weights stay: they are the weights); ``save_rng=False`` the RNG states.
    """
    tmp = begin_save(root, iteration, overwrite, model_config)
    lay = _layout()
    state = _rank_state(iteration, consumed_samples, model_chunks, optimizer, scheduler, extra,
                        save_optim, save_rng)
    path = os.path.join(tmp, _rank_file(lay["tp_rank"], lay["pp_rank"], lay["dp_rank"]))
    with checks.writing(root, iteration):
        torch.save(state, path + ".part")
        os.replace(path + ".part", path)
        rank_state.save(tmp, model_chunks)
    return commit_save(root, iteration, checksums)


def begin_save(root: str, iteration: int, overwrite: bool,
               model_config: Optional[dict] = None) -> str:
    """First half of an atomic save (every rank calls, either format): the checks, then rank 0
    makes a fresh, empty ``iter_XXXXXXX.tmp`` for the ranks to write into (with
    ``model_config.json`` when given); returns its path.

    The new checkpoint's id waits beside it (``iter_XXXXXXX.tmp.id``) until :func:`commit_save`
    moves it in: megatron-core's torch_dist writer warns "Overwriting old incomplete / corrupted
    checkpoint" about a directory that is not empty when it starts."""
    from . import agreement, save_lock

    tmp = iteration_dir(root, iteration) + ".tmp"
    error = None
    try:
        checks.check_save_iteration(root, iteration, overwrite)
        if dist.get_rank() == 0:
            save_lock.check_held(root)
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
            os.makedirs(tmp)
            if model_config is not None:
                checks.write_model_config(tmp, model_config)
            with open(tmp + ".id", "w") as f:
                f.write(checks.new_checkpoint_id() + "\n")
    except (OSError, RuntimeError, ValueError) as e:
        error = f"saving iteration {iteration} into {root}: {e}"
    # Every rank's verdict first: a check that fails on one rank must not leave the others
    # waiting in the next collective until the timeout.
    agreement.raise_errors(agreement.gather(error))
    # Then every rank must see the directory rank 0 just made: the id it wrote names this save.
    seen = _read_id(tmp)
    agreement.check_same(agreement.gather(None, id=seen), "id",
                         f"the checkpoint being saved into {tmp}")
    return tmp


def _read_id(tmp: str) -> str:
    try:
        with open(tmp + ".id", encoding="utf-8") as f:
            return "checkpoint id " + f.read().split(" ")[0]
    except OSError:
        return "no such directory"


def commit_save(root: str, iteration: int, checksums: bool = False) -> str:
    """Second half (every rank calls once its part is written): rank 0 renames the ``.tmp``
    directory, then rewrites ``latest_checkpointed_iteration.txt`` (write + rename).
    ``checksums`` (--ckpt-checksums) first writes every file's SHA-256 (``integrity``)."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.replace(tmp + ".id", os.path.join(tmp, checks.CHECKPOINT_ID))
    if checksums:
        from .integrity import write_checksums

        dist.barrier()  # every rank's files are complete
        write_checksums(tmp)
    from . import agreement, save_lock

    error = None
    if dist.get_rank() == 0:
        try:
            save_lock.check_held(root)  # another job took --save over during this save
        except RuntimeError as e:
            error = f"saving iteration {iteration} into {root}: {e}"
    # (also the barrier: every rank has written its part)
    agreement.raise_errors(agreement.gather(error))
    if dist.get_rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest = os.path.join(root, LATEST)
        with open(latest + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest + ".tmp", latest)
    dist.barrier()
    return final


latest_iteration = checks.latest_iteration


def _read_states(directory: str, lay: dict) -> List[dict]:
    own = os.path.join(directory, _rank_file(lay["tp_rank"], lay["pp_rank"], lay["dp_rank"]))
    if os.path.exists(own):
        state = torch.load(own, weights_only=False)
        saved = state["layout"]
        if all(saved[k] == lay[k] for k in ("tp", "pp", "dp")):
            return [state]  # same layout: this rank's file has exactly its ranges
    pattern = os.path.join(directory, f"mp_rank_{lay['tp_rank']:02d}_{lay['pp_rank']:03d}_dp_*.pt")
    files = sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"no checkpoint files for TP rank {lay['tp_rank']} PP rank "
                         f"{lay['pp_rank']} in {directory}")
    states = [torch.load(f, weights_only=False) for f in files]
    saved = states[0]["layout"]
    if (saved["tp"], saved["pp"]) != (lay["tp"], lay["pp"]):
        raise ValueError(f"checkpoint has TP={saved['tp']} PP={saved['pp']}, this run TP="
                         f"{lay['tp']} PP={lay['pp']}: only the data-parallel layout can change")
    if len(states) != saved["dp"]:
        raise ValueError(
            f"checkpoint {directory} has {len(states)} DP files, expected {saved['dp']}"
        )
    return states


def _assemble(states: List[dict], name: str, key: str, numel: int) -> torch.Tensor:
    """The full flattened tensor ``key`` of parameter ``name`` from every DP rank's range."""
    full = None
    covered = 0
    for state in states:
        entry = state["params"].get(name)
        if entry is None or key not in entry:
            continue
        piece = entry[key]
        if full is None:
            full = torch.zeros(numel, dtype=piece.dtype)
        full[entry["start"] : entry["end"]] = piece.view(-1)
        covered += entry["end"] - entry["start"]
    if full is not None and covered != numel:
        raise ValueError(f"checkpoint covers {covered} of {numel} elements of {name}.{key}")
    return full


def load_checkpoint(root: str, model_chunks, optimizer, scheduler=None,
                    iteration: Optional[int] = None, load_optim: bool = True,
                    load_rng: bool = True, override_scheduler: bool = False,
                    use_checkpoint_scheduler: bool = False,
                    finetune: bool = False) -> Tuple[int, int]:
    """Load a checkpoint (every rank calls); returns ``(iteration, consumed_samples)``.

    The LR schedule follows Megatron-LM's rules (see :func:`checks.load_scheduler`);
    the line saying which schedule was used is logged by rank 0. The ZeRO++ layer's per-rank
    state comes back too (:mod:`.rank_state`); ``finetune``: the run starts counting at 0,
    that state anew.
    """
    it = latest_iteration(root) if iteration is None else iteration
    if it is None:
        raise ValueError(f"no {LATEST} in {root}: nothing to load")
    directory = iteration_dir(root, it)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist")
    lay = _layout()
    states = _read_states(directory, lay)
    single = len(states) == 1 and states[0]["layout"]["dp"] == lay["dp"]
    for opt, name, p, main, (start, end) in _owned(optimizer, model_chunks):
        keys = ("main", "exp_avg", "exp_avg_sq") if load_optim else ("main",)
        values = {}
        for key in keys:
            if single:
                entry = states[0]["params"].get(name)
                if entry is None or (entry["start"], entry["end"]) != (start, end):
                    raise ValueError(f"checkpoint range of {name} differs from this rank's")
                values[key] = entry.get(key)
            else:
                full = _assemble(states, name, key, p.numel())
                values[key] = None if full is None else full[start:end]
        main.data.copy_(values["main"].view_as(main).to(main.device))
        if load_optim and values["exp_avg"] is not None:
            step = next(s["params"][name]["step"] for s in states if name in s["params"])
            opt.optimizer.state[main] = {
                "step": step.clone() if torch.is_tensor(step) else step,
                "exp_avg": values["exp_avg"].view_as(main).to(main.device).clone(),
                "exp_avg_sq": values["exp_avg_sq"].view_as(main).to(main.device).clone(),
            }
    for opt in distributed_optimizers(optimizer):
        copy_main_params_to_model_params(opt)
    for chunk in model_chunks:
        chunk.start_param_sync(force_sync=True)
    first = states[0]
    if load_optim:
        if scheduler is not None and first["scheduler"] is not None:
            used = checks.load_scheduler(scheduler, first["scheduler"],
                                                    override_scheduler, use_checkpoint_scheduler)
            if dist.get_rank() == 0:
                print(f"> {used}", flush=True)
        for opt, scaler in zip(distributed_optimizers(optimizer), first["grad_scalers"]):
            if opt.grad_scaler is not None and scaler is not None:
                opt.grad_scaler.load_state_dict(scaler)
    if load_rng and single and first.get("rng") is not None:
        _set_rng_state(first["rng"])
    rank_state.load(directory, model_chunks, 0 if finetune else it, fresh=finetune)
    return it, first["consumed_samples"]


def saved_args(root: str, iteration: Optional[int] = None) -> dict:
    """The command-line arguments stored with a checkpoint (--use-checkpoint-args)."""
    it = latest_iteration(root) if iteration is None else iteration
    if it is None:
        raise ValueError(f"--use-checkpoint-args: no {LATEST} in {root}")
    files = sorted(glob.glob(os.path.join(iteration_dir(root, it), "mp_rank_*.pt")))
    if not files:
        raise ValueError(f"--use-checkpoint-args: no checkpoint files in {iteration_dir(root, it)}")
    state = torch.load(files[0], weights_only=False, mmap=True)
    saved = state.get("extra", {}).get("args")
    if not saved:
        raise ValueError(f"--use-checkpoint-args: {files[0]} stores no arguments")
    return saved
