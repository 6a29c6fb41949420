"""Full (unsharded) state dicts, the same call for every strategy.

    sd = get_full_state_dict(model)        # names as in the unwrapped model, full tensors, every rank
    set_full_state_dict(model, sd)

DDP-style wrappers (ours, torch's, ShardedDataParallel) replicate the model, so its own state dict is
already full; FullyShardedDataParallel gathers the shards (and scatters them back on load).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def get_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    inner = getattr(model, "module", model)
    # torch's FSDP2 keeps DTensors: full_tensor() all-gathers one
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in inner.state_dict().items()}


def set_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Load as nn.Module.load_state_dict does: strict (every key, no other) unless strict=False, a shape
    mismatch an error either way; returns (missing_keys, unexpected_keys). FSDP checks everything before it
    writes anything; nn.Module.load_state_dict writes the tensors that fit, then raises about the rest."""
    if hasattr(model, "load_full_state_dict"):
        return model.load_full_state_dict(state_dict, strict=strict)
    return getattr(model, "module", model).load_state_dict(state_dict, strict=strict)
