"""Chapter 11: FSDP2 -- per-parameter sharding on DTensors. simple.py: the naive version, a parametrization
that all-gathers each parameter as it is read; then fully_shard, built up by named steps: param.py (the
sharding and the collectives of one module's parameters), runtime.py (each module's state and hooks, and
the root's), fully_shard.py (the API)."""

from minifsdp.fsdp2.fully_shard import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                        UnshardHandle, fully_shard, replicate)
from minifsdp.fsdp2.simple import simple_fsdp

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard",
           "replicate", "simple_fsdp"]
