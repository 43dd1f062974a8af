"""megatron-zeropp: ZeRO++ (qwZ, hpZ, qgZ) as the data-parallel layer beneath Megatron-Core."""

from megatron_zeropp.mcore.version import check_supported as _check_supported

__version__ = "0.1.0"

# An untested megatron-core is refused here, in one line, before any of it runs
# (ZEROPP_ALLOW_UNTESTED_MCORE=1 warns instead).
_check_supported()
