"""Which megatron-core this process runs, and whether this project was tested against it.

:data:`SUPPORTED` is the one table of the releases CI tests: the import gate below, the
dependency range in ``pyproject.toml`` (:func:`pip_requirement`), the README's "Supported
versions" and ``.ci/run``'s installs are checked against it (``tests/test_mcore_versions.py``).

Read from the installed distribution's metadata (no import of megatron-core, which takes seconds),
or from ``megatron.core.package_info`` for a source checkout on ``PYTHONPATH`` (Megatron-LM's own
way of running). Every version difference in :mod:`megatron_zeropp.mcore` branches on
:func:`at_least`, never on ``hasattr`` probing, so an untested version is refused at import
instead of running half of one version's code paths.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Release:
    """A megatron-core release CI tests, from the package registry."""

    version: str
    python: str
    """The Python CI tests it under (the registry serves 0.17+ for Python >= 3.12 only)."""


SUPPORTED: Tuple[Release, ...] = (
    Release("0.16.1", "3.11"),  # the whole suite: the README's command and the slow pass
    Release("0.17.1", "3.12"),  # the slow pass's version checks (.ci/run)
    Release("0.18.2", "3.12"),  # the slow pass's version checks (.ci/run)
    Release("0.19.2", "3.12"),  # parity, layer, checkpoint and tokenizer tests (.ci/run)
)
"""Exactly these releases; any other (0.17.0, 0.18.0, 0.19.0 on the registry, a later patch
release, a build of a Megatron-LM branch) is refused at import until CI has run it."""

ALLOW_ENV = "ZEROPP_ALLOW_UNTESTED_MCORE"


class UnsupportedMegatronCore(ImportError):
    """The installed megatron-core is not one this project was tested against."""


class MegatronCoreMissing(UnsupportedMegatronCore):
    """No megatron-core at all (the quantization kernels and collectives run without it)."""


def _parse(text: str) -> Tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if not m:
        raise UnsupportedMegatronCore(
            f"cannot read megatron-core's version {text!r}; supported: {supported_text()}")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


def supported_versions() -> Tuple[Tuple[int, int, int], ...]:
    """:data:`SUPPORTED` as (major, minor, patch) tuples, oldest first."""
    return tuple(sorted(_parse(r.version) for r in SUPPORTED))


def supported_text() -> str:
    """The supported versions, as a user reads them (``0.16.1, 0.17.1, ...``)."""
    return ", ".join(".".join(map(str, v)) for v in supported_versions())


def pip_requirement() -> str:
    """``pyproject.toml``'s dependency on megatron-core, generated from :data:`SUPPORTED`: from
    the oldest to the newest supported release, without the patch releases before each
    supported one in its minor (0.17.0, 0.18.0 and 0.18.1, ...: the registry's 0.17.0, 0.18.0
    and 0.19.0 and the hand-built 0.19.1 of earlier CI) nor a minor with no supported release.
    A patch release after a supported one inside the range (0.17.2, if it comes) cannot be
    excluded ahead of time; the import gate refuses it."""
    versions = supported_versions()
    clauses = [f">={'.'.join(map(str, versions[0]))}", f"<={'.'.join(map(str, versions[-1]))}"]
    minors = {v[:2]: v[2] for v in versions}
    for minor in range(versions[0][1], versions[-1][1] + 1):
        key = (versions[0][0], minor)
        if key not in minors:
            clauses.append(f"!={key[0]}.{key[1]}.*")
            continue
        start = 0 if key != versions[0][:2] else versions[0][2]
        clauses += [f"!={key[0]}.{key[1]}.{p}" for p in range(start, minors[key])]
    return "megatron-core" + ",".join(clauses)


def _installed_text() -> str:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        pass
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise MegatronCoreMissing(
            f"megatron-core is not installed (supported: {supported_text()})") from exc
    return package_info.__version__


def is_supported(version: Tuple[int, int, int]) -> bool:
    """Whether ``version`` is one of :data:`SUPPORTED`."""
    return tuple(version[:3]) in supported_versions()


@functools.lru_cache(maxsize=None)
def mcore_version() -> Tuple[int, int, int]:
    """The installed megatron-core's (major, minor, patch)."""
    return _parse(_installed_text())


def check_supported(require: bool = False) -> Optional[Tuple[int, int, int]]:
    """Refuse an untested megatron-core in one line (``ZEROPP_ALLOW_UNTESTED_MCORE=1``: warn and
    run; the adapter then takes the code paths of the newest supported minor at or below it).
    Without megatron-core: ``None`` (what needs it fails at its own import), or the refusal
    when ``require``."""
    try:
        version = mcore_version()
    except MegatronCoreMissing:
        if require:
            raise
        return None
    if is_supported(version):
        return version
    text = ".".join(map(str, version))
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(f"megatron-core {text} is untested with megatron-zeropp (tested: "
                      f"{supported_text()}); running anyway because {ALLOW_ENV}=1", stacklevel=2)
        return version
    raise UnsupportedMegatronCore(
        f"megatron-zeropp supports megatron-core {supported_text()}; installed: {text}, which "
        f"CI has not tested (set {ALLOW_ENV}=1 to run it anyway)")


def at_least(major: int, minor: int) -> bool:
    """Whether the installed megatron-core is ``major.minor`` or newer (the adapter's one switch
    between version code paths)."""
    return mcore_version()[:2] >= (major, minor)
