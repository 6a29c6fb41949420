"""Chapter 11: fully_shard, PyTorch FSDP2's API, on per-parameter DTensors (param.py).

    from minifsdp.fsdp2 import fully_shard, MixedPrecisionPolicy
    for block in model.blocks:
        fully_shard(block)                   # each block: one all-gather, one reduce-scatter
    fully_shard(model)                       # the root: what no block holds (embeddings, the head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)   # DTensors, with their own names
    loss = model(x, y); loss.backward(); optimizer.step()

fully_shard(module) shards the module's parameters (those no inner fully_shard took: param.py), swaps the
module's class for one that also derives from FSDPModule (unshard, reshard, the prefetch lists, ...), and
registers the runtime's forward hooks (runtime.py: FSDPState, the hooks, the root's RootState).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.fsdp2.param import FSDPParam, FSDPParamGroup
from minifsdp.fsdp2.runtime import FSDPState


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As torch.distributed.fsdp's: the dtype of the unsharded parameters (and of the all-gather), of the
    reduce-scatter, of the module's outputs; cast_forward_inputs casts floating inputs to param_dtype."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass
class OffloadPolicy:
    """No offloading (torch's default)."""


@dataclasses.dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state in host memory. Accepted on CPU ranks, where they
    are already; refused on GPUs (the FlatParameter FSDP's cpu_offload does it, chapter 8)."""
    pin_memory: bool = True


class UnshardHandle:
    """What unshard(async_op=True) returns: wait() finishes the all-gather and the copy-out."""

    def __init__(self, group: FSDPParamGroup):
        self._group = group

    def wait(self) -> None:
        self._group.wait_for_unshard()


# --8<-- [start:module]
class FSDPModule:
    """Mixed into the class of every module fully_shard has been applied to
    (PyTorch's FSDPModule)."""

    # --8<-- [start:module_unshard]
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (e.g. before its forward, to
        overlap with other work). async_op=True returns a handle at once; its
        wait(), or the module's pre-forward, finishes the copy-out."""
        # before the first forward: take up parameters replaced since
        # (to_empty)
        if self._fsdp.root is None:
            for p in self._fsdp.group.params:
                p.refresh_sharded()
        self._fsdp.group.unshard(async_op=async_op)
        return UnshardHandle(self._fsdp.group) if async_op else None

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """True: the hooks' unshards (and prefetches) of this module and those
        under it issue copy-in and all-gather from the compute stream. Overlap
        then needs explicit prefetch (set_modules_to_forward_prefetch)."""
        for m in self.modules():
            if isinstance(m, FSDPModule):
                m._fsdp.group.unshard_async_op = async_op
    # --8<-- [end:module_unshard]

    def reshard(self) -> None:
        self._fsdp.group.reshard()

    def set_modules_to_forward_prefetch(self,
                                        modules: list["FSDPModule"]) -> None:
        """In this module's pre-forward, also start these modules' all-gathers
        (explicit forward prefetch)."""
        self._fsdp.forward_prefetch = [m._fsdp for m in modules]

    def set_modules_to_backward_prefetch(self,
                                         modules: list["FSDPModule"]) -> None:
        """In this module's pre-backward, start these modules' all-gathers
        instead of the implicit one."""
        self._fsdp.backward_prefetch = [m._fsdp for m in modules]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward adds up the unsharded gradients and sends nothing
        (gradient accumulation)."""
        for m in (self.modules() if recurse else [self]):
            if isinstance(m, FSDPModule):
                m._fsdp.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        for m in (self.modules() if recurse else [self]):
            if isinstance(m, FSDPModule):
                m._fsdp.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        for m in (self.modules() if recurse else [self]):
            if isinstance(m, FSDPModule):
                m._fsdp.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted, for scripts written for torch, and stores nothing. Torch
        uses it to leave the last reduce-scatters of a backward unwaited when
        more backwards follow before the step; here each reduce-scatter is
        waited for inside its own post_backward, so there is nothing to
        leave."""
# --8<-- [end:module]


_classes: dict[type, type] = {}


# --8<-- [start:fully_shard]
def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy()) -> nn.Module:
    """Shard `module`'s parameters (those no inner fully_shard took) as DTensors over `mesh` (default: every
    rank), and gather and reduce them together around its forward and backward. Returns `module`."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not isinstance(mp_policy, MixedPrecisionPolicy) or not isinstance(offload_policy, OffloadPolicy):
        raise TypeError("mp_policy must be a MixedPrecisionPolicy and offload_policy an OffloadPolicy "
                        "(from minifsdp.fsdp2)")
    comm.require_process_group()
    from minifsdp.distributed.launch import current_device
    if isinstance(offload_policy, CPUOffloadPolicy) and current_device().type != "cpu":
        raise NotImplementedError("CPUOffloadPolicy: minifsdp's fully_shard keeps the shards where the module "
                                  "is; for offloading, use the FlatParameter FSDP's cpu_offload (chapter 8). "
                                  "On CPU ranks the shards already live in host memory")
    mesh = mesh or _world_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard takes a 1-D mesh (shard) or a 2-D one (replicate, shard), got {mesh.ndim}-D")
    group = mesh.get_group(mesh.ndim - 1)  # shard over the last dimension...
    across = mesh.get_group(0) if mesh.ndim == 2 else None  # ...and, on a 2-D mesh, replicate over the first
    taken = {id(p.sharded) for m in module.modules() if isinstance(m, FSDPModule) for p in m._fsdp.group.params}
    places = {}  # id of an original parameter -> its (module, name) places: a tied one has several
    for m in _post_order(module):
        for name, p in m._parameters.items():
            if p is not None and id(p) not in taken:  # (an inner fully_shard's parameters are its own)
                places.setdefault(id(p), []).append((m, name))
    params = [FSDPParam(where, mesh, comm.rank(group), comm.world_size(group)) for where in places.values()]
    param_group = FSDPParamGroup(params, group, mp_policy.param_dtype, mp_policy.reduce_dtype,
                                 name=type(module).__name__, replicate_group=across)
    state = FSDPState(module, param_group, reshard_after_forward, mp_policy)
    module._fsdp = state
    module.__class__ = _fsdp_class(type(module))
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    return module
# --8<-- [end:fully_shard]


# --8<-- [start:class_swap]
def _fsdp_class(cls: type) -> type:
    """The class a fully_shard'ed module is swapped to, one per original class:
    FSDPModule first, so that its unshard, reshard and set_* are found before
    any method of the same name on cls; forward, which FSDPModule does not
    define, is still cls's."""
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _classes[cls]
# --8<-- [end:class_swap]


def _world_mesh():
    """Every rank in one dimension, over the default process group (made once per process group)."""
    from torch.distributed.device_mesh import DeviceMesh

    from minifsdp.distributed.launch import current_device
    world = torch.distributed.group.WORLD
    if _meshes.get("world", (None,))[0] is not world:
        _meshes["world"] = (world, DeviceMesh.from_group(world, current_device().type))
    return _meshes["world"][1]


_meshes: dict = {}


# --8<-- [start:replicate]
def replicate(module: nn.Module, *, mesh=None, **options) -> nn.Module:
    """DDP, built the same way: fully_shard over a mesh of N replicas of one
    rank each. Every parameter is whole on every rank (Replicate()); the
    "all-gather" in a group of one is a copy, and the gradients are averaged
    across the replicas by an all-reduce -- HSDP with shards of one."""
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        from minifsdp.distributed.launch import current_device
        world = torch.distributed.group.WORLD
        # (making a mesh makes process groups: once)
        if _meshes.get("replicate", (None,))[0] is not world:
            _meshes["replicate"] = (world, init_device_mesh(
                current_device().type, (comm.world_size(), 1),
                mesh_dim_names=("replicate", "shard")))
        mesh = _meshes["replicate"][1]
    return fully_shard(module, mesh=mesh, **options)
# --8<-- [end:replicate]


def _post_order(module: nn.Module, seen: set | None = None) -> list[nn.Module]:
    """The modules under `module`, each after its children, each once: torch's fully_shard orders a group's
    parameters so, and the order is the layout of the all-gather and reduce-scatter buffers -- the same
    layout sums the same elements in the same order (gloo's reduce-scatter at N = 4 depends on it)."""
    seen = set() if seen is None else seen
    seen.add(module)
    out = []
    for child in module.children():
        if child not in seen:
            out += _post_order(child, seen)
    return out + [module]
