"""Which megatron-core this process runs, and whether this project was tested against it.

Read from the installed distribution's metadata (no import of megatron-core, which takes seconds),
or from ``megatron.core.package_info`` for a source checkout on ``PYTHONPATH`` (Megatron-LM's own
way of running). Every version difference in :mod:`megatron_zeropp.mcore` branches on
:func:`mcore_version`, never on ``hasattr`` probing, so an untested version is refused at import
instead of running half of one version's code paths.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Optional, Tuple

# (major, minor, patch or None for "any patch release"): the versions the CPU suite and a GPU run
# were checked against. 0.17 and 0.18 are not tested and therefore refused.
SUPPORTED: Tuple[Tuple[int, int, object], ...] = ((0, 16, 1), (0, 19, None))
ALLOW_ENV = "ZEROPP_ALLOW_UNTESTED_MCORE"


class UnsupportedMegatronCore(ImportError):
    """The installed megatron-core is not one this project was tested against."""


class MegatronCoreMissing(UnsupportedMegatronCore):
    """No megatron-core at all (the quantization kernels and collectives run without it)."""


def supported_text() -> str:
    """The supported versions, as a user reads them (``0.16.1, 0.19.x``)."""
    return ", ".join(f"{a}.{b}.{'x' if c is None else c}" for a, b, c in SUPPORTED)


def _parse(text: str) -> Tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if not m:
        raise UnsupportedMegatronCore(
            f"cannot read megatron-core's version {text!r}; supported: {supported_text()}")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


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
    return any(version[:2] == (a, b) and (c is None or version[2] == c) for a, b, c in SUPPORTED)


@functools.lru_cache(maxsize=None)
def mcore_version() -> Tuple[int, int, int]:
    """The installed megatron-core's (major, minor, patch)."""
    return _parse(_installed_text())


def check_supported(require: bool = False) -> Optional[Tuple[int, int, int]]:
    """Refuse an untested megatron-core in one line (``ZEROPP_ALLOW_UNTESTED_MCORE=1``: warn and
    run; the adapter then takes the newest tested version's code paths). Without megatron-core:
    ``None`` (what needs it fails at its own import), or the refusal when ``require``."""
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
        f"megatron-zeropp supports megatron-core {supported_text()}; installed: {text} "
        f"(set {ALLOW_ENV}=1 to run an untested version)")


def at_least(major: int, minor: int) -> bool:
    """Whether the installed megatron-core is ``major.minor`` or newer (the adapter's one switch
    between version code paths)."""
    return mcore_version()[:2] >= (major, minor)
