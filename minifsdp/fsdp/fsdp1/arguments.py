"""PyTorch FSDP1's arguments, resolved into the runtime's: sharding strategies as process groups, its enums
matched by name, its wrap-policy callables adapted.

    sharding_strategy   FULL_SHARD     shard over the process group; reshard after forward (ZeRO-3)
                        SHARD_GRAD_OP  the same, keeping the parameters from forward to backward
                        NO_SHARD       a shard group of one rank: every rank keeps each unit whole, and its
                                       gradients are all-reduced over the process group -- DDP, in FSDP's runtime
                        HYBRID_SHARD   shard within a group, replicate across groups (chapter 11's HSDP)

Nothing here changes what a step computes: chapter 6's runtime is fsdp/runtime.py.
"""

from __future__ import annotations

import enum
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.fsdp.flat_param import FlatParameter, ShardState
from minifsdp.fsdp.streams import side_stream


class ShardingStrategy(enum.Enum):
    """What a unit keeps between uses (PyTorch FSDP1's names; ZeRO's stages in brackets)."""
    FULL_SHARD = enum.auto()     # parameters resharded after forward (ZeRO-3)
    SHARD_GRAD_OP = enum.auto()  # parameters kept from forward to backward (ZeRO-2-like memory)
    NO_SHARD = enum.auto()       # nothing sharded, gradients all-reduced: DDP, in FSDP's runtime
    HYBRID_SHARD = enum.auto()   # sharded within a node, replicated across nodes (chapter 11)
    _HYBRID_SHARD_ZERO2 = enum.auto()  # the same, keeping the parameters from forward to backward


def by_name(value, enum_cls, argument: str):
    """minifsdp's enum member for `value`: one of ours, or PyTorch's member of the same name."""
    if value is None or isinstance(value, enum_cls):
        return value
    member = getattr(enum_cls, getattr(value, "name", ""), None)
    if member is None:
        raise ValueError(f"{argument} must be one of {', '.join(m.name for m in enum_cls)} (minifsdp's or "
                         f"torch.distributed.fsdp's {enum_cls.__name__}), not {value!r}")
    return member


# --8<-- [start:groups]
def resolve_groups(strategy: ShardingStrategy | None, reshard_after_forward,
                   process_group, device_mesh):
    """(shard group, replicate group, reshard_after_forward) for a strategy.
    reshard_after_forward, minifsdp's own spelling of the FULL_SHARD /
    SHARD_GRAD_OP choice, may be given instead of a strategy, not as well."""
    if strategy is None:
        raf = True if reshard_after_forward is None else reshard_after_forward
        return resolve_group(process_group, device_mesh), None, raf
    implied = strategy in (ShardingStrategy.FULL_SHARD,
                           ShardingStrategy.HYBRID_SHARD)
    if (reshard_after_forward is not None and reshard_after_forward != implied
            and strategy is not ShardingStrategy.NO_SHARD):
        raise ValueError(f"sharding_strategy={strategy.name} means "
                         f"reshard_after_forward={implied}, but "
                         f"reshard_after_forward={reshard_after_forward} was "
                         f"passed too: give one of them")
    if strategy in (ShardingStrategy.HYBRID_SHARD,
                    ShardingStrategy._HYBRID_SHARD_ZERO2):
        return (*resolve_hybrid(process_group, device_mesh), implied)
    return resolve_group(process_group, device_mesh), None, implied
# --8<-- [end:groups]


# --8<-- [start:hybrid]
def resolve_hybrid(process_group, device_mesh):
    """HYBRID_SHARD's two groups, (shard within, replicate across), as
    PyTorch FSDP1 takes them: a pair of process groups (intra-node,
    inter-node), or a 2-D DeviceMesh whose dimensions are (replicate, shard)."""
    if (device_mesh is not None and process_group is None
            and device_mesh.ndim == 2):
        return device_mesh.get_group(1), device_mesh.get_group(0)
    if (device_mesh is None and isinstance(process_group, tuple)
            and len(process_group) == 2):
        return process_group
    raise ValueError("HYBRID_SHARD needs its two groups: device_mesh=<2-D "
                     "DeviceMesh (replicate, shard)>, e.g. minifsdp.init_mesh("
                     "(2, 2), ('replicate', 'shard')), or process_group=(shard "
                     "group, replicate group)")
# --8<-- [end:hybrid]


def resolve_group(process_group, device_mesh):
    """The process group to shard over: the one given, or a one-dimensional mesh's."""
    if device_mesh is None:
        return process_group
    if process_group is not None or device_mesh.ndim != 1:
        raise ValueError("device_mesh: give a one-dimensional DeviceMesh or a process_group, not both (a "
                         "two-dimensional mesh is HYBRID_SHARD's: pass sharding_strategy=HYBRID_SHARD)")
    return device_mesh.get_group()


def refuse_unsupported(use_orig_params: bool, ignored_states) -> None:
    """PyTorch's arguments minifsdp does not implement, refused by name."""
    if use_orig_params:
        raise NotImplementedError("use_orig_params=True: minifsdp's FullyShardedDataParallel keeps each unit's "
                                  "parameters as one flat shard, which its optimizer steps; for sharded original "
                                  "parameters use fully_shard (chapter 11)")
    if ignored_states is not None:
        raise NotImplementedError("ignored_states: pass the modules as ignored_modules=[...]")


# -- NO_SHARD: a shard group of one rank ---------------------------------------------------------------------
_self_groups: dict = {}


def this_rank_alone():
    """A process group of this rank alone (made once per process group), made by this rank only."""
    world = dist.group.WORLD
    if _self_groups.get("world", (None,))[0] is not world:
        _self_groups["world"] = (world, dist.new_group([dist.get_rank()], use_local_synchronization=True))
    return _self_groups["world"][1]


# --8<-- [start:no_shard]
class ReplicatedFlatParameter(FlatParameter):
    """NO_SHARD: sharded over a group of this rank alone, so the shard is the
    whole unit, and the full buffer *is* the shard: nothing to gather, nothing
    to free. The flat gradient is averaged over the replicate group (every
    rank) by one all-reduce, in flight while backward goes on, as DDP's."""

    def __init__(self, places, requires_grad: bool = True,
                 replicate_group=None):
        super().__init__(places, requires_grad, group=this_rank_alone(),
                         replicate_group=replicate_group)
        # the views point into the one buffer for good
        self._full = self.param.data = self._shard
        self._set_views(use_full=True)
        self.state = ShardState.UNSHARDED

    def unshard(self, async_op: bool = False) -> None:
        # nothing to gather; but the optimizer wrote the buffer in place since
        # the views were cut, and autograd refuses views of a split then
        self._set_views(use_full=True)

    def reshard(self) -> None:
        pass  # the buffer is the shard

    def free_before_concat(self) -> None:
        pass

    def reduce_scatter_grad(self, full_grad: torch.Tensor):
        self.reduce_input = full_grad
        with side_stream("reduce_scatter", full_grad, after_compute=True):
            full_grad.mul_(1.0 / comm.world_size(self.replicate_group))
            handle = comm.all_reduce(full_grad, async_op=True,
                                     tag=f"all_reduce {self.name}",
                                     group=self.replicate_group)
        return handle, full_grad

    def grad_for_optimizer(self, grad_shard, read_now: bool = False):
        # every rank keeps the whole average, as under DDP: no copy
        self.reduce_input = None
        return grad_shard

    @property
    def uses_sharded_strategy(self) -> bool:
        return False
# --8<-- [end:no_shard]


# -- PyTorch's wrap policies ---------------------------------------------------------------------------------
def as_policy(policy):
    """A policy of PyTorch's FSDP1 works too, so a script written for it runs with the import changed:
    size_based_auto_wrap_policy and transformer_auto_wrap_policy (through functools.partial) and its
    ModuleWrapPolicy are asked (module, recurse, nonwrapped_numel) -- first, with recurse=True, whether to
    look inside the module at all; then, with recurse=False, whether to wrap it. Ours are asked the second
    question only, and always looked inside."""
    try:
        torch_style = "recurse" in inspect.signature(policy).parameters
    except (TypeError, ValueError):  # a callable without a signature: take it as ours
        torch_style = False
    return _TorchPolicy(policy) if torch_style else policy


class _TorchPolicy:
    def __init__(self, fn):
        self.fn = fn

    def recurse(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return self.fn(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel)

    def __call__(self, module: nn.Module, unowned_numel: int) -> bool:
        return self.fn(module=module, recurse=False, nonwrapped_numel=unowned_numel)
