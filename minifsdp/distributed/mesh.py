"""Device meshes: the ranks arranged in a grid, one process group per row and per column.

Data parallelism alone needs one group, the world. Chapters 11 and 12 need several at once: HSDP shards
inside a node and replicates across nodes, tensor parallelism splits layers inside a group while data
parallelism runs across groups, pipeline stages each hold a data-parallel group. A mesh names them:

    mesh = init_mesh((2, 2), ("replicate", "shard"))   # 4 ranks: [[0, 1], [2, 3]]
    mesh.get_group("shard")        # rank 2's is {2, 3}: the ranks in its row
    mesh.get_group("replicate")    # rank 2's is {0, 2}: the ranks in its column
    DistributedDataParallel(model, process_group=mesh.get_group("shard"))

It is torch's DeviceMesh (`init_device_mesh`, which runs on CPU + gloo as on CUDA + NCCL); this module only
picks the device type from the launcher and names each dimension's group in the byte counter after the
dimension, so `counter.by_group["shard"]` is what this rank sent inside its row.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device


def init_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A mesh of `shape` over every rank (row-major: rank r sits at the r-th cell), one named group per
    dimension. Every rank must call it, with the same arguments (it creates process groups)."""
    shape, names = tuple(shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"init_mesh: {len(shape)} dimensions {shape} but {len(names)} names {names}")
    total = 1
    for size in shape:
        total *= size
    if total != comm.world_size():
        raise ValueError(f"init_mesh{shape}: a mesh of {total} ranks, but the world has {comm.world_size()}")
    mesh = init_device_mesh(current_device().type, shape, mesh_dim_names=names)
    for name in names:
        comm.name_group(mesh.get_group(name), name)
    return mesh
