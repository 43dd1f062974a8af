"""tools/preprocess_data.py: jsonl -> .bin/.idx round trip, EOD, empty documents, workers."""

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


def test_round_trip_with_eod_and_empty_documents_skipped(corpus, capsys):
    _, _, docs, model = corpus
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    result = _run(corpus, "one", workers=1)
    kept = [d for d in docs if d.strip()]
    assert result.skipped_empty == {"text": len(docs) - len(kept)} == {"text": 16}
    assert result.documents == {"text": len(kept)}
    assert result.dtype == "uint16"
    prefix = result.prefixes["text"]
    assert prefix.endswith("one_text_document")

    written = read_documents(prefix)
    assert len(written) == len(kept)
    for text, ids in zip(kept, written):
        assert ids.tolist() == tokenizer.tokenize(text) + [tokenizer.eod]
    assert result.tokens["text"] == sum(len(ids) for ids in written)
    dataset = IndexedDataset(prefix)
    assert dataset.index.dtype == numpy.uint16
    assert int(dataset.sequence_lengths.min()) > 0
    del dataset
    err = capsys.readouterr().err
    assert "Processed 20 documents" in err
    assert "skipped 16 empty documents" in err


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
    assert three.skipped_empty == {"text": 16, "title": 0}
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
    assert [ids.tolist() for ids in written] == [[1, 65000, 69999, 70000], [7, 70000]]


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
