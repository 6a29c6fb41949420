"""The one place minifsdp starts ranks (launch), the one place it talks (comm), and device meshes (mesh)."""

from minifsdp.distributed import comm
from minifsdp.distributed.launch import RankFailedError, current_device, launch, rank_pool

__all__ = ["RankFailedError", "comm", "current_device", "launch", "rank_pool"]
