"""Workarounds for megatron-core's DistributedOptimizer checkpoint loading with torch's Adam.

megatron-core expects apex's or Transformer Engine's fused Adam, which keeps one ``step`` per
param group; torch's Adam (the fallback here without apex/TE) keeps a ``step`` tensor per
parameter. Every supported version mishandles that on load in the same two ways, fixed here.
"""

from __future__ import annotations

import contextlib

import torch

from .version import at_least


def init_dummy_optimizer_states(opt) -> None:
    """Allocate ``opt``'s Adam state before a load: megatron-core reads the Adam step from
    existing state first (torch Adam); the dummy values are overwritten by the load.
    Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2 (``_init_optimizer_states_with_dummy_values``)."""
    opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def keeping_adam_steps(optimizers):
    """Keep the Adam ``step`` that megatron-core just set from the checkpoint's param groups
    when it then copies the per-parameter tensors (``optimizers``: the DistributedOptimizers).
    Those tensors hold no step (``fully_reshardable``: ``KeyError: 'step'``) or the pre-load
    dummy state's (``dp_reshardable``: the step silently reverts to 1, and Adam's bias
    correction with it). Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2
    (``_set_main_param_and_optimizer_states``)."""
    patched = []
    for opt in optimizers:
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


def unshare_adam_steps(optimizers) -> None:
    """Give every parameter its own Adam ``step`` tensor after a load: megatron-core's
    ``load_state_dict`` gives them all the same one, and torch's Adam increments each in place,
    so a shared one advances once per parameter per iteration and the bias correction goes wrong
    after a resume. Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    for opt in optimizers:
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def write_common_file(directory: str) -> None:
    """Also store a torch_dist checkpoint's common (non-sharded) state in ``common.pt`` (rank 0
    writes; call after ``dist_checkpointing.save``).

    megatron-core 0.19.2 keeps the common state as a ``common_state`` object inside the DCP
    files and writes no ``common.pt``; 0.16.1, 0.17.1 and 0.18.2 (and their Megatron-LM
    releases) read only ``common.pt``, so without it a checkpoint written under 0.19.2 does not
    load under them. 0.19.2 reads ``common.pt`` first when it exists, so every version then
    loads the same common state. A no-op on 0.16.1, 0.17.1 and 0.18.2, which write the file
    themselves. Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2.
    """
    import os

    import torch.distributed as dist

    if not at_least(0, 19) or dist.get_rank() != 0:
        return
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(directory)
    path = os.path.join(directory, "common.pt")
    torch.save(common, path + ".tmp")
    os.replace(path + ".tmp", path)


COMMON_STATE_KEY = "common_state"
"""The ShardedObject in which megatron-core 0.17+ stores a torch_dist checkpoint's common state
(its DCP key ``common_state/shard_0_1``), instead of a ``common.pt``. Checked: 0.19.1, 0.19.2."""


def reads_common_state_object() -> bool:
    """Whether the installed megatron-core loads a torch_dist checkpoint whose common state is
    the :data:`COMMON_STATE_KEY` object alone (no ``common.pt``), as Megatron-LM core_v0.19.0
    on megatron-core 0.19 writes every checkpoint. Checked: 0.16.1 (no: its ``load_common``
    reads only ``common.pt``), 0.19.2 (yes: ``load_common_state_dict`` reads either); 0.17.1 and
    0.18.2 write ``common.pt`` and are not relied on to read the object."""
    return at_least(0, 19)


def installed_text() -> str:
    """The installed megatron-core's version, as a user reads it (``0.16.1``)."""
    from .version import mcore_version

    return ".".join(map(str, mcore_version()))


def is_common(key: str) -> bool:
    """Whether a stored ShardedObject is megatron-core's own copy of the common state (0.19.2
    keeps it in the DCP files as ``common_state``; it is written anew by every save). Checked:
    0.16.1, 0.17.1, 0.18.2 (none), 0.19.2."""
    return at_least(0, 19) and key == COMMON_STATE_KEY


def use_in_process_write_results() -> None:
    """Give megatron-core's torch_dist writer an in-process results queue (call before each
    synchronous ``dist_checkpointing.save``).

    By default it makes a ``multiprocessing`` manager (a spawned server process, and with it the
    resource tracker) for a queue that only an *asynchronous* save needs. Every save here is
    synchronous: the write runs in this process, which both puts and gets the results. The
    manager, started at the first save, outlived a rank that ended with ``os._exit`` and held the
    job's stdout open (``torchrun ... | tee log`` never returned). Checked: 0.16.1, 0.17.1,
    0.18.2, 0.19.2 (``filesystem_async._results_queue``, the same module-level variable in all).
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def stop_write_results_manager() -> None:
    """Shut down the ``multiprocessing`` manager of megatron-core's torch_dist writer, if one
    was started (another caller of its writer than :func:`use_in_process_write_results`): its
    server process would outlive a rank that ends with ``os._exit``. The module is not imported
    when it was not (a failing rank would spend seconds on it for nothing). Checked: 0.16.1,
    0.19.1 (``filesystem_async._results_queue``)."""
    import sys

    filesystem_async = sys.modules.get(
        "megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is None:
        return
    try:
        manager.shutdown()
    except Exception:  # noqa: BLE001 -- already gone; the caller terminates what is left
        pass
    filesystem_async._results_queue = None


def fully_reshardable_params(opt) -> list:
    """The model parameters of a megatron-core DistributedOptimizer in the order of its
    ``fully_reshardable`` ``param_state`` entries (index i is the i-th): buffer by buffer, each
    buffer's ``param_index_map`` order. Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2
    (``sharded_param_state_fully_reshardable``)."""
    return [p for buffer in opt.buffers for p in buffer.param_index_map]
