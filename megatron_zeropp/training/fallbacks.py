"""megatron-core's "Apex / Transformer Engine not installed, falling back" warnings, said once.

megatron-core warns from a dozen modules at import, on every rank (48 of the CPU demo's 157 log
lines). They are expected wherever those packages are absent, so they are silenced and rank 0
prints one line instead.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Optional

_FALLBACK = r".*(Transformer Engine|Apex|apex)\b.*not installed"


def silence_fallback_warnings() -> None:
    """Filter megatron-core's fallback warnings (call before megatron-core is imported)."""
    warnings.filterwarnings("ignore", message=_FALLBACK)


def fallback_summary() -> Optional[str]:
    """The one line that replaces them, or None when both packages are installed."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"),
                                         ("apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"> note: not installed: {' and '.join(missing)}; megatron-core uses its torch "
            "fallbacks (norms, optimizer, fused kernels)")
