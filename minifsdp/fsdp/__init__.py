"""Chapters 5-10: ZeRO-3 -- the FlatParameter, the FSDP runtime, overlap, precision, training options."""

from minifsdp.fsdp.api import (FullOptimStateDictConfig, FullStateDictConfig, LocalStateDictConfig,
                               OptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy, StateDictType)
from minifsdp.fsdp.checkpointing import checkpoint_module
from minifsdp.fsdp.flat_param import FlatParameter, ShardState
from minifsdp.fsdp.fsdp import FSDP, FullyShardedDataParallel
from minifsdp.fsdp.prefetch import BACKWARD_POST, BACKWARD_PRE, AllGatherLimiter, BackwardPrefetch
from minifsdp.fsdp.wrap import ModuleWrapPolicy, SizeBasedWrapPolicy
from minifsdp.mixed_precision import CPUOffload, MixedPrecision, ShardedGradScaler  # as torch.distributed.fsdp has them

__all__ = ["FSDP", "AllGatherLimiter", "BACKWARD_POST", "BACKWARD_PRE", "BackwardPrefetch", "CPUOffload",
           "FlatParameter", "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel",
           "LocalStateDictConfig", "MixedPrecision", "ModuleWrapPolicy", "OptimStateDictConfig", "ShardState",
           "ShardedGradScaler", "ShardedStateDictConfig", "ShardingStrategy", "SizeBasedWrapPolicy", "StateDictType",
           "checkpoint_module"]
