"""Chapters 3 and 4: ZeRO-1 and ZeRO-2 -- FairScale's OSS and ShardedDataParallel, and the flat design."""

from minifsdp.zero.clip import clip_sharded_grad_norm_
from minifsdp.zero.fairscale_compat import OSS
from minifsdp.zero.flat import FlatOSS, flat_layout
from minifsdp.zero.flat_sdp import FlatShardedDataParallel
from minifsdp.zero.sdp import SDP, ShardedDataParallel

__all__ = ["OSS", "SDP", "FlatOSS", "FlatShardedDataParallel", "ShardedDataParallel", "clip_sharded_grad_norm_",
           "flat_layout"]
