"""make_batch_iterator: Megatron sample order, disjoint DP shards, exact resume."""

import itertools

import pytest
import torch

from megatron_zeropp.data.batches import BATCH_KEYS, make_batch_iterator, num_microbatches

SEQ = 4


class IndexDataset:
    """Sample i holds the number i everywhere, so a batch says which samples it came from."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if not 0 <= i < self.size:
            raise IndexError(i)
        return {
            "tokens": torch.full((SEQ,), i),
            "labels": torch.full((SEQ,), i + 1),
            "loss_mask": torch.ones(SEQ),
            "attention_mask": torch.zeros(1, SEQ, SEQ, dtype=torch.bool),
            "position_ids": torch.arange(SEQ),
            "dataset_id": 0,
        }


def _sample_ids(batch):
    return batch["tokens"][:, 0].tolist()


def _global_batches(dataset, gbs, mbs, dp, consumed, count):
    """count global batches as {rank: [micro-batch sample ids, ...]}."""
    per_rank = num_microbatches(gbs, mbs, dp)
    iterators = [make_batch_iterator(dataset, gbs, mbs, r, dp, consumed) for r in range(dp)]
    return [
        {r: [_sample_ids(next(iterators[r])) for _ in range(per_rank)] for r in range(dp)}
        for _ in range(count)
    ]


def test_ranks_get_disjoint_samples_covering_each_global_batch():
    dataset = IndexDataset(100)
    gbs, mbs, dp = 12, 2, 3
    batches = _global_batches(dataset, gbs, mbs, dp, consumed=0, count=3)
    for step, batch in enumerate(batches):
        ids = [i for r in range(dp) for micro in batch[r] for i in micro]
        assert sorted(ids) == list(range(step * gbs, (step + 1) * gbs))
        assert len(set(ids)) == gbs
    # Megatron-LM's order: micro-step k, rank r reads samples start + k*mbs*dp + r*mbs + [0, mbs).
    assert batches[0] == {0: [[0, 1], [6, 7]], 1: [[2, 3], [8, 9]], 2: [[4, 5], [10, 11]]}


def test_resume_from_consumed_samples_reproduces_the_batches():
    dataset = IndexDataset(100)
    gbs, mbs, dp = 8, 2, 2
    uninterrupted = _global_batches(dataset, gbs, mbs, dp, consumed=0, count=5)
    resumed = _global_batches(dataset, gbs, mbs, dp, consumed=2 * gbs, count=3)
    assert resumed == uninterrupted[2:]
    assert resumed != uninterrupted[:3]


def test_batch_format():
    batch = next(make_batch_iterator(IndexDataset(10), 4, 2, 1, 2, 0))
    assert set(batch) == set(BATCH_KEYS)  # dataset_id is not part of the forward step's input
    assert batch["tokens"].shape == (2, SEQ)
    assert batch["attention_mask"].shape == (2, 1, SEQ, SEQ)
    assert _sample_ids(batch) == [2, 3]
    assert batch["labels"][:, 0].tolist() == [3, 4]


def test_stops_before_a_partial_global_batch():
    gbs, mbs, dp = 8, 2, 2
    per_rank = [list(make_batch_iterator(IndexDataset(21), gbs, mbs, r, dp)) for r in range(dp)]
    assert [len(batches) for batches in per_rank] == [4, 4]  # 2 global batches, 2 micro each
    assert max(i for batches in per_rank for b in batches for i in _sample_ids(b)) == 15
    assert list(make_batch_iterator(IndexDataset(21), gbs, mbs, 0, dp, consumed_samples=16)) == []


def test_bad_arguments_are_refused_up_front():
    dataset = IndexDataset(50)
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not a multiple .* = 2 \* 3 = 6"):
        make_batch_iterator(dataset, 10, 2, 0, 3)
    with pytest.raises(ValueError, match=r"dp_rank=3 is outside 0..2"):
        make_batch_iterator(dataset, 12, 2, 3, 3)
    with pytest.raises(ValueError, match="consumed_samples=51 is outside"):
        make_batch_iterator(dataset, 12, 2, 0, 3, consumed_samples=51)
    with pytest.raises(ValueError, match="consumed_samples=3 is not a multiple"):
        make_batch_iterator(dataset, 12, 2, 0, 3, consumed_samples=3)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        num_microbatches(8, 0, 1)
    # A valid call is accepted and yields.
    assert len(list(itertools.islice(make_batch_iterator(dataset, 12, 2, 0, 3), 2))) == 2
