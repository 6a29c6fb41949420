"""Chapter 1: collectives, and DistributedDataParallel from scratch."""

from minifsdp.ddp.collectives import all_reduce_by_parts, demo_all_reduce_by_parts
from minifsdp.ddp.ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "all_reduce_by_parts", "demo_all_reduce_by_parts"]
