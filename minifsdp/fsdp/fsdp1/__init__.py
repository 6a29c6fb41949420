"""PyTorch FSDP1's surface around chapters 5-10's runtime: FullyShardedDataParallel with FSDP1's arguments,
sharding strategies, state dict types and summon_full_params. Chapter 6's "Coming from FSDP1" covers it."""

from minifsdp.fsdp.fsdp1.arguments import ShardingStrategy
from minifsdp.fsdp.fsdp1.model import FSDP, FullyShardedDataParallel
from minifsdp.fsdp.fsdp1.state_dict_types import (FullOptimStateDictConfig, FullStateDictConfig,
                                                  LocalStateDictConfig, OptimStateDictConfig,
                                                  ShardedStateDictConfig, StateDictType)

__all__ = ["FSDP", "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel",
           "LocalStateDictConfig", "OptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
           "StateDictType"]
