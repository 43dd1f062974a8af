"""Documents from jsonl or plain-text files, as Megatron-LM's tools read them.

A jsonl line is one JSON object; each key named in ``--json-keys`` holds one document (a string).
Errors name the file, the line and the key, so a bad record in a large corpus can be found.
"""

from __future__ import annotations

import json
from typing import Iterator, Sequence


def iter_documents(
    path: str, json_keys: Sequence[str] = ("text",), input_format: str = "auto"
) -> Iterator[str]:
    """Yield the text documents of ``path``.

    ``input_format`` is ``jsonl`` (one JSON object per line; every key in ``json_keys`` is one
    document), ``text`` (the whole file is one document), or ``auto`` (``jsonl`` for ``.jsonl`` /
    ``.json`` files, else ``text``).
    """
    if input_format == "auto":
        input_format = "jsonl" if path.endswith((".jsonl", ".json")) else "text"
    if input_format == "text":
        with open(path, encoding="utf-8") as f:
            yield f.read()
        return
    if input_format != "jsonl":
        raise ValueError(f"input_format must be auto, jsonl or text, got {input_format!r}")
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            for _, text in json_fields(line, json_keys, path, line_number):
                yield text if isinstance(text, str) else "\n".join(text)


def json_fields(line: str, json_keys: Sequence[str], path: str, line_number: int):
    """``(key, text)`` for each of ``json_keys`` in one jsonl line; ValueError naming the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number} is not valid JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{line_number} holds a {type(record).__name__}, not an object")
    for key in json_keys:
        if key not in record:
            raise ValueError(
                f"{path}:{line_number} has no key {key!r} (keys: {sorted(record)[:10]})"
            )
        value = record[key]
        # A list of strings is a pre-split document (sentences), as Megatron-LM's tool takes it.
        if not isinstance(value, str) and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise ValueError(
                f"{path}:{line_number} key {key!r} holds a {type(record[key]).__name__}, "
                "not a string (or a list of strings)"
            )
        yield key, record[key]
