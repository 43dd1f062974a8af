"""Check ``.bin/.idx`` data files completely before training touches them.

megatron-core reads these files lazily: a ``.bin`` missing its tail trained 6 iterations and then
crashed naming no file, a corrupt ``.idx`` body gave a bare ``AssertionError``, and token ids
beyond the tokenizer's vocabulary raised ``IndexError`` at TP1 but were silently masked at TP2.
:func:`check_data_files` finds all of these at start and names the file.

The ``.idx`` layout (megatron-core's ``IndexedDataset``, little endian)::

    b"MMIDIDX\\x00\\x00"  version u64 (=1)  dtype code u8  S = sequences u64  D = documents u64
    lengths int32[S]  pointers int64[S] (byte offsets into .bin)  document_indices int64[D]

so a consistent pair has ``pointers[i+1] = pointers[i] + lengths[i] * itemsize``, ``.bin`` size
``= pointers[-1] + lengths[-1] * itemsize``, and document indices rising from 0 to S.

Every rank runs the checks (reads only, same files, same verdict); the token scan reads the whole
``.bin`` once per rank at memory bandwidth.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, List, Optional, Sequence

import numpy

from megatron_zeropp.errors import StartupError

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(_MAGIC) + 8 + 1 + 8 + 8
# megatron-core's DType codes.
_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
           6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_SCAN_CHUNK = 1 << 26  # tokens per read while looking for the largest id


def data_prefixes(*paths: Optional[Sequence[str]]) -> List[str]:
    """Every file prefix named by ``--data-path`` style values (blend weights dropped)."""
    from .datasets import parse_data_path

    prefixes: List[str] = []
    for path in paths:
        if path is not None:
            prefixes += [p for p in parse_data_path(path)[0] if p not in prefixes]
    return prefixes


def _fail(path: str, why: str) -> StartupError:
    return StartupError(f"data file {path}: {why}")


def _read_index(idx: str):
    try:
        with open(idx, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise _fail(idx, f"cannot be read ({e.strerror})") from None
    if len(raw) == 0:
        raise _fail(idx, "is empty")
    if len(raw) < _HEADER or raw[: len(_MAGIC)] != _MAGIC:
        raise _fail(idx, "is not a megatron-core .idx file (bad header)")
    version, code, sequences, documents = struct.unpack_from("<QBQQ", raw, len(_MAGIC))
    if version != 1 or code not in _DTYPES:
        raise _fail(idx, f"has version {version} and dtype code {code}; expected 1 and one of "
                         f"{sorted(_DTYPES)}")
    expected = _HEADER + sequences * (4 + 8) + documents * 8
    if len(raw) < expected:
        raise _fail(idx, f"is truncated: {len(raw)} bytes, its header ({sequences} sequences, "
                         f"{documents} document indices) needs {expected}")
    lengths = numpy.frombuffer(raw, numpy.int32, sequences, _HEADER)
    pointers = numpy.frombuffer(raw, numpy.int64, sequences, _HEADER + 4 * sequences)
    doc_index = numpy.frombuffer(raw, numpy.int64, documents, _HEADER + 12 * sequences)
    return numpy.dtype(_DTYPES[code]), lengths, pointers, doc_index


def check_pair(prefix: str) -> numpy.dtype:
    """Check one ``prefix.idx`` against itself and against ``prefix.bin``; returns the dtype."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise _fail(path, "does not exist (give the prefix without .bin/.idx, "
                              "e.g. out_text_document)")
    dtype, lengths, pointers, doc_index = _read_index(idx)
    if len(lengths) == 0:
        raise _fail(idx, "holds no documents")
    if (lengths < 0).any():
        first = int(numpy.argmax(lengths < 0))
        raise _fail(idx, f"has negative sequence lengths (first at sequence {first})")
    ends = pointers + lengths.astype(numpy.int64) * dtype.itemsize
    bad = numpy.flatnonzero(pointers[1:] != ends[:-1])
    if pointers[0] != 0 or len(bad):
        where = 0 if pointers[0] != 0 else int(bad[0]) + 1
        raise _fail(idx, f"sequence pointers are inconsistent at sequence {where} (corrupt index)")
    if doc_index[0] != 0 or doc_index[-1] != len(lengths) or (numpy.diff(doc_index) < 0).any():
        raise _fail(idx, f"document indices do not rise from 0 to {len(lengths)} (corrupt index)")
    try:
        size = os.path.getsize(bin_path)
        with open(bin_path, "rb"):
            pass
    except OSError as e:
        raise _fail(bin_path, f"cannot be read ({e.strerror})") from None
    if size != int(ends[-1]):
        raise _fail(bin_path, f"has {size} bytes but {idx} points to {int(ends[-1])} "
                              f"({'truncated' if size < ends[-1] else 'extra bytes'}; "
                              f"re-run tools/preprocess_data.py)")
    return dtype


def largest_token(bin_path: str, dtype: numpy.dtype) -> int:
    """The largest token id in a ``.bin`` (read in chunks, never all at once)."""
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r")
    try:
        return max(int(tokens[i: i + _SCAN_CHUNK].max())
                   for i in range(0, len(tokens), _SCAN_CHUNK))
    finally:
        del tokens


def check_data_files(prefixes: Iterable[str], vocab_size: int) -> None:
    """Raise :class:`StartupError` naming the file for the first bad ``.bin/.idx`` pair.

    Checks: both files exist and are readable, the index is well formed and non-empty, the
    ``.bin`` size matches the index's pointers, and no token id reaches ``vocab_size`` (the
    tokenizer's, before padding: ids in the padding are not words either).
    """
    for prefix in prefixes:
        dtype = check_pair(prefix)
        top = largest_token(prefix + ".bin", dtype)
        if top >= vocab_size:
            raise _fail(prefix + ".bin", f"holds token id {top}, but the tokenizer has "
                                         f"{vocab_size} tokens (ids 0..{vocab_size - 1}): was it "
                                         f"preprocessed with another tokenizer?")


def check_preprocess_input(path: str) -> None:
    """Refuse a preprocessing input without a single non-blank line (it made an empty dataset)."""
    try:
        with open(path, encoding="utf-8") as f:
            if any(line.strip() for line in f):
                return
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"input file {path!r} cannot be read: {e}") from None
    raise ValueError(f"input file {path!r} holds no documents (it is empty or blank): "
                     f"nothing to preprocess")
