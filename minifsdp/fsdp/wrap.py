"""Chapter 6: which modules become units -- the wrap policies, and the walks over a wrapped model.

    FSDPUnit(model, auto_wrap_policy=ModuleWrapPolicy({Block}))

A policy is asked about every submodule, innermost first, and says whether it becomes a unit of its own
(a unit of the wrapping class around it). Each unit owns the parameters of its subtree that no nested unit
owns: one FlatParameter, so one all-gather and one reduce-scatter per unit. What the root (the outermost
unit) owns is whatever no policy claimed.

The walks here stop at units: a unit's subtree belongs to it. A module is a unit when its class says so
(`_fsdp_unit = True`, set by FSDPUnit), so nothing here needs the runtime itself. Two checks of
wrapping live here too: what may be wrapped, and an optimizer built before wrapping.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch
import torch.nn as nn

from minifsdp.ddp.ddp import require_module


# --8<-- [start:policies]
class ModuleWrapPolicy:
    """Wrap every submodule whose class is in `classes` (e.g. {Block}) in
    its own unit."""

    def __init__(self, classes):
        self.classes = tuple(classes)

    def __call__(self, module: nn.Module, unowned_numel: int) -> bool:
        return isinstance(module, self.classes)


class SizeBasedWrapPolicy:
    """Wrap a submodule once the parameters not yet in a nested unit reach
    `min_num_params`."""

    def __init__(self, min_num_params: int = 100_000_000):
        self.min_num_params = min_num_params

    def __call__(self, module: nn.Module, unowned_numel: int) -> bool:
        return unowned_numel >= self.min_num_params
# --8<-- [end:policies]


def is_unit(module: nn.Module) -> bool:
    return getattr(type(module), "_fsdp_unit", False)


def is_ignored(module: nn.Module) -> bool:
    """In FullyShardedDataParallel's ignored_modules: no unit owns it, nothing wraps it."""
    return getattr(module, "_fsdp_ignored", False)


def named_modules_not_in_units(module: nn.Module, prefix: str = ""):
    """(qualified name + ".", module) for `module` and its descendants, stopping at nested units (they own
    their own subtrees) and at ignored modules (nobody owns those)."""
    yield prefix, module
    for name, child in module.named_children():
        if not is_unit(child) and not is_ignored(child):
            yield from named_modules_not_in_units(child, f"{prefix}{name}.")


def modules_not_in_units(module: nn.Module):
    return [m for _, m in named_modules_not_in_units(module)]


def unowned_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of `module`'s subtree that no nested unit owns yet (a tied one once). A nested unit's
    own FlatParameter is not among them: it is registered on the unit, where the walk stops."""
    return list(dict.fromkeys(p for m in modules_not_in_units(module) for p in m.parameters(recurse=False)))


def unowned_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in unowned_params(module))


def unowned_named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters and buffers no nested unit owns: what a unit may broadcast from rank
    0. A nested unit's tensors are shards by now -- each rank's own -- and must not be overwritten."""
    found = {}  # id -> (name, tensor): a tied tensor once, under its first name
    for prefix, m in named_modules_not_in_units(module):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    found.setdefault(id(t), (prefix + name, t))
    return list(found.values())


def move_own_tensors(module: nn.Module, device: torch.device) -> None:
    """module.to(device) for the parameters and buffers no nested unit owns -- a nested unit's are shards
    held by its FlatParameter, which module.to() would move behind its back."""
    with torch.no_grad():
        for m in modules_not_in_units(module):
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None and t.device != device:
                    t.data = t.data.to(device)


# --8<-- [start:wrap]
def wrap_children(module: nn.Module, policy, uses: dict,
                  wrap: Callable[[nn.Module], nn.Module],
                  prefix: str = "") -> None:
    """Post-order: wrap the deepest matching submodules first (`wrap(child)`
    makes the unit), so outer units own what is left.

    uses: every parameter -> the qualified names it appears under (a tied
    parameter has several).
    """
    for name, child in module.named_children():
        if is_unit(child) or is_ignored(child):
            continue
        if (hasattr(policy, "recurse")
                and not policy.recurse(child, unowned_numel(child))):
            # a PyTorch policy says: leave this subtree alone (too small, or
            # a leaf module)
            continue
        path = f"{prefix}{name}."
        wrap_children(child, policy, uses, wrap, path)
        if policy(child, unowned_numel(child)):
            # (what nested units own was checked when they were wrapped)
            for p in unowned_params(child):
                outside = [n for n in uses[p] if not n.startswith(path)]
                if outside:
                    inside = next(n for n in uses[p] if n.startswith(path))
                    raise ValueError(
                        f"{inside!r} is tied to {outside[0]!r}, but the wrap "
                        f"policy puts them in different units: tied "
                        f"parameters must live in the same unit (wrap a "
                        f"module that contains both)")
            setattr(module, name, wrap(child))
# --8<-- [end:wrap]


def named_units(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name of the wrapped module as before wrapping, unit) for every unit under `root`; the root is ''."""
    found = [("", root)]

    def walk(module, prefix):
        for name, child in module.named_children():
            if is_unit(child):
                found.append((prefix + name, child))
                child = child.module
            walk(child, prefix + name + ".")

    walk(root.module, "")
    return found


def names_without_wrappers(module: nn.Module, prefix: str = ""):
    """(qualified name + ".", module) for every module, as named before wrapping: a unit adds no name."""
    yield prefix, module
    for name, child in module.named_children():
        if is_unit(child):
            child = child.module
        yield from names_without_wrappers(child, prefix + name + ".")


def check_wrappable(module, auto_wrap_policy) -> None:
    """What cannot be wrapped is refused now, with what to do instead."""
    # (units nested inside are allowed, unlike DDP)
    require_module(module, "FullyShardedDataParallel")
    if is_unit(module) or getattr(module, "_fsdp_wrapped", False):
        raise ValueError(f"{type(module).__name__} is already wrapped in "
                         "FullyShardedDataParallel; wrap each module once "
                         "(nested units come from auto_wrap_policy)")
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        hint = (f" (for classes, ModuleWrapPolicy({auto_wrap_policy!r}))"
                if isinstance(auto_wrap_policy, (set, list, tuple)) else "")
        raise TypeError(f"auto_wrap_policy must be a policy such as "
                        f"ModuleWrapPolicy({{Block}}) or "
                        f"SizeBasedWrapPolicy(min_num_params=...), got "
                        f"{auto_wrap_policy!r}{hint}")


# --8<-- [start:refuse_stale]
def refuse_stale_optimizers(root: nn.Module) -> None:
    """An optimizer built before wrapping holds the original parameters, which
    now hold nothing: it would step nothing, silently. Asked once, at the
    root's first forward: is any original still held in an optimizer's
    param_groups? (A look at what refers to them -- no cost to any optimizer's
    step.)"""
    originals = [p for u in root.units() for flat in u.flat_params
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
