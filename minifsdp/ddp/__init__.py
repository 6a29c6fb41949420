"""Chapter 1: collectives, and DistributedDataParallel from scratch: naive first, then as torch builds it."""

from minifsdp.ddp.collectives import all_reduce_by_parts, demo_all_reduce_by_parts
from minifsdp.ddp.ddp import DDP, DistributedDataParallel
from minifsdp.ddp.naive import NaiveDDP

__all__ = ["DDP", "DistributedDataParallel", "NaiveDDP", "all_reduce_by_parts", "demo_all_reduce_by_parts"]
