"""ZeroPPDataParallel: ZeRO-3 with qwZ / hpZ / qgZ, a drop-in for megatron-core's DDP.

Data flow of one unit (≈ one transformer layer) in one training step::

    forward pre-hook    gather full weights: the first time in a step from the primary shards
                        over the DP group (qwZ: INT8 blocks), keeping this rank's node-local
                        slice (hpZ); later in the step from that slice, inside the node;
                        prefetch the next unit asynchronously
    forward post-hook   release the full weights; hook the outputs for backward
    output grad hook    gather again (hpZ: inside the node), prefetch the previous unit
    grad accumulation   megatron-core's main_grad; when the unit's last grad arrived,
                        release the weights; on the last micro-batch the unit reduce-scatters
                        its buckets (qgZ: 2-hop quantized all-to-all) into chunk r of the grad
                        buffer, where DistributedOptimizer reads it. With shard_grads, every
                        micro-batch reduces the unit at once into an fp32 shard and frees its
                        full gradients. The unit owns its gradients either way: megatron-core's
                        buckets are only the optimizer's view of the memory.
    optimizer step      DistributedOptimizer updates its fp32 shard and writes the 16-bit
                        result into the primary shard (the shard map's views;
                        see mcore/optimizer.py);
                        start_param_sync() then bumps the weight version, which makes every
                        hpZ secondary stale (reading it raises) until the next forward gather,
                        and starts the next forward's first gathers. With qwz_diff_bits that
                        gather sends differences against the secondary, updated in place
                        (comm/qwz_diff.py, sharding/diff_reference.py).

The methods megatron-core's schedules, ``finalize_model_grads`` and ``DistributedOptimizer`` call
(``no_sync``, ``start_grad_sync``, ``finish_grad_sync``, ``start_param_sync``,
``zero_grad_buffer``, ``scale_gradients``, ``broadcast_params``, ``buffers``) keep their meaning;
``shard_map`` tells the optimizer and checkpoints which part of each parameter this rank holds.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron_zeropp.comm import drain
from megatron_zeropp.mcore.buffers import BaseDataParallel
from megatron_zeropp.mcore.rerun import may_rerun_iterations, reruns_current_iteration
from megatron_zeropp.topology import ProcessGroups, Topology, build_process_groups

from . import rank_state
from .config import ZeroPPConfig
from .partition import CombinedBuffer, build_unit_buffers, find_units
from .schedule import UnitSchedule
from .shard_comm import ShardComm
from .shard_map import ShardMap
from .sharded_state import is_sharded_load, load_sharded, model_sharded_state
from .step_clock import StepClock
from .unit import ShardedUnit, UnitState


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _move_leftovers(module: torch.nn.Module, device: torch.device) -> None:
    """What no unit owns (frozen parameters, buffers) goes to the units' device: a host-built
    model's leftovers; a no-op when the model was built there."""
    for p in module.parameters():
        if p.device != device:
            p.data = p.data.to(device)
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


def check_grads(unit, nan_or_inf: bool, large: bool) -> None:
    """megatron-core DDP's check before a gradient reduction (``check_for_nan_in_grad``, which
    Megatron-LM sets from ``--check-for-nan-in-loss-and-grad``, and ``check_for_large_grads``):
    the norm of each of the unit's buckets, judged by megatron-core's rerun state machine (a
    NaN/Inf raises on this rank; with reruns enabled it attributes the fault). One host read per
    bucket, as in megatron-core."""
    import functools

    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    for i, bucket in enumerate(unit.buckets):
        norm = bucket.grad_data.norm(p=2)
        where = f"unit {unit.name} bucket #{i} before data-parallel communication"
        if nan_or_inf:
            for test, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                machine.validate_result(result=norm, rejection_func=test, tolerance=0.001,
                                        message=f"found {what} in local grad norm for {where}",
                                        fatal=True)
        if large:
            machine.validate_result(
                result=norm, tolerance=0.001, fatal=False,
                rejection_func=functools.partial(machine.is_unexpectedly_large, threshold=10,
                                                 context="grads"),
                message=f"found unexpected large grads in {where}")


def _check_ddp_config(ddp_config) -> None:
    problems = []
    if not ddp_config.use_distributed_optimizer:
        problems.append("use_distributed_optimizer must be True (ZeRO shards the optimizer)")
    if ddp_config.overlap_param_gather:
        problems.append("overlap_param_gather must be False (the layer gathers weights itself)")
    if ddp_config.num_distributed_optimizer_instances != 1:
        problems.append(
            f"num_distributed_optimizer_instances must be 1, got "
            f"{ddp_config.num_distributed_optimizer_instances}"
        )
    if ddp_config.average_in_collective:
        problems.append("average_in_collective is not supported (gradients are pre-scaled)")
    if getattr(ddp_config, "use_megatron_fsdp", False):
        problems.append("use_megatron_fsdp must be False")
    if problems:
        raise ValueError("ZeroPPDataParallel: " + "; ".join(problems))


class ZeroPPDataParallel(BaseDataParallel):
    """Shard ``module``'s weights over the DP group and gather them just in time.

    Args:
        config: the model's TransformerConfig.
        ddp_config: megatron-core DistributedDataParallelConfig (distributed optimizer on,
            ``overlap_param_gather`` off; ``overlap_grad_reduce`` makes reductions asynchronous).
        module: the model chunk (e.g. a GPTModel, or Float16Module around it).
        topology: the job's :class:`Topology` (node size included).
        zeropp: which ZeRO++ techniques to use (default: plain ZeRO-3).
        process_groups: this rank's groups; built from ``topology`` when omitted.
        schedule: the :class:`UnitSchedule` shared by all model chunks of this rank (virtual
            pipeline stages: one ZeroPPDataParallel per chunk, one schedule for all, so that
            gathers run ahead in the order the pipeline schedule really enters the units);
            a chunk of its own when omitted.
        train_iters: the run's training iterations, for ``qgz_fraction`` < 1 (the iteration
            where qgZ switches off); ``None`` otherwise.
        chunk_index: this chunk's index among the rank's model chunks (virtual pipeline
            stages), so that two chunks of a rank never share stochastic-rounding keys; default:
            the number of chunks registered with ``schedule`` before this one.

    The layer keeps its own :class:`~.step_clock.StepClock`: ``zero_grad_buffer`` begins an
    iteration (megatron-core's rerun of an iteration in place begins none).
    """

    def __init__(
        self,
        config,
        ddp_config,
        module: torch.nn.Module,
        topology: Topology,
        zeropp: Optional[ZeroPPConfig] = None,
        process_groups: Optional[ProcessGroups] = None,
        schedule: Optional[UnitSchedule] = None,
        train_iters: Optional[int] = None,
        chunk_index: Optional[int] = None,
    ):
        super().__init__(config=config, module=module)
        _check_ddp_config(ddp_config)
        zeropp = ZeroPPConfig() if zeropp is None else zeropp
        if not isinstance(zeropp, ZeroPPConfig):
            raise ValueError(f"zeropp must be a ZeroPPConfig, got {type(zeropp).__name__}")
        expert = [n for n, p in module.named_parameters() if not getattr(p, "allreduce", True)]
        if expert:
            raise ValueError(f"expert-parallel parameters are not supported: {expert[:3]}")
        self.ddp_config = ddp_config
        self.zeropp = zeropp
        self.topology = topology
        groups = process_groups or build_process_groups(topology, zeropp.hpz_partition_size)
        self._check_groups(groups)
        if schedule is None:
            schedule = UnitSchedule(zeropp.prefetch_depth)
        elif schedule.depth != zeropp.prefetch_depth:
            raise ValueError(f"the shared UnitSchedule prefetches {schedule.depth} entries ahead, "
                             f"this chunk's prefetch_depth is {zeropp.prefetch_depth}")
        self.schedule = schedule
        if chunk_index is None:
            chunk_index = schedule.chunks  # the chunks of this rank registered before this one
        self.clock = StepClock(zeropp, groups.dp_ranks.index(dist.get_rank()), train_iters,
                               chunk_index)
        self.comm = ShardComm(zeropp, groups, topology, self.clock)
        # the last measured iteration's report of each diagnostic ("qgz", "qwz"), until read
        self._error_reports: Dict[str, dict] = {}
        self._rank_state_loaded = True  # False from load_state_dict to load_rank_state
        self._residuals_at_start = None  # qgZ residuals as this iteration found them (reruns)
        self.weight_version = 0
        self._forward_phase = "forward"  # "exact" inside exact_forwards()
        self.overlap_param_gather_with_optimizer_step = False
        self._last_microbatch = True  # False inside no_sync(): gradients only accumulate
        self._sharded_metadata = None  # of the last sharded_state_dict(), for its load
        self._build_units(config, ddp_config, module, groups)
        self._hook_handles: list = []
        self.schedule.add_chunk(self.units, self._prefetch)
        self._call_stack: Dict[int, list] = {}
        self._install_hooks()
        self.release_all()

    # -- construction ----------------------------------------------------------------------
    def _check_groups(self, groups: ProcessGroups) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            mine = dist.get_process_group_ranks(
                parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
            if tuple(mine) != tuple(groups.dp_ranks):
                raise ValueError(
                    f"topology DP group {groups.dp_ranks} differs from megatron-core's "
                    f"data-parallel group {tuple(mine)}: build the Topology with the same TP/PP/CP"
                )

    def _build_units(self, config, ddp_config, module, groups) -> None:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = ProcessGroupCollection()
        pgc.tp = parallel_state.get_tensor_model_parallel_group()
        pgc.dp_cp = groups.dp
        scale = 1.0 if config.calculate_per_token_loss else 1.0 / len(groups.dp_ranks)
        names = {p: n for n, p in module.named_parameters()}
        self.units: List[ShardedUnit] = []
        self.grad_accs = []
        for spec in find_units(module, self.zeropp.unit):
            buffers = build_unit_buffers(spec, ddp_config, groups.dp, scale, names, pgc)
            unit = ShardedUnit(spec.name, spec.root, buffers, self.comm)
            self._hook_grads(unit)
            # Sharded at once: with a host-built model (use_cpu_initialization) only this unit is
            # ever whole on the device.
            unit.release()
            self.units.append(unit)
        if self.units:
            _move_leftovers(module, self.units[0].buckets[0].param_data.device)
        self.param_to_unit = {p: u for u in self.units for p in u.params}
        # What the optimizer and checkpoints read and write instead of the (transient) full
        # parameters.
        self.shard_map: ShardMap = {}
        for unit in self.units:
            self.shard_map.update(unit.shard_map())
        # One megatron-core-shaped buffer per dtype for the optimizer, units in reverse order
        # (megatron-core's buffers start from the end of the model too).
        parts: Dict[tuple, list] = {}
        for unit in reversed(self.units):
            for buf in unit.buffers:
                parts.setdefault((buf.param_dtype, buf.grad_dtype), []).append(buf)
        self.buffers = [CombinedBuffer(pd, gd, p) for (pd, gd), p in parts.items()]
        self.expert_parallel_buffers: list = []
        # megatron-core's DDP communicates through bucket groups; the units do it here.
        self.bucket_groups: list = []
        self.expert_parallel_bucket_groups: list = []
        self.params_with_grad = [p for u in self.units for p in u.params]
        for p in self.params_with_grad:
            p.grad_added_to_main_grad = False

    def _install_hooks(self) -> None:
        roots = {id(u.root): u for u in self.units}
        self._root_to_unit = roots
        for m in self.module.modules():
            if id(m) in roots:
                self._hook_handles.append(m.register_forward_pre_hook(self._root_pre_hook))
                self._hook_handles.append(m.register_forward_hook(self._root_post_hook))
            else:
                self._hook_handles.append(
                    m.register_forward_pre_hook(self._use_pre_hook, with_kwargs=True)
                )
                self._hook_handles.append(m.register_forward_hook(self._use_post_hook))

    def _hook_grads(self, unit: ShardedUnit) -> None:
        for p in unit.params:
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_grad_hook(p))
            self.grad_accs.append(acc)

    # -- gather scheduling -----------------------------------------------------------------
    def _prefetch(self, unit: ShardedUnit, phase: str) -> None:
        # The schedule's call: gather ``unit`` ahead, at this chunk's weight version.
        if unit.state is UnitState.RELEASED:
            unit.start_gather(self.weight_version,
                              self._forward_phase if phase == "forward" else phase,
                              async_op=True)

    def _root_pre_hook(self, module, args):
        unit = self._root_to_unit[id(module)]
        unit.acquire(self.weight_version, self._forward_phase)
        self.schedule.entered(unit, "forward")

    def _root_post_hook(self, module, args, output):
        unit = self._root_to_unit[id(module)]
        unit.release_use()
        if torch.is_grad_enabled():
            self._gather_before_backward(output, [unit])
        return None

    def _use_pre_hook(self, module, args, kwargs):
        # Parameters used outside their unit's forward (a tied output layer reading the
        # embedding weight) are gathered for this call only.
        needed = []
        for p in list(module.parameters(recurse=False)) + [
            t for t in _tensors((args, kwargs)) if isinstance(t, torch.nn.Parameter)
        ]:
            unit = self.param_to_unit.get(p)
            if unit is not None and unit.users == 0 and unit not in needed:
                needed.append(unit)
        for unit in needed:
            unit.acquire(self.weight_version, self._forward_phase)
        self._call_stack.setdefault(id(module), []).append(needed)
        return None

    def _use_post_hook(self, module, args, output):
        needed = self._call_stack[id(module)].pop()
        for unit in needed:
            unit.release_use()
        if needed and torch.is_grad_enabled():
            self._gather_before_backward(output, needed)
        return None

    def _gather_before_backward(self, output, units: List[ShardedUnit]) -> None:
        tensors = [t for t in _tensors(output) if t.requires_grad]

        def hook(grad):
            for unit in units:
                self._acquire_for_backward(unit)
            return None

        for t in tensors:
            t.register_hook(hook)

    def _acquire_for_backward(self, unit: ShardedUnit) -> None:
        if unit.begin_backward(self.weight_version):
            self.schedule.entered(unit, "backward")

    def _make_grad_hook(self, param):
        def hook(*unused):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
            param.grad = None
            unit = self.param_to_unit[param]
            if not unit.grad_ready(param):
                return
            overlap = bool(self.ddp_config.overlap_grad_reduce)
            if unit.grads.reduces_every_microbatch:
                self._start_grad_reduce(unit, async_op=overlap)
            elif overlap and self._last_microbatch:
                self._start_grad_reduce(unit, async_op=True)

        return hook

    def _start_grad_reduce(self, unit: ShardedUnit, async_op: bool) -> None:
        if unit.reduction_pending():
            cfg = self.ddp_config
            if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
                check_grads(unit, cfg.check_for_nan_in_grad, cfg.check_for_large_grads)
        unit.start_grad_reduce(async_op)

    # -- megatron-core DDP interface -------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (all but the last micro-batch)."""
        self._last_microbatch = False
        try:
            yield
        finally:
            self._last_microbatch = True

    def start_grad_sync(self, *unused):
        """Launch every unit's gradient reduction that has not started yet."""
        for unit in reversed(self.units):
            self._start_grad_reduce(unit, async_op=True)

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Finish gradient reductions; release any weights still gathered; raise if an hpZ read
        of this step saw a stale secondary (the step's one host read of that flag)."""
        if force_all_reduce:
            raise ValueError("force_all_reduce is not supported by the ZeRO++ layer")
        for unit in reversed(self.units):
            # Leftovers: no overlap, or parameters without a gradient this step.
            self._start_grad_reduce(unit, async_op=False)
            unit.finish_grad_reduce()
            unit.grads_synced()
        self.schedule.end_step()
        self.release_all()
        self.comm.check_stale()
        for what in self._measured_errors():
            self._report_error(what)

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """The optimizer wrote new primary shards: weights of the next forward are a new
        version, and every hpZ secondary is stale until refreshed by a forward gather.

        Then this chunk's units among the first ``prefetch_depth`` entries of the learned step
        order (:class:`UnitSchedule`) start gathering, so the link works while the host
        finishes the step (logging, the next batch) instead of waiting for the first forward
        hook. ``force_sync`` (weights loaded from a checkpoint) prefetches nothing."""
        self.weights_changed()
        if not force_sync:
            for unit, phase in self.first_entries():
                self._prefetch(unit, phase)

    def finish_param_sync(self, *unused, **kwargs):
        """Nothing to wait for: gathers happen in the forward hooks."""

    def first_entries(self) -> list:
        """``(unit, phase)`` of this chunk among the first ``prefetch_depth`` entries of the
        learned step order: what :meth:`start_param_sync` gathers ahead (empty before a whole
        training step ran)."""
        return self.schedule.first_entries(self.units)

    def zero_grad_buffer(self):
        """Zero the gradient buffers before a new step, and begin the step's iteration on the
        clock (no new one while megatron-core's rerun state machine re-runs this one) and a
        step of the unit schedule."""
        self.schedule.begin_step()
        for p in self.params_with_grad:
            p.grad_added_to_main_grad = False
        for unit in self.units:
            unit.zero_grads()  # waits for reductions in flight: they read the clock
        if not self._rank_state_loaded:
            self._note_missing_rank_state()
        rerun = reruns_current_iteration()
        self.clock.begin_iteration(rerun=rerun)
        self._keep_iteration_start(rerun)
        for what in self._measured_errors():
            self._meter(what).reset()

    def _keep_iteration_start(self, rerun: bool) -> None:
        """While megatron-core's rerun state machine may re-run an iteration in place, keep the
        qgZ residuals as the iteration found them, and give them back to a rerun: it then
        reduces exactly as the run it checks."""
        if not self.zeropp.qgz_error_feedback:
            return
        if rerun and self._residuals_at_start is not None:
            for unit, states in zip(self.units, self._residuals_at_start):
                unit.load_qgz_residual_states(states)
        elif may_rerun_iterations():
            self._residuals_at_start = [unit.qgz_residual_states() for unit in self.units]
        else:
            self._residuals_at_start = None

    def scale_gradients(self, scaling_factor: float) -> None:
        """Scale all gradients by ``scaling_factor``."""
        for unit in self.units:
            unit.scale_grads(scaling_factor)

    def broadcast_params(self):
        """Make every DP rank hold DP rank 0's weights (then re-shard).

        Under ZeRO-3 each element has one owner, so the gathered weights already agree across DP
        ranks; this keeps megatron-core's contract for callers and marks a weight change.
        """
        src = dist.get_global_rank(self.comm.dp_group, 0)
        with self.gathered_parameters(write_back=True):
            for p in self.params_with_grad:
                dist.broadcast(p.data, src=src, group=self.comm.dp_group)

    # -- whole-model access ----------------------------------------------------------------
    def wait_for_gathers(self) -> None:
        """Finish every in-flight gather (e.g. the next step's first units, started by
        :meth:`start_param_sync`) and keep the weights: for timing a step with all of its
        communication inside it."""
        for unit in self.units:
            unit.wait()

    def release_all(self) -> None:
        """Wait for in-flight gathers and free every unit's full weights."""
        for unit in self.units:
            unit.release()

    def drop_diff_references(self) -> None:
        """The primary shards were replaced from outside the optimizer (a load, a broadcast):
        with ``qwz_diff_bits`` the next first gather of every unit is an exact one, since the
        receivers' reconstruction no longer follows from the owners' differences."""
        for unit in self.units:
            if unit.diff is not None:
                unit.diff.drop()

    def weights_changed(self) -> None:
        """Declare the primary shards changed: bump the version, drop gathered weights."""
        self.release_all()
        self.weight_version += 1
        self.clock.weights_changed()

    @contextlib.contextmanager
    def exact_forwards(self):
        """Forwards inside the block compute with the exact 16-bit weights, as a checkpoint
        holds them: every gather reads the primary shards unquantized (never qwZ, never the
        hpZ secondary) and leaves the secondary and the qwZ difference reference alone, one
        unit at a time as in any forward. For evaluating the trained weights themselves
        (``--zeropp-eval-weights``); what training computes afterwards is unchanged, since the
        units gathered inside are released on both sides of the block."""
        self.release_all()
        self._forward_phase = "exact"
        try:
            yield
        finally:
            self._forward_phase = "forward"
            self.release_all()

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False):
        """All full weights, exact (never quantized), for the duration of the block.

        With ``write_back=True`` changes made to the parameters inside the block become the new
        primary shards (and a new weight version).
        """
        self.release_all()
        try:
            for unit in self.units:
                unit.acquire(self.weight_version, "exact")
            yield
            if write_back:
                for unit in self.units:
                    unit.write_back()
        finally:
            if write_back:
                self.weights_changed()
                self.drop_diff_references()
            else:
                self.release_all()

    def state_dict(self, prefix="", keep_vars=False, destination=None):
        """Full (gathered, exact) weights, cloned so they outlive the gather."""
        with self.gathered_parameters():
            sd = self.module.state_dict(prefix=prefix, keep_vars=False)
            out = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                   for k, v in sd.items()}
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        """Same as :meth:`state_dict` (full weights)."""
        return self.state_dict(prefix=prefix)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's model ``sharded_state_dict`` with every sharded parameter described
        by this rank's primary shard only (nothing gathered): what Megatron-LM's torch_dist
        save and load ask a model chunk for, as they ask megatron-core's DDP."""
        self._sharded_metadata = metadata
        return model_sharded_state(self, prefix, sharded_offsets, metadata)[0]

    def parameter_templates(self, metadata=None) -> dict:
        """Each sharded parameter's entry in the model's own ``sharded_state_dict`` (key and
        layout), for describing its optimizer state in the same coordinates."""
        return model_sharded_state(self, metadata=metadata)[1]

    def load_state_dict(self, state_dict, strict=True):
        """Load weights; they become the new primary shards (hpZ copies go stale).

        ``state_dict`` is either whole weights (:meth:`state_dict`'s form: gathered, written,
        re-sharded) or what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`
        (each parameter as the boxes of this rank's shard: copied into the primary shards, no
        gather). The per-rank state of the old weights goes (qgZ residuals, qwZ difference
        references); the checkpoint's comes back through :meth:`load_rank_state`, and if none
        does before the next step, that step says so once."""
        self._rank_state_loaded = False
        for unit in self.units:
            unit.load_qgz_residual_states(None)
        if is_sharded_load(state_dict):
            load_sharded(self, state_dict, self._sharded_metadata)
            self.start_param_sync(force_sync=True)
            self.drop_diff_references()
            return None
        with self.gathered_parameters(write_back=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    # -- per-rank state ---------------------------------------------------------------------
    def rank_state(self) -> dict:
        """What this rank of this chunk needs, besides weights and optimizer, to resume exactly
        (:mod:`.rank_state`: the step clock, qgZ residuals, qwZ difference references, with the
        layout it belongs to). Host copies; no collective."""
        return rank_state.collect(self)

    def load_rank_state(self, state: Optional[dict], iterations_done: int) -> None:
        """Take back :meth:`rank_state`'s ``state`` after loading the weights of a checkpoint of
        iteration ``iterations_done`` (``None``: none saved, or not usable: the clock resumes at
        ``iterations_done``, residuals start at zero, the first gathers are exact). Refuses a
        state of another layout, naming each difference. Collective over the DP group with
        ``qwz_diff_bits``."""
        rank_state.restore(self, state, iterations_done)
        self._rank_state_loaded = True

    def _note_missing_rank_state(self) -> None:
        """Weights were loaded and no per-rank state followed: say so once (on DP rank 0)."""
        self._rank_state_loaded = True
        cfg = self.zeropp
        if not (cfg.qgz or cfg.qwz_stochastic_rounding or cfg.qwz_diff_bits):
            return  # nothing of the layer depends on it
        if self.comm.dp_rank == 0 and self.clock.chunk_index == 0:
            print(f"> ZeRO++ note: weights loaded without the layer's per-rank state "
                  f"(load_rank_state): the step clock goes on at iteration "
                  f"{self.clock.iterations_begun + 1}, qgZ residuals start at zero, the first "
                  f"gathers are exact", flush=True)

    def _meter(self, what: str):
        return self.comm.qgz_error if what == "qgz" else self.comm.qwz_error

    def _measured_errors(self) -> List[str]:
        """The error diagnostics this iteration measures (``qgz_error_interval``,
        ``qwz_error_interval``)."""
        return [what for what, on in (("qgz", self.clock.measure_qgz_error),
                                      ("qwz", self.clock.measure_qwz_error)) if on]

    def _report_error(self, what: str) -> None:
        """The end of a measured iteration's gradient sync: diagnostic ``what`` over the DP
        group (one all-reduce, through the reduction lane; every DP rank gets here)."""
        report = self._meter(what).report([u.name for u in self.units], self.comm.dp_group)
        if report is not None:
            self._error_reports[what] = report
            self.error_measured(what, self.clock.iteration + 1, report)

    def error_measured(self, what: str, iteration: int, report: dict) -> None:
        """Called on every DP rank with each measured iteration's report of diagnostic
        ``what`` (``"qgz"``, ``"qwz"``; 1-based ``iteration``); nothing here: the loop reads
        :meth:`error_report`, a subclass may print it."""

    def error_report(self, what: str) -> Optional[dict]:
        """After a step measured by error diagnostic ``what`` (``"qgz"``: the qgZ reduction,
        ``"qwz"``: the weights the forward computed with): ``{"units": {unit name: relative
        error}, "total": relative error}`` over this DP group, once; ``None`` on other steps.
        No collective (the report was reduced at the step's gradient sync)."""
        return self._error_reports.pop(what, None)

    # -- reporting ------------------------------------------------------------------------
    def comm_counts(self, reset: bool = True) -> dict:
        """Bytes sent by this rank per phase (``forward``, ``backward``, ``grad``) since the last
        reset, as :class:`megatron_zeropp.comm.StepCounts`. Waits for queued CPU calls first
        (the next step's prefetch), so that their bytes at the call land in the same count as
        their modelled bytes."""
        drain()
        return {
            phase: (s.step() if reset else s.peek()) for phase, s in self.comm.stats.items()
        }

    def memory_bytes(self) -> dict:
        """Persistent bytes of this rank (primary / secondary weights, grads) and what is
        currently gathered."""
        out = {"primary": 0, "secondary": 0, "grad": 0, "gathered": 0}
        for unit in self.units:
            for k, v in unit.persistent_bytes().items():
                out[k] = out.get(k, 0) + v
            out["gathered"] += unit.gathered_bytes()
        return out
