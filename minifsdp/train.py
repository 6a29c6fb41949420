"""One training loop for every strategy, so the tour, the tests and the notebooks compare like with like.

A *strategy* turns (model, optimizer factory) into the wrapped model and the optimizer that trains it.
`train(...)` runs on one rank (inside `launch`), feeds it its slice of a deterministic global batch, and
returns the final parameters, the losses, what the meter and the counter saw, and the step times.
The reference strategy "single" trains one process on the whole global batch.

    from minifsdp import launch
    from minifsdp.train import train
    ours, = launch(train, world_size=2, kwargs=dict(strategy="ddp", steps=5))[:1]
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from minifsdp.ddp import DistributedDataParallel
from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device, threads_per_rank
from minifsdp.measure.meter import MemoryMeter
from minifsdp.mixed_precision import ShardedGradScaler
from minifsdp.models import GPTConfig, TinyGPT, ToyModel, gpt_batch, toy_batch
from minifsdp.state_dict import get_full_state_dict
from minifsdp.zero.oss import OSS
from minifsdp.zero.sdp import ShardedDataParallel

# SGD with momentum as well as AdamW: Adam divides by the gradient's own scale, so it hides a gradient
# that is off by a factor of N; SGD does not.
OPTIMIZER_SPECS: dict[str, tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1)),
}
OPTIMIZERS: dict[str, Callable] = {name: (lambda params, cls=cls, kw=kw: cls(params, **kw))
                                   for name, (cls, kw) in OPTIMIZER_SPECS.items()}


def _torch_ddp(model, optimizer, find_unused, mp=None, offload=None, group=None):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.nn.parallel.distributed import _MixedPrecision

    _no_offload("torch_ddp", offload)
    if mp is not None and not torch.cuda.is_available():
        raise ValueError("torch's DDP takes mixed_precision only on CUDA (it records CUDA events)")
    policy = mp and _MixedPrecision(param_dtype=mp.param_dtype, reduce_dtype=mp.grad_dtype,
                                    buffer_dtype=mp.buffer_dtype)
    wrapped = TorchDDP(model, find_unused_parameters=find_unused, mixed_precision=policy, process_group=group)
    return wrapped, OPTIMIZERS[optimizer](wrapped.parameters())


def _ours_ddp(model, optimizer, find_unused, mp=None, offload=None, group=None):
    _no_offload("ddp", offload)
    wrapped = DistributedDataParallel(model, find_unused_parameters=find_unused, mixed_precision=mp,
                                      process_group=group)
    return wrapped, OPTIMIZERS[optimizer](wrapped.parameters())


def _oss(model, optimizer, find_unused, mp=None, offload=None, group=None):
    _no_offload("oss", offload)
    cls, kw = OPTIMIZER_SPECS[optimizer]
    wrapped = DistributedDataParallel(model, find_unused_parameters=find_unused, mixed_precision=mp,
                                      process_group=group)
    return wrapped, OSS(model.parameters(), optim=cls, group=group, **kw)


def _fsdp(reshard_after_forward, overlap=False):
    def build(model, optimizer, find_unused, mp=None, offload=None, group=None):
        from minifsdp.fsdp import BACKWARD_PRE, FullyShardedDataParallel, ModuleWrapPolicy
        from minifsdp.models import Block

        # chapter 6's runs issue each all-gather when it is needed; chapter 7 adds the prefetching
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block, ToyModel}),
                                           reshard_after_forward=reshard_after_forward,
                                           backward_prefetch=BACKWARD_PRE if overlap else None,
                                           forward_prefetch=overlap, mixed_precision=mp, cpu_offload=offload,
                                           process_group=group)
        return wrapped, OPTIMIZERS[optimizer](wrapped.parameters())  # built after wrapping: the shards
    return build


def _flat(stage):
    def build(model, optimizer, find_unused, mp=None, offload=None, group=None):
        from minifsdp.zero import FlatOSS, FlatShardedDataParallel

        if mp is not None or offload is not None:
            raise ValueError("the flat ZeRO-1/2 strategies take no mixed_precision or cpu_offload here")
        cls, kw = OPTIMIZER_SPECS[optimizer]
        if stage == 1:  # no DDP underneath: the optimizer reduce-scatters the gradients in step()
            return model, FlatOSS(model.parameters(), optim=cls, group=group, **kw)
        # buckets of 1 MB: a model of a few MB is sent in several, each freed as soon as it is sent
        opt = FlatOSS(model.parameters(), optim=cls, bucket_cap_mb=1, group=group, **kw)
        return FlatShardedDataParallel(model, opt), opt
    return build


def _torch_fsdp2(model, optimizer, find_unused, mp=None, offload=None, group=None):
    """torch's own FSDP2: fully_shard each block, then the root -- the same units as our "fsdp"."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = dict(mp_policy=MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
                   if mp else MixedPrecisionPolicy(),
                   offload_policy=CPUOffloadPolicy() if offload and offload.offload_params else OffloadPolicy(),
                   mesh=None if group is None else DeviceMesh.from_group(group, current_device().type))

    # fully_shard assumes every rank built the same weights; make it so
    comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()), src=0, group=group)
    for block in getattr(model, "blocks", []):
        fully_shard(block, **options)
    wrapped = fully_shard(model, **options)
    return wrapped, OPTIMIZERS[optimizer](wrapped.parameters())


def _sdp(model, optimizer, find_unused, mp=None, offload=None, group=None):
    _no_offload("sdp", offload)
    cls, kw = OPTIMIZER_SPECS[optimizer]
    opt = OSS(model.parameters(), optim=cls, group=group, **kw)
    return ShardedDataParallel(model, opt, find_unused_parameters=find_unused, mixed_precision=mp), opt


def _no_offload(name, offload):
    if offload is not None and offload.offload_params:
        raise ValueError(f"cpu_offload is FullyShardedDataParallel's option; strategy {name!r} keeps its "
                         f"parameters on the device")


class Strategy(NamedTuple):
    build: Callable   # (model, optimizer name, find_unused, mp=, offload=, group=) -> (wrapped model, optimizer)
    stage: int        # ZeRO stage, for the analytic memory model
    comm_passes: int  # bytes per step = comm_passes x Ψ x 4 x (N-1)/N (ring-equivalent)


STRATEGIES: dict[str, Strategy] = {
    "torch_ddp": Strategy(_torch_ddp, 0, 2),
    "ddp": Strategy(_ours_ddp, 0, 2),            # all-reduce
    "oss": Strategy(_oss, 1, 3),                 # DDP's all-reduce + the owners' broadcast
    "sdp": Strategy(_sdp, 2, 2),                 # reduce to the owner + the owners' broadcast
    "oss_flat": Strategy(_flat(1), 1, 2),        # reduce-scatter in step() + all-gather
    "sdp_flat": Strategy(_flat(2), 2, 2),        # reduce-scatter in backward + all-gather
    "fsdp": Strategy(_fsdp(True), 3, 3),         # all-gather in forward and in backward + reduce-scatter
    "fsdp_nraf": Strategy(_fsdp(False), 3, 2),   # parameters kept from forward to backward: one all-gather
    "fsdp_overlap": Strategy(_fsdp(True, overlap=True), 3, 3),  # + forward_prefetch and BACKWARD_PRE
    "torch_fsdp2": Strategy(_torch_fsdp2, 3, 3),  # torch's fully_shard, for comparison (not counted)
}


def build_model(name: str, seed: int, gpt_config: GPTConfig | None = None) -> nn.Module:
    if name == "gpt":
        return TinyGPT(gpt_config or GPTConfig(), seed=seed)
    if name == "toy":
        return ToyModel(seed=seed)
    raise ValueError(f"unknown model {name!r}: 'gpt' or 'toy'")


def batch(model_name: str, step: int, global_batch: int, rank: int, world_size: int, device,
          gpt_config: GPTConfig | None = None):
    """This rank's contiguous slice of the global batch of `step` (the whole batch when world_size is 1)."""
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} does not divide by world_size={world_size}")
    if model_name == "gpt":
        tensors = gpt_batch(gpt_config or GPTConfig(), step, global_batch, device=device)
    else:
        tensors = toy_batch(step, global_batch, device=device)
    per = global_batch // world_size
    return tuple(t[rank * per: (rank + 1) * per] for t in tensors)


def loss_of(model_name: str, model: nn.Module, tensors) -> torch.Tensor:
    if model_name == "gpt":
        x, y = tensors
        return model(x, y)
    x, y, mask = tensors
    return ((model(x, mask) - y) ** 2).mean()


def train(strategy: str = "ddp", model: str = "gpt", optimizer: str = "adamw", steps: int = 5,
          global_batch: int = 12, seed: int = 0, gpt_config: GPTConfig | None = None,
          set_to_none: str = "always", measure: bool = True, rank_seeds: bool = True,
          on_step: Callable[[], None] | None = None, mixed_precision=None, cpu_offload=None,
          scaler: dict | None = None, emulate_world_size: int = 1, group=None) -> dict:
    """Train on this rank; return what the comparisons need (all tensors on the CPU).

    rank_seeds: build each rank's model from seed + rank, so the result is only right if the strategy
                really makes the replicas start from rank 0's weights.
    set_to_none: "always", "never" or "alternate" (zero_grad(set_to_none=...) by step parity).
    on_step:     called after each step (e.g. to move a progress bar).
    mixed_precision, cpu_offload: chapter 8's policies, for the strategies that take them.
    scaler:      train with a ShardedGradScaler(**scaler) (fp16).
    emulate_world_size: for strategy "emulated" -- one process playing this many ranks, with the casts
                 mixed precision makes (chapter 8's reference; see _emulated_backward).
    group:       train data-parallel over this process group only (default: every rank); the global batch
                 is split across the group's ranks, and each rank's model seed is seed + its global rank.
    """
    device = current_device()
    single, emulated = strategy == "single", strategy == "emulated"
    if single or emulated:
        rank, n, seed_rank = 0, (1 if single else emulate_world_size), 0
    else:
        rank, n, seed_rank = comm.rank(group), comm.world_size(group), comm.rank()
    net = build_model(model, seed + (seed_rank if rank_seeds else 0), gpt_config).to(device)
    psi = sum(p.numel() for p in net.parameters())  # before any wrapper replaces them with shards
    find_unused = model == "toy"  # the toy model leaves a parameter unused in some steps
    if emulated:  # CPU kernels split their sums by thread: use as many threads as each of n ranks would get
        torch.set_num_threads(threads_per_rank(n))
    if single or emulated:
        wrapped, opt = net, OPTIMIZERS[optimizer](net.parameters())
    else:
        wrapped, opt = STRATEGIES[strategy].build(net, optimizer, find_unused, mp=mixed_precision,
                                                  offload=cpu_offload, group=group)
    grad_scaler = ShardedGradScaler(**scaler) if scaler is not None else None
    scale = grad_scaler.scale if grad_scaler else (lambda loss: loss)
    scales = []
    # The meter watches the model states all along, but tracks activations only in the last step: a
    # steady-state step (optimizer state exists), and the other steps run at full speed for the timings.
    meter = MemoryMeter(wrapped, opt) if measure else None
    if meter is not None and hasattr(wrapped, "units"):  # FSDP: its unsharded buffers are parameters too
        meter.watch([flat._full for unit in wrapped.units() for flat in unit.flat_params], "params")
    losses, times = [], []
    with comm.counting() if not (single or emulated) else contextlib.nullcontext() as counter:
        for step in range(steps):
            tensors = batch(model, step, global_batch, rank, n, device, gpt_config)
            metered = meter is not None and step == steps - 1
            if metered:
                meter.reset_peak()
            t0 = time.perf_counter()
            with meter if metered else contextlib.nullcontext():
                if emulated:
                    loss = _emulated_backward(model, net, mixed_precision, n, scale,
                                              [batch(model, step, global_batch, r, n, device, gpt_config)
                                               for r in range(n)])
                else:
                    loss = loss_of(model, wrapped, tensors)
                    scale(loss).backward()
                if grad_scaler:
                    scales.append(grad_scaler.get_scale())
                    grad_scaler.step(opt)
                    grad_scaler.update()
                else:
                    opt.step()
                if metered:
                    meter.snapshot("after step")
                opt.zero_grad(set_to_none={"always": True, "never": False, "alternate": step % 2 == 0}[set_to_none])
            if not metered:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if on_step:
                on_step()
    if meter:
        meter.close()
    return {
        "params": {k: v.cpu() for k, v in get_full_state_dict(wrapped).items()},
        "losses": losses,
        "step_times": times[1:] or times,  # the first step pays for lazy initialisation
        "peak": meter.peak if meter else None,
        "peak_by_category": meter.peak_by_category if meter else None,
        "category_peak": meter.category_peak if meter else None,  # each category's own maximum
        "after_step": meter.snapshots.get("after step") if meter else None,
        "allocator": meter.allocator_stats() if meter else {},  # CUDA only: the allocator's own peak
        "comm_bytes": dict(counter.bytes) if counter else {},
        "comm_bytes_by_group": {g: dict(kinds) for g, kinds in counter.by_group.items()} if counter else {},
        "comm_calls": dict(counter.calls) if counter else {},
        "comm_copies": dict(counter.copies) if counter else {},
        "scales": scales,   # the loss scale each step used (with a scaler)
        "skipped": [s for s, inf in enumerate(getattr(grad_scaler, "local_found_inf", [])) if inf],
        "steps": steps,
        "psi": psi,
        "world_size": n,
    }


# --8<-- [start:emulated]
def _emulated_backward(model_name, net, mp, n, scale,
                       rank_batches) -> torch.Tensor:
    """One process playing n ranks, with exactly the casts mixed precision
    makes -- the reference chapter 8 compares against (not fp32 with a loose
    tolerance): each rank's slice computes with a param_dtype cast of the fp32
    parameters; each rank's gradient is cast to reduce_dtype and multiplied by
    1/n; the n are added in rank order, in reduce_dtype; the sum lands in fp32
    .grad. Returns the mean loss."""
    from torch.func import functional_call

    params = dict(net.named_parameters())
    compute = (mp and mp.param_dtype) or torch.float32
    reduce = (mp and mp.grad_dtype) or compute
    total, losses = {}, []
    for tensors in rank_batches:
        cast = {k: p.detach().to(compute).requires_grad_()
                for k, p in params.items()}
        loss = loss_of(model_name,
                       lambda *args: functional_call(net, cast, args), tensors)
        scale(loss).backward()
        for k, c in cast.items():
            grad = c.grad if c.grad is not None else torch.zeros_like(c)
            g = grad.to(reduce).mul_(1.0 / n)
            total[k] = g if k not in total else total[k] + g
        losses.append(loss.detach().float())
    for k, p in params.items():
        p.grad = total[k].to(p.dtype)
    return torch.stack(losses).mean()
# --8<-- [end:emulated]


def max_abs_diff(a: dict, b: dict) -> float | None:
    """Largest |a - b| over every tensor of two state dicts (0.0 means bit-identical; None: both empty).
    In float64, so that a float64 model's differences are not rounded away (float32's are exact in it)."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(set(a) ^ set(b))}")
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=None)
