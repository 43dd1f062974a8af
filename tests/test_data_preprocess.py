"""tools/preprocess_data.py: jsonl -> .bin/.idx round trip, EOD, empty documents, workers, and
byte-identity with files written by Megatron-LM's own tools/preprocess_data.py."""

import importlib.util
import json
import os

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_zeropp.data.preprocess import PreprocessConfig, preprocess, read_documents
from megatron_zeropp.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from megatron_zeropp.data.tokenizers import build_tokenizer

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "preprocess_data.py")


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documents():
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)]
    # Short and long documents, with empty ones interleaved at known places.
    docs = []
    for i, text in enumerate(texts):
        docs.append(text[: 200 + 37 * i])
        if i % 10 == 3:
            docs.append("")
        if i % 10 == 7:
            docs.append(" \n\t ")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    docs = _documents()
    path = root / "corpus.jsonl"
    with open(path, "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"text": text, "title": f"document number {i}"}) + "\n")
            if i == 5:
                f.write("\n")  # a blank line is no document at all
    model = train_sentencepiece(docs, str(root / "tok"), TokenizerTrainingConfig(vocab_size=800))
    return root, str(path), docs, model


def _run(corpus, name, workers, keys=("text",), append_eod=True):
    root, path, _, model = corpus
    return preprocess(
        PreprocessConfig(
            input=path,
            output_prefix=str(root / name),
            tokenizer_type="SentencePieceTokenizer",
            tokenizer_model=model,
            json_keys=keys,
            append_eod=append_eod,
            workers=workers,
            log_interval=20,
        )
    )


def test_round_trip_with_eod_and_empty_documents_kept(corpus, capsys):
    _, _, docs, model = corpus
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    result = _run(corpus, "one", workers=1)
    with_tokens = [d for d in docs if tokenizer.tokenize(d)]
    # The 8 empty strings; the 8 whitespace-only ones tokenize to ids and are kept as such.
    assert result.empty == {"text": len(docs) - len(with_tokens)} == {"text": 8}
    assert result.documents == {"text": len(docs)}  # every line is a document, as Megatron-LM
    assert result.dtype == "uint16"
    prefix = result.prefixes["text"]
    assert prefix.endswith("one_text_document")

    written = read_documents(prefix)  # sequences: the empty documents have none
    assert len(written) == len(with_tokens)
    for text, ids in zip(with_tokens, written):
        assert ids.tolist() == tokenizer.tokenize(text) + [tokenizer.eod]
    assert result.tokens["text"] == sum(len(ids) for ids in written)
    dataset = IndexedDataset(prefix)
    assert dataset.index.dtype == numpy.uint16
    # Document i starts at sequence document_indices[i]; an empty document repeats the index.
    starts = dataset.document_indices.tolist()
    assert len(starts) == len(docs) + 1
    assert [b - a for a, b in zip(starts, starts[1:])] == [int(bool(tokenizer.tokenize(d)))
                                                            for d in docs]
    del dataset
    err = capsys.readouterr().err
    assert "Processed 20 documents" in err
    assert "8 of them empty" in err


def test_without_eod(corpus):
    _, _, docs, model = corpus
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    written = read_documents(_run(corpus, "noeod", workers=1, append_eod=False).prefixes["text"])
    assert written[0].tolist() == tokenizer.tokenize(docs[0])
    assert all(tokenizer.eod not in ids.tolist() for ids in written)


def test_workers_give_identical_files_and_one_pair_per_key(corpus):
    one = _run(corpus, "w1", workers=1, keys=("text", "title"))
    three = _run(corpus, "w3", workers=3, keys=("text", "title"))
    assert one.documents == three.documents
    assert three.empty == {"text": 8, "title": 0}
    for key in ("text", "title"):
        for suffix in (".bin", ".idx"):
            with open(one.prefixes[key] + suffix, "rb") as a:
                with open(three.prefixes[key] + suffix, "rb") as b:
                    assert a.read() == b.read(), (key, suffix)
    # The two keys' files really differ (the equality above is not vacuous).
    with open(one.prefixes["text"] + ".bin", "rb") as a:
        with open(one.prefixes["title"] + ".bin", "rb") as b:
            assert a.read() != b.read()
    leftovers = os.listdir(os.path.dirname(one.prefixes["text"]))
    assert not any(name.endswith(".tmp") for name in leftovers)


def test_int32_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(
        json.dumps({"text": "1 65000 69999"}) + "\n" + json.dumps({"text": "7"}) + "\n"
    )
    result = preprocess(
        PreprocessConfig(
            input=str(path), output_prefix=str(tmp_path / "big"), tokenizer_type="NullTokenizer",
            vocab_size=70000, append_eod=True,
        )
    )
    assert result.dtype == "int32"
    written = read_documents(result.prefixes["text"])
    eod = _null_eod(70000)  # 70000 up to megatron-core 0.17.1, 69999 from 0.18.2
    assert [ids.tolist() for ids in written] == [[1, 65000, 69999, eod], [7, eod]]


def _null_eod(vocab_size):
    from megatron_zeropp.data.tokenizers import build_tokenizer

    return build_tokenizer("NullTokenizer", vocab_size=vocab_size).eod


def test_cli_matches_megatron_flags_and_reports_errors(corpus, capsys):
    root, path, _, model = corpus
    tool = _load_tool()
    argv = [
        "--input", path, "--json-keys", "text", "--output-prefix", str(root / "cli"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
        "--workers", "2", "--append-eod",
    ]
    assert tool.main(argv) == 0
    assert os.path.isfile(str(root / "cli_text_document.bin"))
    assert os.path.isfile(str(root / "cli_text_document.idx"))
    with open(root / "cli_text_document.bin", "rb") as a:
        with open(root / "w1_text_document.bin", "rb") as b:
            assert a.read() == b.read()

    assert tool.main(argv[:3] + ["nokey"] + argv[4:]) == 2
    assert "has no key 'nokey'" in capsys.readouterr().err


def test_bad_input_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "1 2"}\n{"text": 3}\n')
    config = PreprocessConfig(
        input=str(path), output_prefix=str(tmp_path / "bad"), tokenizer_type="NullTokenizer",
        vocab_size=10,
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2 key 'text' holds a int"):
        preprocess(config)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 is not valid JSON"):
        preprocess(config)
    path.write_text('{"text": "1 2"}\n{"text": "1 two"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 key 'text': tokenizing failed"):
        preprocess(config)
    null = dict(output_prefix="x", tokenizer_type="NullTokenizer")
    with pytest.raises(ValueError, match="input file .* does not exist"):
        PreprocessConfig(input=str(tmp_path / "nope"), **null)
    with pytest.raises(ValueError, match="workers=0"):
        PreprocessConfig(input=str(path), workers=0, **null)


MEGATRON_LM = os.path.join(os.path.dirname(__file__), "data", "megatron_lm")


def _same_files(ours_prefix, reference_prefix):
    for suffix in (".bin", ".idx"):
        with open(ours_prefix + suffix, "rb") as a, open(reference_prefix + suffix, "rb") as b:
            assert a.read() == b.read(), suffix


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="GPT2BPETokenizer needs transformers")
@pytest.mark.parametrize("name, flags", [
    ("gpt2_eod", ["--append-eod", "--workers", "1"]),
    ("gpt2_partitions2", ["--workers", "2", "--partitions", "2"]),
    ("gpt2_eod", ["--append-eod", "--workers", "1", "--legacy-tokenizer"]),
])
def test_gpt2_files_are_byte_identical_to_megatron_lm(tmp_path, monkeypatch, name, flags):
    # References: Megatron-LM core_v0.16.1 tools/preprocess_data.py on corpus.jsonl (empty,
    # whitespace-only and unicode documents) with tests/bpe_files.py's vocabulary; see the
    # README next to them.
    from bpe_files import write_gpt2_files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vocab, merges = write_gpt2_files(str(tmp_path))
    out = str(tmp_path / "ours")
    assert _load_tool().main([
        "--input", os.path.join(MEGATRON_LM, "corpus.jsonl"), "--output-prefix", out,
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        *flags]) == 0
    _same_files(out + "_text_document", os.path.join(MEGATRON_LM, f"{name}_text_document"))


def test_int32_files_are_byte_identical_to_megatron_lm(tmp_path):
    if _null_eod(70000) != 70000:
        pytest.skip("the stored files are Megatron-LM core_v0.16.1's (EOD id 70000); megatron-core "
                    "0.18.2 and later's NullTokenizer ends documents with 69999")
    out = str(tmp_path / "ours")
    assert _load_tool().main([
        "--input", os.path.join(MEGATRON_LM, "null_corpus.jsonl"), "--output-prefix", out,
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000", "--workers", "1",
        "--append-eod"]) == 0
    _same_files(out + "_text_document",
                os.path.join(MEGATRON_LM, "null_int32_eod_text_document"))


def test_partitions_deal_lines_round_robin(tmp_path):
    # Megatron-LM deals lines to partitions 0, 1, 0, 1, ... and concatenates them in order.
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(5)))
    common = dict(input=str(path), tokenizer_type="NullTokenizer", vocab_size=10, workers=2)
    dealt = preprocess(PreprocessConfig(output_prefix=str(tmp_path / "p"), partitions=2,
                                        **common))
    kept = preprocess(PreprocessConfig(output_prefix=str(tmp_path / "s"), partitions=2,
                                       keep_sequential_samples=True, **common))
    assert [d.tolist() for d in read_documents(dealt.prefixes["text"])] == [[0], [2], [4], [1],
                                                                            [3]]
    assert [d.tolist() for d in read_documents(kept.prefixes["text"])] == [[0], [1], [2], [3],
                                                                           [4]]


def test_megatron_lm_flags_that_cannot_apply_say_why(tmp_path, capsys):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"text": "1"}) + "\n")
    base = ["--input", str(path), "--output-prefix", str(tmp_path / "x"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    tool = _load_tool()
    assert tool.main(base + ["--workers", "3", "--partitions", "2"]) == 2
    assert "--workers 3 is not a multiple of --partitions 2" in capsys.readouterr().err
    assert tool.main(base + ["--workers", "1", "--legacy-tokenizer"]) == 2
    assert "--legacy-tokenizer: only GPT2BPETokenizer" in capsys.readouterr().err
    if importlib.util.find_spec("nltk") is None:
        assert tool.main(base + ["--workers", "1", "--split-sentences"]) == 2
        assert "--split-sentences needs the 'nltk' package" in capsys.readouterr().err
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
