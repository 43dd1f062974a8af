"""Tokenizers by --tokenizer-type, and SentencePiece training."""

import importlib.util
import os

import pytest

from megatron_zeropp.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from megatron_zeropp.data.tokenizers import build_tokenizer, padded_vocab_size


def _topics():
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("tok") / "tok")
    return train_sentencepiece(_topics(), prefix, TokenizerTrainingConfig(vocab_size=1000))


TRICKY = 'def f(x):\n    """Return  x²."""\n\treturn x  # ünïcode 日本 🙂\n\n'


def test_sentencepiece_round_trip_is_exact(sp_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert tokenizer.vocab_size == 1000
    for text in (TRICKY, "The assert statement", "   leading spaces", ""):
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    # Whitespace is kept, not normalized away: two spaces and one space differ.
    assert tokenizer.tokenize("a  b") != tokenizer.tokenize("a b")
    # eod is SentencePiece's </s>, a control piece that ordinary text never produces.
    assert tokenizer.eod == 2
    assert tokenizer.eod not in tokenizer.tokenize(TRICKY + " </s>")


def test_training_is_deterministic(sp_model, tmp_path):
    again = train_sentencepiece(
        _topics(), str(tmp_path / "again"), TokenizerTrainingConfig(vocab_size=1000)
    )
    # The .model file also records the model prefix; the .vocab file holds pieces and scores.
    def vocab(model):
        with open(model.removesuffix(".model") + ".vocab", encoding="utf-8") as f:
            return f.read()

    assert vocab(again) == vocab(sp_model)
    other = train_sentencepiece(
        _topics()[:-1], str(tmp_path / "other"), TokenizerTrainingConfig(vocab_size=1000)
    )
    assert vocab(other) != vocab(sp_model)  # the comparison above can fail


def test_sampled_training_is_deterministic_by_its_seed(tmp_path):
    """With max_sentences below the sentences there are, SentencePiece trains on a sample: the
    same seed draws the same one, another seed another (the control)."""
    def vocab(name, seed):
        model = train_sentencepiece(
            _topics(), str(tmp_path / name),
            TokenizerTrainingConfig(vocab_size=1000, max_sentences=500, sampling_seed=seed))
        with open(model.removesuffix(".model") + ".vocab", encoding="utf-8") as f:
            return f.read()

    first = vocab("a", 1234)
    assert vocab("b", 1234) == first
    assert vocab("c", 99) != first


def test_unigram_trains_too(tmp_path):
    model = train_sentencepiece(
        _topics()[:10], str(tmp_path / "uni"),
        TokenizerTrainingConfig(vocab_size=600, model_type="unigram"),
    )
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    assert tokenizer.vocab_size == 600
    assert tokenizer.detokenize(tokenizer.tokenize(TRICKY)) == TRICKY


def test_training_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type must be"):
        TokenizerTrainingConfig(model_type="wordpiece")
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        TokenizerTrainingConfig(vocab_size=100)
    with pytest.raises(ValueError, match="no non-empty text"):
        train_sentencepiece(["", "  \n\n"], str(tmp_path / "x"), TokenizerTrainingConfig())
    with pytest.raises(ValueError, match="SentencePiece training failed.*Vocabulary size"):
        train_sentencepiece(["tiny text"], str(tmp_path / "x"), TokenizerTrainingConfig())


def test_null_tokenizer():
    from megatron_zeropp.mcore.version import at_least

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    if at_least(0, 18):
        # megatron-core 0.18.2's and 0.19.2's NullTokenizer (what Megatron-LM core_v0.18.2 and
        # core_v0.19.0 build for --vocab-size 100): the EOD id is the last of the 100
        # (training_config.py: null_tokenizer_eod_id "Defaults to vocab_size - 1").
        assert tokenizer.vocab_size == 100 and tokenizer.eod == 99
    else:
        # 0.16.1 and 0.17.1: the EOD id is appended, as in Megatron-LM core_v0.16.1 and
        # core_v0.17.1 (megatron-core 0.17.1's null-text tokenizer keeps 0.16.1's sizes).
        assert tokenizer.vocab_size == 101
        assert tokenizer.eod == 100
    assert tokenizer.tokenize("3 1 4") == [3, 1, 4]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_type='BertWordPieceCase' is not supported"):
        build_tokenizer("BertWordPieceCase", "x")
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs an existing vocab_file"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="TikTokenizer needs an existing vocabulary"):
        build_tokenizer("TikTokenizer", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="does not exist"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="needs tokenizer_model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="NullTokenizer needs vocab_size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="takes no tokenizer_model"):
        build_tokenizer("NullTokenizer", "m.model", vocab_size=10)
    with pytest.raises(ValueError, match="takes its vocabulary from the model"):
        build_tokenizer("SentencePieceTokenizer", "m.model", vocab_size=10)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is not None, reason="transformers is installed"
)
def test_huggingface_without_transformers_says_what_to_install():
    with pytest.raises(ImportError, match="pip install transformers"):
        build_tokenizer("HuggingFaceTokenizer", os.getcwd())


def test_padded_vocab_size():
    assert padded_vocab_size(4096) == 4096
    assert padded_vocab_size(4097) == 4224
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(1, 128, 8) == 1024
    with pytest.raises(ValueError, match="tensor_model_parallel_size=0"):
        padded_vocab_size(10, 128, 0)


def test_train_tokenizer_tool_reads_jsonl_keys(tmp_path, capsys):
    import json

    spec = importlib.util.spec_from_file_location(
        "train_tokenizer_tool",
        os.path.join(os.path.dirname(__file__), "..", "tools", "train_tokenizer.py"),
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"body": t, "other": 1}) + "\n" for t in _topics()[:20])
    )
    prefix = str(tmp_path / "cli")
    argv = ["--input", str(corpus), "--json-keys", "body", "--vocab-size", "700",
            "--model-prefix", prefix, "--model-type", "bpe"]
    assert tool.main(argv) == 0
    tokenizer = build_tokenizer("SentencePieceTokenizer", prefix + ".model")
    assert tokenizer.vocab_size == 700
    assert tokenizer.detokenize(tokenizer.tokenize(TRICKY)) == TRICKY
    assert tool.main(argv[:3] + ["text"] + argv[4:]) == 2  # the key is "body"
    assert "has no key 'text'" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="GPT2BPETokenizer needs transformers")
def test_gpt2_bpe_from_vocab_and_merge_files(tmp_path):
    from bpe_files import write_gpt2_files

    vocab_file, merge_file = write_gpt2_files(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tok.vocab_size == 256 + 5 + 1
    assert tok.eod == 261  # <|endoftext|>, the last id
    ids = tok.tokenize(" the in")
    assert ids == [258, 32, 259]  # "Ġthe" (merged), "Ġ" (byte 32), "in" (merged)
    assert tok.detokenize(ids) == " the in"


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is None,
                    reason="TikTokenizer needs tiktoken")
def test_tiktoken_from_a_local_vocabulary(tmp_path):
    from bpe_files import write_tiktoken_file

    path = write_tiktoken_file(str(tmp_path))
    tok = build_tokenizer("TikTokenizer", path, tiktoken_pattern="v2", num_special_tokens=32,
                          vocab_size=261 + 32)
    ids = tok.tokenize("the cat")
    assert tok.detokenize(ids) == "the cat"
    assert len(ids) < len("the cat")  # merges applied


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SNAPSHOT = "/work/shared/megatron-lm/core_v0.16.1"
for _candidate in (os.path.join(os.path.dirname(_ROOT), "shared", "megatron-lm", "core_v0.16.1"),):
    if os.path.isdir(_candidate):
        _SNAPSHOT = _candidate


_LEGACY_SIZES = """
import argparse, json, sys
sys.path.insert(0, {tools!r})
from dump_megatron_lm_flags import import_megatron_lm
legacy = import_megatron_lm({snapshot!r}, "megatron.training.tokenizer.tokenizer")
model = {model!r}
sizes = {{"sp": [legacy._SentencePieceTokenizer(model, vocab_extra_ids=k).vocab_size
                for k in (0, 3)],
         "llama2": legacy._Llama2Tokenizer(model).vocab_size,
         "null": legacy._NullTokenizer(100).vocab_size,
         "padded": [legacy._vocab_size_with_padding(v, argparse.Namespace(
             make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp, rank=1))
             for v in (1005, 1008) for tp in (1, 2, 8)]}}
print(json.dumps(sizes))
"""


def _megatron_lm_legacy_sizes(model):
    """Sizes from Megatron-LM core_v0.16.1's own megatron/training/tokenizer/tokenizer.py (the
    snapshot), in a child process: importing it stands in for modules (six, regex) it needs."""
    import json
    import subprocess
    import sys

    from megatron_zeropp.data.tokenizers import legacy_vocabulary

    if not os.path.isfile(os.path.join(_SNAPSHOT, "megatron", "training", "tokenizer",
                                       "tokenizer.py")):
        pytest.skip(f"no Megatron-LM core_v0.16.1 snapshot at {_SNAPSHOT}")
    if not legacy_vocabulary():
        pytest.skip("core_v0.16.1's tokenizer code imports megatron-core 0.16's modules")
    code = _LEGACY_SIZES.format(tools=os.path.join(_ROOT, "tools"), snapshot=_SNAPSHOT,
                                model=model)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_vocabulary_sizes_are_megatron_lm_legacy_tokenizers(sp_model):
    from megatron_zeropp.data.tokenizers import megatron_lm_vocab_size

    theirs = _megatron_lm_legacy_sizes(sp_model)
    sp = build_tokenizer("SentencePieceTokenizer", sp_model)
    ours = [megatron_lm_vocab_size(sp, "SentencePieceTokenizer", sp_model, k, legacy=True)
            for k in (0, 3)]
    # 1000 pieces + <CLS> <SEP> <EOD> <MASK> <PAD> (the model has no pad piece) + extra ids
    assert ours == theirs["sp"] == [1005, 1008]
    assert [padded_vocab_size(v, 128, tp) for v in ours for tp in (1, 2, 8)] == theirs["padded"]
    llama = build_tokenizer("Llama2Tokenizer", sp_model)
    assert megatron_lm_vocab_size(llama, "Llama2Tokenizer", sp_model, legacy=True) == \
        theirs["llama2"] == 1000
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert megatron_lm_vocab_size(null, "NullTokenizer", legacy=True) == theirs["null"] == 101
    # Negative control: megatron-core's own tokenizer (core_v0.19.0's choice) has no extra pieces.
    assert megatron_lm_vocab_size(sp, "SentencePieceTokenizer", sp_model, legacy=False) == 1000


def test_vocabulary_size_is_megatron_cores_where_megatron_lm_builds_it(sp_model):
    import argparse

    from megatron.core.package_info import __version__

    from megatron_zeropp.data.tokenizers import megatron_lm_vocab_size

    if tuple(int(v) for v in __version__.split(".")[:2]) < (0, 17):
        pytest.skip(f"megatron-core {__version__}: Megatron-LM of that release uses its legacy "
                    "tokenizer (previous test)")
    # Megatron-LM core_v0.17.1 and later build their tokenizer with megatron-core's
    # build_tokenizer, which sets args.padded_vocab_size itself
    # (vocab_utils.calculate_padded_vocab_size arithmetic; 0.17.1 names two of the arguments
    # tokenizer_special_tokens and tokenizer_metadata).
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as mcore_build

    args = argparse.Namespace(
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model, chat_template=None,
        tokenizer_sentencepiece_ignore_extra_whitespaces=True, tokenizer_sentencepiece_legacy=False,
        special_tokens=None, tokenizer_special_tokens=None, tokenizer_metadata=None,
        pad_vocab_size=True, metadata_path=None, padded_vocab_size=None,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, rank=0)
    theirs = mcore_build(args)
    ours = megatron_lm_vocab_size(build_tokenizer("SentencePieceTokenizer", sp_model),
                                  "SentencePieceTokenizer", sp_model)
    assert ours == theirs.vocab_size == 1000
    assert padded_vocab_size(ours, 128, 2) == args.padded_vocab_size
