"""State dicts of a FullyShardedDataParallel model, under the names it had before wrapping.

Full (FULL_STATE_DICT): gathered one FlatParameter at a time, as PyTorch's FSDP1 does -- all-gather its
fp32 master shards, let the originals be views into the full buffer, copy each out (to host memory with
offload_to_cpu; on rank 0 only with rank0_only), and free the buffer before the next unit is gathered.
So the working memory is the largest unit, not the model: on a GPU, the difference between a checkpoint
that fits and one that does not (minifsdp/reports/state_dict_memory.py measures it). Loading walks the
same way: each unit is unsharded, written, and each rank copies its slice back into its shard.

Sharded (SHARDED_STATE_DICT): no gather at all. Each original parameter is described by the pieces of it
this rank's flat shard holds, as a ShardedTensor of views (minifsdp/checkpoint/flat_chunks.py), which
torch.distributed.checkpoint writes, and reads back at any world size. DTensors (Shard(0) of each
parameter, _use_dtensor=True) need the gather again: a flat shard cuts through parameters, a DTensor does not.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from minifsdp.distributed import comm
from minifsdp.fsdp.streams import sync_all_gathers
from minifsdp.fsdp.wrap import names_without_wrappers


# --8<-- [start:state_dict]
@contextlib.contextmanager
def unsharded(flat, summoned: bool = False):
    """Inside the block, this one FlatParameter's originals are views into
    its full fp32 parameters.

    summoned: its unit is inside summon_full_params, which has gathered it on
    every rank already: the values are those shown there (edits included),
    and that block, not this one, reshards them."""
    if summoned:
        if not flat.is_unsharded:
            raise RuntimeError("inside summon_full_params(rank0_only=True) "
                               "only rank 0 holds the full parameters: take "
                               "the full state dict on rank 0 only")
        yield
        return
    # the fp32 masters, not their bf16 cast (chapter 8)
    with flat.full_precision():
        flat.unshard()
        try:
            yield
        finally:
            flat.reshard()


def each_full_tensor(root):
    """(name, full tensor) for every entry of the full state dict, in
    nn.Module.state_dict()'s order of modules: first the buffers and the
    parameters no unit flattened, then unit by unit the originals. A unit's
    originals are views into its unsharded buffer, which is freed before the
    next unit comes: copy what you keep. (Every rank must walk to the end:
    each unit is an all-gather.)"""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    for prefix, m in names_without_wrappers(root.module):
        for name, t in _plain_tensors(m):
            yield prefix + name, t.detach()
    # the shards may have just been written (a step, a load)
    sync_all_gathers(root.device)
    for unit in root.units():
        for flat in unit.flat_params:
            with unsharded(flat, unit._summoned):
                # a tied parameter: under each of its names
                for module, name in flat.places:
                    yield (names[id(module)] + name,
                           getattr(module, name).detach())


def full_state_dict(root, offload_to_cpu: bool = False,
                    rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict, with the names the model had before
    wrapping, gathered unit by unit.
    offload_to_cpu: each tensor is copied to host memory as soon as its unit
    is gathered. rank0_only: every rank takes part in the all-gathers, only
    rank 0 of the group copies anything (the others get {})."""
    keep = not rank0_only or comm.rank(root.process_group) == 0
    out = {}
    for name, t in each_full_tensor(root):
        if keep:  # a copy of its own: the view's buffer is about to be freed
            out[name] = t.to("cpu", copy=True) if offload_to_cpu else t.clone()
    return out
def _plain_tensors(m):
    """A module's persistent buffers, and the parameters no unit flattened
    (ignored_modules'), by name: with the flattened parameters, exactly the
    keys nn.Module.state_dict() gives the unwrapped model. (Inside
    summon_full_params the flattened ones are registered too, marked: they
    come with their units.)"""
    return [(name, t) for table in (m._buffers, m._parameters)
            for name, t in table.items()
            if t is not None and name not in m._non_persistent_buffers_set
            and not hasattr(t, "_summoned_original")]


def key_problems(wanted, known, given,
                 strict: bool) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, problems so far) of a state dict `given` for a
    model that wants the keys of `wanted` and knows those of `known`: under
    strict, each missing or unexpected key is a problem."""
    missing = [k for k in wanted if k not in given]
    unexpected = [k for k in given if k not in known]
    problems = ([f"missing key {k!r}" for k in missing]
                + [f"unexpected key {k!r}" for k in unexpected])
    return missing, unexpected, problems if strict else []


class IncompatibleKeys(NamedTuple):
    """What load_full_state_dict(strict=False) let pass, as
    nn.Module.load_state_dict returns it."""
    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self):  # as nn.Module.load_state_dict's result prints
        if not (self.missing_keys or self.unexpected_keys):
            return "<All keys matched successfully>"
        return (f"IncompatibleKeys(missing_keys={self.missing_keys}, "
                f"unexpected_keys={self.unexpected_keys})")


def _original_shapes(root) -> dict[str, torch.Size]:
    """Every name full_state_dict() gives, with its shape. Outside
    summon_full_params() the parameters are empty placeholders, so their
    shapes come from the flat parameters, which keep the originals'."""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    shapes = {}
    for prefix, m in names_without_wrappers(root.module):
        for name, t in _plain_tensors(m):
            shapes[prefix + name] = t.shape
    for unit in root.units():
        for flat in unit.flat_params:
            # a tied parameter: each of its names
            for (module, name), i in zip(flat.places, flat.index):
                shapes[names[id(module)] + name] = flat.shapes[i]
    return shapes


def load_full_state_dict(root, state_dict: dict[str, torch.Tensor],
                         strict: bool = True) -> IncompatibleKeys:
    """Write a full state dict (as full_state_dict() gives) into the shards:
    each rank keeps its slice.

    Checked first, as nn.Module.load_state_dict checks: every key must be one
    the unwrapped model has and (strict) every one of those must be there; a
    shape must match exactly, strict or not -- copy_() would broadcast a (4,)
    tensor into a (3, 4) weight without a word. One error names every
    problem, and comes before the first write (and before the first
    all-gather), so the model keeps what it had.
    strict=False skips missing and unexpected keys and returns them."""
    expected = _original_shapes(root)
    missing, unexpected, problems = key_problems(expected, expected,
                                                 state_dict, strict)
    for k, shape in expected.items():
        if k not in state_dict:
            continue
        value = state_dict[k]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{k!r}: expected a tensor of shape "
                            f"{tuple(shape)}, got {type(value).__name__}")
        elif value.shape != shape:
            problems.append(f"size mismatch for {k!r}: expected shape "
                            f"{tuple(shape)}, got {tuple(value.shape)}")
    if problems:
        raise RuntimeError("load_full_state_dict: nothing was loaded, the "
                           "model is unchanged:\n  "
                           + "\n  ".join(problems))

    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    with torch.no_grad():
        for prefix, m in names_without_wrappers(root.module):
            for name, t in _plain_tensors(m):
                # not there: strict=False, and it keeps its value
                if prefix + name in state_dict:
                    t.copy_(state_dict[prefix + name])
        sync_all_gathers(root.device)
        # one unit unsharded at a time, as when saving
        for unit in root.units():
            for flat in unit.flat_params:
                with unsharded(flat, unit._summoned):
                    for module, name in flat.places:
                        key = names[id(module)] + name
                        # the others are written back unchanged
                        if key in state_dict:
                            getattr(module, name).copy_(state_dict[key])
                    # this rank's slice of what was written, into its shard
                    flat.write_back_shard()
    return IncompatibleKeys(missing, unexpected)
# --8<-- [end:state_dict]


# -- sharded state dicts ----------------------------------------------------------------------------------------
def original_names(root) -> list[tuple]:
    """For every FlatParameter under `root`: (the FlatParameter, the name of each original it holds -- a tied
    one's first, in module order, as named_parameters() gives it --, every (name, index of the original)
    it is reachable under, as nn.Module.state_dict() lists them)."""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    order = {id(m): i for i, (_, m) in enumerate(names_without_wrappers(root.module))}
    out = []
    for unit in root.units():
        for flat in unit.flat_params:
            every = [(names[id(module)] + name, i) for (module, name), i in zip(flat.places, flat.index)]
            first = {}
            for (module, name), i in sorted(zip(flat.places, flat.index), key=lambda x: order[id(x[0][0])]):
                first.setdefault(i, names[id(module)] + name)
            out.append((flat, [first[i] for i in range(len(flat.shapes))], every))
    return out


# --8<-- [start:sharded]
def sharded_pieces(unit) -> dict:
    """SHARDED_STATE_DICT: original names -> ShardedTensors whose local shards
    are views into this rank's flat shards (minifsdp/checkpoint/flat_chunks.py
    cuts them): no collective, no copy. A 0-dim parameter lies on one rank: a
    plain tensor there, absent elsewhere. Buffers and ignored parameters are
    whole, and so is everything under NO_SHARD."""
    # (imported here: the rest of minifsdp.checkpoint builds on this package)
    from minifsdp.checkpoint.flat_chunks import flat_piece

    _between_steps(unit)
    out = {prefix + name: t.detach()
           for prefix, m in names_without_wrappers(unit.module)
           for name, t in _plain_tensors(m)}
    for flat, _, every in original_names(unit):
        shard, start = flat.param.detach(), flat.rank * flat.shard_numel
        made = [flat_piece(shard, start, flat.shard_numel, offset, shape,
                           flat.group, flat.uses_sharded_strategy)
                for shape, offset in zip(flat.shapes, flat.offsets)]
        # a tied one: under each name
        out.update({name: made[i] for name, i in every if made[i] is not None})
    return out


def load_sharded_pieces(unit, state_dict_: dict,
                        strict: bool) -> IncompatibleKeys:
    """Copy SHARDED_STATE_DICT's pieces back in place, with no collective:
    each ShardedTensor must hold the boxes this rank holds now -- what
    state_dict() gave, or torch.distributed.checkpoint loaded into it (which
    reads a checkpoint of any world size). Checked, all of it, before
    anything is written."""
    current = sharded_pieces(unit)
    missing, unexpected, problems = key_problems(
        current, _original_shapes(unit), state_dict_, strict)
    for k, value in state_dict_.items():
        # (not there: a 0-dim parameter another rank's shard holds)
        if k in current:
            problem = _mismatch(current[k], value)
            problems += [f"{k!r}: {problem}"] if problem else []
    if problems:
        raise RuntimeError("load_state_dict (SHARDED_STATE_DICT): nothing was "
                           "loaded, the model is unchanged:\n  "
                           + "\n  ".join(problems))
    with torch.no_grad():
        for k, value in state_dict_.items():
            if k in current:
                for mine, given in zip(_local_tensors(current[k]),
                                       _local_tensors(value)):
                    mine.copy_(given)
    return IncompatibleKeys(missing, unexpected)


def _local_tensors(t) -> list[torch.Tensor]:
    return ([s.tensor for s in t.local_shards()]
            if hasattr(t, "local_shards") else [t])


def _boxes(t) -> list[tuple[list[int], list[int]]]:
    """(offsets, sizes) of what this rank holds of `t`: its local shards, or
    the whole of a plain tensor."""
    if hasattr(t, "local_shards"):
        return [(list(s.metadata.shard_offsets), list(s.metadata.shard_sizes))
                for s in t.local_shards()]
    return [([0] * t.dim(), list(t.shape))]


def _shape(t) -> tuple[int, ...]:
    # (a ShardedTensor's metadata: any torch operation on one warns that
    # ShardedTensor is deprecated)
    return tuple(t.metadata().size if hasattr(t, "local_shards") else t.shape)


def _mismatch(mine, given) -> str | None:
    if not isinstance(given, torch.Tensor):
        return f"expected a tensor, got {type(given).__name__}"
    if _shape(given) != _shape(mine):
        return (f"size mismatch: expected shape {_shape(mine)}, "
                f"got {_shape(given)}")
    if (hasattr(mine, "local_shards") != hasattr(given, "local_shards")
            or _boxes(mine) != _boxes(given)):
        return (f"this rank holds the pieces (offsets, sizes) {_boxes(mine)}, "
                f"the state dict has {_boxes(given)}: load a checkpoint of "
                f"another layout with torch.distributed.checkpoint into "
                f"model.state_dict()")
    return None


def _between_steps(unit, kind: str = "SHARDED_STATE_DICT") -> None:
    """The shards are what these state dicts hold: refused while a unit holds
    its full parameters, or its originals stand in for its flat parameter
    (summon_full_params)."""
    if any((flat.uses_sharded_strategy and flat.is_unsharded) or u._summoned
           for u in unit.units() for flat in u.flat_params):
        raise RuntimeError(f"{kind}: a unit holds its full parameters now "
                           "(inside a training step, or summon_full_params): "
                           "take or load the state dict between steps")


def sharded_dtensors(unit) -> dict[str, torch.Tensor]:
    """ShardedStateDictConfig(_use_dtensor=True): original names -> DTensors
    holding this rank's Shard(0) of each tensor (a 0-dim one is Replicated).
    The flat shards cut through parameters, while a DTensor shards each
    parameter by itself: so each unit is gathered whole and cut again along
    dim 0 -- one unit at a time, as PyTorch FSDP1 does."""
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

    group = unit.process_group or torch.distributed.group.WORLD
    mesh = DeviceMesh.from_group(group, unit.device.type)
    n, r = comm.world_size(unit.process_group), comm.rank(unit.process_group)
    out = {}
    # t: a view into its unit's buffer, freed after the unit
    for name, t in each_full_tensor(unit):
        if t.dim() == 0:
            out[name] = DTensor.from_local(t.clone(), mesh, [Replicate()],
                                           run_check=False)
            continue
        chunks = list(t.chunk(n, dim=0))
        local = (chunks[r] if r < len(chunks)
                 else t.new_empty((0,) + tuple(t.shape[1:])))
        out[name] = DTensor.from_local(local.clone(), mesh, [Shard(0)],
                                       run_check=False, shape=t.shape,
                                       stride=t.stride())
    return out
# --8<-- [end:sharded]


def _all_units_at_once(root) -> dict[str, torch.Tensor]:
    """The full state dict as chapter 6 first took it: every unit gathered at once (summon_full_params),
    then copied -- the whole model unsharded on every rank for a moment. Kept for the comparison in
    minifsdp/reports/state_dict_memory.py; full_state_dict() gives the same bits, one unit at a time."""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    out = {}
    with root.summon_full_params(writeback=False):
        for prefix, m in names_without_wrappers(root.module):
            for name, t in _plain_tensors(m):
                out[prefix + name] = t.detach().clone()
        for unit in root.units():
            for flat in unit.flat_params:
                for module, name in flat.places:
                    out[names[id(module)] + name] = getattr(module, name).detach().clone()
    return out
