"""Checkpoints in Megatron-LM's layouts: ``torch_dist`` (megatron-core ``dist_checkpointing``,
:mod:`.dist`) and the legacy per-rank ``torch`` format (:mod:`.legacy`), with the checks that make
a resume safe (:mod:`.checks`). The calls are Megatron-LM's: the ZeRO layer and its optimizer
answer ``sharded_state_dict`` / ``load_state_dict`` with their own shards, as megatron-core's DDP
and DistributedOptimizer do with theirs.

Submodules are imported on use: most of them import megatron-core, which takes seconds.
"""
