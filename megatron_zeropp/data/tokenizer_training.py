"""Train a SentencePiece model from text or jsonl (for ``--tokenizer-type SentencePieceTokenizer``).

The defaults are chosen for code and documentation text and for exact round trips:
``identity`` normalization and kept whitespace (indentation and repeated spaces survive), byte
fallback (any character, newlines included, maps to byte pieces instead of ``<unk>``), digits
split one per piece. ``detokenize(tokenize(text)) == text`` then holds for every string.

SentencePiece reads sentences, one per line; each non-empty line of a document is one sentence.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Iterable, Iterator


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainingConfig:
    """What to train; validated on construction."""

    vocab_size: int = 4096
    """Pieces in the model, special and byte pieces included."""
    model_type: str = "bpe"
    """``bpe`` (fast to train) or ``unigram``."""
    character_coverage: float = 0.9995
    """Fraction of characters covered by ordinary pieces; the rare rest falls back to bytes."""
    max_sentences: int = 0
    """Train on at most this many sentences (a uniform sample); 0 means all of them."""
    num_threads: int = 2
    """SentencePiece trainer threads."""
    sampling_seed: int = 1234
    """Seed of the sample of ``max_sentences`` sentences, drawn here: SentencePiece's own
    sampling draws another sample, and so another model, in every process (0.2.x; its
    ``set_random_generator_seed`` did not change that)."""

    def __post_init__(self) -> None:
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {self.model_type!r}")
        # <unk> <s> </s> + 256 byte-fallback pieces, plus room for some actual text pieces.
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small: byte fallback alone needs 256 pieces"
            )
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError(f"character_coverage must be in (0, 1], got {self.character_coverage}")
        if not 0 <= self.sampling_seed < 2**32:
            raise ValueError(f"sampling_seed must be in [0, 2**32), got {self.sampling_seed}")
        if self.max_sentences < 0 or self.num_threads < 1:
            raise ValueError(
                f"need max_sentences >= 0 and num_threads >= 1, got "
                f"max_sentences={self.max_sentences}, num_threads={self.num_threads}"
            )


def _sentences(documents: Iterable[str]) -> Iterator[str]:
    for document in documents:
        for line in document.split("\n"):
            if line.strip():
                yield line


def _sample(sentences: Iterator[str], size: int, seed: int) -> Iterator[str]:
    """At most ``size`` of ``sentences``, uniformly (reservoir sampling from ``seed``), in the
    order they came."""
    rng = random.Random(seed)
    kept: list = []
    for i, sentence in enumerate(sentences):
        if i < size:
            kept.append((i, sentence))
        else:
            j = rng.randrange(i + 1)
            if j < size:
                kept[j] = (i, sentence)
    kept.sort()
    return iter([sentence for _, sentence in kept])


def train_sentencepiece(
    documents: Iterable[str], model_prefix: str, config: TokenizerTrainingConfig
) -> str:
    """Train on ``documents``, write ``{model_prefix}.model`` and ``.vocab``, return the model path.

    Deterministic: the same documents and config give the same pieces and scores (the ``.vocab``
    file; the ``.model`` file also records the prefix), with ``max_sentences`` too (its sample is
    drawn here from ``sampling_seed``). No sampling unless ``max_sentences`` is set.
    """
    import sentencepiece

    sentences = _sentences(documents)
    if config.max_sentences:
        sentences = _sample(sentences, config.max_sentences, config.sampling_seed)
    first = next(sentences, None)
    if first is None:
        raise ValueError("no non-empty text to train the tokenizer on")

    def all_sentences():
        yield first
        yield from sentences

    directory = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(directory, exist_ok=True)
    options = dict(
        sentence_iterator=all_sentences(),
        model_prefix=model_prefix,
        vocab_size=config.vocab_size,
        model_type=config.model_type,
        character_coverage=config.character_coverage,
        num_threads=config.num_threads,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        split_digits=True,
        minloglevel=2,
    )
    try:
        sentencepiece.SentencePieceTrainer.train(**options)
    except RuntimeError as error:
        # e.g. "Vocabulary size too high (4096). Please set it to a value <= 900."
        raise ValueError(f"SentencePiece training failed: {error}") from None
    return model_prefix + ".model"
