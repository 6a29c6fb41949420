"""Chapter 10: what each strategy holds on this rank, under the names of the unwrapped model.

Every strategy keeps the same training state -- each parameter, each buffer, the optimizer's state of
each parameter -- in a layout of its own:

    DDP, a single process      every rank holds all of it
    OSS, SDP (ZeRO-1, -2)      every rank holds the parameters; a parameter's optimizer state lives whole,
                               on its owner only
    FlatOSS, FlatSDP           every rank holds the parameters; the optimizer state is flat, and rank r
                               holds chunk r of every flat bucket
    FullyShardedDataParallel   parameters and optimizer state are both flat shards (one per unit)
    fully_shard (FSDP2)        each parameter and its state is a DTensor, Shard(0)

A checkpoint names everything as the unwrapped model does: model.<name> for parameters and buffers,
optim.state.<name>.<key> for the optimizer (exp_avg, exp_avg_sq, step, momentum_buffer), the names
PyTorch's own get_state_dict() gives. Each rank describes what it holds as *views into its own storage*,
and DCP records which part of each tensor it wrote. Loading walks the same way: each rank describes what
it holds now, and DCP copies into those views whatever part of the saved tensors overlaps them. That is
how a checkpoint from 4 FSDP ranks loads into 3 OSS ranks, or into a single process.
"""

from __future__ import annotations


import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp.checkpoint.flat_chunks import flat_piece
from minifsdp.ddp.ddp import DistributedDataParallel
from minifsdp.fsdp import FullyShardedDataParallel
from minifsdp.fsdp.state_dict import original_names, sharded_pieces
from minifsdp.fsdp.wrap import names_without_wrappers
from minifsdp.zero.flat import FlatOSS
from minifsdp.zero.oss import OSS


def strategy_of(model: nn.Module, optimizer=None) -> str:
    """Which layout holds this model's (and optimizer's) state: fsdp, flat, oss, dtensor or replicated."""
    if isinstance(model, FullyShardedDataParallel):
        return "fsdp"
    if type(model).__module__ == "torch.distributed.fsdp.fully_sharded_data_parallel":  # not fully_shard's
        raise TypeError("torch's FullyShardedDataParallel (FSDP1) keeps flat parameters of its own: save it with "
                        "torch.distributed.checkpoint.state_dict.get_state_dict, or use minifsdp's "
                        "FullyShardedDataParallel (or torch's fully_shard), which minifsdp.checkpoint reads")
    if isinstance(optimizer, FlatOSS):
        return "flat"
    if isinstance(optimizer, OSS):
        return "oss"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "dtensor"
    return "replicated"


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP-style wrapper (ours, torch's, SDP, FlatSDP); the model itself otherwise."""
    return model.module if isinstance(model, (DistributedDataParallel, TorchDDP)) else model


class Slot:
    """One tensor an optimizer really steps (a parameter, a flat bucket's chunk, a unit's flat shard), with
    the original parameters it holds part of: (name, a function from a tensor of the slot's layout -- the
    slot itself, or one of its state tensors -- to that parameter's part of it)."""

    def __init__(self, tensor: torch.Tensor, state: dict, pieces: list):
        self.tensor, self.state, self.pieces = tensor, state, pieces


def _whole(name: str):
    return [(name, lambda t: t)]


def _flat_pieces(names, shapes, offsets, start: int, chunk: int, group, sharded: bool):
    """The parts of the original parameters laid out at `offsets` of a flat buffer, of which this rank
    holds [start, start + chunk): a ShardedTensor each (flat_chunks.py), or plain views when every rank
    holds the whole buffer (FSDP's NO_SHARD)."""
    def piece(shape, offset):
        return lambda t: flat_piece(t, start, chunk, offset, shape, group, sharded)
    return [(name, piece(shape, offset)) for name, shape, offset in zip(names, shapes, offsets)]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, by its unwrapped name, as views into what this rank holds:
    FSDP's SHARDED_STATE_DICT (pieces of the flat shards, fsdp/state_dict.py); the model's own state dict
    otherwise (DTensors under fully_shard)."""
    if isinstance(model, FullyShardedDataParallel):
        return sharded_pieces(model)
    return dict(unwrapped(model).state_dict())


def slots(model: nn.Module, optimizer) -> list[Slot]:
    """What `optimizer` steps on this rank, each with the original parameters it holds part of."""
    kind = strategy_of(model, optimizer)
    if kind == "fsdp":
        by_flat = {id(flat.param): (flat, first) for flat, first, _ in original_names(model)}
        plain = {}  # the parameters no unit flattened (ignored_modules'), stepped whole
        for prefix, m in names_without_wrappers(model.module):
            plain.update({id(p): prefix + name for name, p in m._parameters.items() if p is not None})
        out = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in by_flat:
                    flat, first = by_flat[id(p)]
                    out.append(Slot(p, optimizer.state, _flat_pieces(
                        first, flat.shapes, flat.offsets, flat.rank * flat.shard_numel, flat.shard_numel,
                        flat.group, flat.uses_sharded_strategy)))
                else:
                    out.append(Slot(p, optimizer.state, _whole(plain[id(p)])))
        return out
    names = {id(p): name for name, p in unwrapped(model).named_parameters()}
    if kind == "flat":
        return [Slot(b.shard, optimizer._local.state, _flat_pieces(
                    [names[id(p)] for p in b.params], [p.shape for p in b.params], b.offsets, b.start,
                    b.shard.numel(), optimizer.group, True)) for b in optimizer.buckets]
    if kind == "oss":  # the owner's local optimizer holds whole parameters
        return [Slot(p, optimizer.optim.state, _whole(names[id(p)]))
                for group in optimizer.optim.param_groups for p in group["params"]]
    return [Slot(p, optimizer.state, _whole(names[id(p)]))
            for group in optimizer.param_groups for p in group["params"]]


# --8<-- [start:optimizer_state]
# --8<-- [start:optimizer_state_only]
def optimizer_state(model: nn.Module,
                    optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {key: this rank's part of that parameter's state}}: the
    per-parameter state PyTorch's optimizers keep, cut from whatever layout
    this strategy steps. A 0-dim value (AdamW's step) is whole on every rank
    that holds a part of the parameter."""
    out = {}
    for slot in slots(model, optimizer):
        state = slot.state.get(slot.tensor, {})
        for name, piece in slot.pieces:
            for key, value in state.items():
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"optimizer state {key!r} of {name!r} is a "
                        f"{type(value).__name__}, not a tensor: "
                        f"minifsdp.checkpoint saves tensor state only")
                part = value if value.dim() == 0 else piece(value)
                if part is not None:
                    out.setdefault(name, {})[key] = part
    return out
# --8<-- [end:optimizer_state_only]


def make_optimizer_state(model: nn.Module, optimizer,
                         saved: dict[str, dict[str, tuple]]) -> None:
    """Give every slot the state tensors the checkpoint has for its
    parameters, zero-filled, where the optimizer has none yet (a fresh
    optimizer has no state until its first step): `saved` maps a name to
    {key: (size, dtype)}. Then optimizer_state() can describe them, and DCP
    load into them in place."""
    for slot in slots(model, optimizer):
        state = slot.state.setdefault(slot.tensor, {})
        for name, _ in slot.pieces:
            for key, (size, dtype) in saved.get(name, {}).items():
                if key in state:
                    continue
                if len(size) == 0:
                    state[key] = torch.zeros(
                        (), dtype=dtype,
                        device=(slot.tensor.device if key != "step"
                                else torch.device("cpu")))
                else:
                    state[key] = torch.zeros_like(slot.tensor, dtype=dtype)
        if not state:
            del slot.state[slot.tensor]
# --8<-- [end:optimizer_state]


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


def param_groups(model: nn.Module, optimizer) -> list[dict]:
    """The optimizer's hyper-parameters, one dict per param group, "params" listing the original names (a
    FlatParameter stands for every original it holds), as PyTorch's get_optimizer_state_dict does."""
    kind = strategy_of(model, optimizer)
    if kind == "fsdp":
        names = {id(s.tensor): [n for n, _ in s.pieces] for s in slots(model, optimizer)}
        groups = [(g, [n for p in g["params"] for n in names[id(p)]]) for g in optimizer.param_groups]
    else:
        named = {id(p): n for n, p in unwrapped(model).named_parameters()}
        groups = [(g, [named[id(p)] for p in g["params"]]) for g in optimizer.param_groups]
    return [{k: _jsonable(v) for k, v in g.items() if k != "params"} | {"params": params} for g, params in groups]


def load_param_groups(model: nn.Module, optimizer, saved: list[dict]) -> None:
    """Set each group's hyper-parameters from the saved group that holds its first parameter (the groups
    of another strategy hold the same names, cut differently)."""
    where = {name: g for g in saved for name in g["params"]}
    for group, current in zip(optimizer.param_groups, param_groups(model, optimizer)):
        source = next((where[n] for n in current["params"] if n in where), None)
        if source is None:
            continue
        for k, v in source.items():
            if k == "params" or k not in group:
                continue
            if isinstance(group[k], torch.Tensor):
                group[k].fill_(v)
            else:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


# -- DDP's buckets: part of what the next step computes ------------------------------------------------------------
def bucket_order(model: nn.Module) -> list[list[str]] | None:
    """minifsdp DDP's buckets, by parameter name, once rebuilt in the order gradients arrived (chapter 1).
    They group the sums of the all-reduce, and at N >= 3 the grouping changes the last bit of the sums: a
    resumed run that started again from the first guess would not continue bit for bit."""
    if not isinstance(model, DistributedDataParallel) or not model.rebuild_buckets or not model._rebuilt:
        return None
    names = {id(p): n for n, p in model.module.named_parameters()}
    return [[names[id(p)] for p in b.params] for b in model._buckets]


def set_bucket_order(model: nn.Module, saved: list[list[str]] | None) -> None:
    """Use the saved buckets if this is a DDP that has not rebuilt its own and they hold its parameters."""
    if not saved or not isinstance(model, DistributedDataParallel) or not model.rebuild_buckets or model._rebuilt:
        return
    params = dict(model.module.named_parameters())
    if sorted(n for group in saved for n in group) != sorted(n for n, p in params.items() if p.requires_grad):
        return  # another model or other trainable parameters: let it rebuild from what it sees
    model._set_buckets([[params[n] for n in group] for group in saved])
    model._arrivals, model._rebuilt = [], True
