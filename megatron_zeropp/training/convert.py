"""Convert a checkpoint between ``--ckpt-format torch`` and ``torch_dist``.

Behind tools/convert_checkpoint.py.

The model, optimizer and LR schedule are rebuilt from the arguments stored in the input checkpoint
(this project's, or Megatron-LM's for torch_dist input), loaded in the input's format and saved in
the other, with the same iteration, optimizer state, schedule and RNG states. Runs as a normal
distributed job (torchrun) or as one process. Layouts:

* the output's TP/PP are the input's unless given; DP is what the job's world size leaves;
* ``torch`` input must be read with its own TP/PP (that format reshards DP only); ``torch_dist``
  input reads into any TP/PP/DP;
* the data-parallel implementation is the input's (``--data-parallel-impl`` when it was stored,
  else ZeRO-3 without qwZ/hpZ/qgZ); both write the same files;
* RNG states carry over when the job has the input's layout (``torch`` stores one per rank).
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

import torch.distributed as dist

from megatron_zeropp.backend import init_distributed, init_megatron
from megatron_zeropp.checkpointing import checks as checkpoint_checks
from megatron_zeropp.checkpointing import dist as checkpoint_dist
from megatron_zeropp.checkpointing import integrity as checkpoint_integrity
from megatron_zeropp.checkpointing import legacy as checkpoint
from megatron_zeropp.errors import StartupError
from megatron_zeropp.sharding import support
from megatron_zeropp.topology import build_topology

from .arguments import parse_args
from .megatron_lm_flags import CHECKPOINT_ARGS
from .model import (
    build_model_chunks,
    build_optimizer,
    num_floating_point_operations,
    transformer_config,
)

FORMATS = ("torch", "torch_dist")


def _parse_stored(argv: List[str], world: int):
    """parse_args on the command line rebuilt from the checkpoint; its errors are the
    checkpoint's, reported as such (not as pretrain_gpt.py's, whose flags the converter lacks)."""
    import contextlib
    import io

    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            return parse_args(argv, world)
    except SystemExit:
        text = message.getvalue().strip().splitlines()
        text = text[-1] if text else "invalid"
        text = text.split("error: ", 1)[-1].replace(" (--help lists the flags)", "")
        raise StartupError(f"the arguments stored in the checkpoint do not describe a model "
                           f"this project builds: {text}") from None


def _stored_args(root: str, iteration: int, fmt: str) -> dict:
    if fmt == "torch_dist":
        return checkpoint_dist.saved_args(root, iteration)
    return checkpoint.saved_args(root, iteration)


def _argv(stored: dict, to: str, tp: Optional[int], pp: Optional[int]) -> List[str]:
    """A command line for the stored model: the flags parse_args requires, then the stored
    model-defining values (CHECKPOINT_ARGS) override them as --use-checkpoint-args would."""
    def flag(name, value):
        return [f"--{name.replace('_', '-')}", str(value)]

    argv = []
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        argv += flag(name, stored[name])
    argv += flag("micro_batch_size", 1) + flag("lr", stored.get("lr") or 1e-4)
    argv += flag("train_iters", 1) + ["--ckpt-format", to, "--eval-iters", "0"]
    # No data is read; the vocabulary size comes from the checkpoint (padded_vocab_size).
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "2"]
    argv += flag("tensor_model_parallel_size", tp or stored.get("tensor_model_parallel_size", 1))
    argv += flag("pipeline_model_parallel_size",
                 pp or stored.get("pipeline_model_parallel_size", 1))
    if stored.get("virtual_pipeline_model_parallel_size") and pp is None:
        # the stored chunks per rank (a torch-format checkpoint holds one entry per chunk)
        argv += flag("num_virtual_stages_per_pipeline_rank",
                     stored["virtual_pipeline_model_parallel_size"])
    for precision in ("bf16", "fp16"):
        if stored.get(precision):
            argv.append(f"--{precision}")
    if stored.get("data_parallel_impl") == "megatron":
        argv += ["--data-parallel-impl", "megatron"]
    return argv


def convert(input_dir: str, output_dir: str, to: str, iteration: Optional[int] = None,
            tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None,
            ranks_per_node: Optional[int] = None) -> str:
    """Convert ``input_dir``'s checkpoint (latest, or ``iteration``) into ``output_dir`` in
    format ``to``; every rank calls. Returns the written iteration directory."""
    if to not in FORMATS:
        raise StartupError(f"--to must be one of {FORMATS}, got {to!r}")
    it = checkpoint_checks.latest_iteration(input_dir) if iteration is None else iteration
    if it is None or not os.path.isdir(checkpoint.iteration_dir(input_dir, it)):
        raise StartupError(f"--input {input_dir}: no checkpoint"
                           + (f" of iteration {it}" if it is not None else ""))
    checkpoint_checks.check_output(output_dir, it)  # before loading anything
    checkpoint_integrity.check_files(checkpoint.iteration_dir(input_dir, it))
    source = checkpoint_dist.checkpoint_format(input_dir, it)
    stored = _stored_args(input_dir, it, source)
    world = dist.get_world_size() if dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    args = _parse_stored(_argv(stored, to, tensor_parallel, pipeline_parallel), world)
    for name in CHECKPOINT_ARGS:
        if name in stored and name not in ("tensor_model_parallel_size",
                                           "pipeline_model_parallel_size"):
            setattr(args, name, stored[name])
    args.padded_vocab_size = stored["padded_vocab_size"]
    if source == "torch" and (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) \
            != (stored.get("tensor_model_parallel_size", 1),
                stored.get("pipeline_model_parallel_size", 1)):
        raise StartupError("a torch-format checkpoint is read with its own TP/PP; convert it to "
                         "torch_dist first, then to another TP/PP")
    init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    init_megatron(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size, args.seed,
                  virtual_pipeline=args.virtual_pipeline_model_parallel_size)
    world = dist.get_world_size()
    topology = build_topology(world, args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size, args.context_parallel_size,
                              support.ranks_per_node(ranks_per_node, world))
    config = transformer_config(args)
    chunks = build_model_chunks(args, config, topology)
    optimizer, scheduler = build_optimizer(args, chunks)
    load = (checkpoint_dist if source == "torch_dist" else checkpoint).load_checkpoint
    has_optim = not stored.get("no_save_optim", False)
    it, consumed = load(input_dir, chunks, optimizer, scheduler, it, load_optim=has_optim,
                        use_checkpoint_scheduler=True)
    common = dict(overwrite=False, model_config=checkpoint_checks.model_config(args),
                  save_optim=has_optim, save_rng=not stored.get("no_save_rng", False))
    if to == "torch_dist":
        saved = argparse.Namespace(**{**stored, **{k: getattr(args, k) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "ckpt_format")}})
        flops = num_floating_point_operations(args, consumed * args.seq_length)
        return checkpoint_dist.save_checkpoint(output_dir, it, consumed, chunks, optimizer,
                                               scheduler, saved, flops, **common)
    saved = {**stored, "ckpt_format": "torch",
             "tensor_model_parallel_size": args.tensor_model_parallel_size,
             "pipeline_model_parallel_size": args.pipeline_model_parallel_size}
    return checkpoint.save_checkpoint(output_dir, it, consumed, chunks, optimizer, scheduler,
                                      extra={"args": saved}, **common)


def to_non_distributed(input_dir: str, output_dir: str, iteration: Optional[int] = None) -> str:
    """Rewrite a ``fully_reshardable`` torch_dist checkpoint (this project's, or Megatron-LM's
    with --dist-ckpt-optim-fully-reshardable) in the layout of megatron-core's non-distributed
    optimizer, which Megatron-LM without --use-distributed-optimizer loads (one process; every
    tensor is read whole and written as one piece, which any TP/PP/DP reads). Weights, Adam
    moments, schedule and RNG states are copied bit for bit; the fp32 main weights are stored
    under the non-distributed names (16-bit models) or dropped (fp32 models: there the model
    weight is the main weight). Returns the written iteration directory."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megatron_zeropp.backend import apply_mcore_patches
    from megatron_zeropp.checkpointing import non_distributed
    from megatron_zeropp.mcore.checkpoint import (
        is_common,
        use_in_process_write_results,
        write_common_file,
    )

    apply_mcore_patches()  # megatron-core's writer on CPU

    it = checkpoint_checks.latest_iteration(input_dir) if iteration is None else iteration
    source = checkpoint.iteration_dir(input_dir, it) if it is not None else input_dir
    if it is not None:
        checkpoint_checks.check_output(output_dir, it)  # before loading anything
    checkpoint_integrity.check_files(source)
    if not checkpoint_dist.is_dist_checkpoint(source):
        raise StartupError(f"--input {input_dir}: --optimizer-layout non-distributed needs a "
                           f"torch_dist checkpoint; convert it with --to torch_dist first")
    if dist.get_world_size() != 1:
        raise StartupError(f"--optimizer-layout non-distributed runs as one process, not "
                           f"{dist.get_world_size()}")
    common = dist_checkpointing.load_common_state_dict(source)
    content = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    kind = content.get("distrib_optim_sharding_type")
    if kind != checkpoint_dist.SHARDING_TYPE or "optimizer" not in common:
        raise StartupError(
            f"--input {input_dir}: optimizer stored as {kind!r}; the rewrite reads "
            f"{checkpoint_dist.SHARDING_TYPE!r} (convert with --to torch_dist first: this "
            f"project writes it) and needs the optimizer state (not --no-save-optim)")
    described = load_sharded_metadata(source)
    loaded = dist_checkpointing.load(dict(described), source, validate_access_integrity=False)
    tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    args = common.get("args")
    half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    opt_common, opt_tensors = non_distributed.non_distributed_state(
        common["optimizer"], tensors, half)
    state = {k: v for k, v in common.items() if k not in ("optimizer", "content_metadata")}
    state["optimizer"] = opt_common
    state["model"] = {**(common.get("model") or {}), **{
        k: ShardedTensor.from_rank_offsets(k, t, replica_id=0)
        for k, t in tensors.items() if not k.startswith("optimizer.")}}
    state["optimizer_tensors"] = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0)
                                  for k, t in opt_tensors.items()}
    state["objects"] = {
        k: ShardedObject(v.key, loaded[k], v.global_shape, v.global_offset, replica_id=0)
        for k, v in described.items() if isinstance(v, ShardedObject) and not is_common(v.key)}
    if getattr(args, "use_distributed_optimizer", None) is not None:
        state["args"] = argparse.Namespace(**{**vars(args), "use_distributed_optimizer": False})
    tmp = checkpoint.begin_save(output_dir, it, overwrite=False)
    use_in_process_write_results()
    dist_checkpointing.save(state, tmp, content_metadata={
        k: v for k, v in content.items() if not k.startswith("distrib_optim")})
    write_common_file(tmp)
    config = os.path.join(source, checkpoint_checks.MODEL_CONFIG)
    if os.path.exists(config):
        import shutil

        shutil.copy(config, os.path.join(tmp, checkpoint_checks.MODEL_CONFIG))
    return checkpoint.commit_save(output_dir, it)
