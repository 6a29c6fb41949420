"""minifsdp: fully sharded data parallel training, built up chapter by chapter.

    from minifsdp import launch, DistributedDataParallel, MemoryMeter, comm
"""

from minifsdp import analytic, comm
from minifsdp.ddp import DDP, DistributedDataParallel, all_reduce_by_parts
from minifsdp.launch import RankFailedError, current_device, launch
from minifsdp.flat import FlatOSS, FlatShardedDataParallel
from minifsdp.fsdp import FSDP, BackwardPrefetch, FullyShardedDataParallel, ModuleWrapPolicy, SizeBasedWrapPolicy
from minifsdp.meter import MemoryMeter
from minifsdp.mixed_precision import CPUOffload, MixedPrecision, ShardedGradScaler
from minifsdp.oss import OSS
from minifsdp.timeline import Timeline
from minifsdp.sdp import SDP, ShardedDataParallel
from minifsdp.models import GPTConfig, TinyGPT, ToyModel, gpt_batch, toy_batch
from minifsdp.state_dict import get_full_state_dict, set_full_state_dict

__version__ = "0.1.0"

__all__ = ["BackwardPrefetch", "CPUOffload", "MixedPrecision", "ShardedGradScaler", "Timeline", "DDP", "DistributedDataParallel", "FSDP", "FlatOSS", "FlatShardedDataParallel",
           "FullyShardedDataParallel", "ModuleWrapPolicy", "SizeBasedWrapPolicy", "get_full_state_dict",
           "set_full_state_dict", "GPTConfig", "MemoryMeter", "OSS", "RankFailedError", "SDP", "ShardedDataParallel", "TinyGPT",
           "ToyModel", "all_reduce_by_parts", "analytic", "comm", "current_device", "gpt_batch", "launch",
           "toy_batch"]
