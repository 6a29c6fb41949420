"""Chapter 3, the flat design's checkpoints: FlatOSS's state, per rank or whole (flat.py).

FlatOSS's local optimizer holds one tensor of state per bucket slice: this rank's 1/N of every bucket,
cutting through parameters. A checkpoint takes one of two forms:
- this rank's shard (state_dict() after a step): one file per rank, resumed by the same rank of the same
  layout, with no communication;
- the full state in a plain torch optimizer's format (consolidated_state_dict(), on every rank; or
  consolidate_state_dict(recipient_rank), OSS's protocol): each element-wise state tensor all-gathered
  bucket by bucket and cut back into per-parameter tensors. It loads into a FlatOSS of any world size, or
  into a plain optimizer over the same parameters.
"""

from __future__ import annotations

import torch

from minifsdp.distributed import comm


class FlatStateDict:
    """FlatOSS's state dicts (a mixin: FlatOSS provides buckets, _local, _hyper, _parked, _laid_out)."""

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """OSS's protocol (FairScale's): gather the full state, in a plain torch optimizer's format, and keep
        it on rank `recipient_rank` (-1: every rank) for state_dict(). Call it on every rank."""
        full = self.consolidated_state_dict()
        self._consolidated = full if recipient_rank in (-1, self.rank) else None

    def state_dict(self, all_ranks: bool = False) -> dict:
        """The full state consolidate_state_dict() kept here, if no step came since (all_ranks=True: gathered
        now, on every rank); otherwise this rank's shard of the state (one file per rank), with every
        group's hyper-parameters."""
        if all_ranks:
            return self.consolidated_state_dict()
        if self._consolidated is not None:
            return self._consolidated
        return {"world_size": self.world_size, "rank": self.rank,
                "shard_numels": [b.shard.numel() for b in self.buckets],
                "param_groups": [self._hyper(g) for g in range(len(self.param_groups))],
                "local": self._local.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict() saved by this rank of the same layout, or a plain torch optimizer's state
        dict over the same params (e.g. from consolidated_state_dict(), at any world size)."""
        if "local" not in state_dict:
            return self._load_consolidated(state_dict)
        saved = (state_dict["world_size"], state_dict["rank"], state_dict["shard_numels"])
        mine = (self.world_size, self.rank, [b.shard.numel() for b in self.buckets])
        if saved != mine:
            raise ValueError(f"this sharded state dict is (world_size, rank, shard sizes) = {saved}, but this "
                             f"FlatOSS is {mine}. Load a consolidated_state_dict() to change the layout.")
        self._local.load_state_dict(state_dict["local"])
        for group, hyper in zip(self.param_groups, state_dict["param_groups"]):
            group.update(hyper)

    def _torch_indices(self) -> tuple[dict, list]:
        """Param -> index as torch's Optimizer.state_dict() numbers them, and the packed param groups."""
        index, packed, n = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(p, n)
                ids.append(index[p])
                n += 1
            packed.append(dict(self._hyper(len(packed)), params=ids))
        return index, packed

    def consolidated_state_dict(self) -> dict:
        """On every rank: the state dict a plain torch optimizer over the same params would have.

        Element-wise state (momentum, exp_avg, ...) is all-gathered bucket by bucket and cut back into
        per-parameter tensors; per-slice scalars (Adam's step) are the same for every param of a bucket.
        """
        index, packed = self._torch_indices()
        state: dict[int, dict] = {}
        for b in self.buckets:
            for key, value in self._local.state.get(b.shard, {}).items():
                if torch.is_tensor(value) and value.shape == b.shard.shape:
                    full = torch.empty_like(b.flat)
                    comm.all_gather(full, value.contiguous(), tag="state", group=self.group)
                    for p, start in zip(b.params, b.offsets):
                        state.setdefault(index[p], {})[key] = full[start: start + p.numel()].view_as(p).clone()
                else:
                    for p in b.params:
                        state.setdefault(index[p], {})[key] = value.clone() if torch.is_tensor(value) else value
        state.update({index[p]: parked for p, parked in self._parked.items()})
        return {"state": dict(sorted(state.items())), "param_groups": packed}

    def _load_consolidated(self, state_dict: dict) -> None:
        index, _ = self._torch_indices()
        saved = state_dict["state"]
        local_state = {}
        for i, b in enumerate(self.buckets):
            have = [saved[index[p]] for p in b.params if index[p] in saved]
            if not have:
                continue  # never stepped
            local_state[i] = {}
            for key, value in have[0].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    full = torch.zeros_like(b.flat)  # a param without state starts from zeros
                    for p, start in zip(b.params, b.offsets):
                        if key in saved.get(index[p], {}):
                            full[start: start + p.numel()].copy_(saved[index[p]][key].reshape(-1))
                    local_state[i][key] = full[b.start: b.start + b.shard.numel()].clone()
                else:
                    local_state[i][key] = value
        for group, hyper in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        self._local.load_state_dict({"state": local_state, "param_groups": [
            dict(self._hyper(b.group), params=[i]) for i, b in enumerate(self.buckets)]})
        self._parked = {p: saved[i] for p, i in index.items() if p not in self._laid_out and i in saved}
