"""Checkpoints in Megatron-LM's layouts: ``torch_dist`` (megatron-core ``dist_checkpointing``,
:mod:`.dist`) and the legacy per-rank ``torch`` format (:mod:`.legacy`), with the checks that make
a resume safe (:mod:`.checks`) and the ZeRO layer's sharded state (:mod:`.sharded_state`).

Submodules are imported on use: most of them import megatron-core, which takes seconds.
"""
