"""Corpora built from text that ships with Python (no download), and a cached data pipeline.

``corpus="docs"`` (the default, ~2 MB of English and code) has these documents:

- every topic of ``pydoc_data.topics`` (the language reference help text ``help()`` shows), one
  document per topic;
- one document per standard-library source module: its docstring, then each class and function
  docstring under a ``class Name(bases)`` / ``def Name.method(args)`` heading. The source is parsed
  with :mod:`ast`, never imported (importing ``antigravity`` opens a browser, ``this`` prints).

``corpus="sources"`` adds whole source files, for runs that need tens of millions of tokens: every
``.py`` file of the standard library (tests included) and of the interpreter's installed packages
(``purelib``), taken in hash order until ``max_source_bytes``; one document per file.

The text is deterministic for a given Python version (and, with ``sources``, installed packages; the
stdlib changes between versions, so the version is part of the cache key). About 3 % of the
documents (the 30 of ``--split 969,30,1``), chosen by a hash of their id, are held out for
validation; the training file is ordered by the same hash, so Megatron's contiguous ``--split``
ranges also mix topics and modules.

:func:`prepare_sample_data` runs corpus -> SentencePiece tokenizer -> ``.bin``/``.idx`` once per
work directory and returns the cached paths afterwards (about 5 s on two cores, most of it
importing megatron-core and parsing the stdlib).
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, List, Tuple

CORPUS_VERSION = 1
CORPORA = ("docs", "sources")
"""Bump when the document extraction changes, so cached work directories are rebuilt."""

_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "turtledemo", "__pycache__"}


def _topic_documents() -> Iterator[Tuple[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc-topic:{name}", topics[name].strip()


def _stdlib_files() -> List[Tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS & set(relative.parts[:-1]) or relative.parts[0].startswith("config-"):
            continue
        if path.name.startswith("test_"):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        files.append((module, path))
    return sorted(files)


def _docstring_sections(body, qualifier: str) -> List[str]:
    """``heading\ndocstring`` for each documented class/function in ``body``, methods included."""
    sections = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(base) for base in node.bases)
            heading = f"class {qualifier}{node.name}({bases})"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            heading = f"def {qualifier}{node.name}({ast.unparse(node.args)})"
        else:
            continue
        doc = ast.get_docstring(node)
        if doc:
            sections.append(f"{heading}\n{doc}")
        # Methods and nested classes, but not functions nested in functions (implementation
        # details, rarely documented).
        if isinstance(node, ast.ClassDef):
            sections += _docstring_sections(node.body, f"{qualifier}{node.name}.")
    return sections


def _module_documents(module: str, source: bytes) -> List[Tuple[str, str]]:
    """``(doc_id, text)`` documents of one source module.

    One document for the module (its docstring and module-level functions) and one per
    top-level class (class and method docstrings), so a document is a unit a reader would take
    in at once and the held-out split has enough of them.
    """
    tree = ast.parse(source)
    module_doc = ast.get_docstring(tree)
    module_parts = [module_doc] if module_doc else []
    documents = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            sections = _docstring_sections([node], f"{module}.")
            if sections:
                documents.append((f"stdlib:{module}.{node.name}", "\n\n".join(sections)))
        else:
            module_parts += _docstring_sections([node], "")
    if module_parts:
        text = "\n\n".join([f"Module {module}"] + module_parts)
        documents.insert(0, (f"stdlib:{module}", text))
    return documents


def iter_sample_documents() -> Iterator[Tuple[str, str]]:
    """``(doc_id, text)`` for every document, in a fixed order (topics, then modules)."""
    yield from _topic_documents()
    for module, path in _stdlib_files():
        try:
            documents = _module_documents(module, path.read_bytes())
        except (SyntaxError, ValueError):
            continue  # a few stdlib files are deliberately invalid (e.g. lib2to3 test data)
        yield from documents


def _source_roots() -> List[Path]:
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    # A venv's purelib lies outside the stdlib; the base interpreter's lies inside it. Either way
    # each file is read once (below, by resolved path).
    return roots


def iter_source_documents(max_bytes: int) -> Iterator[Tuple[str, str]]:
    """``("source:<path>", text)`` of whole ``.py`` files, in hash order, up to ``max_bytes``.

    Unreadable or non-UTF-8 files and exact duplicates (vendored copies) are skipped.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    files = {}
    for root in _source_roots():
        for path in root.rglob("*.py"):
            resolved = path.resolve()
            doc_id = f"source:{path.relative_to(root).as_posix()}"
            files.setdefault(resolved, doc_id)
    seen, total = set(), 0
    for resolved, doc_id in sorted(files.items(), key=lambda item: (_hash(item[1]), item[1])):
        try:
            text = resolved.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            continue
        total += size
        yield doc_id, text


def _corpus_documents(corpus: str, max_source_bytes: int) -> Iterator[Tuple[str, str]]:
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    yield from iter_sample_documents()
    if corpus == "sources":
        yield from iter_source_documents(max_source_bytes)


def _hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")


def write_sample_corpus(
    output_dir: str, valid_per_mille: int = 30, corpus: str = "docs",
    max_source_bytes: int = 80 * 10**6,
) -> Tuple[str, str, int, int]:
    """Write ``sample_corpus_train.jsonl`` and ``sample_corpus_valid.jsonl`` into ``output_dir``.

    Each line is ``{"id": ..., "text": ...}``. A document is held out when its id's hash mod 1000
    is below ``valid_per_mille``. Returns ``(train_path, valid_path, train_docs, valid_docs)``.
    """
    if not 0 < valid_per_mille < 1000:
        raise ValueError(f"valid_per_mille must be in 1..999, got {valid_per_mille}")
    documents = sorted(_corpus_documents(corpus, max_source_bytes),
                       key=lambda item: (_hash(item[0]), item[0]))
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, f"sample_corpus_{name}.jsonl") for name in ("train", "valid")]
    counts = [0, 0]
    with open(paths[0] + ".tmp", "w", encoding="utf-8") as train, open(
        paths[1] + ".tmp", "w", encoding="utf-8"
    ) as valid:
        for doc_id, text in documents:
            held_out = _hash(doc_id) % 1000 < valid_per_mille
            (valid if held_out else train).write(json.dumps({"id": doc_id, "text": text}) + "\n")
            counts[held_out] += 1
    for path in paths:
        os.replace(path + ".tmp", path)
    return paths[0], paths[1], counts[0], counts[1]


@dataclass(frozen=True)
class SampleData:
    """Paths of a prepared sample-data work directory."""

    tokenizer_model: str
    """SentencePiece model (``--tokenizer-type SentencePieceTokenizer --tokenizer-model``)."""
    train_data_prefix: str
    """IndexedDataset prefix of the training documents (``--data-path``)."""
    valid_data_prefix: str
    """IndexedDataset prefix of the held-out documents (``--valid-data-path``)."""
    vocab_size: int
    """Tokenizer vocabulary size (before Megatron's padding)."""
    train_documents: int
    valid_documents: int
    train_tokens: int
    valid_tokens: int


def _cache_key(vocab_size: int, valid_per_mille: int, corpus: str = "docs",
               max_source_bytes: int = 0) -> dict:
    key = {
        "corpus_version": CORPUS_VERSION,
        "python": platform.python_version(),
        "vocab_size": vocab_size,
        "valid_per_mille": valid_per_mille,
    }
    if corpus != "docs":  # keeps the key (and so the caches) of the docs corpus as it was
        key.update(corpus=corpus, max_source_bytes=max_source_bytes)
    return key


def prepare_sample_data(
    work_dir: str, vocab_size: int = 4096, valid_per_mille: int = 30, corpus: str = "docs",
    max_source_bytes: int = 80 * 10**6, workers: int = 1,
) -> SampleData:
    """Build corpus -> tokenizer -> ``.bin``/``.idx`` in ``work_dir`` once; reuse it afterwards.

    Safe to call from several processes at once (e.g. every rank): an exclusive file lock makes one
    build while the others wait, then read the finished manifest. Rebuilds when the Python version,
    ``CORPUS_VERSION`` or the arguments differ from the cached build. ``workers`` > 1 tokenizes
    in that many processes (only from a process that may fork, e.g. the command-line tool).
    """
    work_dir = os.path.abspath(work_dir)
    os.makedirs(work_dir, exist_ok=True)
    manifest_path = os.path.join(work_dir, "sample_data.json")
    key = _cache_key(vocab_size, valid_per_mille, corpus, max_source_bytes)
    with open(os.path.join(work_dir, ".sample_data.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_manifest(manifest_path, key)
        if cached is not None:
            return cached
        data = _build(work_dir, vocab_size, valid_per_mille, corpus, max_source_bytes, workers)
        with open(manifest_path + ".tmp", "w") as f:
            json.dump({"key": key, "data": asdict(data)}, f, indent=1)
        os.replace(manifest_path + ".tmp", manifest_path)
        return data


def _read_manifest(path: str, key: dict):
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("key") != key:
        return None
    data = SampleData(**manifest["data"])
    prefixes = (data.train_data_prefix, data.valid_data_prefix)
    files = [data.tokenizer_model] + [p + suffix for p in prefixes for suffix in (".bin", ".idx")]
    return data if all(os.path.isfile(f) for f in files) else None


def _build(work_dir: str, vocab_size: int, valid_per_mille: int, corpus: str,
           max_source_bytes: int, workers: int) -> SampleData:
    from .documents import iter_documents
    from .preprocess import PreprocessConfig, preprocess
    from .tokenizer_training import TokenizerTrainingConfig, train_sentencepiece

    train_jsonl, valid_jsonl, _, _ = write_sample_corpus(
        work_dir, valid_per_mille, corpus, max_source_bytes)
    model = train_sentencepiece(
        iter_documents(train_jsonl),
        os.path.join(work_dir, "sample_tokenizer"),
        # A few hundred MB of sentences would take the trainer minutes and GBs; a sample of
        # lines gives the same merges for a vocabulary this small.
        TokenizerTrainingConfig(vocab_size=vocab_size, model_type="bpe",
                                **({"max_sentences": 2_000_000} if corpus == "sources" else {})),
    )
    results = {}
    for split, jsonl in (("train", train_jsonl), ("valid", valid_jsonl)):
        # One worker: this may run inside a training process that already has threads (gloo),
        # where forking is unsafe; tokenizing 2 MB takes about a second anyway.
        results[split] = preprocess(
            PreprocessConfig(
                input=jsonl,
                output_prefix=os.path.join(work_dir, f"sample_{split}"),
                tokenizer_type="SentencePieceTokenizer",
                tokenizer_model=model,
                append_eod=True,
                workers=workers,
                log_interval=10**9,
            )
        )
    return SampleData(
        tokenizer_model=model,
        train_data_prefix=results["train"].prefixes["text"],
        valid_data_prefix=results["valid"].prefixes["text"],
        vocab_size=vocab_size,
        train_documents=results["train"].documents["text"],
        valid_documents=results["valid"].documents["text"],
        train_tokens=results["train"].tokens["text"],
        valid_tokens=results["valid"].tokens["text"],
    )
