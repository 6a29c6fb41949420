"""PyTorch FSDP1's summon_full_params(): every original parameter whole, between steps, with the names the
model had before wrapping.

    with FSDP.summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():    # the originals, full
            ...

It gathers unit by unit with chapter 5's unshard() and writes edits back with write_back_shard(); the rest
is PyTorch's surface: which units, on which ranks, copied where, with or without their gradients.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.fsdp.streams import sync_all_gathers
from minifsdp.fsdp.wrap import is_unit


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
    if grad is None or not flat.uses_sharded_strategy:
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
