"""Optimizer state dicts of a FullyShardedDataParallel model, by original name, as PyTorch's FSDP1 gives them.

The optimizer steps each unit's flat shard, so its state is flat shards too: AdamW's exp_avg of a unit is a
flat tensor of this rank's shard_numel elements, laid out exactly as the parameter shard (chapter 5). That
layout is this wrapping's at this world size. A checkpoint meant to outlive it -- another world size,
another wrapping, no FSDP at all -- names the state by the original parameters instead:

    osd = FSDP.optim_state_dict(model, optimizer)
    # {"state": {"blocks.0.fc.weight": {"exp_avg": <full, (256, 64)>, "exp_avg_sq": ..., "step": tensor(12.)},
    #            ...},
    #  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), ..., "params": ["wte.weight", "wpe.weight", ...]}]}
    optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, osd))  # any world size

optim_state_dict() gathers one FlatParameter at a time and one state tensor at a time: all-gather it, take
each original's elements out of the full flat tensor (they are contiguous: each original is a run of the
flat buffer), copy them, and let the flat tensor go. A 0-dim state (AdamW's step) is one per flat shard and
the same on every rank: every original of the unit gets it. optim_state_dict_to_load() needs no gather at
all: each rank copies, from each original's full tensor, the elements its own shard covers, and leaves
the gaps and the padding at zero -- where AdamW leaves them, stepping zero gradients.

Under state_dict_type(..., optim_state_dict_config=FullOptimStateDictConfig(rank0_only=True)), only rank 0
keeps the state dict; when loading, only rank 0 needs to have read it (it sends each tensor when needed).
offload_to_cpu is True by default, as in PyTorch: the optimizer state is twice the parameters, under Adam.

minifsdp.checkpoint (chapter 10) saves the same state with no gather at all -- pieces of the flat shards,
through torch.distributed.checkpoint. This file is for scripts written against FSDP1, and for one file.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from minifsdp.distributed import comm
from minifsdp.fsdp.fsdp1.state_dict_types import StateDictType, optim_config_of
from minifsdp.fsdp.state_dict import original_names
from minifsdp.fsdp.wrap import names_without_wrappers


def _kind(value) -> int:
    """How a state value is laid out: 0 like its parameter (exp_avg), 1 a 0-dim tensor (step), 2 not a
    tensor. (PyTorch's FSDP1 lists each parameter's state in this order, then by name.)"""
    if isinstance(value, _Pending) or isinstance(value, torch.Tensor) and value.dim() > 0:
        return 0
    return 1 if isinstance(value, torch.Tensor) else 2


def _copy(t, offload_to_cpu: bool = False):
    """A copy the caller owns. (The optimizer steps its state in place -- AdamW adds 1 to step -- so a state
    dict that shared a tensor with it, or a loaded optimizer that shared one with the dict, would change.)"""
    if not isinstance(t, torch.Tensor):
        return copy.deepcopy(t)
    return t.to("cpu", copy=True) if offload_to_cpu else t.detach().clone()


def _what_it_steps(model, optim):
    """For each tensor the optimizer steps, in its param_groups' order (the ids of optim.state_dict()):
    (the tensor, its FlatParameter or None, the original names it holds)."""
    flats = {id(flat.param): (flat, first) for flat, first, _ in original_names(model)}
    plain = {id(p): prefix + name for prefix, m in names_without_wrappers(model.module)  # ignored_modules'
             for name, p in m._parameters.items() if p is not None}
    out = []
    for group in optim.param_groups:
        for p in group["params"]:
            if id(p) not in flats and id(p) not in plain:
                raise ValueError("the optimizer steps a tensor that is no parameter of this model: build it over "
                                 "model.parameters(), after wrapping")
            flat, names = flats.get(id(p), (None, [plain.get(id(p))]))
            out.append((p, flat, names))
    return out


def _full_only(model, what: str) -> None:
    if model._state_dict_type is not StateDictType.FULL_STATE_DICT:
        raise NotImplementedError(f"FSDP.{what} under {model._state_dict_type.name}: minifsdp gives the full one "
                                  f"(FULL_STATE_DICT). For the optimizer state in pieces, with no gather, save "
                                  f"with minifsdp.checkpoint.save(path, model, optimizer)")


# --8<-- [start:optim_state_dict]
def optim_state_dict(model, optim, optim_state_dict=None, group=None) -> dict:
    """The optimizer's state under the original parameters' names, full tensors of their shapes, and its
    param_groups with those names in "params": what torch.optim's state_dict() of the unwrapped model
    would be, keyed by name (PyTorch FSDP1's format). optim_state_dict: optim.state_dict(), if already
    taken. Every rank must call it (each flat state tensor is an all-gather); with rank0_only, only rank 0
    of `group` (default: the model's) gets it, the others {}."""
    _full_only(model, "optim_state_dict")
    config = optim_config_of(model)
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    keep = not getattr(config, "rank0_only", False) or comm.rank(group or model.process_group) == 0
    names_of, state = [], {}
    for i, (_, flat, names) in enumerate(_what_it_steps(model, optim)):
        names_of.append(names)
        held = osd["state"].get(i, {})  # nothing before the first step
        if flat is not None:
            unflat = _unflatten(flat, names, held, config.offload_to_cpu, keep)
        else:  # a parameter no unit flattened (ignored_modules'): stepped whole, on every rank
            unflat = {names[0]: {key: _copy(v, config.offload_to_cpu) for key, v in held.items()}} if held else {}
        if keep:
            state.update(unflat)
    if not keep:
        return {}
    groups = [{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
               "params": [name for i in g["params"] for name in names_of[i]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _unflatten(flat, names: list[str], held: dict, offload_to_cpu: bool, keep: bool) -> dict:
    """{original name: {key: its state}} of one FlatParameter, from this rank's shard of each state tensor."""
    out = {name: {} for name in names}
    for key in sorted(held, key=lambda k: (_kind(held[k]), k)):
        value = held[key]
        if _kind(value) != 0:  # the step (or a number): one per flat shard, the same on every rank
            shared = _copy(value, offload_to_cpu) if keep else None
            for name in names:
                out[name][key] = shared
            continue
        if tuple(value.shape) != (flat.shard_numel,):
            raise ValueError(f"optimizer state {key!r} of unit {flat.name!r} has shape {tuple(value.shape)}, not the "
                             f"shard's ({flat.shard_numel},): it cannot be cut into the original parameters")
        whole = _all_gather(flat, value)  # one flat state tensor at a time
        if keep:
            for name, shape, offset, numel in zip(names, flat.shapes, flat.offsets, flat.numels):
                out[name][key] = _copy(whole[offset: offset + numel].view(shape), offload_to_cpu)
        del whole  # before the next one is gathered
    return out if keep and held else {}


def _all_gather(flat, shard: torch.Tensor) -> torch.Tensor:
    """The full flat tensor (padding included) of a state tensor laid out as this unit's shard."""
    if not flat.uses_sharded_strategy:  # NO_SHARD: every rank holds all of it
        return shard
    device = flat._full.device  # where the unit's all-gathers run (the state may live in host memory)
    whole = torch.empty(flat.shard_numel * flat.world_size, dtype=shard.dtype, device=device)
    comm.all_gather(whole, shard.detach().to(device), tag=f"optim state {flat.name}", group=flat.group)
    return whole
# --8<-- [end:optim_state_dict]


# --8<-- [start:optim_state_dict_to_load]
def optim_state_dict_to_load(model, optim, optim_state_dict: dict, is_named_optimizer: bool = False,
                             load_directly: bool = False, group=None) -> dict:
    """Turn an optimizer state dict keyed by original names -- optim_state_dict()'s, at any world size,
    PyTorch FSDP1's, or a plain optimizer's with its ids replaced by names -- into what optim.load_state_dict()
    takes for this rank's flat shards. No collective, unless rank0_only (then rank 0 sends what it read).
    load_directly: load it into `optim` too."""
    if is_named_optimizer:
        raise NotImplementedError("is_named_optimizer=True: minifsdp's optimizer is a torch.optim optimizer over "
                                  "model.parameters(); pass an optimizer state dict keyed by parameter names")
    _full_only(model, "optim_state_dict_to_load")
    saved = _Saved(optim_state_dict, getattr(optim_config_of(model), "rank0_only", False),
                   group or model.process_group)
    # a tied parameter may be saved under any of its names; the state dict knows it by its first one
    canonical = {name: first[i] for _, first, every in original_names(model) for name, i in every}
    stepped = _what_it_steps(model, optim)
    canonical.update({name: name for _, flat, names in stepped if flat is None for name in names})
    unknown = [name for name in saved.state if name not in canonical]
    if unknown:
        raise ValueError(f"optim_state_dict_to_load: the state dict has state for parameters this model does "
                         f"not have: {unknown}")
    by_name = {canonical[name]: name for name in saved.state}  # a name of ours -> its name in the state dict
    # a key laid out like its parameter somewhere (exp_avg) is so everywhere, even for a 0-dim parameter
    per_element = {key for held in saved.state.values() for key, v in held.items() if _kind(v) == 0}
    state = {}
    for i, (tensor, flat, names) in enumerate(stepped):
        present = [by_name.get(name) for name in names]
        if not any(present):
            continue  # no state yet for these: a fresh optimizer's
        if flat is None:  # stepped whole: its state as saved
            state[i] = {key: _copy(saved.tensor(present[0], key, tensor.device)) for key in saved.state[present[0]]}
        else:
            state[i] = _shard_of(flat, present, saved, per_element)
    out = {"state": state, "param_groups": _param_groups(optim, saved.param_groups, [n for _, _, n in stepped])}
    if load_directly:
        optim.load_state_dict(out)
    return out


def _shard_of(flat, saved_names: list, saved, per_element: set) -> dict:
    """This rank's flat shard of each state key of one FlatParameter, from the originals' full tensors."""
    start, device = flat.rank * flat.shard_numel, flat.param.device
    keys = sorted({key for name in saved_names if name for key in saved.state[name]},
                  key=lambda k: (k not in per_element, k))
    out = {}
    for key in keys:
        if key not in per_element:  # one value for the whole flat shard: they must agree
            values = [saved.state[n][key] for n in saved_names if n and key in saved.state[n]]
            if any(not _same(v, values[0]) for v in values):
                raise ValueError(f"optim_state_dict_to_load: {key!r} differs among {[n for n in saved_names if n]}, "
                                 f"which one flat shard ({flat.name}) holds: it has one {key!r}")
            out[key] = _copy(values[0])
            continue
        shard = None
        for name, shape, offset, numel in zip(saved_names, flat.shapes, flat.offsets, flat.numels):
            if name is None or key not in saved.state[name]:
                continue  # no state for this one (a plain run where it got no gradient): zeros
            value = saved.tensor(name, key, device)
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"optim_state_dict_to_load: {key!r} of {name!r} has shape {tuple(value.shape)}, "
                                 f"the parameter {tuple(shape)}")
            if shard is None:
                shard = torch.zeros(flat.shard_numel, dtype=value.dtype, device=device)
            lo, hi = max(offset, start), min(offset + numel, start + flat.shard_numel)  # what this rank holds
            if lo < hi:
                shard[lo - start: hi - start] = value.reshape(-1)[lo - offset: hi - offset]
        out[key] = shard
    return out
# --8<-- [end:optim_state_dict_to_load]


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def _param_groups(optim, saved_groups: list[dict], names_of: list[list[str]]) -> list[dict]:
    """Each of the optimizer's groups, its ids as optim.load_state_dict() numbers them, with the
    hyper-parameters of the saved group that holds its first parameter (another layout groups the same
    names, cut differently)."""
    where = {name: g for g in saved_groups for name in g["params"]}
    out, first_id = [], 0
    for group in optim.param_groups:
        ids = list(range(first_id, first_id + len(group["params"])))
        first_id += len(ids)
        source = next((where[n] for i in ids for n in names_of[i] if n in where), {})
        hyper = {k: copy.deepcopy(v) for k, v in source.items() if k not in ("params", "param_names")}
        out.append({**{k: v for k, v in group.items() if k != "params"}, **hyper, "params": ids})
    return out


class _Pending(NamedTuple):
    """A tensor rank 0 will send when it is needed (rank0_only)."""
    shape: tuple
    dtype: torch.dtype


class _Saved:
    """The state dict being loaded, as every rank sees it. With rank0_only only rank 0 has read it: it sends
    the structure (names, keys, shapes, hyper-parameters, the 0-dim values) at once, and each tensor when
    the walk needs it -- every rank walks in the same order -- so no other rank holds more than one."""

    def __init__(self, osd: dict, rank0_only: bool, group):
        self.group = group
        self.mine = osd if not rank0_only or comm.rank(group) == 0 else None
        if rank0_only:
            structure = None
            if self.mine is not None:
                structure = {"param_groups": osd["param_groups"], "state": {
                    name: {k: _Pending(tuple(v.shape), v.dtype) if _kind(v) == 0 else v for k, v in held.items()}
                    for name, held in osd["state"].items()}}
            osd = comm.all_gather_object(structure, group=group)[0]
        self.state, self.param_groups = osd["state"], osd["param_groups"]

    def tensor(self, name: str, key: str, device: torch.device):
        value = self.state[name][key]
        if not isinstance(value, _Pending):
            return value
        if self.mine is not None:
            t = self.mine["state"][name][key].to(device)
        else:
            t = torch.empty(value.shape, dtype=value.dtype, device=device)
        comm.broadcast(t, src=0, tag=f"optim state {name}", group=self.group)
        return t
