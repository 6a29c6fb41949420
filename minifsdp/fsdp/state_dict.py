"""Full (unsharded) state dicts of a FullyShardedDataParallel model: the names it had before wrapping.

Gathering is summon_full_params(): every unit all-gathers its fp32 master shards, the originals become views
into the full buffers, and a copy of each is taken; loading writes into those views, and each rank copies
its slice back into its shard. (Chapter 10 adds sharded state dicts, optimizer state, and checkpoints.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minifsdp.fsdp.wrap import names_without_wrappers


# --8<-- [start:state_dict]
def full_state_dict(root) -> dict[str, torch.Tensor]:
    """The unsharded state dict, with the names the model had before wrapping (on every rank)."""
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


def _plain_tensors(m):
    """A module's persistent buffers, and the parameters no unit flattened (ignored_modules'), by name: with
    the flattened parameters, exactly the keys nn.Module.state_dict() gives the unwrapped model."""
    return [(name, t) for table in (m._buffers, m._parameters) for name, t in table.items()
            if t is not None and name not in m._non_persistent_buffers_set]


class IncompatibleKeys(NamedTuple):
    """What load_full_state_dict(strict=False) let pass, as nn.Module.load_state_dict returns it."""
    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self):  # as nn.Module.load_state_dict's result prints
        if not (self.missing_keys or self.unexpected_keys):
            return "<All keys matched successfully>"
        return f"IncompatibleKeys(missing_keys={self.missing_keys}, unexpected_keys={self.unexpected_keys})"


def _original_shapes(root) -> dict[str, torch.Size]:
    """Every name full_state_dict() gives, with its shape. Outside summon_full_params() the parameters are
    empty placeholders, so their shapes come from the flat parameters, which keep the originals'."""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    shapes = {}
    for prefix, m in names_without_wrappers(root.module):
        for name, t in _plain_tensors(m):
            shapes[prefix + name] = t.shape
    for unit in root.units():
        for flat in unit.flat_params:
            for (module, name), i in zip(flat.places, flat.index):  # a tied parameter: each of its names
                shapes[names[id(module)] + name] = flat.shapes[i]
    return shapes


def load_full_state_dict(root, state_dict: dict[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
    """Write a full state dict (as full_state_dict() gives) into the shards: each rank keeps its slice.

    Checked first, as nn.Module.load_state_dict checks: every key must be one the unwrapped model has and
    (strict) every one of those must be there; a shape must match exactly, strict or not -- copy_() would
    broadcast a (4,) tensor into a (3, 4) weight without a word. One error names every problem, and comes
    before the first write (and before the collectives of summon_full_params), so the model keeps what it
    had. strict=False skips missing and unexpected keys and returns them."""
    expected = _original_shapes(root)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    problems = []
    if strict:
        problems += [f"missing key {k!r}" for k in missing] + [f"unexpected key {k!r}" for k in unexpected]
    for k, shape in expected.items():
        if k not in state_dict:
            continue
        value = state_dict[k]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{k!r}: expected a tensor of shape {tuple(shape)}, got {type(value).__name__}")
        elif value.shape != shape:
            problems.append(f"size mismatch for {k!r}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    if problems:
        raise RuntimeError("load_full_state_dict: nothing was loaded, the model is unchanged:\n  "
                           + "\n  ".join(problems))

    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    with root.summon_full_params(writeback=True):
        for prefix, m in names_without_wrappers(root.module):
            for name, t in _plain_tensors(m):
                if prefix + name in state_dict:  # not there: strict=False, and it keeps its value
                    t.copy_(state_dict[prefix + name])
        for unit in root.units():
            for flat in unit.flat_params:
                for module, name in flat.places:
                    if names[id(module)] + name in state_dict:  # the others are written back unchanged
                        getattr(module, name).copy_(state_dict[names[id(module)] + name])
    return IncompatibleKeys(missing, unexpected)
# --8<-- [end:state_dict]
