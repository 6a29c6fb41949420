"""Chapter 3: ZeRO-1, optimizer state sharding -- OSS, with FairScale's name and signature.

DDP leaves every rank with the same averaged gradients, and then every rank runs the same optimizer step
on the same numbers: N copies of identical work, and N copies of the optimizer state (8Ψ bytes for Adam,
half of all model-state memory). ZeRO-1 keeps one copy, split across ranks:

- the parameters are *partitioned*: each one is owned by exactly one rank;
- each rank's local optimizer holds state for, and steps, only the parameters it owns;
- after the step, each owner broadcasts its freshly updated parameters, so all replicas are current.

    model = DistributedDataParallel(TinyGPT())                     # gradients averaged as before
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-3)
    model(x, y).backward(); optimizer.step()                      # 1/N of the state, 1/N of the maths

How to partition? Greedily by size, largest first: give each parameter to the rank that owns the fewest
elements so far. Cutting the parameter list into N consecutive runs (by order) would be simpler, but
parameter sizes vary by orders of magnitude (an embedding next to a LayerNorm bias), so runs by order
leave some ranks with several times the state of others -- and the largest rank sets the memory every
rank must have. Greedy-largest-first keeps the ranks within one parameter of each other; only a single
tensor larger than Ψ/N defeats it, which is what ZeRO-3 fixes by slicing tensors (chapter 5).
"""

from __future__ import annotations

import math

import torch

from minifsdp.ddp.ddp import _pack
from minifsdp.distributed import comm
from minifsdp.zero.clip import clip_sharded_grad_norm_


# --8<-- [start:partition]
def partition_parameters(param_groups: list[dict],
                         world_size: int) -> list[list[dict]]:
    """partition[rank][group_index] = that group (its hyper-parameters) with
    only the params `rank` owns."""
    sizes = [0] * world_size
    partition = [[] for _ in range(world_size)]
    for group in param_groups:
        owned = [[] for _ in range(world_size)]
        # BEGIN EXERCISE 3.1: each param to one rank: balanced, same everywhere
        # stable: same on every rank
        for p in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            owned[rank].append(p)
            sizes[rank] += p.numel()
        # END EXERCISE
        for rank in range(world_size):
            partition[rank].append({**group, "params": owned[rank]})
    return partition
# --8<-- [end:partition]


def require_optimizer_class(optim, sharded: str) -> None:
    """A sharded optimizer builds the local optimizer itself, over this rank's part: it needs the class."""
    if not (isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer)):
        raise TypeError(f"{sharded}(optim=...) takes the optimizer's class, which it builds over this rank's "
                        f"part (e.g. optim=torch.optim.AdamW, lr=...), not {optim!r}")


def partition_by_order(param_groups: list[dict], world_size: int) -> list[list[torch.Tensor]]:
    """The naive alternative, for comparison: N consecutive runs of about Ψ/N elements each, in order."""
    params = [p for group in param_groups for p in group["params"]]
    total, runs, filled = sum(p.numel() for p in params), [[] for _ in range(world_size)], 0
    for p in params:
        rank = min(world_size - 1, filled * world_size // total)
        runs[rank].append(p)
        filled += p.numel()
    return runs


def imbalance(shares: list[list[torch.Tensor]]) -> float:
    """Largest share over the mean share (1.0 = perfectly even). The largest share sets every rank's bill."""
    sizes = [sum(p.numel() for p in share) for share in shares]
    return max(sizes) * len(sizes) / sum(sizes)


class OSS(torch.optim.Optimizer):
    """Optimizer State Sharding: wraps a local optimizer of class `optim` over this rank's parameters only.

    params, **defaults:    exactly what `optim` would take (param groups with their own hyper-parameters
                           work); `self.param_groups` is the global view that LR schedulers adjust.
    group:                 the ranks the state is sharded over (default: all of them).
    broadcast_buffer_size: cap, in elements, on one broadcast after the step: an owner's share goes out in
                           flat buckets of at most this size (a bigger parameter alone), so the scratch
                           buffer stays that small. 0 or -1 (FairScale's default): one bucket per owner.
    broadcast_fp16:        send the updated parameters in fp16, half the bytes. Every replica, the owner's
                           included, then holds the fp16-rounded values, so they stay identical. (16-bit
                           parameters travel as they are.)
    param_sync:            how replicas are made current after the step: "broadcast" (each owner broadcasts
                           its parameters) or "all_gather" (one collective, but every rank's share is padded
                           to the largest share).

    The parameters may mix dtypes (fp32 and fp64, say), as FairScale's OSS allows and torch's
    ZeroRedundancyOptimizer does not: an owner sends one flat tensor per dtype, so every replica gets the
    owner's bits.

    The arguments before param_sync are FairScale's, in FairScale's order; minifsdp.OSS
    (fairscale_compat.py) adds the rest of FairScale's surface. OSS is an optimizer: it keeps the trainable
    parameters identical on every rank after each step, and touches nothing else. Making the replicas
    start identical (frozen parameters and buffers included) is the wrapper's job: DDP or
    ShardedDataParallel broadcast rank 0's model when they are built.
    """

    # --8<-- [start:init]
    def __init__(self, params,
                 optim: type[torch.optim.Optimizer] = torch.optim.SGD,
                 group=None, broadcast_buffer_size: int = -1,
                 broadcast_fp16: bool = False, *,
                 param_sync: str = "broadcast", **defaults):
        comm.require_process_group()
        require_optimizer_class(optim, "OSS")
        if param_sync not in ("broadcast", "all_gather"):
            raise ValueError(f"param_sync must be 'broadcast' or "
                             f"'all_gather', not {param_sync!r}")
        if param_sync == "all_gather" and broadcast_buffer_size > 0:
            raise ValueError("broadcast_buffer_size cuts the owners' broadcasts "
                             "into buckets; param_sync='all_gather' sends "
                             "every share in one collective, so it has none "
                             "to cut")
        self.group = group
        self.rank, self.world_size = comm.rank(group), comm.world_size(group)
        self.optim_class, self.param_sync = optim, param_sync
        self.broadcast_buffer_size = broadcast_buffer_size
        self.broadcast_fp16 = broadcast_fp16
        # builds and checks self.param_groups (e.g. duplicates)
        super().__init__(params, defaults)
        comm.assert_same_across_ranks(
            [(f"param {i}", p) for i, p in enumerate(self._all_params())],
            group=group)
        self._partition = partition_parameters(self.param_groups, self.world_size)
        self.optim = optim(self._partition[self.rank], **defaults)
        self._fill_defaults()
        # the state that exists is the local one (the meter reads it here)
        self.state = self.optim.state
    # --8<-- [end:init]

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def partition_parameters(self) -> list[list[dict]]:
        return self._partition

    def owned_params(self, rank: int) -> list[torch.Tensor]:
        return [p for group in self._partition[rank] for p in group["params"]]

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, filter_params_fn=None) -> torch.Tensor:
        """Clip as torch.nn.utils.clip_grad_norm_ would on all the gradients (chapter 9). Each parameter is
        owned, and stepped, by one rank, so each rank sums over its own (ZeRO-2 keeps only those) and
        scales them; zero/clip.py. Returns the total norm before clipping. As in FairScale,
        filter_params_fn(params) picks which of them count in the norm; all of them are scaled."""
        owned = [p for p in self.owned_params(self.rank) if p.grad is not None]
        counted = owned if filter_params_fn is None else list(filter_params_fn(owned))
        return clip_sharded_grad_norm_([p.grad for p in counted], max_norm, norm_type, group=self.group,
                                       scaled=[p.grad for p in owned])

    clip_grad_norm_ = clip_grad_norm  # torch's spelling

    # --8<-- [start:param_groups]
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if not hasattr(self, "optim"):
            return  # called from __init__, before the partition exists
        # Re-partitioning everything would move existing state between ranks;
        # the greedy partition of the earlier groups does not depend on later
        # ones, so only the new group needs placing.
        self._partition = partition_parameters(self.param_groups, self.world_size)
        self.optim.add_param_group(self._partition[self.rank][-1])
        self._fill_defaults()

    def _fill_defaults(self) -> None:
        """Give the global groups every hyper-parameter the optimizer class
        defaults (as a plain one has)."""
        for global_group, local_group in zip(self.param_groups,
                                             self.optim.param_groups):
            for k, v in local_group.items():
                global_group.setdefault(k, v)
    # --8<-- [end:param_groups]

    # --8<-- [start:step]
    # --8<-- [start:step_method]
    @torch.no_grad()
    def step(self, closure=None):
        # LR schedulers change self.param_groups: carry every hyper-parameter
        # over to the local groups; after the step, carry back what the
        # optimizer wrote into its own (the two views stay one, as in torch's
        # ZeroRedundancyOptimizer)
        _copy_hyper_parameters(self.param_groups, self.optim.param_groups)
        loss = self._local_step(closure)
        self._sync_params()
        _copy_hyper_parameters(self.optim.param_groups, self.param_groups)
        return loss
    # --8<-- [end:step_method]

    def _local_step(self, closure):
        """This rank's optimizer steps its share (passed a closure only when
        given one: not every optimizer's step takes one)."""
        if closure is None:
            return self.optim.step()
        return self.optim.step(closure=closure)

    # --8<-- [start:sync_params]
    def _sync_params(self) -> None:
        """Make every replica current: each rank's updated parameters go to
        everyone."""
        # Frozen parameters never change, so they are never sent.
        shares = [[p for p in self.owned_params(r) if p.requires_grad]
                  for r in range(self.world_size)]
        if self.param_sync == "all_gather":
            return self._all_gather_params(shares)
        for owner, share in enumerate(shares):
            for params in self._broadcast_buckets(share):
                wire = wire_dtype(params[0].dtype, self.broadcast_fp16)
                # BEGIN EXERCISE 3.2: owner broadcasts its params (flat, in `wire`)
                if owner == self.rank:
                    flat = _flatten(params).to(wire)
                else:
                    flat = params[0].new_empty(_numel(params), dtype=wire)
                comm.broadcast(flat, src=owner, tag=f"params of rank {owner}",
                               group=self.group)
                # sent rounded: the owner takes what all got
                if owner != self.rank or wire != params[0].dtype:
                    _unflatten_into(flat, params)
                # before the next bucket is allocated: one bucket-sized buffer
                # at a time
                comm.release(flat)
                # END EXERCISE
    # --8<-- [end:sync_params]

    def _broadcast_buckets(self, share) -> list[list[torch.Tensor]]:
        """An owner's flat broadcasts: one per dtype (a flat tensor holds one;
        flattened in another, an fp64 parameter would reach the others rounded
        to fp32), each cut at broadcast_buffer_size elements if > 0."""
        buckets = []
        for dtype in dict.fromkeys(p.dtype for p in share):
            same = [p for p in share if p.dtype == dtype]
            cap = self.broadcast_buffer_size * same[0].element_size()
            buckets += _pack(same, cap if cap > 0 else math.inf)
        return buckets
    # --8<-- [end:step]

    # --8<-- [start:all_gather]
    def _all_gather_params(self, shares) -> None:
        """One all-gather (per dtype) instead of N broadcasts: fewer calls,
        but every share is padded to the largest."""
        for dtype in dict.fromkeys(p.dtype for s in shares for p in s):
            parts = [[p for p in s if p.dtype == dtype] for s in shares]
            wire = wire_dtype(dtype, self.broadcast_fp16)
            width = max(_numel(part) for part in parts)
            device = next(p.device for part in parts for p in part)
            mine = torch.zeros(width, dtype=wire, device=device)
            if parts[self.rank]:
                mine[: _numel(parts[self.rank])] = _flatten(parts[self.rank])
            everything = mine.new_empty(width * self.world_size)
            comm.all_gather(everything, mine, tag="params", group=self.group)
            for owner, params in enumerate(parts):
                if params and (owner != self.rank or wire != dtype):
                    start = owner * width
                    _unflatten_into(everything[start: start + _numel(params)],
                                    params)
    # --8<-- [end:all_gather]

    # -- state dicts: one full state, in the format of a plain optimizer over the same parameters ----------
    def _global_index(self) -> dict:
        return {p: i for i, p in enumerate(self._all_params())}

    # --8<-- [start:state_dict]
    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every rank's shard of the state into one full state dict,
        kept on rank `recipient_rank` (-1: on every rank)."""
        index = self._global_index()
        local = self.optim.state_dict()
        local_params = [p for group in self.optim.param_groups
                        for p in group["params"]]
        # local state is keyed by position in the local optimizer; re-key it
        # by global position
        mine = {index[local_params[i]]: {k: (v.cpu() if torch.is_tensor(v) else v)
                                         for k, v in s.items()}
                for i, s in local["state"].items()}
        shards = comm.all_gather_object(mine, group=self.group)
        self._consolidated = None
        if recipient_rank in (-1, self.rank):
            state = {k: v for shard in shards for k, v in shard.items()}
            groups, start = [], 0
            for group in self.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                ids = list(range(start, start + len(group["params"])))
                groups.append({**hyper, "params": ids})
                start += len(group["params"])
            self._consolidated = {"state": dict(sorted(state.items())),
                                  "param_groups": groups}

    def state_dict(self, all_ranks: bool = False) -> dict:
        """The full state from the last consolidate_state_dict() kept here;
        all_ranks=True consolidates it on every rank now (a collective: call it
        on every rank)."""
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        consolidated = getattr(self, "_consolidated", None)
        if consolidated is None:
            raise RuntimeError(
                "OSS.state_dict() returns the full state, which no single "
                "rank holds: call consolidate_state_dict(recipient_rank=r) on "
                "every rank first, then state_dict() on rank r (or "
                "state_dict(all_ranks=True) on every rank)")
        return consolidated
    # --8<-- [end:state_dict]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (from OSS.state_dict() at any world size, or from a plain optimizer).

        As torch's optimizers do, this rank's part of the state is used in place, not copied: stepping
        changes the tensors of `state_dict`, so load one dict into one optimizer (deepcopy it otherwise).
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        for global_group, saved in zip(self.param_groups, groups):
            global_group.update({k: v for k, v in saved.items() if k != "params"})
        index = self._global_index()
        local_state, local_groups, position = {}, [], 0
        for local_group, saved in zip(self.optim.param_groups, groups):
            ids = []
            for p in local_group["params"]:
                saved_state = state_dict["state"].get(index[p])
                if saved_state is not None:
                    local_state[position] = saved_state
                ids.append(position)
                position += 1
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state


def wire_dtype(dtype: torch.dtype, fp16: bool) -> torch.dtype:
    """The dtype parameters of `dtype` travel in: broadcast_fp16 halves what a wider float sends; a 16-bit
    one travels as it is (bf16 sent as fp16 would lose range, and save nothing)."""
    return torch.float16 if fp16 and dtype.is_floating_point and dtype.itemsize > 2 else dtype


def _copy_hyper_parameters(source: list[dict], destination: list[dict]) -> None:
    """Every entry of each group but its parameters, from `source`'s groups to `destination`'s."""
    for source_group, destination_group in zip(source, destination):
        destination_group.update({k: v for k, v in source_group.items() if k != "params"})


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _flatten(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _unflatten_into(flat: torch.Tensor, params) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()
