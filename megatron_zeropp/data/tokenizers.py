"""Tokenizers by Megatron-LM's ``--tokenizer-type`` name, built from megatron-core's own classes.

megatron-core 0.16.1 ships the tokenizer wrappers Megatron-LM uses (``megatron.core.tokenizers``),
and they load offline from a local model file, so we build those rather than our own: the objects
then carry exactly the attributes ``GPTDataset`` and ``MockGPTDataset`` read (``vocab_size``,
``eod``, ``pad``, ``unique_identifiers``) and hash into the dataset cache the way Megatron-LM's do.

Every returned tokenizer has ``.tokenize(text) -> list[int]``, ``.detokenize(ids) -> str``,
``.vocab_size`` and ``.eod``.

- ``SentencePieceTokenizer``: ``tokenizer_model`` is a sentencepiece ``.model`` file; ``eod`` is
  the model's end-of-sentence id.
- ``NullTokenizer``: ``vocab_size`` ids; text is space-separated integers; ``eod`` is the extra id
  ``vocab_size`` (so ``.vocab_size`` is one more than asked, as in Megatron-LM).
- ``HuggingFaceTokenizer``: ``tokenizer_model`` is a local directory or hub name understood by
  ``transformers.AutoTokenizer``; needs ``transformers``.
- ``GPT2BPETokenizer``: ``vocab_file`` (``gpt2-vocab.json``) and ``merge_file``
  (``gpt2-merges.txt``), as Megatron-LM's ``--vocab-file --merge-file``; needs ``transformers``.
- ``Llama2Tokenizer``: a SentencePiece ``.model`` file (``eod`` is its end-of-sentence id).
- ``TikTokenizer``: ``tokenizer_model`` is a tiktoken vocabulary ``.json`` (a list of
  ``{"rank", "token_bytes", "token_str"}``), ``tiktoken_pattern`` ``v1`` or ``v2``; needs
  ``tiktoken``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from megatron_zeropp.mcore.tokenizers import from_pretrained, legacy_vocabulary

TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                   "GPT2BPETokenizer", "Llama2Tokenizer", "TikTokenizer")
"""The ``--tokenizer-type`` values we accept."""


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    **kwargs: Any,
):
    """Build a tokenizer the way Megatron-LM's ``--tokenizer-type`` / ``--tokenizer-model`` do.

    Args:
        tokenizer_type: one of :data:`TOKENIZER_TYPES`.
        tokenizer_model: model file (SentencePiece) or directory/name (HuggingFace).
        vocab_size: number of ordinary ids, NullTokenizer only.
        **kwargs: passed on to megatron-core's library class (e.g. ``use_fast`` for HuggingFace).

    Returns:
        A ``megatron.core.tokenizers.MegatronTokenizerBase``, usable as
        ``GPTDatasetConfig.tokenizer``.

    Raises:
        ValueError: unknown type, missing or superfluous arguments, missing model file.
        ImportError: ``HuggingFaceTokenizer`` without ``transformers`` installed.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"tokenizer_type={tokenizer_type!r} is not supported; choose one of {TOKENIZER_TYPES}"
        )
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(kwargs.pop("vocab_file", None), kwargs.pop("merge_file", None), **kwargs)
    if tokenizer_type == "TikTokenizer":
        if vocab_size is not None:
            kwargs["vocab_size"] = int(vocab_size)
        return _tiktoken(tokenizer_model, **kwargs)
    if tokenizer_type == "NullTokenizer":
        if tokenizer_model is not None:
            raise ValueError(
                f"NullTokenizer takes no tokenizer_model (got {tokenizer_model!r}); "
                "pass vocab_size instead"
            )
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs vocab_size >= 1, got vocab_size={vocab_size!r}")
        library, path = "null", None
        kwargs["vocab_size"] = int(vocab_size)
    else:
        if vocab_size is not None:
            raise ValueError(
                f"{tokenizer_type} takes its vocabulary from the model; got vocab_size={vocab_size}"
            )
        if not tokenizer_model:
            raise ValueError(f"{tokenizer_type} needs tokenizer_model, got {tokenizer_model!r}")
        if tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer"):
            if not os.path.isfile(tokenizer_model):
                raise ValueError(
                    f"SentencePiece model file {tokenizer_model!r} does not exist "
                    "(train one with tools/train_tokenizer.py)"
                )
            library, path = "sentencepiece", tokenizer_model
        else:
            if importlib.util.find_spec("transformers") is None:
                raise ImportError(
                    "HuggingFaceTokenizer needs the 'transformers' package "
                    "(pip install transformers); or use SentencePieceTokenizer / NullTokenizer"
                )
            library, path = "huggingface", tokenizer_model

    return from_pretrained(path, library, **kwargs)


def _need(package: str, tokenizer_type: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{tokenizer_type} needs the '{package}' package (pip install {package})")


def _gpt2_bpe(vocab_file, merge_file, **kwargs):
    for flag, path in (("vocab_file", vocab_file), ("merge_file", merge_file)):
        if not path or not os.path.isfile(path):
            raise ValueError(f"GPT2BPETokenizer needs an existing {flag}, got {path!r}")
    _need("transformers", "GPT2BPETokenizer")
    import hashlib
    import json
    import tempfile

    # megatron-core's "megatron" library would ask the Hugging Face hub for gpt2's config; a
    # local directory with the two files and a config naming GPT-2's tokenizer needs no network.
    # Its name depends only on the two files, so every rank (and every run) gets the same path:
    # the path is part of the tokenizer's identity in megatron-core's dataset-cache hash.
    files = [os.path.abspath(vocab_file), os.path.abspath(merge_file)]
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(f.read())
    name = f"megatron-zeropp-gpt2-bpe-{digest.hexdigest()[:16]}"
    directory = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(directory, exist_ok=True)
    for path, name in zip(files, ("vocab.json", "merges.txt")):
        link = os.path.join(directory, name)
        tmp = f"{link}.{os.getpid()}"
        os.symlink(path, tmp)
        os.replace(tmp, link)  # atomic: ranks racing here all end with a valid link
    config = os.path.join(directory, "tokenizer_config.json")
    with open(f"{config}.{os.getpid()}", "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
                   "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f)
    os.replace(f"{config}.{os.getpid()}", config)
    return from_pretrained(directory, "huggingface", **kwargs)


def _tiktoken(tokenizer_model, tiktoken_pattern=None, **kwargs):
    if not tokenizer_model or not os.path.isfile(tokenizer_model):
        raise ValueError(f"TikTokenizer needs an existing vocabulary .json, got "
                         f"{tokenizer_model!r}")
    _need("tiktoken", "TikTokenizer")

    if tiktoken_pattern is not None:
        kwargs["pattern"] = tiktoken_pattern
    return from_pretrained(tokenizer_model, "tiktoken", **kwargs)


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Embedding rows for ``vocab_size`` tokens, padded like Megatron-LM.

    Megatron-LM rounds the vocabulary up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size`` so each tensor-parallel shard of
    the embedding and output layer has the same, GEMM-friendly, number of rows.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"need positive values, got vocab_size={vocab_size}, "
            f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, "
            f"tensor_model_parallel_size={tensor_model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def megatron_lm_vocab_size(tokenizer, tokenizer_type: str, tokenizer_model: str | None = None,
                           vocab_extra_ids: int = 0, legacy: bool | None = None) -> int:
    """The vocabulary size Megatron-LM pads into embedding rows, for the same flags.

    Only ``SentencePieceTokenizer`` differs from ``tokenizer.vocab_size`` (megatron-core's
    tokenizer, which this project tokenizes with), and only where Megatron-LM uses its legacy
    tokenizer (``legacy``, default :func:`legacy_vocabulary`): its ``_SentencePieceTokenizer``
    (core_v0.16.1 ``megatron/training/tokenizer/tokenizer.py``) adds ``<CLS> <SEP> <EOD> <MASK>``,
    then the model's pad, bos and eos pieces (``<PAD> <BOS> <EOS>`` where the model has none),
    then ``vocab_extra_ids`` pieces ``<extra_id_i>``, each only if not already a piece: a
    4096-piece model without a pad piece gives 4101 (padded to 4224 by 128). Its Llama2, GPT-2
    BPE, Hugging Face, TikToken and Null tokenizers have megatron-core's sizes (the model's pieces,
    ``len`` of the Hugging Face tokenizer, the TikToken ``vocab_size``, Null's ids + 1).
    """
    legacy = legacy_vocabulary() if legacy is None else legacy
    if not legacy or tokenizer_type != "SentencePieceTokenizer":
        return tokenizer.vocab_size
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    pieces = {model.id_to_piece(i) for i in range(len(model))}

    def piece(token_id, fallback: str) -> str:
        try:
            return model.id_to_piece(token_id)
        except IndexError:  # id -1: the model has no such piece
            return fallback

    pieces |= {"<CLS>", "<SEP>", "<EOD>", "<MASK>", piece(model.pad_id(), "<PAD>"),
               piece(model.bos_id(), "<BOS>"), piece(model.eos_id(), "<EOS>")}
    pieces |= {f"<extra_id_{i}>" for i in range(vocab_extra_ids)}
    return len(pieces)
