"""megatron-zeropp: ZeRO++ (qwZ, hpZ, qgZ) as the data-parallel layer beneath Megatron-Core."""

__version__ = "0.1.0"
