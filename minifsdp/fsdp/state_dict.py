"""Full (unsharded) state dicts of a FullyShardedDataParallel model: the names it had before wrapping.

Gathering is summon_full_params(): every unit all-gathers its fp32 master shards, the originals become views
into the full buffers, and a copy of each is taken; loading writes into those views, and each rank copies
its slice back into its shard. (Chapter 10 adds sharded state dicts, optimizer state, and checkpoints.)
"""

from __future__ import annotations

import torch

from minifsdp.fsdp.wrap import names_without_wrappers


# --8<-- [start:state_dict]
def full_state_dict(root) -> dict[str, torch.Tensor]:
    """The unsharded state dict, with the names the model had before wrapping (on every rank)."""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    out = {}
    with root.summon_full_params():
        for prefix, m in names_without_wrappers(root.module):
            for name, b in m.named_buffers(recurse=False):
                out[prefix + name] = b.detach().clone()
        for unit in root.units():
            for flat in unit.flat_params:
                for module, name in flat.places:
                    out[names[id(module)] + name] = getattr(module, name).detach().clone()
    return out


def load_full_state_dict(root, state_dict: dict[str, torch.Tensor]) -> None:
    """Write a full state dict (as full_state_dict() gives) into the shards: each rank keeps its slice."""
    names = {id(m): prefix for prefix, m in names_without_wrappers(root.module)}
    with root.summon_full_params(writeback=True):
        for prefix, m in names_without_wrappers(root.module):
            for name, b in m.named_buffers(recurse=False):
                b.copy_(state_dict[prefix + name])
        for unit in root.units():
            for flat in unit.flat_params:
                for module, name in flat.places:
                    getattr(module, name).copy_(state_dict[names[id(module)] + name])
# --8<-- [end:state_dict]
