"""Chapters 5-10: ZeRO-3 -- the FlatParameter, the FSDP runtime, overlap, precision, training options."""

from minifsdp.fsdp.checkpointing import checkpoint_module
from minifsdp.fsdp.flat_param import FlatParameter, ShardState
from minifsdp.fsdp.fsdp import FSDP, FullyShardedDataParallel
from minifsdp.fsdp.prefetch import BACKWARD_POST, BACKWARD_PRE, AllGatherLimiter, BackwardPrefetch
from minifsdp.fsdp.wrap import ModuleWrapPolicy, SizeBasedWrapPolicy

__all__ = ["FSDP", "AllGatherLimiter", "BACKWARD_POST", "BACKWARD_PRE", "BackwardPrefetch", "FlatParameter",
           "FullyShardedDataParallel", "ModuleWrapPolicy", "ShardState", "SizeBasedWrapPolicy", "checkpoint_module"]
