"""Tokenize a jsonl corpus into Megatron ``.bin``/``.idx`` files: Megatron-LM's tool, same flags,
byte-identical files (see megatron_zeropp/data/preprocess.py for the few differences).

Usage::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix out --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --workers 8 --append-eod

writes ``out_text_document.bin`` and ``out_text_document.idx`` (one pair per json key;
``_sentence`` instead of ``_document`` with --split-sentences), readable by
``megatron.core.datasets.indexed_dataset.IndexedDataset("out_text_document")`` and usable as
``--data-path out_text_document``. Documents without text are kept (as empty documents), as
Megatron-LM keeps them.
"""

from __future__ import annotations

import argparse
import sys

from megatron_zeropp.data.preprocess import PreprocessConfig, preprocess
from megatron_zeropp.data.tokenizers import TOKENIZER_TYPES

UNSUPPORTED = {
    "vocab_extra_ids": "extra sentinel ids are a T5/BERT-tokenizer option",
}
LEGACY_SAME = ("GPT2BPETokenizer",)
"""Tokenizers whose files with --legacy-tokenizer were checked byte-identical to Megatron-LM's
legacy tokenizer (the others' legacy classes live in Megatron-LM's megatron.training)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece model, HF tokenizer, tiktoken vocabulary")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer/TikTokenizer")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument("--tiktoken-pattern", default=None, choices=("v1", "v2"))
    group.add_argument("--legacy-tokenizer", action="store_true")
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object"
    )
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences (needs nltk and its punkt data)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep newlines between sentences when splitting")
    group = parser.add_argument_group("tokenization process")
    group.add_argument(
        "--append-eod", action="store_true", help="append an end-of-document token to each document"
    )
    group.add_argument("--lang", default="english", help="NLTK punkt language")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="prefix of the .bin/.idx files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizing processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="Megatron-LM's input partitions; only the document order depends on "
                            "it (round-robin over partitions)")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="with --partitions: keep the input order")
    group.add_argument("--log-interval", type=int, default=1000, help="progress line every N docs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    bad = [f"--{k.replace('_', '-')}: {why}" for k, why in UNSUPPORTED.items() if getattr(args, k)]
    if args.legacy_tokenizer and args.tokenizer_type not in LEGACY_SAME:
        bad.append(f"--legacy-tokenizer: only {', '.join(LEGACY_SAME)} is known to tokenize like "
                   f"Megatron-LM's legacy class; {args.tokenizer_type}'s legacy class is in "
                   "Megatron-LM's megatron.training, not megatron-core")
    if bad:
        print("error: " + "; ".join(bad), file=sys.stderr)
        return 2
    try:
        config = PreprocessConfig(
            input=args.input,
            output_prefix=args.output_prefix,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tiktoken_pattern=args.tiktoken_pattern,
            json_keys=tuple(args.json_keys),
            append_eod=args.append_eod,
            split_sentences=args.split_sentences,
            keep_newlines=args.keep_newlines,
            lang=args.lang,
            workers=args.workers,
            partitions=args.partitions,
            keep_sequential_samples=args.keep_sequential_samples,
            log_interval=args.log_interval,
        )
        preprocess(config)
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
