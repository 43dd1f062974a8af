"""jsonl -> Megatron ``.bin``/``.idx`` token files (the library behind tools/preprocess_data.py).

Byte-identical to Megatron-LM's ``tools/preprocess_data.py`` (core_v0.16.1) for the same input
and flags, checked against that tool run here. For each key in ``json_keys`` this writes
``{output_prefix}_{key}_{level}.bin`` and ``.idx`` (level ``document``, or ``sentence`` with
``split_sentences``) through megatron-core's ``IndexedDatasetBuilder``, one document per jsonl
line. Like Megatron-LM:

- every line is a document, even one whose text is empty or tokenizes to nothing: it is written
  as a document of no sequences (its ``.idx`` document index repeats), so document numbers stay
  line numbers; GPT datasets never sample it;
- a key may hold a list of strings (pre-split sentences); with ``split_sentences`` NLTK's punkt
  splits each text (``keep_newlines`` keeps the newlines between sentences); each non-empty
  sentence is one sequence and ``append_eod`` extends the last one;
- with ``partitions`` N the lines are dealt round-robin to N partitions (or in N contiguous
  blocks with ``keep_sequential_samples``) and the partitions are concatenated in order, so the
  output order is what Megatron-LM's merged files hold (without its intermediate files);
- tokens are uint16 when the vocabulary fits (``DType.optimal_dtype``), else int32.

Differences, on purpose: Megatron-LM finalizes only the last key's ``.idx`` (every key is
finalized here), and with ``split_sentences`` and one partition it stops after writing the split
jsonl (here both steps run in one call).

Worker processes tokenize (the expensive part); the parent writes, in output order, so the files
are byte-identical for any number of workers.
"""

from __future__ import annotations

import importlib.util
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
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer vocabulary (``--vocab-file``)."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer merges (``--merge-file``)."""
    tiktoken_pattern: Optional[str] = None
    """TikTokenizer split pattern, ``v1`` or ``v2``."""
    split_sentences: bool = False
    """Split each text into sentences with NLTK's punkt (``--split-sentences``)."""
    keep_newlines: bool = False
    """Keep the newlines between split sentences (``--keep-newlines``)."""
    lang: str = "english"
    """punkt model language (``--lang``)."""
    partitions: int = 1
    """Megatron-LM's ``--partitions``: only the output order depends on it (see module doc)."""
    keep_sequential_samples: bool = False
    """With ``partitions``: contiguous blocks instead of round-robin."""

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
        if self.workers < 1 or self.log_interval < 1 or self.partitions < 1:
            raise ValueError(
                f"need workers >= 1, log_interval >= 1 and partitions >= 1, got "
                f"workers={self.workers}, log_interval={self.log_interval}, "
                f"partitions={self.partitions}"
            )
        if self.workers % self.partitions:
            raise ValueError(f"--workers {self.workers} is not a multiple of --partitions "
                             f"{self.partitions} (Megatron-LM asserts the same)")
        if self.keep_newlines and not self.split_sentences:
            raise ValueError("--keep-newlines only applies with --split-sentences")
        if self.split_sentences and importlib.util.find_spec("nltk") is None:
            raise ValueError("--split-sentences needs the 'nltk' package (pip install nltk) and "
                             "its punkt data")

    def output_path_prefix(self, key: str) -> str:
        """The IndexedDataset prefix written for ``key``."""
        level = "sentence" if self.split_sentences else "document"
        return f"{self.output_prefix}_{key}_{level}"


@dataclass
class PreprocessResult:
    """What was written, per json key."""

    prefixes: Dict[str, str]
    """IndexedDataset prefix per key."""
    dtype: str
    """Token dtype in the .bin files (``uint16`` or ``int32``)."""
    documents: Dict[str, int] = field(default_factory=dict)
    """Documents written per key."""
    empty: Dict[str, int] = field(default_factory=dict)
    """Documents without tokens (empty text, or text tokenizing to nothing), written as empty
    documents, per key."""
    tokens: Dict[str, int] = field(default_factory=dict)
    """Tokens written per key, EOD included."""


# Per-process state of the tokenizing workers (set once by _init_worker, read by _encode_line).
_WORKER: dict = {}


def _init_worker(config: PreprocessConfig) -> None:
    _WORKER["config"] = config
    extra = {}
    if config.tokenizer_type == "GPT2BPETokenizer":
        extra = {"vocab_file": config.vocab_file, "merge_file": config.merge_file}
    elif config.tokenizer_type == "TikTokenizer" and config.tiktoken_pattern:
        extra = {"tiktoken_pattern": config.tiktoken_pattern}
    _WORKER["tokenizer"] = build_tokenizer(
        config.tokenizer_type, config.tokenizer_model, config.vocab_size, **extra
    )
    _WORKER["splitter"] = _sentence_splitter(config) if config.split_sentences else None


def _sentence_splitter(config: PreprocessConfig):
    """NLTK punkt for ``config.lang`` (from NLTK_DATA when set), as Megatron-LM loads it."""
    import nltk

    if os.environ.get("NLTK_DATA"):
        url = "file:" + os.path.join(os.environ["NLTK_DATA"], "tokenizers", "punkt",
                                     f"{config.lang}.pickle")
    else:
        url = "nltk:" + os.path.join("tokenizers", "punkt", f"{config.lang}.pickle")
    try:
        splitter = nltk.load(url)
    except LookupError as error:
        raise ValueError(f"--split-sentences: NLTK's punkt data for {config.lang!r} is not "
                         f"installed ({url}); python -m nltk.downloader punkt") from error
    if not config.keep_newlines:
        return splitter
    from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer

    class _KeepNewlines(PunktLanguageVars):
        # punkt's period context with the whitespace after a sentence end made part of the
        # sentence (\s* instead of \s+ before the next token), so newlines survive the split.
        _period_context_fmt = r"""
            \S*
            %(SentEndChars)s
            \s*
            (?=(?P<after_tok>
                %(NonWord)s
                |
                (?P<next_tok>\S+)
            ))"""

    return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=_KeepNewlines())


def _sentences(text, splitter) -> List[str]:
    if isinstance(text, list):
        return text
    if splitter is None:
        return [text]
    step = 1_000_000  # Megatron-LM splits in 1M-character pieces
    return [s for i in range(0, len(text), step) for s in splitter.tokenize(text[i:i + step])]


def _encode_line(task: Tuple[int, str]) -> Tuple[int, Dict[str, Tuple[numpy.ndarray, List[int]]]]:
    """Tokenize one jsonl line: (bytes, {key: (ids, sequence lengths)}), empty when no tokens."""
    line_number, line = task
    config: PreprocessConfig = _WORKER["config"]
    tokenizer = _WORKER["tokenizer"]
    encoded = {}
    for key, text in json_fields(line, config.json_keys, config.input, line_number):
        ids: List[int] = []
        lengths: List[int] = []
        for sentence in _sentences(text, _WORKER["splitter"]):
            try:
                sentence_ids = tokenizer.tokenize(sentence)
            except Exception as error:  # name the record: the tokenizer's own message does not
                raise ValueError(
                    f"{config.input}:{line_number} key {key!r}: tokenizing failed: {error!r}"
                ) from error
            if len(sentence_ids) > 0:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and config.append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        encoded[key] = (numpy.asarray(ids, dtype=numpy.int64), lengths)
    return len(line.encode("utf-8")), encoded


def _lines(config: PreprocessConfig):
    """(line number, line) in Megatron-LM's output order (see module doc for partitions)."""
    with open(config.input, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    n = config.partitions
    if n == 1:
        return lines
    if config.keep_sequential_samples:
        return lines  # contiguous blocks of ceil(len / n), concatenated: the input order
    return [line for p in range(n) for line in lines[p::n]]


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
        result.documents[key] = result.empty[key] = result.tokens[key] = 0

    tasks = _lines(config)
    pool = None
    if config.workers > 1:
        # fork: workers inherit the imported megatron-core (seconds to import afresh).
        pool = mp.get_context("fork").Pool(config.workers, _init_worker, (config,))
        encoded_lines = pool.imap(_encode_line, tasks, chunksize=16)
    else:
        encoded_lines = map(_encode_line, tasks)
    try:
        _write_all(encoded_lines, builders, result, config.log_interval)
    except BaseException:
        for prefix in result.prefixes.values():  # no half-written files left behind
            for suffix in (".bin.tmp", ".idx.tmp"):
                if os.path.exists(prefix + suffix):
                    os.remove(prefix + suffix)
        raise
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
            f"{result.empty[key]} of them empty",
            file=sys.stderr,
        )
    return result


def _write_all(encoded_lines, builders, result: PreprocessResult, log_interval: int) -> None:
    start = time.monotonic()
    total_bytes = 0
    count = 0
    for count, (num_bytes, encoded) in enumerate(encoded_lines, start=1):
        total_bytes += num_bytes
        for key, (ids, lengths) in encoded.items():
            builders[key].add_document(ids, lengths)
            result.documents[key] += 1
            result.empty[key] += int(ids.size == 0)
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
