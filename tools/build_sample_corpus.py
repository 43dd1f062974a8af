"""Build the sample corpus from text that ships with Python (no download), optionally all the way
to a tokenizer and ``.bin``/``.idx`` files.

Usage::

    python tools/build_sample_corpus.py --output-dir data/            # jsonl only
    python tools/build_sample_corpus.py --output-dir data/ --prepare  # + tokenizer + .bin/.idx

The jsonl files (``sample_corpus_train.jsonl``, ``sample_corpus_valid.jsonl``, one
``{"id", "text"}`` object per line) work with ``tools/train_tokenizer.py`` and
``tools/preprocess_data.py`` like any corpus. ``--prepare`` does those two steps too (cached: a
second run returns at once) and prints the flags to train on the result.
"""

from __future__ import annotations

import argparse
import sys

from megatron_zeropp.data.sample_corpus import prepare_sample_data, write_sample_corpus


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--valid-per-mille", type=int, default=30, help="held-out documents per 1000"
    )
    parser.add_argument(
        "--prepare", action="store_true", help="also train a tokenizer and write .bin/.idx"
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="with --prepare")
    parser.add_argument(
        "--corpus", choices=("docs", "sources"), default="docs",
        help="docs: ~2 MB of help topics and docstrings; sources: also whole .py files of the "
             "standard library and installed packages, up to --max-source-mbytes",
    )
    parser.add_argument("--max-source-mbytes", type=float, default=80.0,
                        help="with --corpus sources")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (--prepare)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    max_source_bytes = int(args.max_source_mbytes * 10**6)
    try:
        if not args.prepare:
            train, valid, train_docs, valid_docs = write_sample_corpus(
                args.output_dir, args.valid_per_mille, args.corpus, max_source_bytes
            )
            print(f"wrote {train} ({train_docs} documents) and {valid} ({valid_docs} documents)")
            return 0
        data = prepare_sample_data(args.output_dir, args.vocab_size, args.valid_per_mille,
                                   args.corpus, max_source_bytes, args.workers)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"train: {data.train_documents} documents, {data.train_tokens} tokens; "
        f"valid: {data.valid_documents} documents, {data.valid_tokens} tokens\n"
        f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {data.tokenizer_model} "
        f"--train-data-path {data.train_data_prefix} --valid-data-path {data.valid_data_prefix}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
