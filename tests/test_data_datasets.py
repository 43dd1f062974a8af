"""build_gpt_datasets: blends, splits, samples drawn from the corpus, caching with and without a
process group."""

import glob
import json
import os
import random

import pytest
import torch

from megatron_zeropp.data.batches import make_batch_iterator
from megatron_zeropp.data.datasets import (
    DataConfig,
    build_gpt_datasets,
    parse_data_path,
    parse_split,
    split_sample_counts,
)
from megatron_zeropp.data.preprocess import PreprocessConfig, preprocess
from megatron_zeropp.data.tokenizers import build_tokenizer
from megatron_zeropp.simulated_nodes import run_distributed

VOCAB = 100_000  # NullTokenizer ids (documents use ids below 100000 - 1000)
# megatron-core 0.16.1 and 0.17.1 append the EOD id (100000), 0.18.2 and 0.19.2 take the last one
# (99999): tests/test_data_tokenizers.py::test_null_tokenizer.
EOD = build_tokenizer("NullTokenizer", vocab_size=VOCAB).eod
SEQ = 32


def _write_corpus(directory, name, first_doc, num_docs, seed):
    """Document d holds ids d*1000, d*1000+1, ...: any token says which document it came from."""
    rng = random.Random(seed)
    path = os.path.join(directory, f"{name}.jsonl")
    with open(path, "w") as f:
        for d in range(first_doc, first_doc + num_docs):
            length = rng.randint(1, 120)
            f.write(json.dumps({"text": " ".join(str(d * 1000 + j) for j in range(length))}))
            f.write("\n")
    result = preprocess(
        PreprocessConfig(
            input=path, output_prefix=os.path.join(directory, name),
            tokenizer_type="NullTokenizer", vocab_size=VOCAB, append_eod=True,
        )
    )
    return result.prefixes["text"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("corpora"))
    return {
        "a": _write_corpus(directory, "a", first_doc=0, num_docs=60, seed=1),
        "b": _write_corpus(directory, "b", first_doc=60, num_docs=40, seed=2),
        "dir": directory,
    }


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("NullTokenizer", vocab_size=VOCAB)


def _check_sample_comes_from_the_corpus(sample, documents):
    tokens, labels = sample["tokens"], sample["labels"]
    assert tokens.shape == labels.shape == (SEQ,)
    assert torch.equal(labels[:-1], tokens[1:])  # one stream of SEQ + 1 tokens, shifted
    stream = tokens.tolist() + [labels[-1].item()]
    for a, b in zip(stream, stream[1:]):
        if a == EOD:
            assert b != EOD and b % 1000 == 0 and b // 1000 in documents  # a document's start
        elif b == EOD:
            assert a % 1000 == documents[a // 1000] - 1  # a document's last token
        else:
            assert b == a + 1 and a // 1000 == b // 1000  # inside one document
    assert torch.equal(sample["position_ids"], torch.arange(SEQ))
    assert torch.equal(sample["loss_mask"], torch.ones(SEQ))
    assert torch.equal(sample["attention_mask"][0], ~torch.ones(SEQ, SEQ).tril().bool())


def _doc_lengths(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    first_ids = [int(dataset[i][0]) // 1000 for i in range(len(dataset))]
    lengths = [int(n) - 1 for n in dataset.sequence_lengths]  # without EOD
    del dataset
    return dict(zip(first_ids, lengths))


def test_gpt_dataset_over_preprocessed_output(corpora, tokenizer, tmp_path):
    config = DataConfig(
        seq_length=SEQ, seed=7, data_path=(corpora["a"],), split="80,20,0",
        data_cache_path=str(tmp_path / "cache"),
    )
    train, valid, test = build_gpt_datasets(config, tokenizer, (300, 40, 0))
    assert test is None  # a 0 split weight builds nothing
    assert len(train) >= 300 and len(valid) >= 40
    lengths = _doc_lengths(corpora["a"])
    train_docs = {d: n for d, n in lengths.items() if d < 48}  # split 80,20: documents 0..47
    valid_docs = {d: n for d, n in lengths.items() if d >= 48}
    for i in range(0, 300, 7):
        _check_sample_comes_from_the_corpus(train[i], train_docs)
    for i in range(40):
        _check_sample_comes_from_the_corpus(valid[i], valid_docs)
    assert glob.glob(str(tmp_path / "cache" / "*GPTDataset-train-shuffle_index.npy"))

    # Same seed -> same samples (now from the cache); another seed -> another order.
    again, _, _ = build_gpt_datasets(config, tokenizer, (300, 40, 0))
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(300))
    other_seed = DataConfig(**{**config.__dict__, "seed": 8})
    other, _, _ = build_gpt_datasets(other_seed, tokenizer, (300, 40, 0))
    assert not all(torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(300))


def test_the_corpus_check_catches_foreign_samples(corpora, tokenizer):
    config = DataConfig(seq_length=SEQ, data_path=(corpora["a"],), split="1")
    train, _, _ = build_gpt_datasets(config, tokenizer, (5, 0, 0))
    lengths = _doc_lengths(corpora["a"])
    _check_sample_comes_from_the_corpus(train[0], lengths)
    swapped = dict(train[0])
    swapped["tokens"] = train[0]["tokens"].flip(0)
    with pytest.raises(AssertionError):
        _check_sample_comes_from_the_corpus(swapped, lengths)
    skipped = {k: v.clone() for k, v in train[0].items()}
    skipped["tokens"][5:] += 1  # a token missing from the stream
    skipped["labels"][4:] += 1
    with pytest.raises(AssertionError):
        _check_sample_comes_from_the_corpus(skipped, lengths)


def test_weighted_blend_draws_in_proportion(corpora, tokenizer):
    config = DataConfig(
        seq_length=SEQ, data_path=("0.25", corpora["a"], "0.75", corpora["b"]), split="1"
    )
    with pytest.raises(ValueError, match="weighted blend needs a sample count for the valid"):
        build_gpt_datasets(config, tokenizer, (400, None, None))
    train, valid, test = build_gpt_datasets(config, tokenizer, (400, 0, 0))
    assert valid is None and test is None
    assert len(train) == 400
    from_b = 0
    for i in range(len(train)):
        sample = train[i]
        first = next(t for t in sample["tokens"].tolist() if t != EOD)
        assert (first // 1000 >= 60) == (int(sample["dataset_id"]) == 1)  # b holds docs 60..99
        from_b += int(sample["dataset_id"])
    assert from_b == 300


def test_per_split_paths_and_mock_data(corpora, tokenizer):
    config = DataConfig(
        seq_length=SEQ, train_data_path=(corpora["a"],), valid_data_path=(corpora["b"],)
    )
    train, valid, test = build_gpt_datasets(config, tokenizer, (50, 20, None))
    assert test is None
    _check_sample_comes_from_the_corpus(valid[0], _doc_lengths(corpora["b"]))
    _check_sample_comes_from_the_corpus(train[0], _doc_lengths(corpora["a"]))

    train, valid, test = build_gpt_datasets(
        DataConfig(seq_length=SEQ, mock_data=True), tokenizer, (10, 10, 10)
    )
    assert train[0]["tokens"].shape == (SEQ,)
    assert int(train[0]["tokens"].max()) <= EOD


def test_parse_data_path():
    assert parse_data_path("/d/a_text_document") == (["/d/a_text_document"], None)
    assert parse_data_path(["/a", "/b"]) == (["/a", "/b"], None)
    assert parse_data_path("0.3 /a 0.7 /b") == (["/a", "/b"], [0.3, 0.7])
    assert parse_data_path(["1", "/a", "3e0", "/b"]) == (["/a", "/b"], [1.0, 3.0])
    for bad in ("0.3 /a /b", "/a 0.3", "0.3 /a 0.7", "0.3 0.7 /a /b"):
        with pytest.raises(ValueError, match="mixes weights and prefixes"):
            parse_data_path(bad)
    with pytest.raises(ValueError, match=r"got \[-1.0, 2.0\]"):
        parse_data_path("-1 /a 2 /b")
    with pytest.raises(ValueError, match="empty"):
        parse_data_path("  ")


def test_config_and_split_validation(corpora, tokenizer):
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001]
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("", "a,b", "1,-1", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="split must be"):
            parse_split(bad)
    with pytest.raises(ValueError, match="exactly one of"):
        DataConfig(seq_length=8)
    with pytest.raises(ValueError, match="exactly one of"):
        DataConfig(seq_length=8, mock_data=True, data_path=("/a",))
    with pytest.raises(ValueError, match="seq_length must be >= 1, got 0"):
        DataConfig(seq_length=0, mock_data=True)
    with pytest.raises(ValueError, match="missing"):
        build_gpt_datasets(DataConfig(seq_length=8, data_path=(corpora["a"] + ".bin",)),
                           tokenizer, (1, 1, 1))
    assert split_sample_counts(100, 16, 25, 2) == (1600, 5 * 2 * 16, 32)


def test_a_split_without_documents_is_refused_instead_of_hanging(corpora, tokenizer):
    # 969,30,1 of 40 documents leaves the test range empty: megatron-core would loop forever.
    config = DataConfig(seq_length=SEQ, data_path=(corpora["b"],), split="969,30,1")
    with pytest.raises(ValueError, match=r"test split of .* is documents \[40, 40\) of 40"):
        build_gpt_datasets(config, tokenizer, (10, 10, 1))
    # The same data with a test weight of 0 builds.
    config = DataConfig(seq_length=SEQ, data_path=(corpora["b"],), split="969,30,0")
    train, valid, test = build_gpt_datasets(config, tokenizer, (10, 10, 1))
    assert test is None and len(valid) >= 10


def test_a_split_of_only_empty_documents_is_refused(tmp_path, tokenizer):
    # tools/preprocess_data.py never writes empty documents; other tools may.
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "holes")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for length in (50, 0, 60, 0, 0):
        builder.add_document(numpy.arange(length, dtype=numpy.int32) + 1, [length])
    builder.finalize(prefix + ".idx")
    # Documents 3 and 4 (the valid split of 60,40) are both empty: megatron-core would hang.
    config = DataConfig(seq_length=8, data_path=(prefix,), split="60,40", data_cache_path=None)
    with pytest.raises(ValueError, match=r"valid split .* is documents \[3, 5\) of 5 and holds no"):
        build_gpt_datasets(config, tokenizer, (10, 2, 0))
    # Empty documents next to non-empty ones are fine for megatron-core.
    config = DataConfig(seq_length=8, data_path=(prefix,), split="1")
    train, _, _ = build_gpt_datasets(config, tokenizer, (10, 0, 0))
    assert len(train) >= 10


def test_cache_with_a_blend_needs_a_process_group(corpora, tokenizer, tmp_path):
    config = DataConfig(
        seq_length=SEQ, data_path=("1", corpora["a"], "1", corpora["b"]), split="1",
        data_cache_path=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        build_gpt_datasets(config, tokenizer, (10, 0, 0))
    # One weighted prefix is a BlendedDataset too; unweighted per-split single prefixes are not.
    one_weighted = DataConfig(**{**config.__dict__, "data_path": ("1", corpora["a"])})
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        build_gpt_datasets(one_weighted, tokenizer, (10, 0, 0))
    per_split = DataConfig(
        seq_length=SEQ, train_data_path=(corpora["a"],), valid_data_path=(corpora["b"],),
        data_cache_path=str(tmp_path / "cache"),
    )
    train, valid, _ = build_gpt_datasets(per_split, tokenizer, (10, 5, None))
    assert len(train) >= 10 and len(valid) >= 5


def _build_on_ranks(ctx, prefix_a, prefix_b, cache_dir):
    """Every rank builds with a shared cache (rank 0 first); returns this rank's micro-batches."""
    config = DataConfig(
        seq_length=SEQ, data_path=("0.5", prefix_a, "0.5", prefix_b), split="1",
        data_cache_path=cache_dir,
    )
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    train, _, _ = build_gpt_datasets(config, tokenizer, (64, 0, 0))
    batches = make_batch_iterator(train, 16, 4, ctx.rank, ctx.world_size, consumed_samples=16)
    return [next(batches)["tokens"] for _ in range(2)]


def test_distributed_build_with_cache_matches_an_in_memory_build(corpora, tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    per_rank = run_distributed(
        _build_on_ranks, nodes=1, ranks_per_node=2, args=(corpora["a"], corpora["b"], cache)
    )
    assert glob.glob(os.path.join(cache, "*BlendedDataset-train-dataset_index.npy"))
    config = DataConfig(
        seq_length=SEQ, data_path=("0.5", corpora["a"], "0.5", corpora["b"]), split="1"
    )
    train, _, _ = build_gpt_datasets(config, tokenizer, (64, 0, 0))
    for rank in range(2):
        expected = [
            torch.stack([train[i]["tokens"] for i in range(first, first + 4)])
            for first in (16 + 4 * rank, 16 + 8 + 4 * rank)
        ]
        assert all(torch.equal(a, b) for a, b in zip(per_rank[rank], expected))
    assert not torch.equal(per_rank[0][0], per_rank[1][0])
