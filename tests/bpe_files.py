"""Tiny byte-level BPE vocabularies in the file formats of GPT-2 (vocab.json + merges.txt) and
tiktoken (a JSON list of ranks), for tests that must not download the real ones."""

from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Tuple

MERGES: List[Tuple[str, str]] = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]


def byte_symbols() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_gpt2_files(directory: str) -> Tuple[str, str]:
    """(vocab.json, merges.txt): 256 byte symbols, the merged pairs, then <|endoftext|>."""
    symbols = list(byte_symbols().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file = os.path.join(directory, "gpt2-vocab.json")
    merge_file = os.path.join(directory, "gpt2-merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return vocab_file, merge_file


def write_tiktoken_file(directory: str) -> str:
    """A tiktoken vocabulary of the 256 single bytes plus a few merges (ranks in merge order)."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"in"]
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]
    path = os.path.join(directory, "tiktoken.json")
    with open(path, "w") as f:
        json.dump(entries, f)
    return path
