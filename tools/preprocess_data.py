"""Tokenize a jsonl corpus into Megatron ``.bin``/``.idx`` files (same flags as Megatron-LM's tool).

Usage::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix out --tokenizer-type SentencePieceTokenizer --tokenizer-model m.model \\
        --workers 8 --append-eod

writes ``out_text_document.bin`` and ``out_text_document.idx`` (one pair per json key), readable
by ``megatron.core.datasets.indexed_dataset.IndexedDataset("out_text_document")`` and usable as
``--data-path out_text_document``. Empty documents are skipped and counted.
"""

from __future__ import annotations

import argparse
import sys

from megatron_zeropp.data.preprocess import PreprocessConfig, preprocess
from megatron_zeropp.data.tokenizers import TOKENIZER_TYPES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece model / HF tokenizer")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    group.add_argument(
        "--append-eod", action="store_true", help="append an end-of-document token to each document"
    )
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="prefix of the .bin/.idx files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizing processes")
    group.add_argument("--log-interval", type=int, default=1000, help="progress line every N docs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = PreprocessConfig(
            input=args.input,
            output_prefix=args.output_prefix,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
            json_keys=tuple(args.json_keys),
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
        )
        preprocess(config)
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
