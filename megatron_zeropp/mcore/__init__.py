"""The one place that touches megatron-core's private API, and every difference between the
megatron-core versions this project supports (:data:`version.SUPPORTED`: 0.16.1, 0.17.1, 0.18.2
and 0.19.2).

Nothing outside this package imports an underscore name of megatron-core or branches on its
version. Each contact is one function, with the versions it was checked against (all four,
0.16.1 0.17.1 0.18.2 0.19.2, for every row):

module            contact                                                              checked
================  ===================================================================  ==========
buffers           ``_BaseDataParallel`` (the layer's base class); ``_ParamAndGradBuffer``  0.16.1,
                  per unit (0.19: the layout comes from ``DistributedOptimizer.        0.19.1
                  compute_full_param_layout``, 0.16.1 computes it inside the buffer);
                  ``_ParamAndGradBucket`` over existing tensors (0.19: two more
                  arguments)
optimizer         ``DistributedOptimizer`` subclass over the layer's shard map:        0.16.1,
                  ``_build_model_and_main_param_groups`` (shard attributes: 0.19 adds  0.19.1
                  GTP and optimizer metadata), ``_copy_main_params_to_model_params``,
                  ``_copy_model_grads_to_main_grads``; ``_get_model_param_range_map``;
                  the name ``megatron.core.optimizer.DistributedOptimizer`` rebound
                  while ``get_megatron_optimizer`` builds it
checkpoint        Adam ``step`` kept per parameter on load                             0.16.1,
                  (``_set_main_param_and_optimizer_states``), dummy states before a    0.19.1
                  load (``_init_optimizer_states_with_dummy_values``); the torch_dist
                  writer's results queue (``filesystem_async._results_queue``)
tokenizers        ``megatron.core.tokenizers`` (0.19: NullTokenizer needs no path)     0.16.1,
                                                                                       0.19.1
cpu_patches       megatron-core on CPU/gloo (only without CUDA)                        0.16.1,
                                                                                       0.19.1
grad_norm         device-side gradient norm in place of the no-apex fallback           0.16.1,
                                                                                       0.19.1
rerun             the rerun state machine's state, read without creating one (the      0.16.1,
                  layer's step clock: an iteration re-run in place is the same one)    0.19.1
================  ===================================================================  ==========
=======
==============  ======================================================================
module          contact (and where the versions differ)
==============  ======================================================================
buffers         ``_BaseDataParallel`` (the layer's base class); ``_ParamAndGradBuffer`` per
                unit (0.17.1: the parameters with their names; 0.18.2 and 0.19.2: the layout
                from ``DistributedOptimizer.compute_full_param_layout``, 0.16.1 and 0.17.1
                compute it inside the buffer); ``_ParamAndGradBucket`` over existing tensors
                (0.17.1 on: two more arguments); the index map 0.17.1's optimizer reads
                through ``get_unpacked_index_map``; DDP's ``full_param_layout`` (0.18.2 on)
optimizer       ``DistributedOptimizer`` subclass over the layer's shard map:
                ``_build_model_and_main_param_groups`` (shard attributes: ``shared`` up to
                0.18.2, GTP and optimizer metadata in 0.19.2),
                ``_copy_main_params_to_model_params``, ``_copy_model_grads_to_main_grads``,
                ``start_param_sync_for_bucket_group_subset`` (0.18.2 on);
                ``_get_model_param_range_map``; the name
                ``megatron.core.optimizer.DistributedOptimizer`` rebound while
                ``get_megatron_optimizer`` builds it
checkpoint      Adam ``step`` kept per parameter on load
                (``_set_main_param_and_optimizer_states``), dummy states before a load
                (``_init_optimizer_states_with_dummy_values``); ``common.pt`` beside 0.19.2's
                ``common_state`` object
tokenizers      ``megatron.core.tokenizers`` (0.17.1 on: ``null-text``; Megatron-LM builds
                its legacy tokenizer only in core_v0.16.1)
cpu_patches     megatron-core on CPU/gloo (only without CUDA)
grad_norm       device-side gradient norm in place of the no-apex fallback
dp_reshardable  Megatron-LM's ``dp_reshardable`` optimizer layout, read into model space
rerun           the rerun state machine's state, read without creating one (the layer's step
                clock: an iteration re-run in place is the same one)
==============  ======================================================================

Importing this package imports nothing of megatron-core; its submodules do.
"""
