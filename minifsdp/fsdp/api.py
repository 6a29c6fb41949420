"""PyTorch FSDP1's surface around the runtime, so that a script written for torch.distributed.fsdp runs with
only its import changed:

    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType, ...

    model = FSDP(net, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, ignored_modules=[net.head])
    torch.save(model.state_dict(), "model.pt")               # full, with the original names: loads into `net`
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        shards = model.state_dict()                           # ShardedTensors: what each rank's shard holds
    osd = FSDP.optim_state_dict(model, optimizer)             # full, by original name (optim_state_dict.py)
    with FSDP.summon_full_params(model, writeback=False):
        ...

The enums of torch.distributed.fsdp (ShardingStrategy, BackwardPrefetch, StateDictType) are accepted too:
they are matched by name. Nothing here changes what a step computes; chapter 6's runtime is fsdp.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gc

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.fsdp import state_dict as state_dicts
from minifsdp.fsdp.flat_param import sync_all_gathers
from minifsdp.fsdp.wrap import is_unit


class ShardingStrategy(enum.Enum):
    """What a unit keeps between uses (PyTorch FSDP1's names; ZeRO's stages in brackets)."""
    FULL_SHARD = enum.auto()     # parameters resharded after forward (ZeRO-3)
    SHARD_GRAD_OP = enum.auto()  # parameters kept from forward to backward (ZeRO-2-like memory)
    NO_SHARD = enum.auto()       # nothing sharded, gradients all-reduced: DDP, in FSDP's runtime
    HYBRID_SHARD = enum.auto()   # sharded within a node, replicated across nodes (chapter 11)
    _HYBRID_SHARD_ZERO2 = enum.auto()


class StateDictType(enum.Enum):
    FULL_STATE_DICT = enum.auto()     # original names, full tensors (the default, as in PyTorch)
    LOCAL_STATE_DICT = enum.auto()    # the flat shards themselves, as nn.Module would save them
    SHARDED_STATE_DICT = enum.auto()  # original names, ShardedTensors: the pieces this rank's shards hold


@dataclasses.dataclass
class StateDictConfig:
    offload_to_cpu: bool = False  # the tensors returned are copied to host memory


@dataclasses.dataclass
class FullStateDictConfig(StateDictConfig):
    rank0_only: bool = False  # only rank 0 of the group gets the state dict; the others get {}


class LocalStateDictConfig(StateDictConfig):
    pass


@dataclasses.dataclass
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = False  # PyTorch's name: DTensors, Shard(0) of each parameter, instead of ShardedTensors


@dataclasses.dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True  # PyTorch's default for optimizer state: it is twice the parameters (Adam)


@dataclasses.dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False  # only rank 0 keeps the optimizer state dict (and sends it, when loading)


def by_name(value, enum_cls, argument: str):
    """minifsdp's enum member for `value`: one of ours, or PyTorch's member of the same name."""
    if value is None or isinstance(value, enum_cls):
        return value
    member = getattr(enum_cls, getattr(value, "name", ""), None)
    if member is None:
        raise ValueError(f"{argument} must be one of {', '.join(m.name for m in enum_cls)} (minifsdp's or "
                         f"torch.distributed.fsdp's {enum_cls.__name__}), not {value!r}")
    return member


def resolve_sharding(sharding_strategy, reshard_after_forward) -> tuple[bool, bool]:
    """(shard the parameters?, reshard after forward?) for a strategy; reshard_after_forward, minifsdp's own
    spelling of the FULL_SHARD / SHARD_GRAD_OP choice, may be given instead, not as well."""
    strategy = by_name(sharding_strategy, ShardingStrategy, "sharding_strategy")
    if strategy is None:
        return True, True if reshard_after_forward is None else reshard_after_forward
    implied = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    if reshard_after_forward is not None and strategy is not ShardingStrategy.NO_SHARD \
            and reshard_after_forward != implied:
        raise ValueError(f"sharding_strategy={strategy.name} means reshard_after_forward={implied}, but "
                         f"reshard_after_forward={reshard_after_forward} was passed too: give one of them")
    return strategy is not ShardingStrategy.NO_SHARD, implied


def is_hybrid(sharding_strategy) -> bool:
    return by_name(sharding_strategy, ShardingStrategy, "sharding_strategy") in (
        ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


# --8<-- [start:hybrid]
def resolve_hybrid(process_group, device_mesh):
    """HYBRID_SHARD's two groups, (shard within, replicate across), as PyTorch FSDP1 takes them: a pair of
    process groups (intra-node, inter-node), or a 2-D DeviceMesh whose dimensions are (replicate, shard)."""
    if device_mesh is not None and process_group is None and device_mesh.ndim == 2:
        return device_mesh.get_group(1), device_mesh.get_group(0)
    if device_mesh is None and isinstance(process_group, tuple) and len(process_group) == 2:
        return process_group
    raise ValueError("HYBRID_SHARD needs its two groups: device_mesh=<2-D DeviceMesh (replicate, shard)>, e.g. "
                     "minifsdp.init_mesh((2, 2), ('replicate', 'shard')), or process_group=(shard group, "
                     "replicate group)")
# --8<-- [end:hybrid]


def resolve_group(process_group, device_mesh, use_orig_params: bool, ignored_states):
    """The process group to shard over; PyTorch's arguments minifsdp does not implement are refused by name."""
    if use_orig_params:
        raise NotImplementedError("use_orig_params=True: minifsdp's FullyShardedDataParallel keeps each unit's "
                                  "parameters as one flat shard, which its optimizer steps; for sharded original "
                                  "parameters use fully_shard (chapter 11)")
    if ignored_states is not None:
        raise NotImplementedError("ignored_states: pass the modules as ignored_modules=[...]")
    if device_mesh is None:
        return process_group
    if process_group is not None or device_mesh.ndim != 1:
        raise ValueError("device_mesh: give a one-dimensional DeviceMesh or a process_group, not both (a "
                         "two-dimensional mesh is HYBRID_SHARD's: pass sharding_strategy=HYBRID_SHARD)")
    return device_mesh.get_group()


def fsdp_modules(module: nn.Module, root_only: bool = False) -> list:
    """Every FullyShardedDataParallel unit in `module`'s tree (itself included), or only the outermost ones."""
    if not root_only:
        return [m for m in module.modules() if is_unit(m)]

    def outermost(m):
        if is_unit(m):
            return [m]
        return [u for child in m.children() for u in outermost(child)]

    return outermost(module)


class static_or_bound:
    """A method callable as PyTorch's static `FSDP.summon_full_params(model, ...)`, as
    `model.summon_full_params(model, ...)`, and as minifsdp's `model.summon_full_params(...)`."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, cls=None):
        if obj is None:
            return self.fn

        @functools.wraps(self.fn)
        def bound(*args, **kwargs):
            if args and isinstance(args[0], nn.Module):
                return self.fn(*args, **kwargs)
            return self.fn(obj, *args, **kwargs)
        return bound


# --8<-- [start:summon]
@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True,
                       writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """Inside the block every original parameter under `module` holds its full
    value (the fp32 masters under mixed precision); with writeback, changes
    made to them are kept (each rank copies its slice back).

    As in PyTorch, the originals are registered nn.Parameters inside the
    block, and the flat parameters are not: model.named_parameters() gives the
    names the model had before wrapping, with the full values. (List them, do
    not build an optimizer over them: they are gone when the block ends.) No
    forward or backward inside the block.

    recurse=False: only the outermost units' own parameters. rank0_only: every
    rank takes part in the all-gathers, but only rank 0 keeps the full values
    (the others are back to their shards inside the block, and list their flat
    parameters). offload_to_cpu: the originals show host copies (the device
    buffers stay allocated inside the block: a write-back copies them in).
    with_grads: the gradients are all-gathered too, into each original's
    .grad."""
    if rank0_only and writeback:
        raise ValueError("summon_full_params(rank0_only=True, writeback=True): "
                         "the other ranks would have nothing to write back; "
                         "pass writeback=False")
    roots = fsdp_modules(module, root_only=True)
    # a unit an enclosing block holds already is left to that block, as
    # PyTorch leaves it
    units = [u for root in roots
             for u in (root.units() if recurse else [root])
             if not u._summoned]
    flats = [flat for unit in units for flat in unit.flat_params]
    keep = not rank0_only or comm.rank() == 0
    for root in roots:
        # the shards may have just been written (a step, a load)
        sync_all_gathers(root.device)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for flat in flats:
            # the fp32 masters, not their bf16 cast
            stack.enter_context(flat.full_precision())
            flat.unshard()
        grads = [_all_gather_grad(flat) for flat in flats] if with_grads else []
        copies = [_show_copies(flat, offload_to_cpu,
                               grads[i] if with_grads else None)
                  if keep else None
                  for i, flat in enumerate(flats)]
        if keep:
            _register_originals(units, originals=True)
        else:
            for flat in flats:
                flat.reshard()
        for unit in units:
            unit._summoned = True
        try:
            yield
        finally:
            for unit in units:
                unit._summoned = False
            # before the reshard: a plain tensor cannot be assigned to a
            # registered parameter's name
            if keep:
                _register_originals(units, originals=False)
            for flat, shown in zip(flats, copies):
                if writeback and offload_to_cpu and shown:
                    # an offloaded copy goes back into the full buffer first
                    for view, copy in shown:
                        view.copy_(copy)
                if writeback:
                    flat.write_back_shard()
                flat.reshard()
# --8<-- [end:summon]


def _all_gather_grad(flat) -> torch.Tensor | None:
    """The full flat gradient, from every rank's shard of it (None if this unit has none now)."""
    grad = flat.param.grad
    if grad is None or not flat.sharded:
        return grad
    gathered = grad.new_empty(flat.shard_numel * flat.world_size)
    comm.all_gather(gathered, grad, tag=f"summon grads {flat.name}", group=flat.group)
    return gathered


def _show_copies(flat, offload_to_cpu: bool, full_grad) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Register each original as an nn.Parameter holding what the caller should see: its view into the full
    buffer (the same memory, so edits reach it), or a host copy of it; with its gradient's view in .grad.
    Returns (view, shown) pairs for the write-back."""
    pairs, shown_for = [], {}
    for (module, name), i in zip(flat.places, flat.index):
        if i not in shown_for:
            view = getattr(module, name)
            shown = nn.Parameter(view.detach().cpu() if offload_to_cpu else view.detach(),
                                 requires_grad=flat.param.requires_grad)
            shown._summoned_original = True  # a unit's, not one no unit owns (state_dict.py)
            if full_grad is not None:
                offset, numel = flat.offsets[i], flat.numels[i]
                grad = full_grad[offset: offset + numel].view(flat.shapes[i])
                shown.grad = grad.cpu() if offload_to_cpu else grad
            shown_for[i] = shown
            pairs.append((view, shown))
        setattr(module, name, shown_for[i])  # a tied parameter: the same one at each of its places
    return pairs


def _register_originals(units, originals: bool) -> None:
    """True: the flat parameters leave their units' parameters (_show_copies registered the originals in
    their place). False: the flat parameters are back, and the originals are unregistered, so that reshard()
    can set them to empty tensors again."""
    for unit in units:
        for i, flat in enumerate(unit.flat_params):
            if originals:
                del unit._parameters[f"flat_param_{i}"]
                continue
            for module, name in flat.places:
                delattr(module, name)
            unit._parameters[f"flat_param_{i}"] = flat.param


def names_before_wrapping(unit: nn.Module, named, prefix: str = ""):
    """nn.Module's (name, tensor) pairs from `unit`, under the names the model had before wrapping: each
    unit's `module.` step dropped, as PyTorch drops its `_fsdp_wrapped_module.` (along the tree, not by text:
    a model may have a submodule called `module` of its own)."""
    def join(a, b):
        return f"{a}.{b}" if a else b

    before = {}  # each module's name as nn.Module gives it -> its name before wrapping

    def walk(m, name, clean):
        before[name] = clean
        for child_name, child in m._modules.items():
            if child is not None:
                wrapper_step = is_unit(m) and child_name == "module"
                walk(child, join(name, child_name), clean if wrapper_step else join(clean, child_name))

    walk(unit, prefix, prefix)
    for name, t in named:
        owner, _, leaf = name.rpartition(".")
        yield join(before[owner], leaf), t


# -- state dicts ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type, state_dict_config: StateDictConfig | None = None,
                    optim_state_dict_config: OptimStateDictConfig | None = None):
    """Inside the block, model.state_dict(), load_state_dict() and FSDP.optim_state_dict() use this type,
    for every unit in `module`. (PyTorch's config classes are accepted too: their fields are read by name.)"""
    kind = by_name(state_dict_type, StateDictType, "state_dict_type")
    defaults = {StateDictType.FULL_STATE_DICT: FullStateDictConfig, StateDictType.LOCAL_STATE_DICT:
                LocalStateDictConfig, StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig}
    config = state_dict_config or defaults[kind]()
    optim_config = optim_state_dict_config or (FullOptimStateDictConfig() if kind is StateDictType.FULL_STATE_DICT
                                               else OptimStateDictConfig())
    units = fsdp_modules(module)
    before = [(u._state_dict_type, u._state_dict_config, optim_config_of(u)) for u in units]
    for u in units:
        u._state_dict_type, u._state_dict_config, u._optim_state_dict_config = kind, config, optim_config
    try:
        yield
    finally:
        for u, (k, c, o) in zip(units, before):
            u._state_dict_type, u._state_dict_config, u._optim_state_dict_config = k, c, o


def optim_config_of(unit) -> OptimStateDictConfig:
    """The optimizer state dict config state_dict_type() set (PyTorch's default outside it)."""
    return getattr(unit, "_optim_state_dict_config", None) or FullOptimStateDictConfig()


def state_dict(unit, destination=None, prefix: str = "", keep_vars: bool = False):
    """The unit's state dict of its current type (FULL by default, as in PyTorch), under `prefix`."""
    kind, config = unit._state_dict_type, unit._state_dict_config
    if kind is StateDictType.FULL_STATE_DICT:  # offload and rank0_only act as each unit is gathered
        out = state_dicts.full_state_dict(unit, offload_to_cpu=config.offload_to_cpu,
                                          rank0_only=getattr(config, "rank0_only", False))
        out = {prefix + k: v for k, v in out.items()}
    else:
        if kind is StateDictType.LOCAL_STATE_DICT:
            state_dicts._between_steps(unit, kind.name)
            out = nn.Module.state_dict(unit, prefix=prefix, keep_vars=keep_vars)
        elif getattr(config, "_use_dtensor", False):
            out = {prefix + k: v for k, v in state_dicts.sharded_dtensors(unit).items()}
        else:
            out = {prefix + k: v for k, v in state_dicts.sharded_pieces(unit).items()}
        if config.offload_to_cpu:
            out = {k: v.cpu() for k, v in out.items()}
    if destination is None:
        return out
    destination.update(out)
    return destination


def load_state_dict(unit, state_dict_: dict, strict: bool = True):
    """Load a state dict of the unit's current type; FULL and SHARDED are checked before anything is written."""
    kind = unit._state_dict_type
    if kind is StateDictType.LOCAL_STATE_DICT:
        state_dicts._between_steps(unit, kind.name)
        return nn.Module.load_state_dict(unit, state_dict_, strict)
    if kind is StateDictType.SHARDED_STATE_DICT:
        if not any(hasattr(v, "full_tensor") for v in state_dict_.values()):
            return state_dicts.load_sharded_pieces(unit, state_dict_, strict)
        # DTensors (_use_dtensor=True): gather each parameter whole, then load it as a full one
        state_dict_ = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict_.items()}
    return state_dicts.load_full_state_dict(unit, state_dict_, strict)


# -- an optimizer built before wrapping -----------------------------------------------------------------------------
# --8<-- [start:refuse_stale]
def refuse_stale_optimizers(unit) -> None:
    """An optimizer built before wrapping holds the original parameters, which
    now hold nothing: it would step nothing, silently. Asked once, at the
    root's first forward: is any original still held in an optimizer's
    param_groups? (A look at what refers to them -- no cost to any optimizer's
    step.)"""
    originals = [p for u in unit.units() for flat in u.flat_params
                 for ref in flat._originals
                 if (p := ref()) is not None]
    if not originals:
        return
    holders = [r for r in gc.get_referrers(*originals) if isinstance(r, list)]
    groups = [g for g in gc.get_referrers(*holders)
              if isinstance(g, dict)
              and any(g.get("params") is h for h in holders)]
    if groups:
        raise RuntimeError("an optimizer holds parameters that "
                           "FullyShardedDataParallel has since flattened into "
                           "its shards, so it would train nothing: build the "
                           "optimizer after wrapping, over the wrapped model's "
                           "parameters()")
# --8<-- [end:refuse_stale]


# --8<-- [start:refuse_moved]
def refuse_moved_offloaded_shards(unit) -> None:
    """At every root forward: an offloaded shard must still be in host memory
    (model.cuda() moves it)."""
    for u in unit.units():
        for i, flat in enumerate(u.flat_params):
            # what module.to() moved (or replaced)
            held = u._parameters[f"flat_param_{i}"]
            if flat.offload and held.device.type != "cpu":
                raise RuntimeError(
                    f"cpu_offload keeps the sharded parameters in host "
                    f"memory, where the optimizer steps them, but unit "
                    f"{u.unit_name!r} holds its shard on {held.device}: the "
                    f"model was moved after wrapping. Do not move an "
                    f"offloaded model (FSDP brings each unit to the device "
                    f"itself)")
# --8<-- [end:refuse_moved]
