"""jsonl -> Megatron ``.bin``/``.idx`` token files (the library behind tools/preprocess_data.py).

For each key in ``json_keys`` this writes ``{output_prefix}_{key}_document.bin`` and ``.idx``
through megatron-core's ``IndexedDatasetBuilder``, one document per jsonl line, in input order, so
``IndexedDataset(f"{output_prefix}_{key}_document")`` reads it back. Tokens are stored as uint16
when the vocabulary fits (megatron-core's ``DType.optimal_dtype``), else int32.

Documents that are empty or whitespace-only, or that tokenize to no ids, are skipped and counted:
they carry nothing to learn, and a ``--split`` range made only of zero-length documents makes
megatron-core's dataset build spin forever later.

Worker processes tokenize (the expensive part); the parent writes, in input order, so the output
is byte-identical for any number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy

from .documents import json_fields
from .tokenizers import TOKENIZER_TYPES, build_tokenizer


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """One preprocessing run, with Megatron-LM's flag names."""

    input: str
    """jsonl file, one JSON object per line."""
    output_prefix: str
    """Outputs go to ``{output_prefix}_{key}_document.{bin,idx}``."""
    tokenizer_type: str
    """One of :data:`~megatron_zeropp.data.tokenizers.TOKENIZER_TYPES`."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model file or HuggingFace tokenizer name/directory."""
    vocab_size: Optional[int] = None
    """NullTokenizer only."""
    json_keys: Tuple[str, ...] = ("text",)
    """Keys to tokenize; one output pair each."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id to every document."""
    workers: int = 1
    """Tokenizing processes; 1 tokenizes in this process."""
    log_interval: int = 1000
    """Print a progress line to stderr every this many input lines."""

    def __post_init__(self) -> None:
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(
                f"tokenizer_type={self.tokenizer_type!r}; choose one of {TOKENIZER_TYPES}"
            )
        if not os.path.isfile(self.input):
            raise ValueError(f"input file {self.input!r} does not exist")
        from .validate import check_preprocess_input

        check_preprocess_input(self.input)
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise ValueError(f"json_keys must be non-empty and distinct, got {self.json_keys}")
        if self.workers < 1 or self.log_interval < 1:
            raise ValueError(
                f"need workers >= 1 and log_interval >= 1, got workers={self.workers}, "
                f"log_interval={self.log_interval}"
            )

    def output_path_prefix(self, key: str) -> str:
        """The IndexedDataset prefix written for ``key``."""
        return f"{self.output_prefix}_{key}_document"


@dataclass
class PreprocessResult:
    """What was written, per json key."""

    prefixes: Dict[str, str]
    """IndexedDataset prefix per key."""
    dtype: str
    """Token dtype in the .bin files (``uint16`` or ``int32``)."""
    documents: Dict[str, int] = field(default_factory=dict)
    """Documents written per key."""
    skipped_empty: Dict[str, int] = field(default_factory=dict)
    """Empty (or tokenizing-to-nothing) documents skipped per key."""
    tokens: Dict[str, int] = field(default_factory=dict)
    """Tokens written per key, EOD included."""


# Per-process state of the tokenizing workers (set once by _init_worker, read by _encode_line).
_WORKER: dict = {}


def _init_worker(config: PreprocessConfig) -> None:
    _WORKER["config"] = config
    _WORKER["tokenizer"] = build_tokenizer(
        config.tokenizer_type, config.tokenizer_model, config.vocab_size
    )


def _encode_line(task: Tuple[int, str]) -> Tuple[int, Dict[str, Optional[numpy.ndarray]]]:
    """Tokenize one jsonl line: (bytes, {key: ids or None if the document is empty})."""
    line_number, line = task
    config: PreprocessConfig = _WORKER["config"]
    tokenizer = _WORKER["tokenizer"]
    encoded: Dict[str, Optional[numpy.ndarray]] = {}
    for key, text in json_fields(line, config.json_keys, config.input, line_number):
        try:
            ids = tokenizer.tokenize(text) if text.strip() else []
        except Exception as error:  # name the record: the tokenizer's own message does not
            raise ValueError(
                f"{config.input}:{line_number} key {key!r}: tokenizing failed: {error!r}"
            ) from error
        if len(ids) == 0:
            encoded[key] = None
            continue
        if config.append_eod:
            ids = list(ids) + [tokenizer.eod]
        encoded[key] = numpy.asarray(ids, dtype=numpy.int64)
    return len(line.encode("utf-8")), encoded


def _nonblank_lines(path: str):
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                yield line_number, line


def preprocess(config: PreprocessConfig) -> PreprocessResult:
    """Tokenize ``config.input`` and write one IndexedDataset per json key; see the module doc."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    _init_worker(config)  # the parent needs vocab_size too, and tokenizes itself when workers == 1
    vocab_size = _WORKER["tokenizer"].vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    out_dir = os.path.dirname(os.path.abspath(config.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    result = PreprocessResult(
        prefixes={key: config.output_path_prefix(key) for key in config.json_keys},
        dtype=numpy.dtype(dtype).name,
    )
    # Write under temporary names and rename at the end, so an interrupted run never leaves a
    # .bin/.idx pair that looks complete.
    builders = {
        key: IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype)
        for key, prefix in result.prefixes.items()
    }
    for key in config.json_keys:
        result.documents[key] = result.skipped_empty[key] = result.tokens[key] = 0

    tasks = _nonblank_lines(config.input)
    pool = None
    if config.workers > 1:
        # fork: workers inherit the imported megatron-core (seconds to import afresh).
        pool = mp.get_context("fork").Pool(config.workers, _init_worker, (config,))
        encoded_lines = pool.imap(_encode_line, tasks, chunksize=16)
    else:
        encoded_lines = map(_encode_line, tasks)
    try:
        _write_all(encoded_lines, builders, result, config.log_interval)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    for key, prefix in result.prefixes.items():
        builders[key].finalize(prefix + ".idx.tmp")
        os.replace(prefix + ".bin.tmp", prefix + ".bin")
        os.replace(prefix + ".idx.tmp", prefix + ".idx")
    for key in config.json_keys:
        print(
            f"{result.prefixes[key]}: {result.documents[key]} documents, "
            f"{result.tokens[key]} tokens ({result.dtype}), "
            f"skipped {result.skipped_empty[key]} empty documents",
            file=sys.stderr,
        )
    return result


def _write_all(encoded_lines, builders, result: PreprocessResult, log_interval: int) -> None:
    start = time.monotonic()
    total_bytes = 0
    count = 0
    for count, (num_bytes, encoded) in enumerate(encoded_lines, start=1):
        total_bytes += num_bytes
        for key, ids in encoded.items():
            if ids is None:
                result.skipped_empty[key] += 1
                continue
            builders[key].add_document(ids, [ids.size])
            result.documents[key] += 1
            result.tokens[key] += int(ids.size)
        if count % log_interval == 0:
            _log_progress(count, total_bytes, time.monotonic() - start)
    if count % log_interval != 0 or count == 0:
        _log_progress(count, total_bytes, time.monotonic() - start)


def _log_progress(count: int, total_bytes: int, elapsed: float) -> None:
    elapsed = max(elapsed, 1e-9)
    print(
        f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
        f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).",
        file=sys.stderr,
        flush=True,
    )


def read_documents(prefix: str) -> List[numpy.ndarray]:
    """All documents of an IndexedDataset as arrays (for tests and inspection of small data)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    # Copies: the arrays IndexedDataset returns are views of an mmap that closes with it.
    return [numpy.array(dataset[i]) for i in range(len(dataset))]
