"""Build the lab study's corpus from English prose that Debian packages ship (no hub download).

The seeded study needs tens of millions of tokens of natural-language text that no one here
wrote; neither PyPI nor Debian ships a web or book corpus of that size (searched: Gutenberg,
Wikipedia/wikitext, TinyStories, BookCorpus, OpenWebText, enwik, PG-19 names find only
downloaders). The largest English prose in Debian's main archive is documentation and a few
dictionaries; this tool takes 28 such packages, each under its own free licence
(:data:`PACKAGES`), for about 50M tokens:

    python tools/build_debian_corpus.py --debs /work/corpus/debs --output-dir /work/corpus/lab

It runs ``apt-get download`` for the packages missing from ``--debs``, unpacks each with
``dpkg-deb -x``, turns its files into documents (reStructuredText, Markdown, AsciiDoc and POD
as they are; HTML stripped to text and then of the lines a package's pages share (menus,
sidebars), a dictionary cut into documents of about 20 kB, GCIDE's per-sense source tags
dropped), holds out
``--valid-per-mille`` of the documents by a hash of their ids, trains a SentencePiece BPE
tokenizer (``--vocab-size``) and writes Megatron ``.bin``/``.idx`` files and a
``sample_data.json`` manifest (what ``benchmarks/lab_study.py --data-dir`` reads) with the
packages' versions and licences. The output directory stays outside git; ``--pack`` also
writes ``lab_data.tar.xz`` (tokens, tokenizer, manifest) small enough to carry to the device.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, Iterator, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

Documents = Iterator[Tuple[str, str]]


class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: List[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "dt", "dd"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def html_text(markup: str) -> str:
    """Visible text of an HTML page, one paragraph per line, blank runs collapsed."""
    parser = _Text()
    parser.feed(markup)
    text = "".join(parser.parts)
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _read(path: str) -> str:
    opener = gzip.open if path.endswith((".gz", ".dz")) else open  # dictzip is gzip
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _files(root: str, pattern: str, name: str) -> Documents:
    """Every file under ``root`` matching ``pattern``, once: packages link directories into
    each other (``usr/share/doc/x -> y``), so a recursive glob meets a file under two names
    and only the first (sorted) is kept."""
    seen = set()
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        text = _read(path)
        if text.strip():
            yield f"{name}/{os.path.relpath(path, root)}", text


def without_boilerplate(docs: List[Tuple[str, str]], max_share: float = 0.01,
                        min_docs: int = 20) -> List[Tuple[str, str]]:
    """Drop the lines that recur across a package's pages (menus, sidebars, footers that
    every generated HTML page repeats): a line found in more than ``max(min_docs,
    max_share * pages)`` pages goes from all of them; pages left empty go too."""
    counts: Dict[str, int] = {}
    for _, text in docs:
        for line in set(line.strip() for line in text.splitlines()):
            if line:
                counts[line] = counts.get(line, 0) + 1
    limit = max(min_docs, max_share * len(docs))
    out = []
    for doc_id, text in docs:
        kept = [line for line in text.splitlines() if counts.get(line.strip(), 0) <= limit]
        body = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
        if body:
            out.append((doc_id, body))
    return out


def _pages(pages: Documents) -> List[Tuple[str, str]]:
    """HTML pages (id, markup) as documents: their visible text, without the lines the
    package's pages share (:func:`without_boilerplate`); pages without text go."""
    docs = [(doc_id, html_text(markup)) for doc_id, markup in pages]
    return without_boilerplate([(d, t) for d, t in docs if t])


def _html(patterns: Tuple[str, ...], name: str) -> Callable[[str], Documents]:
    """Documents of the HTML pages under a package's root matching ``patterns``
    (:func:`_pages`)."""
    def documents(root: str) -> Documents:
        yield from _pages(page for pattern in patterns
                          for page in _files(root, pattern, name))
    return documents


def _text(patterns: Tuple[str, ...], name: str) -> Callable[[str], Documents]:
    """Documents of the text files (reStructuredText or Markdown sources) under a package's
    root matching ``patterns``, as they are."""
    def documents(root: str) -> Documents:
        for pattern in patterns:
            yield from _files(root, pattern, name)
    return documents


def _kernel(root: str) -> Documents:
    base = glob.glob(os.path.join(root, "usr/share/doc/linux-doc-*/Documentation"))[0]
    for pattern in ("**/*.rst.gz", "**/*.rst", "**/*.txt.gz", "**/*.txt"):
        yield from _files(base, pattern, "linux-doc")


def _python(root: str) -> Documents:
    base = glob.glob(os.path.join(root, "usr/share/doc/python3*/html/_sources"))[0]
    yield from _files(base, "**/*.txt", "python-doc")


def _postgresql(root: str) -> Documents:
    base = glob.glob(os.path.join(root, "usr/share/doc/postgresql-doc-*/html"))[0]
    yield from _pages(_files(base, "*.html", "postgresql-doc"))


def _git(root: str) -> Documents:
    yield from _files(os.path.join(root, "usr/share/doc/git-doc"), "**/*.txt", "git-doc")


def _perl(root: str) -> Documents:
    yield from _files(os.path.join(root, "usr/share/perl"), "**/*.pod", "perl-doc")


# The source tag dictd puts after every sense ("[1913 Webster]", "[WordNet 1.5]", ...).
_GCIDE_SOURCE = re.compile(r"^[ \t]*\[[^\]\n]{1,40}\][ \t]*$", re.MULTILINE)


def _chunks(text: str, name: str) -> Documents:
    """A dictionary's entries as documents of about 20 kB each."""
    chunk: List[str] = []
    size, n = 0, 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        chunk.append(para)
        size += len(para)
        if size > 20_000:
            yield f"{name}/{n:06d}", "\n\n".join(chunk)
            chunk, size, n = [], 0, n + 1
    if chunk:
        yield f"{name}/{n:06d}", "\n\n".join(chunk)


def _gcide(root: str) -> Documents:
    """The dictionary (dictd's plain-text rendering), without the source tag under every
    sense."""
    yield from _chunks(
        _GCIDE_SOURCE.sub("", _read(os.path.join(root, "usr/share/dictd/gcide.dict.dz"))),
        "gcide")


def _dictd(name: str) -> Callable[[str], Documents]:
    def documents(root: str) -> Documents:
        yield from _chunks(_read(os.path.join(root, f"usr/share/dictd/{name}.dict.dz")), name)
    return documents


def _sphinx_sources(name: str) -> Callable[[str], Documents]:
    """A Sphinx-built documentation package's sources (``_sources/**/*.txt``: the
    reStructuredText its pages were made from, without their menus)."""
    return _text(("usr/share/doc/**/_sources/**/*.txt",), name)


_RUST_BOOKS = ("book", "reference", "nomicon", "rust-by-example", "edition-guide",
               "embedded-book", "rustc", "rustdoc", "unstable-book")


# package: (licence as its Debian copyright file states it, documents)
PACKAGES: Dict[str, Tuple[str, Callable[[str], Documents]]] = {
    "linux-doc-6.12": ("GPL-2.0 (the Linux kernel's Documentation/)", _kernel),
    "dict-gcide": ("GPL-3+ (GNU Collaborative International Dictionary of English: Webster's "
                   "1913 and WordNet additions)", _gcide),
    "python3.11-doc": ("PSF-2.0 (Python 3.11 documentation sources)", _python),
    "postgresql-doc-15": ("PostgreSQL licence (PostgreSQL 15 manual)", _postgresql),
    "perl-doc": ("GPL-1+ or Artistic (Perl 5.36 POD manuals)", _perl),
    "git-doc": ("GPL-2.0 (Git manual pages and guides, AsciiDoc)", _git),
    "erlang-doc": ("Apache-2.0 (Erlang/OTP documentation, HTML)",
                   _html(("usr/share/doc/erlang-doc/**/*.html",), "erlang-doc")),
    "rust-doc": ("MIT or Apache-2.0 (the Rust books: the book, the reference, the Rustonomicon, "
                 "Rust by Example and others; not the API pages)",
                 _html(tuple(f"usr/share/doc/rust-doc/html/{b}/**/*.html" for b in _RUST_BOOKS),
                       "rust-doc")),
    "python-scipy-doc": ("BSD-3-clause (SciPy documentation, HTML)",
                         _html(("usr/share/doc/python-scipy-doc/html/**/*.html",),
                               "python-scipy-doc")),
    "python-sqlalchemy-doc": ("Expat (SQLAlchemy documentation, HTML)",
                              _html(("usr/share/doc/python-sqlalchemy-doc/html/**/*.html",),
                                    "python-sqlalchemy-doc")),
    "python-django-doc": ("BSD-3-Clause (Django documentation, HTML)",
                          _html(("usr/share/doc/python-django-doc/html/**/*.html",),
                                "python-django-doc")),
    "python-sklearn-doc": ("BSD-3-Clause (scikit-learn documentation sources)",
                           _sphinx_sources("python-sklearn-doc")),
    "python-pandas-doc": ("BSD-3 (pandas documentation sources)",
                          _sphinx_sources("python-pandas-doc")),
    "python-statsmodels-doc": ("BSD-3 (statsmodels documentation sources)",
                               _sphinx_sources("python-statsmodels-doc")),
    "python-astropy-doc": ("BSD-3-Clause (Astropy documentation sources)",
                           _sphinx_sources("python-astropy-doc")),
    "python-pytest-doc": ("Expat (pytest documentation sources)",
                          _sphinx_sources("python-pytest-doc")),
    "python-sympy-doc": ("BSD-3-clause (SymPy documentation sources)",
                         _sphinx_sources("python-sympy-doc")),
    "python-dask-doc": ("BSD-3-Clause (Dask documentation sources)",
                        _sphinx_sources("python-dask-doc")),
    "python-xarray-doc": ("Apache-2.0 (xarray documentation sources)",
                          _sphinx_sources("python-xarray-doc")),
    "sphinx-doc": ("BSD-2-clause (Sphinx documentation sources)",
                   _sphinx_sources("sphinx-doc")),
    "python-flask-doc": ("BSD-3-clause (Flask documentation sources)",
                         _sphinx_sources("python-flask-doc")),
    "sqlite3-doc": ("public domain (SQLite documentation, HTML)",
                    _html(("usr/share/doc/sqlite3/**/*.html",), "sqlite3-doc")),
    "libreoffice-help-en-us": ("MPL-2.0 (LibreOffice help, English, HTML)",
                               _html(("usr/share/libreoffice/help/en-US/**/*.html",),
                                     "libreoffice-help-en-us")),
    "nodejs-doc": ("Expat (Node.js API documentation, Markdown)",
                   _text(("usr/share/doc/nodejs/api/*.md.gz", "usr/share/doc/nodejs/api/*.md"),
                         "nodejs-doc")),
    "r-doc-html": ("GPL-2 (the R manuals, HTML)",
                   _html(("usr/share/doc/r-doc-html/manual/*.html",), "r-doc-html")),
    "debian-handbook": ("GPL-2.0+ or CC-BY-SA-3.0 (The Debian Administrator's Handbook, "
                        "English, HTML)",
                        _html(("usr/share/doc/debian-handbook/html/en-US/*.html",),
                              "debian-handbook")),
    "dict-foldoc": ("GFDL-1.1+ (Free On-line Dictionary of Computing, dictd's text)",
                    _dictd("foldoc")),
    "dict-jargon": ("public domain (the Jargon File, dictd's text)", _dictd("jargon")),
}


def fetch(debs: str, download: bool) -> Dict[str, str]:
    """{package: its .deb in ``debs``}, running ``apt-get download`` for the missing ones."""
    os.makedirs(debs, exist_ok=True)
    found = {}
    for package in PACKAGES:
        hits = sorted(glob.glob(os.path.join(debs, f"{package}_*.deb")))
        if not hits and download:
            subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
            hits = sorted(glob.glob(os.path.join(debs, f"{package}_*.deb")))
        if not hits:
            raise ValueError(f"no {package}_*.deb in {debs} (run without --no-download)")
        found[package] = hits[-1]
    return found


def _hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")


def write_documents(debs: Dict[str, str], out_dir: str, valid_per_mille: int
                    ) -> Tuple[str, str, Dict[str, dict]]:
    """Unpack each package and write the train/valid jsonl; per package: documents, bytes."""
    paths = [os.path.join(out_dir, f"corpus_{s}.jsonl") for s in ("train", "valid")]
    stats: Dict[str, dict] = {}
    with open(paths[0], "w") as train, open(paths[1], "w") as valid:
        for package, deb in debs.items():
            licence, documents = PACKAGES[package]
            with tempfile.TemporaryDirectory() as root:
                subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
                docs = sorted(documents(root))
            for doc_id, text in docs:
                held_out = _hash(doc_id) % 1000 < valid_per_mille
                (valid if held_out else train).write(
                    json.dumps({"id": doc_id, "text": text}) + "\n")
            stats[package] = {"deb": os.path.basename(deb), "licence": licence,
                              "documents": len(docs), "bytes": sum(len(t) for _, t in docs)}
            print(f"{package}: {len(docs)} documents, {stats[package]['bytes'] / 1e6:.1f} MB",
                  flush=True)
    return paths[0], paths[1], stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--debs", required=True, help="where the .deb files are (or go)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--no-download", action="store_true")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--valid-per-mille", type=int, default=10)
    p.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="sentences SentencePiece trains on (sampled)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pack", action="store_true", help="also write lab_data.tar.xz")
    args = p.parse_args(argv)
    from megatron_zeropp.data.documents import iter_documents
    from megatron_zeropp.data.preprocess import PreprocessConfig, preprocess
    from megatron_zeropp.data.tokenizer_training import (
        TokenizerTrainingConfig,
        train_sentencepiece,
    )

    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    try:
        debs = fetch(os.path.abspath(args.debs), not args.no_download)
    except (ValueError, subprocess.CalledProcessError) as e:
        p.error(str(e))
    train_jsonl, valid_jsonl, stats = write_documents(debs, out, args.valid_per_mille)
    model = train_sentencepiece(
        iter_documents(train_jsonl), os.path.join(out, "tokenizer"),
        TokenizerTrainingConfig(vocab_size=args.vocab_size, model_type="bpe",
                                max_sentences=args.max_sentences, num_threads=args.workers))
    results = {}
    for split, jsonl in (("train", train_jsonl), ("valid", valid_jsonl)):
        results[split] = preprocess(PreprocessConfig(
            input=jsonl, output_prefix=os.path.join(out, f"lab_{split}"),
            tokenizer_type="SentencePieceTokenizer", tokenizer_model=model, append_eod=True,
            workers=args.workers, log_interval=10**9))
    data = {"tokenizer_model": model,
            "train_data_prefix": results["train"].prefixes["text"],
            "valid_data_prefix": results["valid"].prefixes["text"],
            "vocab_size": args.vocab_size,
            "train_documents": results["train"].documents["text"],
            "valid_documents": results["valid"].documents["text"],
            "train_tokens": results["train"].tokens["text"],
            "valid_tokens": results["valid"].tokens["text"]}
    with open(os.path.join(out, "sample_data.json"), "w") as f:
        json.dump({"data": data, "packages": stats}, f, indent=1)
    print(json.dumps(data, indent=1))
    if args.pack:
        names = ["sample_data.json", os.path.basename(model)] + [
            os.path.basename(data[k]) + ext for k in ("train_data_prefix", "valid_data_prefix")
            for ext in (".bin", ".idx")]
        subprocess.run(["tar", "cJf", "lab_data.tar.xz"] + names, cwd=out, check=True)
        print(f"packed {os.path.join(out, 'lab_data.tar.xz')}: "
              f"{os.path.getsize(os.path.join(out, 'lab_data.tar.xz')) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
