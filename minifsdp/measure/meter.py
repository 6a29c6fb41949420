"""The one place minifsdp measures memory: per-rank live and peak bytes, split by category.

    meter = MemoryMeter(model, optimizer)
    with meter:
        loss = model(x).sum(); loss.backward(); optimizer.step()
        meter.snapshot("after step")
    meter.peak, meter.peak_by_category, meter.snapshots["after step"]

How it measures:
- Everywhere (CPU, CUDA, meta tensors) it *tracks tensor storages*: inside the `with` block every op's
  output is seen by a TorchDispatchMode; each new storage is added to a running total, and a weak
  reference tells us the moment the storage is freed, so the total is always the live bytes and its
  maximum is the peak. Storages that existed before (the model, the optimizer state) are added when the
  meter is given the model and optimizer.
- On CUDA the caching allocator also reports its own numbers (`max_memory_allocated`, `num_alloc_retries`),
  which include what the tracker cannot see (workspaces, fragmentation): they are the truth there.

Categories: params, grads (the `.grad` of watched params), optim (tensors in optimizer.state) and other
(activations, temporaries, communication buffers). A storage is re-labelled the moment it becomes a
gradient or optimizer state (hooks), so the split at the peak is right too. A meter made with
`categories=CATEGORIES + ("unsharded",)` has a category of that name too, for storages given to
`watch(...)` under it (chapter 13: FSDP's full parameters, apart from the shards); a storage watched under a
category keeps it.

Meta tensors (chapter 13) are counted as if they were real: a meta storage has no memory, but it has a
size, `nbytes()`, and it lives and dies as a real one would. So the same model, wrapper and step give the
same figures on the meta device as on the CPU, at sizes no machine here could hold.

A storage that changes size in place (storage.resize_ is not an op a dispatch mode sees) is announced by
the runtime as an event (minifsdp/events.py: FSDP frees and re-allocates its unsharded parameters this
way, chapter 6); the meter listens while it is inside its `with` block.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minifsdp import events

CATEGORIES = ("params", "grads", "optim", "other")


def _storage(t: torch.Tensor):
    """The storage really holding `t`'s data: a DTensor (torch's FSDP2) is a wrapper around a local shard."""
    return getattr(t, "_local_tensor", t).untyped_storage()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared weights are counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


# --8<-- [start:dispatch]
class _Tracker(TorchDispatchMode):
    """Sees every op's outputs and reports new storages to the meter."""

    def __init__(self, meter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.meter._track(_storage(t), "other")
        return out
# --8<-- [end:dispatch]


class MemoryMeter:
    def __init__(self, model: torch.nn.Module | None = None, optimizer=None, categories: tuple = CATEGORIES,
                 refresh: bool = True):
        if not set(CATEGORIES) <= set(categories):
            raise ValueError(f"categories must include {CATEGORIES}, got {categories!r}")
        self.categories = tuple(categories)
        # re-read every live storage's size at every op (_refresh): for code that resizes storages without
        # announcing it (torch's own FSDP2). minifsdp's wrappers announce theirs, so a meter of them alone
        # may pass refresh=False and save O(live storages) per op (chapter 13 does, on models of 70B)
        self.refresh = refresh
        self._live: dict[int, list] = {}  # id(storage) -> [nbytes, category, weakref]
        self._by_cat = defaultdict(int)
        self._pinned: set[int] = set()    # ids of storages watch() labelled: they keep their category
        self._hooks = []
        self._models, self._optimizers = [], []
        self.peak = 0
        self.peak_by_category = {c: 0 for c in self.categories}  # the split at the moment of the peak
        self.category_peak = {c: 0 for c in self.categories}     # each category's own highest, at any moment
        self.snapshots: dict[str, dict[str, int]] = {}
        self._mode = None
        self._retries_before = self._cuda_stat("num_alloc_retries")  # the allocator counts from process start
        if model is not None:
            self.watch_model(model)
        if optimizer is not None:
            self.watch_optimizer(optimizer)

    # -- what we track -------------------------------------------------------------------------------
    # --8<-- [start:track]
    def _track(self, storage, category: str) -> None:
        self._set_category(storage, category)
        self._update_peak()

    # --8<-- [start:count]
    def _set_category(self, storage, category: str) -> None:
        """Count the storage under `category` (a new one, or one that just
        changed roles); no peak update."""
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, lambda _, key=key: self._free(key))
            self._live[key] = entry = [nbytes, category, ref]
            self._by_cat[category] += nbytes
        elif (entry[1] != category and category != "other"
              and key not in self._pinned):
            # e.g. an autograd output that just became p.grad
            self._by_cat[entry[1]] -= entry[0]
            self._by_cat[category] += entry[0]
            entry[1] = category
    # --8<-- [end:count]

    def _resize(self, storage) -> None:
        entry = self._live.get(id(storage))
        if entry is None:
            self._track(storage, "other")
            return
        new = storage.nbytes()
        self._by_cat[entry[1]] += new - entry[0]
        entry[0] = new
        self._update_peak()

    # --8<-- [start:free]
    def _free(self, key: int) -> None:
        self._pinned.discard(key)
        entry = self._live.pop(key, None)
        if entry is not None:
            self._by_cat[entry[1]] -= entry[0]
    # --8<-- [end:free]

    def _refresh(self) -> None:
        """Re-read every live storage's size: code we do not control (torch's
        FSDP2, say) may resize a storage in place, which no op reports.
        O(live storages) per op: fine for a meter, not for speed."""
        # (a copy: a storage freed while we read -- its weakref callback runs
        # at once -- leaves the dict)
        for entry in list(self._live.values()):
            storage = entry[2]()
            if storage is not None and storage.nbytes() != entry[0]:
                self._by_cat[entry[1]] += storage.nbytes() - entry[0]
                entry[0] = storage.nbytes()

    def _update_peak(self) -> None:
        if self.refresh:
            self._refresh()
        total = sum(self._by_cat.values())
        for c in self.categories:
            self.category_peak[c] = max(self.category_peak[c], self._by_cat[c])
        if total > self.peak:
            self.peak = total
            self.peak_by_category = {c: self._by_cat[c] for c in self.categories}
    # --8<-- [end:track]

    def watch_model(self, model: torch.nn.Module) -> None:
        self._models.append(model)
        for p in model.parameters():
            self._track(_storage(p), "params")
            if p.grad is not None:
                self._track(_storage(p.grad), "grads")
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._label_grad))

    def watch(self, tensors, category: str) -> None:
        """Count these tensors' storages under `category` from now on, whatever their size becomes (e.g.
        FSDP's unsharded buffers as "params": they are parameters while a unit computes). The storages keep
        the category: the model's parameters re-labelled "params" at live() leave them as they are."""
        if category not in self.categories:
            raise ValueError(f"category {category!r} is not one of this meter's {self.categories}")
        for t in tensors:
            storage = _storage(t)
            self._pinned.discard(id(storage))
            self._track(storage, category)
            self._pinned.add(id(storage))

    def _label_grad(self, p) -> None:
        if p.grad is not None:  # ZeRO-2 may already have dropped a gradient this rank does not own
            self._track(_storage(p.grad), "grads")

    def watch_optimizer(self, optimizer) -> None:
        self._optimizers.append(optimizer)
        self._label_optimizer_state(optimizer)
        self._hooks.append(optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self._label_optimizer_state(opt)))

    def _label_optimizer_state(self, optimizer) -> None:
        for t in optimizer_tensors(optimizer):
            self._track(_storage(t), "optim")
        # The tensors the optimizer really steps are its state's keys; a sharded optimizer may step
        # slices that are no parameter of the model, and their gradients are gradients too.
        for p in optimizer.state:
            if isinstance(p, torch.Tensor) and p.grad is not None:
                self._track(_storage(p.grad), "grads")

    # -- what we report ------------------------------------------------------------------------------
    def live(self) -> dict[str, int]:
        """Live bytes by category right now (re-labelled from the watched model and optimizer) and total."""
        for opt in self._optimizers:
            self._label_optimizer_state(opt)
        for m in self._models:
            for p in m.parameters():
                # (FSDP swaps a parameter's storage for its unsharded buffer while the unit is in use)
                self._track(_storage(p), "params")
                if p.grad is not None:
                    self._track(_storage(p.grad), "grads")
        out = {c: self._by_cat[c] for c in self.categories}
        out["total"] = sum(out.values())
        return out

    def snapshot(self, label: str) -> dict[str, int]:
        self.snapshots[label] = snap = self.live()
        return snap

    def peak_snapshot(self) -> dict[str, int]:
        """The split by category at the moment of the peak (since the last reset_peak), and its total."""
        return {**self.peak_by_category, "total": self.peak}

    def reset_peak(self) -> None:
        self.peak = 0
        self.category_peak = {c: 0 for c in self.categories}
        self._update_peak()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def allocator_stats(self) -> dict[str, int]:
        """CUDA only: the caching allocator's own view (bytes), the truth on a GPU. num_alloc_retries: how many
        times, since this meter was made, an allocation found no free block, so the allocator emptied its
        cache and tried again -- fragmentation, or memory nearly full. On the CPU: {} (no caching allocator)."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {}
        s = torch.cuda.memory_stats()
        return {"allocated": s.get("allocated_bytes.all.current", 0),
                "max_allocated": s.get("allocated_bytes.all.peak", 0),
                "num_alloc_retries": s.get("num_alloc_retries", 0) - self._retries_before}

    @staticmethod
    def _cuda_stat(key: str) -> int:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return 0
        return torch.cuda.memory_stats().get(key, 0)

    def __enter__(self):
        self._mode = _Tracker(self)
        self._mode.__enter__()
        events.subscribe(events.STORAGE_RESIZED, self._resize)
        return self

    def __exit__(self, *exc):
        events.unsubscribe(events.STORAGE_RESIZED, self._resize)
        self._mode.__exit__(*exc)
        self._mode = None
        return False

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
