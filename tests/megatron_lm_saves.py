"""torch_dist checkpoints written as Megatron-LM's ``save_checkpoint`` writes them, driven through
megatron-core (for tests where Megatron-LM's own loop does not run): its sharded-state metadata
and its iteration directory, ``latest_checkpointed_iteration.txt`` and RNG entry."""

import os


def metadata(sharding_type):
    """Megatron-LM's ``_build_sharded_state_dict_metadata`` (``sharding_type`` None: without
    --use-distributed-optimizer)."""
    from megatron.core import parallel_state as ps

    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if sharding_type is not None:
        meta["distrib_optim_sharding_type"] = sharding_type
    if sharding_type == "fully_reshardable":
        meta["distrib_optim_fully_reshardable_mem_efficient"] = False
    return meta


def write(root, iteration, state, meta):
    """Save ``state`` (model and optimizer entries filled in; the RNG entry is added here) as
    ``root``/iter_NNNNNNN and point ``latest`` at it. Collective."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state["rng_state"] = ShardedObject(
        "rng_state", [{"torch_rng_state": torch.get_rng_state()}],
        (ps.get_pipeline_model_parallel_world_size(), 1),
        (ps.get_pipeline_model_parallel_rank(), 0),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    directory = os.path.join(root, f"iter_{iteration:07d}")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(state, directory, content_metadata={
        k: v for k, v in meta.items() if k != "dp_cp_group"})
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
