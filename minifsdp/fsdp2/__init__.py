"""Chapter 11: FSDP2 -- fully_shard on per-parameter DTensors (param.py: the sharding and the collectives;
fully_shard.py: the API and its hooks)."""

from minifsdp.fsdp2.fully_shard import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                        UnshardHandle, fully_shard, replicate)

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard",
           "replicate"]
