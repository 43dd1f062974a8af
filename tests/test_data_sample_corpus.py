"""The embedded sample corpus and its cached corpus -> tokenizer -> .bin/.idx pipeline."""

import json
import os
import shutil

import pytest
import torch

from megatron_zeropp.data import sample_corpus
from megatron_zeropp.data.batches import make_batch_iterator
from megatron_zeropp.data.datasets import DataConfig, build_gpt_datasets
from megatron_zeropp.data.preprocess import read_documents
from megatron_zeropp.data.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("sample"))
    return work, sample_corpus.prepare_sample_data(work)


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_corpus_is_a_few_mb_of_distinct_documents_with_a_disjoint_held_out_split(prepared):
    work, data = prepared
    train = _read_jsonl(os.path.join(work, "sample_corpus_train.jsonl"))
    valid = _read_jsonl(os.path.join(work, "sample_corpus_valid.jsonl"))
    assert (len(train), len(valid)) == (data.train_documents, data.valid_documents)
    ids = [doc["id"] for doc in train + valid]
    assert len(set(ids)) == len(ids)
    assert all(doc["text"].strip() for doc in train + valid)
    size = sum(len(doc["text"]) for doc in train + valid)
    assert 1_500_000 < size < 6_000_000
    assert len(train) > 1000
    # ~3 % held out, a mix of language-reference topics and stdlib modules.
    assert 0.015 < len(valid) / len(ids) < 0.05
    assert any(i.startswith("pydoc-topic:") for i in ids)
    assert any(i.startswith("stdlib:") for i in ids)
    topics = {doc["id"]: doc["text"] for doc in train + valid}
    from pydoc_data.topics import topics as reference

    assert topics["pydoc-topic:assert"] == reference["assert"].strip()


def test_module_documents_split_per_class():
    source = b'''"""Module doc."""
def top(a, b=1):
    """Top-level function."""
class Thing(Base):
    """A thing."""
    def method(self):
        """Does it."""
        def inner():
            """Not collected."""
class Undocumented:
    x = 1
'''
    documents = sample_corpus._module_documents("pkg.mod", source)
    assert documents == [
        ("stdlib:pkg.mod", "Module pkg.mod\n\nModule doc.\n\ndef top(a, b=1)\nTop-level function."),
        (
            "stdlib:pkg.mod.Thing",
            "class pkg.mod.Thing(Base)\nA thing.\n\ndef pkg.mod.Thing.method(self)\nDoes it.",
        ),
    ]
    assert sample_corpus._module_documents("empty", b"x = 1\n") == []


def test_prepared_data_round_trips_and_is_cached(prepared):
    work, data = prepared
    tokenizer = build_tokenizer("SentencePieceTokenizer", data.tokenizer_model)
    assert tokenizer.vocab_size == data.vocab_size == 4096
    valid_docs = _read_jsonl(os.path.join(work, "sample_corpus_valid.jsonl"))
    written = read_documents(data.valid_data_prefix)
    assert len(written) == len(valid_docs)
    for doc, ids in zip(valid_docs[:10], written):
        assert ids.tolist() == tokenizer.tokenize(doc["text"]) + [tokenizer.eod]
        assert tokenizer.detokenize(ids[:-1].tolist()) == doc["text"]
    assert data.valid_tokens == sum(len(ids) for ids in written)

    mtime = os.path.getmtime(data.train_data_prefix + ".bin")
    assert sample_corpus.prepare_sample_data(work) == data
    assert os.path.getmtime(data.train_data_prefix + ".bin") == mtime  # not rebuilt


def test_other_arguments_rebuild(prepared, monkeypatch, tmp_path):
    # A copy: the fake build below rewrites the manifest, which must not touch the shared one.
    work = shutil.copytree(prepared[0], str(tmp_path / "copy"))
    data = sample_corpus._read_manifest(
        os.path.join(work, "sample_data.json"), sample_corpus._cache_key(4096, 30)
    )
    assert data is not None
    calls = []
    monkeypatch.setattr(sample_corpus, "_build", lambda *args: calls.append(args) or data)
    assert sample_corpus.prepare_sample_data(work) == data
    assert calls == []  # cache hit
    sample_corpus.prepare_sample_data(work, vocab_size=2048)
    assert calls == [(os.path.abspath(work), 2048, 30, "docs", 80_000_000, 1)]


def test_sample_data_feeds_a_gpt_dataset(prepared):
    _, data = prepared
    tokenizer = build_tokenizer("SentencePieceTokenizer", data.tokenizer_model)
    config = DataConfig(
        seq_length=128,
        train_data_path=(data.train_data_prefix,),
        valid_data_path=(data.valid_data_prefix,),
    )
    train, valid, test = build_gpt_datasets(config, tokenizer, (64, 16, None))
    assert test is None
    batch = next(make_batch_iterator(train, 16, 4, dp_rank=1, dp_size=2))
    assert batch["tokens"].shape == (4, 128)
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert int(batch["tokens"].max()) < tokenizer.vocab_size
    assert "(" in tokenizer.detokenize(batch["tokens"][0].tolist())
    assert len(valid) >= 16


def test_corpus_is_deterministic(prepared, tmp_path):
    work, _ = prepared
    train, valid, _, _ = sample_corpus.write_sample_corpus(str(tmp_path))
    for mine in (train, valid):
        with open(mine, "rb") as a, open(os.path.join(work, os.path.basename(mine)), "rb") as b:
            assert a.read() == b.read()


def test_tool_prints_the_training_flags(prepared, capsys):
    import importlib.util

    work, data = prepared
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "build_sample_corpus.py")
    spec = importlib.util.spec_from_file_location("build_sample_corpus_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--output-dir", work, "--prepare"]) == 0  # cached: returns at once
    out = capsys.readouterr().out
    assert f"--tokenizer-model {data.tokenizer_model}" in out
    assert f"--train-data-path {data.train_data_prefix}" in out
    assert tool.main(["--output-dir", work, "--valid-per-mille", "0"]) == 2
    assert "valid_per_mille must be in 1..999, got 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.long
def test_source_corpus_is_capped_deterministic_and_distinct():
    cap = 300_000
    docs = list(sample_corpus.iter_source_documents(cap))
    assert docs == list(sample_corpus.iter_source_documents(cap))
    sizes = [len(text.encode("utf-8")) for _, text in docs]
    assert len(docs) > 5 and sum(sizes) <= cap
    assert len({doc_id for doc_id, _ in docs}) == len(docs)
    assert len({text for _, text in docs}) == len(docs)
    assert all(doc_id.startswith("source:") and doc_id.endswith(".py") for doc_id, _ in docs)
    with pytest.raises(ValueError, match="got 0"):
        next(sample_corpus.iter_source_documents(0))
    with pytest.raises(ValueError, match="'nope'"):
        sample_corpus.write_sample_corpus("/tmp/unused", corpus="nope")
