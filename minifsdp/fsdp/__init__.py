"""Chapters 5-10: ZeRO-3 -- the FlatParameter (5), the runtime (6), overlap (7), precision (8), training
options (9), state dicts (10); FullyShardedDataParallel puts them behind PyTorch FSDP1's surface (fsdp1/)."""

from minifsdp.fsdp.checkpointing import checkpoint_module
from minifsdp.fsdp.flat_param import FlatParameter, ShardState
from minifsdp.fsdp.fsdp1 import (FSDP, FullOptimStateDictConfig, FullStateDictConfig, FullyShardedDataParallel,
                                 LocalStateDictConfig, OptimStateDictConfig, ShardedStateDictConfig,
                                 ShardingStrategy, StateDictType)
from minifsdp.fsdp.naive import NaiveFSDP
from minifsdp.fsdp.prefetch import BACKWARD_POST, BACKWARD_PRE, AllGatherLimiter, BackwardPrefetch
from minifsdp.fsdp.runtime import FSDPUnit, TrainingState
from minifsdp.fsdp.wrap import ModuleWrapPolicy, SizeBasedWrapPolicy
from minifsdp.mixed_precision import CPUOffload, MixedPrecision, ShardedGradScaler  # as torch.distributed.fsdp has them

__all__ = ["FSDP", "AllGatherLimiter", "BACKWARD_POST", "BACKWARD_PRE", "BackwardPrefetch", "CPUOffload",
           "FSDPUnit", "FlatParameter", "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel",
           "LocalStateDictConfig", "MixedPrecision", "ModuleWrapPolicy", "NaiveFSDP", "OptimStateDictConfig",
           "ShardState", "ShardedGradScaler", "ShardedStateDictConfig", "ShardingStrategy", "SizeBasedWrapPolicy",
           "StateDictType", "TrainingState", "checkpoint_module"]
