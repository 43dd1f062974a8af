"""Micro-batches for one data-parallel rank, in Megatron-LM's sample order, resumable exactly.

Order (the same as Megatron-LM's default pretraining sampler, so a resumed Megatron-LM run sees
the same samples): starting at ``consumed_samples``, the dataset is read in index order in steps
of ``micro_batch_size * dp_size`` samples; DP rank ``r`` takes the ``r``-th ``micro_batch_size``
slice of each step. A global batch is ``global_batch_size / (micro_batch_size * dp_size)`` such
steps, so the DP ranks' samples of one global batch are disjoint and together are exactly the
``global_batch_size`` samples after ``consumed_samples``::

    consumed_samples = 8, mbs = 2, dp = 2, gbs = 8
    dataset index:   8  9 | 10 11 | 12 13 | 14 15 | 16 ...
    micro-batch:     rank0  rank1 | rank0   rank1 | (next global batch)
                     step 0       | step 1

Randomness lives in the dataset (megatron-core shuffles documents and samples with the seed),
so the batches depend only on the dataset, the sizes and ``consumed_samples``.
"""

from __future__ import annotations

from typing import Dict, Iterator

import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
"""The keys megatron-core's GPT forward step reads; other sample keys are dropped."""


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per rank per global batch; ValueError unless the sizes divide evenly."""
    if min(global_batch_size, micro_batch_size, dp_size) < 1:
        raise ValueError(
            f"batch sizes must be >= 1, got global_batch_size={global_batch_size}, "
            f"micro_batch_size={micro_batch_size}, dp_size={dp_size}"
        )
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size * "
            f"dp_size = {micro_batch_size} * {dp_size} = {per_step}"
        )
    return global_batch_size // per_step


def collate(samples) -> Dict[str, torch.Tensor]:
    """Stack samples' :data:`BATCH_KEYS` tensors along a new batch dimension 0."""
    return {
        key: torch.stack([sample[key] for sample in samples])
        for key in BATCH_KEYS
        if key in samples[0]
    }


def make_batch_iterator(
    dataset,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int = 0,
) -> Iterator[Dict[str, torch.Tensor]]:
    """Yield this DP rank's micro-batches, global batch after global batch (order: module doc).

    Args:
        dataset: indexable with ``len``, samples as dicts of tensors (e.g. a megatron-core
            ``GPTDataset`` from :func:`~megatron_zeropp.data.datasets.build_gpt_datasets`).
        global_batch_size: samples per optimizer step over all DP ranks.
        micro_batch_size: samples per forward/backward on one rank.
        dp_rank, dp_size: this rank's place in the data-parallel group.
        consumed_samples: samples all ranks consumed before (the training loop's counter: the
            number of completed steps times ``global_batch_size``). Resuming with the same value
            yields the same batches as the original run did from that point.

    Yields:
        ``{"tokens", "labels", "loss_mask", "position_ids": [mbs, s], "attention_mask":
        [mbs, 1, s, s]}`` (the last only if the dataset makes one); ``num_microbatches(...)``
        of them per global batch. Stops before a global batch the dataset cannot fill completely.
    """
    per_rank = num_microbatches(global_batch_size, micro_batch_size, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1} (dp_size={dp_size})")
    if not 0 <= consumed_samples <= len(dataset):
        raise ValueError(
            f"consumed_samples={consumed_samples} is outside 0..len(dataset)={len(dataset)}"
        )
    if consumed_samples % (micro_batch_size * dp_size):
        raise ValueError(
            f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size * dp_size "
            f"= {micro_batch_size * dp_size}; it must sit on a micro-step boundary"
        )
    return _micro_batches(
        dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, consumed_samples, per_rank
    )


def _micro_batches(dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, start, steps):
    step_size = micro_batch_size * dp_size
    while start + global_batch_size <= len(dataset):
        for step in range(steps):
            first = start + step * step_size + dp_rank * micro_batch_size
            yield collate([dataset[i] for i in range(first, first + micro_batch_size)])
        start += global_batch_size
