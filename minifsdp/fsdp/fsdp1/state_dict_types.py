"""PyTorch FSDP1's state dict types: what model.state_dict() returns, chosen with FSDP.state_dict_type().

    FULL_STATE_DICT     original names, full tensors (the default, as in PyTorch): state_dict.py gathers
                        them unit by unit (chapter 10)
    LOCAL_STATE_DICT    the flat shards themselves, as nn.Module would save them
    SHARDED_STATE_DICT  original names, ShardedTensors (or DTensors) of the pieces this rank's shards hold

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        shards = model.state_dict()
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum

import torch.nn as nn

from minifsdp.fsdp import state_dict as state_dicts
from minifsdp.fsdp.fsdp1.arguments import by_name
from minifsdp.fsdp.fsdp1.summon import fsdp_modules


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
