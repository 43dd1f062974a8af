"""The error diagnostics' JSON-lines files (--zeropp-qgz-error-log, --zeropp-qwz-error-log)."""

from __future__ import annotations

import json


def append_error(path: str, iteration: int, report: dict) -> None:
    """Append ``{"iteration", "units": {unit: relative error}, "total"}`` as one JSON line."""
    line = {"iteration": iteration, "units": report["units"], "total": report["total"]}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
