"""Chapter 11: minifsdp.fsdp2.fully_shard, a drop-in for torch's fully_shard, proven against it and against DDP.

Every case trains the same model, wrapped the same way (each block, then the root), on the same data in the same
ranks, once under minifsdp's fully_shard and once under torch's, and compares the losses and each rank's shard
of every state_dict entry (its placements, local shape and values) after 3 steps: the gradients of the first
step are new, those of the second are new again after zero_grad(set_to_none=True), those of the third are added
to zeros (set_to_none=False). Equal shards on every rank, cut alike, are equal full tensors; a full_tensor()
per entry is an all-gather each, which at N = 4 on two cores cost more than a training step.

What runs once where it proved the same thing more than once:
- minifsdp's variants. RAF, NRAF, explicit prefetch, model.unshard() and _set_unshard_async_op(True) (with
  explicit prefetch, as torch advises; on CPU ranks it changes no stream) decide when the all-gathers run; the
  optimizer steps the sharded DTensors after backward, where none of them is visible. So each model runs with
  both optimizers and with RAF and NRAF, and each (optimizer, RAF) pair on some model, but not every model with
  every pair; prefetch and unshard once per architecture. The frozen model (the uneven one with blocks[1].fc1
  frozen) runs with AdamW and NRAF only: its all-gathers treat the frozen parameter as any other, and of the two
  optimizers only AdamW (weight decay) would move a parameter handed a zero gradient instead of none.
- torch's fully_shard, the oracle: once per (model, optimizer), in one of the variants (RAF for the GPT's, each
  of the others on some model), and every minifsdp variant of that model and optimizer is held to it, bit for
  bit. Its own variants compute the same bits: each of RAF, NRAF, prefetch and unshard() against its RAF run,
  for every model and optimizer of the full cross product, at N = 1-4, differed by 0.0. Its meta-device build
  runs once, without unshard() (the recipe is what it checks); minifsdp's with and without.
- Chapter 11's two single-size cases (a parameter frozen after wrapping at N = 2, per-parameter optimizer
  groups at N = 3) run in the launch of their world size.

Tolerances, and why:
- Against torch's fully_shard: 0.0 everywhere -- fp32 (SGD with momentum and AdamW; the tiny GPT with its tied
  embedding, a model whose sizes divide by neither 3 nor 4 with a (1, 13) parameter and a 3-element bias, the
  same with a frozen layer; RAF, NRAF, explicit prefetch as in torch's docs, model.unshard() before forward),
  bf16 mixed precision (reduce in fp32 or in bf16), a meta-device build, gradient accumulation, gradient
  clipping. The two compute the same local gradients (the same kernels on unsharded tensors of their own) and
  lay each group's parameters out the same way in the reduce-scatter buffer (torch's order: a module's
  children before the module itself; padded like torch.chunk), so gloo sums the same elements in the same
  order, and averages with the same ReduceOp.AVG. (The layout matters: gloo's ring reduce-scatter adds slot q
  as g_{q-1} + g_{q-2} + ... + g_q, so an element that moves to another slot is summed in another order;
  with the root's own parameters placed before its children's instead, the uneven model differed by 1.5e-8
  at N = 4.)
- Against torch's DDP (tiny GPT, a plain optimizer): bit-exact at N = 1 and 2 (one addition, commutative).
  At N = 3 and 4 the order of the additions is not the same: the reduce-scatter sums slot q in ring order
  ending at rank q, DDP's all-reduce over its bucket in an order of its own, so a gradient element may differ
  by an ulp of its largest addend, which the steps carry on. torch's fully_shard is exactly as far from DDP
  (checked, to the bit), so the distance is the reduction order, not a bug. (DDP's full tensors are cut as
  fully_shard cuts them, and each rank compares its piece.)
  - SGD: 1e-6 on the parameters, measured 3.7e-9 to 7.5e-9 on two machines: the ulp is passed on times lr.
  - AdamW: 1% of one step's lr (3e-5) on the parameters. Adam divides each element's step by sqrt(v) + eps,
    so an element whose ranks' gradients cancel is sensitive to how its sum was rounded: on an AVX-512 CPU,
    a blocks.1.fc_proj weight got 2.2e-3, -4.3e-4 and -1.8e-3 from its three ranks at N = 3, which sum to
    1.6e-8 -- an average of 5.3e-9, under eps = 1e-8 -- and the ulp of a 2e-3 addend (2.3e-10) is 1.5% of
    that sum; the parameter ended 4.95e-6 from DDP's after 3 steps (0.17% of lr), and torch's the same. A step
    moves by at most lr * rounding / eps for such an element (7e-5 per ulp here): no fixed number of ulps bounds
    it. A mechanism that is wrong moves elements by a whole step, about lr (3e-3), 100 times the tolerance.
    Measured on another CPU: 1.3e-7.
  - The losses: 2e-6, four ulps of a loss near 4; measured one (4.8e-7) with either optimizer.
  Gradient accumulation against DDP's no_sync: the same (measured 7.5e-9 with SGD at N = 3).
- Meta-device init (build under torch.device("meta"), fully_shard, to_empty, distribute_tensor of each full
  tensor into each parameter, optimizer after; also with model.unshard() before each forward, the first
  included): the same bits as the eagerly built model; under torch's fully_shard too, so the script is right.
  And with each module's own reset_parameters() after to_empty (the uneven model, where some ranks hold an
  empty shard): the same bits as torch's fully_shard, before and after training.
- Memory (a GPT with 4 blocks, N = 2, AdamW, the step after 2 warm-up steps, minifsdp.MemoryMeter with each
  design's unsharded-parameter buffers watched): minifsdp's peak per rank <= torch's. Measured 2,207,816 vs
  2,258,248 bytes on each rank; both peak early in backward.

One launch per world size computes every case (the memory at N = 2 only); each rank returns the differences
it measured (of its own shards and its own losses), and every rank's are checked.
"""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minifsdp import comm, launch
from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.train import OPTIMIZER_SPECS, OPTIMIZERS, batch, build_model, loss_of, max_abs_diff
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 3
# Against torch's DDP: bit-exact at N <= 2; past that, per optimizer, the parameters' and the losses' (see above)
DDP_ATOL = {"sgd": 1e-6, "adamw": 0.01 * OPTIMIZER_SPECS["adamw"][1]["lr"]}
LOSS_ATOL = 2e-6


def ddp_atol(n, opt):
    """(parameters, losses) allowed against torch's DDP at world size n."""
    return (0.0, 0.0) if n <= 2 else (DDP_ATOL[opt], LOSS_ATOL)
# (model, optimizer, variant): every model with both optimizers and with RAF and NRAF, every (optimizer, RAF)
# pair on some model; the docs' explicit prefetch and model.unshard() change when the all-gathers run, not
# what they compute: one optimizer each, on the two architectures (see the module docstring)
PARITY = [("gpt", "sgd", "raf"), ("gpt", "adamw", "raf"), ("gpt", "adamw", "nraf"),
          ("gpt", "adamw", "prefetch"), ("gpt", "sgd", "unshard"), ("gpt", "adamw", "async_op"),
          ("uneven", "sgd", "nraf"), ("uneven", "adamw", "raf"), ("uneven", "sgd", "prefetch"),
          ("uneven", "adamw", "unshard"),
          ("frozen", "adamw", "nraf")]
# torch's fully_shard runs once per (model, optimizer), in one of the variants (which one computes the same bits):
# each variant on some model, RAF for the GPT's (the cases compared with DDP); minifsdp's every variant against it
ORACLE = {("gpt", "sgd"): "raf", ("gpt", "adamw"): "raf", ("uneven", "sgd"): "prefetch",
          ("uneven", "adamw"): "unshard", ("frozen", "adamw"): "nraf"}
# (implementation, model.unshard() before each forward) of the meta-device build; torch's once: its plain run
# shows the recipe gives the eager bits, an unshard() changes when the all-gathers run, not what they compute
META = [("ours", False), ("ours", True), ("torch", False)]
POLICIES = {"bf16_fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
            "bf16": {"param_dtype": torch.bfloat16}}
MICRO = 3         # micro-batches per step, gradients synchronised in the last one's backward only
MAX_NORM = 0.5    # below the tiny GPT's gradient norms (0.60-0.71): every step clips
MEMORY_N, MEMORY_CONFIG = 2, GPTConfig(n_layer=4)
FROZEN_N, DECAY_N = 2, 3  # the world sizes of the two cases run at one only


# -- models and data -----------------------------------------------------------------------------------------------
class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 5), nn.Linear(5, 7)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Uneven(nn.Module):
    """No size divides by 3 or 4: Linear(7, 5) and (5, 7), a (1, 13) parameter of the root itself (one row: the
    ranks after the first hold none of it), a bias of 3. frozen=True: blocks[1].fc1 does not train (frozen and
    trainable parameters in one group)."""

    def __init__(self, frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(1, 13))
        self.inp = nn.Linear(13, 7)
        self.blocks = nn.ModuleList(Pair() for _ in range(3))
        self.out = nn.Linear(7, 3)
        if frozen:
            self.blocks[1].fc1.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x * self.gain))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-dim: nothing to shard along dim 0


MODELS = {"gpt": lambda: build_model("gpt", seed=0), "uneven": Uneven, "frozen": lambda: Uneven(frozen=True)}


def data(name, step):
    r, n = dist.get_rank(), dist.get_world_size()
    if name == "gpt":
        return batch("gpt", step, 12, r, n, "cpu")
    g = torch.Generator().manual_seed(1000 + step)
    x, y, per = torch.randn(12, 13, generator=g), torch.randn(12, 3, generator=g), 12 // n
    return x[r * per: (r + 1) * per], y[r * per: (r + 1) * per]


def loss_fn(name, model, tensors):
    if name == "gpt":
        return loss_of("gpt", model, tensors)
    x, y = tensors
    return F.mse_loss(model(x), y)


# -- the two fully_shards, driven by the same script -------------------------------------------------------------
def api(impl):
    """The module a script imports fully_shard, FSDPModule and MixedPrecisionPolicy from."""
    if impl == "ours":
        import minifsdp.fsdp2 as mod
    else:
        import torch.distributed.fsdp as mod
    return mod


def shard(model, impl, **options):
    for block in model.blocks:
        api(impl).fully_shard(block, **options)
    return api(impl).fully_shard(model, **options)


def docs_prefetch(model, k):
    """Explicit prefetching as in torch's fully_shard docs: each block prefetches the next k in forward and the
    previous k in backward."""
    layers = list(model.blocks)
    for i, layer in enumerate(layers):
        if i >= len(layers) - k:
            break
        layer.set_modules_to_forward_prefetch([layers[i + j] for j in range(1, k + 1)])
    for i, layer in enumerate(layers):
        if i < k:
            continue
        layer.set_modules_to_backward_prefetch([layers[i - j] for j in range(1, k + 1)])


def full_state(model):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def shard_state(model):
    """This rank's shard of every state_dict entry, with its placements. Two runs whose shards are equal on
    every rank, cut the same way, have equal full tensors; unlike full_state it needs no all-gather per
    entry (at N = 4 on two cores those cost more than a training step)."""
    from torch.distributed.tensor import DTensor

    return {k: ((v.to_local().detach().clone(), v.placements) if isinstance(v, DTensor)
                else (v.detach().clone(), None)) for k, v in model.state_dict().items()}


def train(model, name, opt, before_forward=None, after_backward=None):
    losses = []
    for step in range(STEPS):
        if before_forward:
            before_forward()
        loss = loss_fn(name, model, data(name, step))
        loss.backward()
        if after_backward:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.detach().float())
    return torch.stack(losses)


def parity_run(impl, name, opt_name, variant):
    model = shard(MODELS[name](), impl, reshard_after_forward=variant != "nraf")
    if variant == "prefetch":  # the docs' way: prefetch lists, and the root's unshard() before each forward
        docs_prefetch(model, k=1 if name == "gpt" else 2)
    if variant == "async_op":  # the hooks' unshards from the compute stream, with the explicit prefetch it needs
        model._set_unshard_async_op(True)
        docs_prefetch(model, k=1)
    opt = OPTIMIZERS[opt_name](model.parameters())
    unshard = model.unshard if variant in ("prefetch", "unshard") else None
    return train(model, name, opt, before_forward=unshard), shard_state(model)


def ddp_run(opt_name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = build_model("gpt", seed=0)
    model = DDP(net)
    losses = train(model, "gpt", OPTIMIZERS[opt_name](model.parameters()))
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def mp_run(impl, policy):
    model = shard(build_model("gpt", seed=0), impl, mp_policy=api(impl).MixedPrecisionPolicy(**POLICIES[policy]))
    return train(model, "gpt", OPTIMIZERS["sgd"](model.parameters())), shard_state(model)


def meta_run(impl, opt_name, unshard):
    """Built on the meta device, sharded, materialised with to_empty, initialised from a full state dict
    (each full tensor distributed to each parameter's placements), the optimizer built after; unshard: the
    root's model.unshard() before each forward, the first included (before any forward has run)."""
    from torch.distributed.tensor import distribute_tensor

    full = build_model("gpt", seed=0).state_dict()
    with torch.device("meta"):
        net = TinyGPT(seed=0)
    model = shard(net, impl)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(distribute_tensor(full[k], p.device_mesh, p.placements))
    tied = model.lm_head.weight is model.wte.weight
    opt = OPTIMIZERS[opt_name](model.parameters())
    return train(model, "gpt", opt, before_forward=model.unshard if unshard else None), shard_state(model), tied


def meta_reset_run(impl):
    """The other meta-device recipe: to_empty, then each module's own reset_parameters() on its DTensor
    parameters, from one seed. The uneven model: at N = 2 and 4 some ranks hold no row of `gain`, whose shard
    is then empty on the meta device and off it."""
    with torch.device("meta"):
        net = Uneven()
    model = shard(net, impl)
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    for m in model.modules():
        if m is not model and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    with torch.no_grad():
        model.gain.fill_(1.0)
    initial = shard_state(model)
    losses = train(model, "uneven", OPTIMIZERS["adamw"](model.parameters()))
    return losses, {**{"initial." + k: v for k, v in initial.items()}, **shard_state(model)}


def accumulation_run(kind, steps=2):
    """MICRO micro-batches a step: set_requires_gradient_sync(False) (DDP: no_sync()) for all but the last."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = build_model("gpt", seed=0)
    model = DDP(net) if kind == "ddp" else shard(net, kind)
    opt = OPTIMIZERS["sgd"](model.parameters())
    losses = []
    for step in range(steps):
        for k in range(MICRO):
            last = k == MICRO - 1
            if kind != "ddp":
                model.set_requires_gradient_sync(last)
            with model.no_sync() if kind == "ddp" and not last else contextlib.nullcontext():
                loss = loss_fn("gpt", model, data("gpt", MICRO * step + k))
                loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    if kind == "ddp":
        return torch.stack(losses), {k: v.detach().clone() for k, v in net.state_dict().items()}
    return torch.stack(losses), shard_state(model)


def clip_run(impl):
    model = shard(build_model("gpt", seed=0), impl)
    norms = []

    def clip():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    losses = train(model, "gpt", OPTIMIZERS["sgd"](model.parameters()), after_backward=clip)
    return losses, shard_state(model), torch.stack(norms)


def shard_diff(a, b):
    """max_abs_diff of two shard_states: infinite where an entry is cut otherwise (placements, local shape,
    dtype), 0.0 for an empty shard of the same shape."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for k in a:
        (x, px), (y, py) = a[k], b[k]
        if px != py or x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def cut_like(full, shards):
    """A full state dict (DDP's) cut as fully_shard cuts each entry (Shard(0): torch.chunk's pieces, none for
    the last ranks where there are fewer pieces than ranks), this rank's piece, as a shard_state."""
    from torch.distributed.tensor import Shard

    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for k, v in full.items():
        placements = shards[k][1]
        if placements is None:
            out[k] = (v, None)
            continue
        assert placements == (Shard(0),), placements
        pieces = torch.chunk(v, n, dim=0)
        out[k] = (pieces[r] if r < len(pieces) else v[:0], placements)
    return out


def diff(a, b):
    """Largest |difference| of the losses and of the final parameters of two runs, (losses, shard_state) each:
    this rank's shards. b's state may be full (DDP's): cut first as a's is."""
    b_state = b[1] if all(isinstance(v, tuple) for v in b[1].values()) else cut_like(b[1], a[1])
    return {"losses": (a[0].double() - b[0].double()).abs().max().item(), "params": shard_diff(a[1], b_state)}


# -- surface --------------------------------------------------------------------------------------------------------
def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test looks at which, and at the message
        return type(e).__name__, str(e)
    return None


def surface():
    from torch.distributed.tensor import DTensor, Shard

    from minifsdp.fsdp2 import FSDPModule, fully_shard

    eager = build_model("gpt", seed=0)
    ours, theirs = shard(build_model("gpt", seed=0), "ours"), shard(build_model("gpt", seed=0), "torch")
    shapes = {k: p.shape for k, p in eager.named_parameters()}
    out = {
        "names": [k for k, _ in ours.named_parameters()] == list(shapes),
        "dtensors": all(isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape == shapes[k]
                        and p.device_mesh.size() == dist.get_world_size() for k, p in ours.named_parameters()),
        # each rank's local shard is torch's: the same rows (padding cut off), the same values
        "local_shards": all(a.to_local().shape == b.to_local().shape and torch.equal(a.to_local(), b.to_local())
                            for a, b in zip(ours.parameters(), theirs.parameters())),
        "tied": ours.lm_head.weight is ours.wte.weight,
        "state_dict_keys": list(ours.state_dict()) == list(eager.state_dict()) == list(theirs.state_dict()),
        "state_dict_dtensors": all(isinstance(v, DTensor) for v in ours.state_dict().values()),
        "state_dict_values": max_abs_diff(full_state(ours), eager.state_dict()),
        "fsdp_modules": all(isinstance(m, FSDPModule) for m in [ours, *ours.blocks]),
    }
    block = ours.blocks[0]
    handle = block.unshard(async_op=True)
    out["handle_has_wait"] = callable(getattr(handle, "wait", None))
    handle.wait()
    w = block.fc.weight
    out["unsharded_after_wait"] = (not isinstance(w, DTensor) and w.shape == eager.blocks[0].fc.weight.shape
                                   and torch.equal(w.detach(), eager.blocks[0].fc.weight.detach()))
    block.reshard()
    out["resharded"] = isinstance(block.fc.weight, DTensor)
    out["sync_unshard_returns_none"] = block.unshard() is None
    block.reshard()
    # _set_unshard_async_op reaches every fully_shard'ed module under the one it is called on, as torch's does
    flags = {}
    for impl, model in (("ours", ours), ("torch", theirs)):
        model.blocks[0]._set_unshard_async_op(True)
        groups = ([m._fsdp.group for m in [model, *model.blocks]] if impl == "ours"
                  else [m._get_fsdp_state()._fsdp_param_group for m in [model, *model.blocks]])
        flags[impl] = [g.unshard_async_op for g in groups]
        model._set_unshard_async_op(True)
        flags[impl] += [g.unshard_async_op for g in groups]
    out["unshard_async_op"] = flags["ours"] == flags["torch"] == (
        [False, True] + [False] * (len(ours.blocks) - 1) + [True] * (1 + len(ours.blocks)))
    out["zero_dim"] = raised(lambda: fully_shard(Gated()))
    out["twice"] = raised(lambda: fully_shard(fully_shard(nn.Linear(4, 4))))
    return out


# -- memory ---------------------------------------------------------------------------------------------------------
def unsharded_buffers(impl, model):
    """The storages each fully_shard keeps from step to step for its unsharded parameters and resizes in place
    (0 bytes while sharded): the meter must know them to count them as they grow (bench/fsdp_vs_torch.py)."""
    out = []
    for m in model.modules():
        if impl == "ours" and isinstance(m, api("ours").FSDPModule):
            out += [p.unsharded for p in m._fsdp.group.params if p.unsharded is not None]
        elif impl == "torch" and isinstance(m, api("torch").FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out += [t for p in group.fsdp_params for t in p.all_gather_outputs] if group is not None else []
    return out


def warmed_up(model, warmup=2):
    """AdamW over `model` after `warmup` steps of the memory model (the optimizer state exists: the steady
    state), and the batch of the next step."""
    opt = OPTIMIZERS["adamw"](model.parameters())
    r, n = dist.get_rank(), dist.get_world_size()
    for step in range(warmup):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu", MEMORY_CONFIG)).backward()
        opt.step()
        opt.zero_grad()
    return opt, batch("gpt", warmup, 12, r, n, "cpu", MEMORY_CONFIG)


def peak_run(impl):
    """The peak of one AdamW step after 2 warm-up steps."""
    from minifsdp import MemoryMeter

    model = shard(TinyGPT(MEMORY_CONFIG, seed=0), impl)
    opt, tensors = warmed_up(model)
    meter = MemoryMeter(model, opt)
    meter.watch(unsharded_buffers(impl, model), "params")
    meter.reset_peak()
    with meter:
        loss_of("gpt", model, tensors).backward()
        opt.step()
    meter.close()
    return {"peak": meter.peak, "split": meter.peak_by_category, "params_peak": meter.category_peak["params"]}


# -- how: each parameter's shard, and what backward sends -----------------------------------------------------------
def mechanism_run():
    """The tiny GPT under minifsdp's fully_shard: each parameter's padded shard as held (11.1), and the collectives
    of one backward (11.2)."""
    from minifsdp.fsdp2 import FSDPModule

    model = shard(build_model("gpt", seed=0), "ours")
    groups = [m._fsdp.group for m in model.modules() if isinstance(m, FSDPModule)]
    shards = []
    for p in [p for g in groups for p in g.params]:
        storage = p.padded.untyped_storage()
        module, name = p.places[0]
        shards.append({"name": f"{type(module).__name__}.{name}", "d0": p.shape[0], "rows": p.padded.shape[0],
                       "bytes": storage.nbytes(), "padded_bytes": p.padded.numel() * p.padded.element_size(),
                       # its own memory, the padded rows and nothing more ...
                       "own": storage.nbytes() == p.padded.numel() * p.padded.element_size(),
                       # ... and the DTensor the optimizer steps is a view of it
                       "view": p.sharded.to_local().untyped_storage().data_ptr() == storage.data_ptr()})
    loss = loss_fn("gpt", model, data("gpt", 0))
    with comm.counting(record=True) as counter:
        loss.backward()
    return {"shards": shards, "padded": sorted(sum(p.padded_numel for p in g.params) for g in groups),
            "calls": dict(counter.calls),
            "reduce_scatters": sorted(e.nbytes for e in counter.events if e.kind == "reduce_scatter")}


# -- every case of one world size ----------------------------------------------------------------------------------
def rank_cases():
    n = dist.get_world_size()
    runs = {}

    def run(impl, *case):
        if (impl, *case) not in runs:
            runs[(impl, *case)] = parity_run(impl, *case)
        return runs[(impl, *case)]

    out = {("torch", name, opt, variant): diff(run("ours", name, opt, variant),
                                               run("torch", name, opt, ORACLE[(name, opt)]))
           for name, opt, variant in PARITY}
    for opt in ("sgd", "adamw"):
        ddp = ddp_run(opt)
        out[("ddp", opt)] = diff(run("ours", "gpt", opt, "raf"), ddp)
        out[("ddp_vs_torch", opt)] = diff(run("torch", "gpt", opt, "raf"), ddp)
    for policy in POLICIES:
        ours = mp_run("ours", policy)
        out[("mp", policy)] = diff(ours, mp_run("torch", policy))
        out[("mp_vs_fp32", policy)] = diff(ours, run("ours", "gpt", "sgd", "raf"))["losses"]
    for impl, unshard in META:
        losses, params, tied = meta_run(impl, "adamw", unshard)
        out[("meta", impl, unshard)] = diff((losses, params), run("ours", "gpt", "adamw", "raf"))
        out[("meta_tied", impl, unshard)] = tied
    with warnings.catch_warnings():  # DTensor's random ops on a CPU mesh: each rank draws for its own shard
        warnings.simplefilter("ignore", UserWarning)
        out["meta_reset"] = diff(meta_reset_run("ours"), meta_reset_run("torch"))
    ours, theirs, ddp = (accumulation_run(kind) for kind in ("ours", "torch", "ddp"))
    out[("accumulation", "torch")], out[("accumulation", "ddp")] = diff(ours, theirs), diff(ours, ddp)
    ours, theirs = clip_run("ours"), clip_run("torch")
    out["clip"] = diff(ours, theirs)
    out["clip_norms"] = (ours[2] - theirs[2]).abs().max().item(), ours[2].min().item()
    out["surface"] = surface()
    out["mechanism"] = mechanism_run()
    if n == MEMORY_N:
        out["memory"] = {impl: peak_run(impl) for impl in ("ours", "torch")}
    if n == FROZEN_N:
        out["frozen_after_wrapping"] = freeze_after_wrapping()
    if n == DECAY_N:
        out["decay_groups"] = decay_groups()
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(rank_cases, world_size=n, device="cpu"), WORLD_SIZES)


def each_rank(ranks, n, key):
    return [ranks[n][r][key] for r in range(n)]


def _same_as_torch(d, what):
    """A failure message for a run that should end where torch's fully_shard does, bit for bit."""
    return (f"{what}: losses {d['losses']:.3g} and parameters {d['params']:.3g} from torch's fully_shard after the same "
            f"steps, expected 0.0 (exercises 11.1, 11.2): does a rank hold the wrong rows (11.1), or does slot q of "
            f"the reduce-scatter's input not hold rank q's rows of every gradient, in the order of the shard (11.2)?")


# -- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("case", PARITY, ids="-".join)
def test_parity_with_torch_fully_shard(ranks, n, case):
    for r, d in enumerate(each_rank(ranks, n, ("torch", *case))):
        assert d == {"losses": 0.0, "params": 0.0}, _same_as_torch(d, f"{'-'.join(case)} on rank {r} of {n}")


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_parity_with_torch_ddp(ranks, n, opt):
    for ours, torchs in zip(each_rank(ranks, n, ("ddp", opt)), each_rank(ranks, n, ("ddp_vs_torch", opt))):
        params_atol, losses_atol = ddp_atol(n, opt)
        assert ours["params"] <= params_atol and ours["losses"] <= losses_atol, (
            f"{opt} at N = {n}: parameters {ours['params']:.3g} and losses {ours['losses']:.3g} from torch's DDP, "
            f"expected within {params_atol:g} and {losses_atol:g} (exercises 11.1, 11.2)")
        # torch's fully_shard is exactly as far from DDP: the reduction order, not a bug
        assert ours == torchs, (
            f"{opt} at N = {n}: {ours} from torch's DDP, where torch's fully_shard is {torchs} from it "
            f"(exercises 11.1, 11.2): the same average summed in another order?")


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_mixed_precision_as_torch(ranks, n, policy):
    for d, vs_fp32 in zip(each_rank(ranks, n, ("mp", policy)), each_rank(ranks, n, ("mp_vs_fp32", policy))):
        assert d == {"losses": 0.0, "params": 0.0}, _same_as_torch(d, f"mixed precision {policy} at N = {n}")
        assert vs_fp32 > 0  # (it did compute in bf16)


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("impl, unshard", META,
                         ids=[f"{impl}-{'unshard_first' if unshard else 'plain'}" for impl, unshard in META])
def test_meta_device_init_equals_eager(ranks, n, impl, unshard):
    for d, tied in zip(each_rank(ranks, n, ("meta", impl, unshard)), each_rank(ranks, n, ("meta_tied", impl, unshard))):
        assert tied  # to_empty kept the embedding and the head one parameter
        assert d == {"losses": 0.0, "params": 0.0}, _same_as_torch(d, f"meta-device build ({impl}) at N = {n}")


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_meta_device_init_with_reset_parameters_as_torch(ranks, n):
    for d in each_rank(ranks, n, "meta_reset"):
        assert d == {"losses": 0.0, "params": 0.0}, _same_as_torch(d, f"meta-device reset_parameters at N = {n}")


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_gradient_accumulation_without_sync(ranks, n):
    for r in range(n):
        d = ranks[n][r][("accumulation", "torch")]
        assert d == {"losses": 0.0, "params": 0.0}, _same_as_torch(d, f"accumulation without sync at N = {n}")
        ddp = ranks[n][r][("accumulation", "ddp")]
        params_atol, losses_atol = ddp_atol(n, "sgd")  # (accumulation_run steps SGD)
        assert ddp["losses"] <= losses_atol and ddp["params"] <= params_atol, ddp


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_clip_grad_norm_on_dtensors(ranks, n):
    for r in range(n):
        d = ranks[n][r]["clip"]
        assert d == {"losses": 0.0, "params": 0.0}, _same_as_torch(d, f"clip_grad_norm_ at N = {n}")
        norm_diff, smallest = ranks[n][r]["clip_norms"]
        assert norm_diff == 0.0 and smallest > MAX_NORM  # the same total norm, and it did clip


@pytest.mark.exercise("11.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_surface(ranks, n):
    for s in each_rank(ranks, n, "surface"):
        for key in ("names", "dtensors", "local_shards", "tied", "state_dict_keys", "state_dict_dtensors",
                    "fsdp_modules", "handle_has_wait", "unsharded_after_wait", "resharded",
                    "sync_unshard_returns_none", "unshard_async_op"):
            assert s[key] is True, key
        assert s["state_dict_values"] == 0.0
        kind, message = s["zero_dim"]
        assert kind == "ValueError" and "'gate'" in message and "0-dim" in message
        kind, message = s["twice"]
        assert kind == "ValueError" and "already" in message


@pytest.mark.mechanism
@pytest.mark.exercise("11.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_each_rank_holds_only_its_padded_rows(ranks, n):
    """A shard of ceil(d0 / N) rows in memory of its own (not a view into a full-size copy that would keep the
    whole parameter alive), and the parameter the optimizer steps is a view of it."""
    for r in range(n):
        for s in ranks[n][r]["mechanism"]["shards"]:
            rows = -(-s["d0"] // n)
            assert s["rows"] == rows, (
                f"rank {r} of {n} holds {s['rows']} rows of {s['name']} ({s['d0']} rows in all), expected "
                f"ceil({s['d0']} / {n}) = {rows} on every rank, padded with zeros where it has fewer real rows "
                f"(exercise 11.1): is the count rounded down, or this rank's real rows kept unpadded?")
            assert s["own"], (
                f"rank {r} of {n}: the shard of {s['name']} keeps a storage of {s['bytes']:,} B alive, expected "
                f"its own {s['padded_bytes']:,} B (exercise 11.1): is `padded` a view into a full-size tensor, "
                f"which then stays alive whole on every rank?")
            assert s["view"], (
                f"rank {r} of {n}: the DTensor the optimizer steps for {s['name']} is not a view of the padded "
                f"shard (exercise 11.1): the optimizer would step a copy the collectives never read")


@pytest.mark.mechanism
@pytest.mark.exercise("11.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_backward_reduce_scatters_each_group_once(ranks, n):
    """One reduce-scatter per fully_shard'ed module of its N padded shards' worth of fp32 gradients -- 4 N P_g
    (N-1)/N bytes, P_g its padded shard elements -- and no all-reduce (an all-reduce and a slice would average
    the same numbers with twice the bytes)."""
    for r in range(n):
        m = ranks[n][r]["mechanism"]
        calls = ", ".join(f"{c} {k}" for k, c in sorted(m["calls"].items())) or "nothing"
        assert m["calls"].get("reduce_scatter") == len(m["padded"]) and "all_reduce" not in m["calls"], (
            f"one backward on rank {r} of {n} issued {calls}, expected {len(m['padded'])} reduce_scatter (one per "
            f"fully_shard'ed module) and no all_reduce (exercise 11.2): an all-reduce and a slice average the same "
            f"numbers with twice the bytes; a collective per parameter pays its latency per parameter")
        expected = sorted((4 * numel * n) * (n - 1) / n for numel in m["padded"])
        assert m["reduce_scatters"] == expected, (
            f"rank {r} of {n} reduce-scattered {', '.join(f'{b:,.0f}' for b in m['reduce_scatters'])} B, expected "
            f"{', '.join(f'{b:,.0f}' for b in expected)} B: each module's N slots of its padded rows of every "
            f"gradient, (N - 1)/N of it on the wire (exercise 11.2): are the gradients padded to ceil(d0 / N) rows "
            f"per rank, and every parameter of the module in the one buffer?")


@pytest.mark.mechanism
@pytest.mark.exercise("11.1", "11.2")
def test_peak_memory_at_most_torchs(ranks):
    psi = sum(p.numel() for p in TinyGPT(MEMORY_CONFIG).parameters())
    block = sum(p.numel() for p in TinyGPT(MEMORY_CONFIG).blocks[0].parameters())
    peaks = [m for m in each_rank(ranks, MEMORY_N, "memory")]
    for r, m in enumerate(peaks):
        ours, torchs = m["ours"]["peak"], m["torch"]["peak"]
        assert ours <= torchs, (
            f"rank {r} of {MEMORY_N} peaked at {ours:,} B under minifsdp's fully_shard, above torch's {torchs:,} B "
            f"(exercises 11.1, 11.2): does a shard keep its full parameter alive (11.1), or the copy-in keep every "
            f"unsharded gradient until the reduce-scatter (11.2)?")
        # the meter saw the unsharded parameters: the shards (4Ψ/N bytes) and at least one block's full ones
        least = 4 * psi / MEMORY_N + 4 * block
        for impl in ("ours", "torch"):
            assert m[impl]["params_peak"] >= least, (
                f"the meter saw {m[impl]['params_peak']:,} B of parameters at most under {impl}, expected at least "
                f"{least:,.0f} B (the shards and one block unsharded): it missed the unsharded parameters")


def sharded_gpts():
    """(implementation, the tiny GPT with fully_shard on each block and the root) for minifsdp's and torch's."""
    import torch.distributed.fsdp as torch_fsdp

    from minifsdp.fsdp2 import fully_shard as ours
    for impl, shard_fn in (("minifsdp", ours), ("torch", torch_fsdp.fully_shard)):
        model = build_model("gpt", seed=0)
        for b in model.blocks:
            shard_fn(b)
        yield impl, shard_fn(model)


def freeze_after_wrapping():
    """A parameter frozen after fully_shard, before the first forward: no gradient, and it does not move."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for impl, model in sharded_gpts():
        model.blocks[0].fc.weight.requires_grad_(False)
        before = model.blocks[0].fc.weight.full_tensor().clone()
        opt = OPTIMIZERS["sgd"](model.parameters())
        loss_of("gpt", model, batch("gpt", 0, 12, r, n, "cpu")).backward()
        grad = model.blocks[0].fc.weight.grad
        opt.step()
        out[impl] = (grad is None, float((model.blocks[0].fc.weight.full_tensor() - before).abs().max()))
    return out


@pytest.mark.exercise("11.1", "11.2")
def test_a_parameter_frozen_after_wrapping_stays_frozen(ranks):
    for res in each_rank(ranks, FROZEN_N, "frozen_after_wrapping"):
        assert res["minifsdp"] == res["torch"] == (True, 0.0)


def decay_groups():
    """AdamW with weight decay on the matrices only (two param groups, picked by name and shape): what a
    FlatParameter cannot say, since its optimizer sees one flat tensor per unit. Under both fully_shards."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for impl, model in sharded_gpts():
        decay = [p for name, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for name, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-3)
        losses = []
        for step in range(3):
            loss = loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[impl] = (losses, {k: v.full_tensor() for k, v in model.state_dict().items()})
    return out


@pytest.mark.exercise("11.1", "11.2")
def test_per_parameter_optimizer_groups_train_as_under_torch(ranks):
    for res in each_rank(ranks, DECAY_N, "decay_groups"):
        (ours, ours_sd), (theirs, theirs_sd) = res["minifsdp"], res["torch"]
        assert ours == theirs
        assert max_abs_diff(ours_sd, theirs_sd) == 0.0
