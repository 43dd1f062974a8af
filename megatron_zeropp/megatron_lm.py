"""ZeRO++ inside a user's own Megatron-LM checkout: everything its patch calls.

The patches in ``patches/`` (one per Megatron-LM tag) add a few lines to Megatron-LM that call
this module; nothing else of Megatron-LM changes::

    pretrain_gpt.py       extra_args_provider=zeropp.arguments_provider(<the existing one>)
    training.py           zeropp.check_args(args)            (after Megatron-LM's validate_args;
                                                              core_v0.19.0: in pretrain_gpt.py)
                          DP = zeropp.data_parallel(args)    (where get_model picks DDP;
                                                              core_v0.19.0: also dist_utils.py)
                          isinstance(model[0], (..., zeropp.ZeroPPDataParallel))  (no_sync wiring)
                          (zeropp.get_optimizer if zeropp.enabled(args) else get_megatron_optimizer)
    checkpointing.py      zeropp.save_rank_state(checkpoint_name, model)   (torch_dist save)
                          zeropp.load_rank_state(checkpoint_name, ddp_model, iteration, ...)

Megatron-LM's ``unwrap_model`` takes off DDP, FSDP and Float16Module only, so its save asks the
ZeRO layer (and the layer's optimizer) for ``sharded_state_dict`` and its load calls their
``load_state_dict`` / ``reload_model_params``, which answer with the shards; the two calls in
``checkpointing.py`` add the layer's per-rank state (step clock, qgZ residuals, qwZ difference
references), so that a resumed run goes on exactly as the one that did not stop.

With no ``--zeropp-*`` switch on, every function here leaves Megatron-LM as it was.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, List, Optional

from megatron_zeropp.sharding import support
from megatron_zeropp.sharding.config import ZeroPPConfig
from megatron_zeropp.sharding.config_flags import PREFIX, add_zeropp_flags, config_from_args
from megatron_zeropp.sharding.data_parallel import ZeroPPDataParallel
from megatron_zeropp.sharding.schedule import UnitSchedule

SWITCHES = ("qwz", "hpz", "qgz", "shard_grads")
"""ZeroPPConfig fields that, set, ask for the layer (besides ``--zeropp-zero3``)."""



# -- arguments --------------------------------------------------------------------------------
def add_arguments(parser):
    """Add the ``--zeropp-*`` flags to Megatron-LM's parser and return it (an
    ``extra_args_provider``). One flag per :class:`ZeroPPConfig` field, generated from the
    dataclass so the two never drift; plus ``--zeropp-zero3`` (plain ZeRO-3, no ZeRO++
    technique) and the node size ``--ranks-per-node``, spelled as this project's
    ``pretrain_gpt.py`` spells it (Megatron-LM has no such flag)."""
    g = parser.add_argument_group("ZeRO++ (megatron_zeropp)")
    g.add_argument("--zeropp-zero3", action="store_true",
                   help="use the ZeRO-3 layer (weights, gradients and optimizer state sharded "
                        "over the data-parallel group) without qwZ/hpZ/qgZ")
    support.add_node_size_flag(g)
    add_zeropp_flags(g)
    return parser


def arguments_provider(existing: Optional[Callable] = None) -> Callable:
    """An ``extra_args_provider`` adding the ``--zeropp-*`` flags after ``existing`` (e.g.
    Megatron-LM's ``add_modelopt_args``; ``None``: none)."""

    def provider(parser):
        if existing is not None:
            parser = existing(parser)
        return add_arguments(parser)

    return provider


def enabled(args) -> bool:
    """Whether any ``--zeropp-*`` switch asks for the ZeRO layer."""
    return bool(getattr(args, PREFIX + "zero3", False)) or any(
        getattr(args, PREFIX + name, False) for name in SWITCHES)


def zeropp_config(args) -> ZeroPPConfig:
    """The :class:`ZeroPPConfig` of the ``--zeropp-*`` flags (validated by the dataclass; its
    messages name the flags)."""
    return config_from_args(args)


def ranks_per_node(args, world_size: int) -> int:
    """``--ranks-per-node``, else torchrun's LOCAL_WORLD_SIZE, else the whole world."""
    return support.ranks_per_node(getattr(args, "ranks_per_node", None), world_size)


def _refusals(args) -> List[str]:
    """Megatron-LM settings the layer cannot honour, each with its reason."""
    errors = []

    def refuse(condition, text):
        if condition:
            errors.append(text)

    refuse(not args.use_distributed_optimizer,
           "--use-distributed-optimizer is required (ZeRO-3 shards the optimizer state; "
           "Megatron-LM builds and checkpoints a sharded optimizer only with it)")
    refuse(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False),
           "--use-torch-fsdp2 / --use-megatron-fsdp replace the data-parallel layer, as ZeRO++ "
           "does: use one")
    refuse(getattr(args, "num_distributed_optimizer_instances", 1) != 1,
           f"--num-distributed-optimizer-instances "
           f"{getattr(args, 'num_distributed_optimizer_instances', 1)}: the layer shards over "
           f"the whole data-parallel group (1 instance)")
    refuse(getattr(args, "ddp_average_in_collective", False),
           "--ddp-average-in-collective: the layer pre-scales gradients")
    refuse(getattr(args, "use_precision_aware_optimizer", False),
           "--use-precision-aware-optimizer is not supported by the ZeRO++ optimizer")
    refuse(getattr(args, "optimizer", "adam") != "adam",
           f"--optimizer {getattr(args, 'optimizer', None)}: only adam is built over the "
           f"layer's shards")
    refuse(getattr(args, "ckpt_format", "torch_dist") != "torch_dist",
           f"--ckpt-format {getattr(args, 'ckpt_format', None)}: the layer and its optimizer "
           f"checkpoint through megatron-core's sharded_state_dict (torch_dist) only")
    refuse(getattr(args, "save_wgrads_interval", None) is not None,
           "--save-wgrads-interval all-reduces full gradients (force_all_reduce); the layer "
           "keeps reduced gradient shards only")
    refuse(getattr(args, "log_params_norm", False),
           "--log-params-norm reads every full parameter, which the layer frees between "
           "uses (their storage is empty)")
    refuse(getattr(args, "check_weight_hash_across_dp_replicas_interval", None) is not None,
           "--check-weight-hash-across-dp-replicas-interval: weights are sharded, not "
           "replicated, over the data-parallel group")
    refuse(getattr(args, "fp8_param_gather", False),
           "--fp8-param-gather: the layer gathers its own (qwZ: int8/int4) weights")
    return errors


def check_args(args, write=print) -> List[str]:
    """Check Megatron-LM's parsed and validated ``args`` against the layer, before any model or
    ZeRO++ process group exists; a no-op without a ``--zeropp-*`` switch.

    Raises ValueError naming every setting the layer cannot honour. Adjusts two settings, with
    one note line each (returned, and written on rank 0): ``--overlap-param-gather`` goes off
    (the layer gathers weights itself, prefetching ``--zeropp-prefetch-depth`` units ahead:
    the overlap is built in), and the distributed optimizer is stored ``fully_reshardable``
    (the layer's optimizer has no DDP bucket layout; Megatron-LM reads the sharding type from a
    checkpoint, so it loads these with or without ZeRO++).
    """
    if not enabled(args):
        return []
    from megatron_zeropp.topology import build_topology

    errors = _refusals(args)
    try:
        config = zeropp_config(args)
    except ValueError as e:
        errors.append(str(e))
        config = None
    world = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    layout = (world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
              getattr(args, "context_parallel_size", 1))
    hpz = getattr(args, PREFIX + "hpz", False)
    errors += support.layout_errors(*layout, getattr(args, "ranks_per_node", None), hpz,
                                    getattr(args, PREFIX + "hpz_partition_size", None))
    if errors:
        raise ValueError("ZeRO++: " + "; ".join(errors))
    topology = build_topology(*layout, ranks_per_node(args, world))
    notes = []
    if args.overlap_param_gather:
        args.overlap_param_gather = False
        args.overlap_param_gather_with_optimizer_step = False
        notes.append("--overlap-param-gather off: the ZeRO++ layer gathers weights itself, "
                     f"{config.prefetch_depth} unit(s) ahead (--zeropp-prefetch-depth)")
    if not args.dist_ckpt_optim_fully_reshardable:
        args.dist_ckpt_optim_fully_reshardable = True
        notes.append("optimizer checkpoints stored fully_reshardable (the ZeRO++ optimizer's "
                     "only format; Megatron-LM reads the type from the checkpoint)")
    if int(os.environ.get("RANK", "0")) == 0:
        write(f"> ZeRO++: {config.describe()}, {topology.describe()}", flush=True)
        for note in notes:
            write(f"> ZeRO++ note: {note}", flush=True)
    return notes


# -- model wrapping ---------------------------------------------------------------------------
class MegatronLMZeroPP(ZeroPPDataParallel):
    """The ZeRO++ layer with the methods Megatron-LM's training loop calls on a model chunk
    beyond megatron-core's (``enable/disable_forward_pre_hook``: only with
    ``--overlap-param-gather``, which :func:`check_args` turns off; kept so that Megatron-LM's
    capability check passes and any call is harmless: the layer's own forward hooks gather)."""

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """The layer's: new weight version, and the next forward's first gathers started now
        (on CUDA). Without CUDA those gathers would run on the layer's communication thread
        while Megatron-LM's ``train_step`` goes on with raw collectives on the same
        data-parallel group (the loss all-reduce right after the optimizer step), which gloo
        could then run in different orders on different ranks: no prefetch there (the first
        forward gathers in its hook, in program order)."""
        import torch

        super().start_param_sync(*unused, force_sync=force_sync or not torch.cuda.is_available(),
                                 force_dispatch=force_dispatch)

    def error_measured(self, what: str, iteration: int, report: dict) -> None:
        """``--zeropp-qgz-error-interval``, ``--zeropp-qwz-error-interval``: one line per
        measured iteration, from the first rank of each data-parallel group's tensor-parallel
        group 0 (Megatron-LM's loop reads no report; this project's ``pretrain_gpt.py`` puts
        it on its training line)."""
        from megatron.core import parallel_state

        if self.comm.dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            worst = max(report["units"], key=report["units"].get)
            name = {"qgz": "qgZ", "qwz": "qwZ weight"}[what]
            print(f"> ZeRO++ {name} relative error at iteration {iteration}: "
                  f"{report['total']:.4e} (largest: {worst} {report['units'][worst]:.4e})",
                  flush=True)

    def enable_forward_pre_hook(self):
        """Nothing to enable: the layer's gathers run in its own forward hooks."""

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """Nothing to disable; weights are gathered just in time in every forward."""
        del param_sync


def train_iters(args) -> Optional[int]:
    """The run's training iterations as Megatron-LM counts them (``--train-iters``, or from
    ``--train-samples`` by its ``update_train_iters``): the layer's qgZ cutoff. With
    ``--train-samples`` Megatron-LM sets ``args.train_iters`` only later, while it builds the
    LR schedule, and branches on it being unset there: counted on a copy of the arguments."""
    if args.train_iters:
        return args.train_iters
    if getattr(args, "train_samples", None) is None:
        return None
    import argparse

    from megatron.training.training import update_train_iters

    copy = argparse.Namespace(**vars(args))
    update_train_iters(copy)
    return copy.train_iters


def data_parallel(args=None, write=print) -> Callable:
    """A class-like factory for where Megatron-LM's ``get_model`` does ``DP = DDP``:
    ``DP(config=, ddp_config=, module=, disable_bucketing=, **kwargs)`` returns the ZeRO++
    layer around ``module``; Megatron-LM's own DDP class when no ``--zeropp-*`` switch is on.

    ``args``: Megatron-LM's arguments (default: its global ones; none set: DDP). The
    topology comes from torch.distributed and megatron-core's parallel state (ranks per node
    from :func:`ranks_per_node`); the process groups are built once, at the first chunk, reusing
    megatron-core's data-parallel (with context-parallel) group, and so is the
    :class:`~megatron_zeropp.sharding.UnitSchedule` the chunks of a rank share (virtual
    pipeline stages: get_model wraps each chunk through the same factory). ``disable_bucketing``,
    ``full_param_layout`` (core_v0.19.0) and ``pg_collection`` are accepted and ignored: the
    layer buckets per unit and reads its groups from the topology.
    """
    if args is None:
        from megatron.training import get_args

        try:
            args = get_args()
        except AssertionError:  # no global arguments (a unit test wrapping chunks directly)
            args = None
    if args is None or not enabled(args):
        from megatron.core.distributed import DistributedDataParallel

        return DistributedDataParallel
    zero_config = zeropp_config(args)
    state = {}

    def make(config=None, ddp_config=None, module=None, disable_bucketing=False, **ignored):
        del disable_bucketing, ignored
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_zeropp.topology import build_process_groups, build_topology

        if "groups" not in state:
            world = dist.get_world_size()
            topology = build_topology(
                world, parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(), ranks_per_node(args, world))
            dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            state["topology"] = topology
            state["groups"] = build_process_groups(topology, zero_config.hpz_partition_size,
                                                   dp_group=dp_group)
            state["schedule"] = UnitSchedule(zero_config.prefetch_depth)
            # the qgZ cutoff, counted once (Megatron-LM's microbatch calculator exists now)
            state["train_iters"] = train_iters(args) if zero_config.qgz_fraction < 1 else None
        if ddp_config.overlap_param_gather:
            ddp_config = dataclasses.replace(ddp_config, overlap_param_gather=False)
            if dist.get_rank() == 0:
                write("> ZeRO++ note: overlap_param_gather off (the layer gathers weights "
                      "itself, with prefetch)", flush=True)
        return MegatronLMZeroPP(config, ddp_config, module, state["topology"], zero_config,
                                state["groups"], state["schedule"],
                                train_iters=state["train_iters"])

    return make


# -- checkpoints ------------------------------------------------------------------------------
def save_rank_state(checkpoint_dir: str, model) -> None:
    """Where Megatron-LM's ``save_checkpoint`` has written a torch_dist checkpoint into
    ``checkpoint_dir`` (the iteration directory): write the layer's per-rank state of every
    chunk of ``model`` beside it (:mod:`megatron_zeropp.checkpointing.rank_state`); nothing
    without the layer."""
    from megatron_zeropp.checkpointing import rank_state

    rank_state.save(checkpoint_dir, model)


def load_rank_state(checkpoint_dir: str, model, iteration: int, fresh: bool = False) -> None:
    """At the end of Megatron-LM's ``load_checkpoint`` (weights and optimizer loaded from
    ``checkpoint_dir``, ``iteration`` as it will go on from): give every chunk its per-rank
    state back, or a fresh one at ``iteration`` (none saved, another layout, or ``fresh``:
    ``--finetune`` / a release checkpoint). Collective; nothing without the layer."""
    from megatron_zeropp.checkpointing import rank_state

    rank_state.load(checkpoint_dir, model, iteration, fresh=fresh)


# -- optimizer --------------------------------------------------------------------------------
def get_optimizer(config, model_chunks, **kwargs):
    """megatron-core's ``get_megatron_optimizer(config, model_chunks, **kwargs)`` over the ZeRO
    layer's shards (:func:`megatron_zeropp.optimizer.get_zeropp_optimizer`); Megatron-LM's
    keyword arguments (``config_overrides``, ``use_gloo_process_groups``, ...) pass through."""
    from megatron_zeropp.optimizer import get_zeropp_optimizer

    return get_zeropp_optimizer(config, model_chunks, **kwargs)


__all__ = ["add_arguments", "arguments_provider", "enabled", "zeropp_config", "check_args",
           "data_parallel", "get_optimizer", "save_rank_state", "load_rank_state",
           "MegatronLMZeroPP", "ZeroPPDataParallel"]
