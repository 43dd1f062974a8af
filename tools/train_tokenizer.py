"""Train a SentencePiece tokenizer for ``--tokenizer-type SentencePieceTokenizer``.

Usage::

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \\
        --vocab-size 4096 --model-prefix tok --model-type bpe

writes ``tok.model`` (pass it as ``--tokenizer-model tok.model``) and ``tok.vocab``. Inputs ending
in ``.jsonl``/``.json`` are read as jsonl, others as plain text; several ``--input`` files may be
given. A few MB of text train in seconds (bpe) on two cores.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from megatron_zeropp.data.documents import iter_documents
from megatron_zeropp.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys read from jsonl")
    parser.add_argument(
        "--input-format", choices=("auto", "jsonl", "text"), default="auto",
        help="auto: jsonl for .jsonl/.json files, else plain text",
    )
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model, PREFIX.vocab")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument(
        "--max-sentences", type=int, default=0, help="sample at most N lines (0: use all)"
    )
    parser.add_argument("--workers", type=int, default=2, help="trainer threads")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = TokenizerTrainingConfig(
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            max_sentences=args.max_sentences,
            num_threads=args.workers,
        )
        documents = itertools.chain.from_iterable(
            iter_documents(path, args.json_keys, args.input_format) for path in args.input
        )
        model = train_sentencepiece(documents, args.model_prefix, config)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {model} ({config.model_type}, {config.vocab_size} pieces)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
