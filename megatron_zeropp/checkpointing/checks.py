"""What makes a resume safe: the checkpoint exists, fits the model, and no save goes backwards.

* ``--load`` that names no checkpoint is an error; ``--load-optional`` lets an empty directory
  mean "start from scratch" (the usual job-script pattern ``--load $DIR --save $DIR``).
* A save never moves ``latest_checkpointed_iteration.txt`` backwards nor replaces an existing
  iteration unless ``--overwrite-checkpoints`` says so; the run refuses at start when it would.
* Each checkpoint carries ``model_config.json`` (older ones: the arguments in their rank files);
  loading compares it with this run's model and reports every difference with both values (a
  checkpoint of another model used to load silently, dropping layers).
* The LR schedule on resume follows Megatron-LM: the checkpoint's and the command line's schedule
  must agree unless ``--override-opt_param-scheduler`` (command line wins) or
  ``--use-checkpoint-opt_param-scheduler`` (checkpoint wins); the choice is reported.

Every check reads only the command line and shared files, so all ranks reach the same verdict
and raise the same :class:`~megatron_zeropp.errors.StartupError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Dict, List, Optional

from megatron_zeropp.errors import StartupError

MODEL_CONFIG = "model_config.json"
_LATEST = "latest_checkpointed_iteration.txt"


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iterations(root: str) -> List[int]:
    """Iterations with a complete directory under ``root`` (``iter_XXXXXXX``, no ``.tmp``)."""
    if not os.path.isdir(root):
        return []
    found = (re.fullmatch(r"iter_(\d{7})", name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m)


def latest_iteration(root: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names; None without the file."""
    path = os.path.join(root, _LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise StartupError(f"{path} is unreadable ({type(e).__name__}: {e}): it should hold "
                           f"the latest iteration number") from None
    if not text.isdigit():
        raise StartupError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


CHECKPOINT_ID = "checkpoint_id.txt"
"""Written into each iteration directory by the saving job (random id, host, pid, time): ranks
compare it before loading, so two copies of "iteration 4" from different saves are told apart."""


def checkpoint_id(directory: str) -> str:
    """What identifies the checkpoint in ``directory``: its :data:`CHECKPOINT_ID`, or (a
    checkpoint written elsewhere, e.g. by Megatron-LM) a digest of its file names and sizes."""
    import hashlib

    path = os.path.join(directory, CHECKPOINT_ID)
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    digest = hashlib.sha256()
    for base, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            full = os.path.join(base, name)
            digest.update(f"{os.path.relpath(full, directory)}:{os.path.getsize(full)};".encode())
    return "files " + digest.hexdigest()[:16]


def new_checkpoint_id() -> str:
    """A fresh id for a save: random, plus where and when it was written (for people)."""
    import socket
    import time
    import uuid

    return (f"{uuid.uuid4().hex} host {socket.gethostname()} pid {os.getpid()} "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")


def load_view(load: Optional[str], iteration: Optional[int]):
    """What this rank would load: ``(iteration, checkpoint id)``, compared across ranks before
    loading (the paths may differ between nodes), and its description for the message."""
    if load is None or iteration is None:
        return (None, None), "no checkpoint (start from scratch)"
    ident = checkpoint_id(_iteration_dir(load, iteration)).split(" ")[0]
    return (iteration, ident), f"iteration {iteration} of --load {load} (checkpoint id {ident})"


def check_save_writable(save: Optional[str], flag: str = "--save") -> None:
    """``--save`` (or the tool's ``flag``) must be a directory this process can create files in
    (or be creatable): found at start, not after a whole --save-interval of training. Probed by
    creating and removing a file, which also catches read-only mounts that permission bits do
    not show."""
    if save is None:
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise StartupError(f"{flag} {save} exists and is not a directory")
    probe_dir = save
    while not os.path.exists(probe_dir):
        parent = os.path.dirname(os.path.abspath(probe_dir))
        if parent == probe_dir:
            break
        probe_dir = parent
    if not os.path.isdir(probe_dir):
        raise StartupError(f"{flag} {save}: {probe_dir} is not a directory, so {save} cannot "
                           f"be created")
    probe = os.path.join(probe_dir, f".zeropp_write_probe.{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        what = "" if probe_dir == save else f" ({probe_dir}, where it would be created)"
        raise StartupError(f"{flag} {save}: cannot write files in it{what}: "
                           f"{e.strerror or e}") from None


def check_output(output: str, iteration: int) -> None:
    """A converter's ``--output`` before anything is loaded: a writable directory that holds
    neither ``iteration`` nor a later latest (a save there would replace or move it back)."""
    check_save_writable(output, "--output")
    latest = latest_iteration(output)
    if os.path.exists(_iteration_dir(output, iteration)):
        raise StartupError(f"--output {output} already holds iteration {iteration} "
                           f"({_iteration_dir(output, iteration)}): convert into another "
                           f"directory, or remove that one first")
    if latest is not None and latest > iteration:
        raise StartupError(f"--output {output}: its {_LATEST} names iteration {latest}, after "
                           f"{iteration}: writing it there would move {_LATEST} back; convert "
                           f"into another directory")


def resolve_load(load: Optional[str], ckpt_step: Optional[int], optional: bool,
                 save: Optional[str] = None, exit_on_missing: bool = False) -> Optional[int]:
    """The iteration to load, or None to start from scratch; raises when ``load`` names nothing.

    An empty ``load`` that is also the ``save`` directory starts from scratch, as in Megatron-LM's
    launch scripts (``--load $CKPT --save $CKPT``): it is the first run of that directory, and a
    typo there cannot overwrite anything; ``exit_on_missing`` (``--exit-on-missing-checkpoint``,
    Megatron-LM's flag) makes that an error too. An empty ``load`` elsewhere is an error unless
    ``optional`` (``--load-optional``).
    """
    if load is None:
        if ckpt_step is not None:
            raise StartupError(f"--ckpt-step {ckpt_step} needs --load")
        return None
    available = saved_iterations(load)
    if ckpt_step is not None:
        if ckpt_step not in available:
            raise StartupError(f"--ckpt-step {ckpt_step}: no {_iteration_dir(load, ckpt_step)} "
                               f"(iterations saved in --load {load}: {available or 'none'})")
        return ckpt_step
    latest = latest_iteration(load)
    if latest is None:
        first_run = save is not None and os.path.abspath(save) == os.path.abspath(load)
        if optional or (first_run and not exit_on_missing):
            return None
        what = "does not exist" if not os.path.exists(load) else f"has no {_LATEST}"
        if exit_on_missing:
            raise StartupError(f"--load {load} {what}: no checkpoint to resume from, and "
                               "--exit-on-missing-checkpoint asks to stop then")
        raise StartupError(f"--load {load} {what}: no checkpoint to resume from (pass "
                           f"--load-optional to start from scratch when it is empty)")
    if latest not in available:
        raise StartupError(f"--load {load}: {_LATEST} names iteration {latest}, but "
                           f"{_iteration_dir(load, latest)} is missing")
    return latest


def check_save_target(save: Optional[str], start_iteration: int, overwrite: bool) -> None:
    """Refuse a run whose saves would move ``save``'s latest iteration back or replace one."""
    if save is None or overwrite:
        return
    latest = latest_iteration(save)
    newer = [i for i in saved_iterations(save) if i > start_iteration]
    if (latest is not None and latest > start_iteration) or newer:
        raise StartupError(
            f"--save {save} already holds iteration(s) {newer or [latest]} after this run's start "
            f"(iteration {start_iteration}): saving would replace them and move {_LATEST} back "
            f"(from {latest}). Resume from the latest with --load {save}, save elsewhere, or "
            f"pass --overwrite-checkpoints")


def check_save_iteration(root: str, iteration: int, overwrite: bool) -> None:
    """At save time: the same rule for one iteration (another job may have saved meanwhile)."""
    if overwrite:
        return
    latest = latest_iteration(root)
    if latest is not None and latest > iteration:
        raise RuntimeError(f"refusing to save iteration {iteration} into {root}: {_LATEST} is "
                           f"already {latest} (--overwrite-checkpoints allows it)")
    if os.path.exists(_iteration_dir(root, iteration)):
        raise RuntimeError(f"refusing to replace {_iteration_dir(root, iteration)} "
                           f"(--overwrite-checkpoints allows it)")


def model_config(args) -> Dict[str, object]:
    """What must match between a checkpoint and the model it is loaded into, by flag name."""
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return {
        "--num-layers": args.num_layers,
        "--hidden-size": args.hidden_size,
        "--ffn-hidden-size": args.ffn_hidden_size,
        "--num-attention-heads": args.num_attention_heads,
        "--num-query-groups": groups,
        "padded vocabulary size": getattr(args, "padded_vocab_size", None),
        "--max-position-embeddings": args.max_position_embeddings,
        "--position-embedding-type": args.position_embedding_type,
        "--normalization": args.normalization,
        "--swiglu": args.swiglu,
        "--untie-embeddings-and-output-weights": args.untie_embeddings_and_output_weights,
        "--disable-bias-linear": args.disable_bias_linear,
        "--tensor-model-parallel-size": args.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        # model chunks per pipeline rank (None: no virtual stages); Megatron-LM's name for it
        "virtual pipeline stages per rank": getattr(args, "virtual_pipeline_model_parallel_size",
                                                    None),
        "dtype": dtype,
    }


def write_model_config(directory: str, config: Dict[str, object]) -> None:
    """Store ``config`` beside a checkpoint's rank files (called by rank 0 before the rename)."""
    with open(os.path.join(directory, MODEL_CONFIG), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)


LAYOUT_KEYS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
               "virtual pipeline stages per rank")


def check_model_config(load: str, iteration: int, current: Dict[str, object],
                       layout_free: bool = False) -> None:
    """Raise listing every field where the checkpoint's model differs from this run's
    (``layout_free``: TP/PP and virtual stages may differ, as torch_dist checkpoints
    reshard)."""
    path = os.path.join(_iteration_dir(load, iteration), MODEL_CONFIG)
    if os.path.exists(path):
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise StartupError(f"{path} is unreadable: {e}") from None
    elif os.path.exists(os.path.join(_iteration_dir(load, iteration), "metadata.json")):
        saved = _config_from_common(_iteration_dir(load, iteration))
    else:
        saved = _config_from_rank_file(_iteration_dir(load, iteration))
    diffs = [f"{key} checkpoint {saved.get(key)!r} vs this run {value!r}"
             for key, value in current.items()
             if saved.get(key) != value and not (layout_free and key in LAYOUT_KEYS)]
    if diffs:
        raise StartupError(f"checkpoint {_iteration_dir(load, iteration)} holds another model: "
                           + "; ".join(diffs) + _vocab_hint(saved, current, layout_free))


def _vocab_hint(saved: Dict[str, object], current: Dict[str, object], layout_free: bool) -> str:
    # The padded vocabulary is --make-vocab-size-divisible-by x TP rows: at another TP the same
    # tokenizer pads to other rows, which only the rows themselves, given, undo.
    key, tp = "padded vocabulary size", "--tensor-model-parallel-size"
    rows = saved.get(key)
    if not (layout_free and isinstance(rows, int) and rows != current.get(key)
            and saved.get(tp) != current.get(tp) and rows % (current.get(tp) or 1) == 0):
        return ""
    return (f" (the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP, "
            f"and this run's TP is {current.get(tp)}, the checkpoint's {saved.get(tp)}: pass "
            f"--padded-vocab-size {rows} to load it)")


MEGATRON_LM_NAMES: Dict[str, tuple] = {
    "disable_bias_linear": ("add_bias_linear", lambda add_bias: not add_bias),
    "apply_layernorm_1p": ("layernorm_zero_centered_gamma", bool),
    "norm_epsilon": ("layernorm_epsilon", float),
}
"""This project's dest -> (Megatron-LM's dest for the same flag, its value -> ours): the flags
whose stored argument Megatron-LM names otherwise (``--disable-bias-linear`` is
``store_false`` into ``add_bias_linear`` there, core_v0.16.1 and core_v0.19.0); every other flag
this project reads from a checkpoint has the same dest in both programs
(tests/test_megatron_lm_config.py checks both against Megatron-LM's own parser)."""


def with_this_projects_names(saved: Dict[str, object]) -> Dict[str, object]:
    """A checkpoint's stored arguments, with this project's name added for each flag Megatron-LM
    stores under its own (:data:`MEGATRON_LM_NAMES`; a name of this project's already there
    wins: the checkpoint is this project's)."""
    out = dict(saved)
    for ours, (theirs, convert) in MEGATRON_LM_NAMES.items():
        if ours not in out and out.get(theirs) is not None:
            out[ours] = convert(out[theirs])
    return out


def _config_from_rank_file(directory: str) -> Dict[str, object]:
    # Checkpoints written before model_config.json existed carry the run's arguments in every
    # rank file; reading one costs a full load of that file, once, at start.
    import argparse
    import glob

    import torch

    files = sorted(glob.glob(os.path.join(directory, "mp_rank_*.pt")))
    if not files:
        raise StartupError(f"{directory} holds neither {MODEL_CONFIG} nor rank files")
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    args = state.get("extra", {}).get("args")
    if not args:
        raise StartupError(f"{files[0]} records no arguments: cannot tell which model it holds")
    return model_config(argparse.Namespace(**with_this_projects_names(args)))


def _config_from_common(directory: str) -> Dict[str, object]:
    # A torch_dist checkpoint written by Megatron-LM: its arguments are in common.pt.
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(directory).get("args")
    if args is None:
        raise StartupError(f"{directory} records no arguments: cannot tell which model it holds")
    # Read under Megatron-LM's names (with_this_projects_names). An absent on/off flag is off
    # (argparse's store_true); any other absent field compares as None, so it is reported
    # rather than guessed.
    defaults = {name: None for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "padded_vocab_size", "max_position_embeddings", "position_embedding_type",
        "normalization", "tensor_model_parallel_size", "pipeline_model_parallel_size")}
    defaults.update(dict.fromkeys(("group_query_attention", "swiglu", "bf16", "fp16",
                                   "untie_embeddings_and_output_weights",
                                   "disable_bias_linear"), False))
    import argparse

    return model_config(argparse.Namespace(**{**defaults,
                                              **with_this_projects_names(vars(args))}))


def rng_tracker_mismatch(saved, current: Dict[str, object]) -> Optional[str]:
    """Why a checkpoint's model-parallel RNG tracker states do not fit this run's, or None.

    The tracker holds one generator state per name: 16 bytes for a CUDA generator, the CPU
    generator's state (5056 bytes) on CPU, where megatron-core's "CUDA" RNG is the CPU one. A
    state of the other form is accepted by ``set_states`` and fails only in the first forward's
    dropout (``torch.set_rng_state``), so it is compared here, before anything is restored.
    """
    import torch

    if not isinstance(saved, dict) or set(saved) != set(current):
        names = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        return f"tracker names {names}, this run's {sorted(current)}"
    where = "CUDA" if torch.cuda.is_available() else "CPU"
    for name, state in saved.items():
        here = current[name]
        if not torch.is_tensor(state) or state.dtype != here.dtype or \
                state.numel() != here.numel():
            size = f"{state.numel()}-byte" if torch.is_tensor(state) else type(state).__name__
            saved_on = "a GPU" if torch.is_tensor(state) and state.numel() == 16 else \
                "another device"
            return (f"'{name}' is a {size} generator state (saved on {saved_on}); this run's "
                    f"{where} generator takes {here.numel()} bytes")
    return None


def restorable_rng(saved_tracker, current_tracker: Dict[str, object]) -> bool:
    """True when the checkpoint's RNG states can be restored; else one note (rank 0), False.

    Skipping all of them, not only the tracker's, leaves the run as ``--no-load-rng`` would.
    """
    import torch.distributed as dist

    reason = rng_tracker_mismatch(saved_tracker, current_tracker)
    if reason is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"> note: the checkpoint's RNG states are not restored ({reason}); the run goes "
              "on as with --no-load-rng (dropout masks differ from the saving run's)",
              flush=True)
    return reason is None


def load_scheduler(scheduler, state: dict, override: bool, use_checkpoint: bool) -> str:
    """Load the LR schedule under Megatron-LM's rules; returns a line saying which was used."""
    if override:
        scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = \
            True, False
        scheduler.load_state_dict(state)
        return "LR schedule: the command line's (--override-opt_param-scheduler)"
    scheduler.override_opt_param_scheduler = False
    scheduler.use_checkpoint_opt_param_scheduler = use_checkpoint
    try:
        scheduler.load_state_dict(state)
    except AssertionError as e:
        raise StartupError(
            f"the checkpoint's LR schedule differs from the command line's ({e}; steps count "
            f"samples). Pass --use-checkpoint-opt_param-scheduler to keep the checkpoint's or "
            f"--override-opt_param-scheduler to use the command line's") from None
    if use_checkpoint:
        return "LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler)"
    return "LR schedule: the checkpoint's, which equals the command line's"


@contextlib.contextmanager
def writing(root: str, iteration: int):
    """Around the writes of a save: a failure says how full the filesystem of ``root`` is and
    what file size limit the process has. A full disk surfaced as torch's "[enforce fail at
    inline_container.cc:672] . unexpected pos 128 vs 0" or megatron-core's "CheckpointException
    ranks:dict_keys([1])", which name neither."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as e:
        raise RuntimeError(f"saving iteration {iteration} into {root} failed with "
                           f"{_space(root)}: {type(e).__name__}: "
                           f"{' '.join(str(e).split())[:300]}") from e


def _space(root: str) -> str:
    import resource
    import shutil

    try:
        usage = shutil.disk_usage(root)
        text = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on its " \
               f"filesystem"
    except OSError as e:
        text = f"its filesystem unreadable ({e.strerror or e})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        text += f", and a file size limit (ulimit -f) of {limit / 2**20:.1f} MiB"
    return text
