"""minifsdp: fully sharded data parallel training, built up chapter by chapter.

    from minifsdp import launch, DistributedDataParallel, MemoryMeter, comm

The package, one sub-package per idea:
    distributed/  launch (the one place ranks start), comm (the one place they talk), mesh
    ddp/          chapter 1: collectives and DistributedDataParallel
    zero/         chapters 3-4: ZeRO-1 and ZeRO-2 (OSS, ShardedDataParallel, and the flat design)
    fsdp/         chapters 5-10: ZeRO-3 (FlatParameter, the runtime, prefetch, training options)
    checkpoint/   chapter 10: save and load every strategy through torch.distributed.checkpoint
    fsdp2/        chapter 11: fully_shard, per-parameter sharding on DTensor; replicate; HSDP
    parallel/     chapter 12: Megatron tensor and sequence parallelism, pipeline schedules
    measure/      chapters 2, 7, 12, 13: the meter, the analytic model, timelines, the simulator (they observe;
                  nothing above imports them)
    reports/      the tour and every chapter's report
    course/       student copies and grading
and beside them the models, the training harness (train.py), mixed precision (chapter 8) and events.py.
"""

from minifsdp.ddp import DDP, DistributedDataParallel, all_reduce_by_parts
from minifsdp.distributed import RankFailedError, comm, current_device, launch, rank_pool
from minifsdp.fsdp import FSDP, BackwardPrefetch, FullyShardedDataParallel, ModuleWrapPolicy, SizeBasedWrapPolicy
from minifsdp.measure import MemoryMeter, Timeline, analytic
from minifsdp.mixed_precision import CPUOffload, MixedPrecision, ShardedGradScaler
from minifsdp.models import GPTConfig, TinyGPT, ToyModel, gpt_batch, toy_batch
from minifsdp.state_dict import get_full_state_dict, set_full_state_dict
from minifsdp.zero import OSS, SDP, FlatOSS, FlatShardedDataParallel, ShardedDataParallel
from minifsdp.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               vocab_parallel_cross_entropy)

__version__ = "0.1.0"

# chapter 11's API, for scripts written for torch's FSDP2 (`from minifsdp import fully_shard`); loaded when
# first asked for, since it loads DTensor, which would add seconds to every rank's start
_FSDP2 = ("CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "fully_shard", "replicate")


def __getattr__(name: str):
    if name in _FSDP2:
        from minifsdp import fsdp2
        return getattr(fsdp2, name)
    raise AttributeError(f"module 'minifsdp' has no attribute {name!r}")

__all__ = ["BackwardPrefetch", "CPUOffload", "MixedPrecision", "ShardedGradScaler", "Timeline", "DDP",
           "DistributedDataParallel", "FSDP", "FlatOSS", "FlatShardedDataParallel", "FullyShardedDataParallel",
           "ModuleWrapPolicy", "SizeBasedWrapPolicy", "get_full_state_dict", "set_full_state_dict", "GPTConfig",
           "MemoryMeter", "OSS", "RankFailedError", "SDP", "ShardedDataParallel", "TinyGPT", "ToyModel",
           "all_reduce_by_parts", "analytic", "comm", "current_device", "gpt_batch", "launch", "rank_pool", "toy_batch",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "fully_shard", "replicate"]
