"""A FairScale training script runs on minifsdp's ZeRO-1/ZeRO-2 classes, and gives torch's DDP's weights.

The script is written as for fairscale.optim.OSS and fairscale.nn.ShardedDataParallel, with their keyword
names: gradients accumulated under no_sync() and sent by reduce(), clip_grad_norm, and a checkpoint made
by consolidate_state_dict(recipient_rank=0) + state_dict() on rank 0, saved, and loaded into a plain
torch optimizer. It runs on OSS + ShardedDataParallel and on the flat FlatOSS + FlatShardedDataParallel,
and is compared with torch's DistributedDataParallel and a plain optimizer on the same data, at 2 ranks.

Tolerance:
- bit-exact (max |diff| == 0.0) while clipping does not bite. Every average is one addition a + b of the
  two ranks' gradients, each scaled by 1/2 first on both sides, and a + b = b + a; SGD and AdamW are
  element-wise, so stepping a rank's part computes what every rank computes under DDP.
- 1e-6 when clipping scales the gradients. The total norm is summed in another order: minifsdp adds each
  rank's partial sum of squares (all-reduce), torch takes the norm of the per-parameter norms. The last
  bits of the norm, hence of the clip coefficient, differ (the norms agree to 1e-7, relative). Measured
  on the weights after 4 steps: 0.0 with SGD, 3e-8 with AdamW.
- fp16 on the wire (reduce_fp16, broadcast_fp16): compared with the fp32 run for closeness only, 2e-3
  (measured after 3 steps: 3e-4 for broadcast_fp16, 2e-5 for reduce_fp16). What is tested exactly there
  is what the argument promises: half the bytes, identical replicas, fp32 gradients.

Every case runs in one launch at 2 ranks (the module-scoped fixture); each test reads its results.
"""

import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp import OSS, FlatOSS, FlatShardedDataParallel, ShardedDataParallel, comm, launch
from minifsdp.train import OPTIMIZER_SPECS, max_abs_diff

N = 2
STEPS = 4
CLIP = {"exact": 1e6, "clipped": 0.05}  # max_norm: never reached / always reached
ATOL = {"exact": 0.0, "clipped": 1e-6}
FP16_ATOL = 2e-3


class Net(nn.Module):
    """Three layers and a frozen one: tiny, and nothing in it divides evenly."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.frozen, self.b, self.c = nn.Linear(6, 15), nn.Linear(15, 15), nn.Linear(15, 13), nn.Linear(13, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))))


def micro_batches(step):
    """This rank's two micro-batches of a global batch of 8 (the same data for every strategy)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    r = dist.get_rank()
    x, y = x[4 * r: 4 * r + 4], y[4 * r: 4 * r + 4]
    return [(x[:2], y[:2]), (x[2:], y[2:])]


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y) / 2  # the mean over two micro-batches


def whole_batch(step):
    """This rank's 4 samples of the global batch at once: one backward, one reduction per bucket."""
    (x1, y1), (x2, y2) = micro_batches(step)
    return torch.cat([x1, x2]), torch.cat([y1, y2])


def average_by_hand(net):
    """DDP's average, element by element: x * (1/N) on each rank, then the sum."""
    for p in net.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad.mul_(1.0 / N))


def params_of(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def attempt(fn, *args, **kwargs):
    """Run one case; an exception becomes its result, so one failing case does not hide the others."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- reported by the test that reads this case
        return {"error": f"{type(e).__name__}: {e}"}


# -- the FairScale script, and torch's DDP on the same data -----------------------------------------------------
def fairscale_script(strategy, opt_name, max_norm):
    net = Net(seed=dist.get_rank())  # different on each rank: the wrapper's startup sync must fix that
    cls, kw = OPTIMIZER_SPECS[opt_name]
    if strategy == "oss":
        optimizer = OSS(params=net.parameters(), optim=cls, group=None, broadcast_buffer_size=-1,
                        broadcast_fp16=False, **kw)
        model = ShardedDataParallel(net, optimizer, process_group=None, broadcast_buffers=True,
                                    sync_models_at_startup=True, reduce_buffer_size=2 ** 23,
                                    auto_refresh_trainable=True, reduce_fp16=False)
    else:  # the flat design: FairScale's names where they apply (its buckets are the optimizer's)
        optimizer = FlatOSS(params=net.parameters(), optim=cls, group=None, broadcast_buffer_size=64,
                            broadcast_fp16=False, **kw)
        model = FlatShardedDataParallel(net, optimizer, process_group=None, broadcast_buffers=True,
                                        sync_models_at_startup=True, auto_refresh_trainable=True, reduce_fp16=False)
    norms = []
    for step in range(STEPS):
        with model.no_sync():
            for x, y in micro_batches(step):
                loss_of(model, x, y).backward()
        model.reduce()
        norms.append(optimizer.clip_grad_norm(max_norm).item())
        optimizer.step()
        model.zero_grad()
    optimizer.consolidate_state_dict(recipient_rank=0)
    out = {"params": params_of(net), "norms": norms, "buckets": len(model._buckets)}
    if dist.get_rank() == 0:  # the checkpoint, saved and loaded back as a FairScale user would
        file = io.BytesIO()
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, file)
        file.seek(0)
        checkpoint = torch.load(file)
        plain = Net(seed=123)
        plain.load_state_dict(checkpoint["model"])
        plain_optimizer = cls(plain.parameters(), **kw)
        plain_optimizer.load_state_dict(checkpoint["optimizer"])
        out["plain"] = {"params": params_of(plain), "optimizer": plain_optimizer.state_dict()}
    return out


def torch_ddp(opt_name, max_norm):
    net = Net(seed=dist.get_rank())
    cls, kw = OPTIMIZER_SPECS[opt_name]
    model = TorchDDP(net)
    optimizer = cls(net.parameters(), **kw)
    norms = []
    for step in range(STEPS):
        first, last = micro_batches(step)
        with model.no_sync():
            loss_of(model, *first).backward()
        loss_of(model, *last).backward()  # the synced backward averages the accumulated sums
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"params": params_of(net), "norms": norms, "optimizer": optimizer.state_dict()}


# -- every new argument does what it says -----------------------------------------------------------------------
def train_sdp(steps=3, oss_kw=None, sdp_kw=None, opt_name="sgd"):
    """OSS + ShardedDataParallel for a few steps: the parameters, the bytes and calls of the steps, the grads."""
    net = Net(seed=dist.get_rank())
    cls, kw = OPTIMIZER_SPECS[opt_name]
    optimizer = OSS(net.parameters(), optim=cls, **(oss_kw or {}), **kw)
    model = ShardedDataParallel(net, optimizer, **(sdp_kw or {}))
    grad_dtypes = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reduce_fp16 without a loss scaler says so: fine for this check
        with comm.counting() as counter:
            for step in range(steps):
                loss_of(model, *whole_batch(step)).backward()
                grad_dtypes |= {p.grad.dtype for p in net.parameters() if p.grad is not None}
                optimizer.step()
                optimizer.zero_grad()
    return {"params": params_of(net), "bytes": dict(counter.bytes), "calls": dict(counter.calls),
            "grad_dtypes": grad_dtypes, "buckets": len(model._buckets)}


def train_flat(steps=3, oss_kw=None, sdp_kw=None, wrap=True):
    """FlatOSS (+ FlatShardedDataParallel) with SGD for a few steps."""
    net = Net(seed=dist.get_rank())
    cls, kw = OPTIMIZER_SPECS["sgd"]
    optimizer = FlatOSS(net.parameters(), optim=cls, **(oss_kw or {}), **kw)
    model = FlatShardedDataParallel(net, optimizer, **(sdp_kw or {})) if wrap else net
    with comm.counting() as counter:
        for step in range(steps):
            loss_of(model, *whole_batch(step)).backward()
            grad_dtypes = {b.shard.grad.dtype for b in optimizer.buckets if b.shard.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
    return {"params": params_of(net), "bytes": dict(counter.bytes), "calls": dict(counter.calls),
            "grad_dtypes": grad_dtypes, "buckets": len(optimizer.buckets)}


def fp16_representable(params):
    return all(torch.equal(v, v.half().float()) for k, v in params.items() if not k.startswith("frozen"))


def clip_with_filter():
    """OSS.clip_grad_norm(filter_params_fn=...): the norm counts the filtered gradients, all are scaled."""
    net = Net(seed=0)
    optimizer = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(net, optimizer)
    for x, y in micro_batches(0):
        loss_of(model, x, y).backward()
    owned = [p for p in optimizer.owned_params(dist.get_rank()) if p.grad is not None]
    before = {p: p.grad.clone() for p in owned}
    weights = [p for p in owned if p.dim() == 2]
    squares = torch.stack([p.grad.pow(2).sum() for p in weights]).sum() if weights else torch.zeros(())
    dist.all_reduce(squares)
    norm = optimizer.clip_grad_norm(0.01, filter_params_fn=lambda ps: [p for p in ps if p.dim() == 2])
    coef = 0.01 / (squares.sqrt() + 1e-6)
    return {"norm": norm.item(), "expected": squares.sqrt().item(),
            "scaled": all(torch.allclose(p.grad, before[p] * coef, rtol=1e-6, atol=0) for p in owned)}


def state_dict_protocol():
    """recipient_rank (and the older `to`), state_dict(all_ranks=True), for OSS and FlatOSS."""
    out = {}
    for name in ("oss", "flat"):
        net = Net(seed=0)
        cls, kw = OPTIMIZER_SPECS["adamw"]
        optimizer = (OSS if name == "oss" else FlatOSS)(net.parameters(), optim=cls, **kw)
        for x, y in micro_batches(0):
            loss_of(net, x, y).backward()
        average_by_hand(net)  # no wrapper here
        optimizer.step()
        optimizer.consolidate_state_dict(recipient_rank=1)
        out[name] = {"recipient_1": attempt(lambda: sorted(optimizer.state_dict()))}
        everywhere = optimizer.state_dict(all_ranks=True)
        out[name]["all_ranks"] = {i: {k: v.clone() for k, v in s.items()} for i, s in everywhere["state"].items()}
        if name == "oss":
            optimizer.consolidate_state_dict(to=0)  # minifsdp's older spelling
            out[name]["to_0"] = attempt(lambda: sorted(optimizer.state_dict()))
        else:  # no consolidation since the last step: state_dict() is this rank's shard again
            optimizer.step()
            out[name]["after_step"] = sorted(optimizer.state_dict())
    return out


def buffers_and_methods():
    """sync_buffers, reduce() with nothing to send, zero_grad on the flat wrapper, FairScale's positional order."""
    out = {}
    net = Net(seed=0)
    net.register_buffer("stat", torch.zeros(3))
    optimizer = OSS(net.parameters(), torch.optim.SGD, None, -1, False, False, lr=0.1)  # FairScale's order
    model = ShardedDataParallel(net, optimizer, None, False, True, 2 ** 23, True, False)
    out["positional"] = (model.process_group, model.broadcast_buffers, optimizer.broadcast_fp16)
    net.stat.fill_(float(dist.get_rank()))  # broadcast_buffers=False: forward alone would leave it so
    model.sync_buffers(blocking=False)
    model(torch.zeros(1, 6))  # waits for the broadcast before reading the buffers
    out["non_blocking"] = net.stat.tolist()
    net.stat.fill_(10.0 + dist.get_rank())
    model.sync_buffers(blocking=True)
    out["blocking"] = net.stat.tolist()
    for x, y in micro_batches(0):
        loss_of(model, x, y).backward()
    out["reduce_without_no_sync"] = attempt(model.reduce)
    flat_net = Net(seed=0)
    flat_opt = FlatOSS(flat_net.parameters(), optim=torch.optim.SGD, bucket_cap_mb=0.001, lr=0.1)
    flat = FlatShardedDataParallel(flat_net, flat_opt)
    for x, y in micro_batches(0):
        loss_of(flat, x, y).backward()
    held = all(b.shard.grad is not None for b in flat_opt.buckets)
    flat.zero_grad()
    out["flat_zero_grad"] = (held, all(b.shard.grad is None for b in flat_opt.buckets))
    out["flat_reduce_buffer_size"] = attempt(FlatShardedDataParallel, Net(seed=0), FlatOSS(
        Net(seed=0).parameters(), optim=torch.optim.SGD, bucket_cap_mb=0.001, lr=0.1), reduce_buffer_size=2 ** 20)
    out["two_bucket_sizes"] = attempt(ShardedDataParallel, Net(seed=0), OSS(Net(seed=0).parameters(), lr=0.1),
                                      reduce_buffer_size=100, bucket_cap_mb=1.0)
    out["flat_filter"] = attempt(flat_opt.clip_grad_norm, 1.0, filter_params_fn=list)
    return out


# -- trainability changes, and FlatOSS used without a wrapper (the defect) -------------------------------------
SCHEDULE = {2: ("b", "frozen")}  # at step 2: freeze layer b, unfreeze the frozen layer


def change_trainability(net, step):
    if step in SCHEDULE:
        freeze, unfreeze = SCHEDULE[step]
        getattr(net, freeze).requires_grad_(False)
        getattr(net, unfreeze).requires_grad_(True)
        return True
    return False


def reference_with_schedule(steps=4):
    """A plain SGD with momentum on rank 0's weights, the gradients averaged by hand: what DDP would do."""
    net = Net(seed=0)
    cls, kw = OPTIMIZER_SPECS["sgd"]
    optimizer = cls(net.parameters(), **kw)
    for step in range(steps):
        change_trainability(net, step)
        loss_of(net, *whole_batch(step)).backward()
        average_by_hand(net)
        optimizer.step()
        optimizer.zero_grad()
    return params_of(net)


def with_schedule(strategy, refresh="auto", steps=4):
    """The same schedule on our classes. refresh: "auto" (the wrapper's, with a warning), "quiet" (the same,
    warn_on_trainable_params_changed=False), "call" (refresh_trainable() by hand), "none" (forgotten)."""
    net = Net(seed=dist.get_rank())  # different on each rank
    cls, kw = OPTIMIZER_SPECS["sgd"]
    fairscale_kw = {"auto_refresh_trainable": refresh in ("auto", "quiet"),
                    "warn_on_trainable_params_changed": refresh != "quiet"}
    if strategy == "flat_alone":
        optimizer = FlatOSS(net.parameters(), optim=cls, **kw)
        model = net
    elif strategy == "flat":
        optimizer = FlatOSS(net.parameters(), optim=cls, bucket_cap_mb=0.001, **kw)
        model = FlatShardedDataParallel(net, optimizer, **fairscale_kw)
    else:
        optimizer = OSS(net.parameters(), optim=cls, **kw)
        model = ShardedDataParallel(net, optimizer, **fairscale_kw)
    held = {k: p for k, p in net.named_parameters()}  # every one of them is in the optimizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if change_trainability(net, step) and refresh == "call":
                (optimizer if strategy == "flat_alone" else model).refresh_trainable()
            loss_of(model, *whole_batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"params": {k: p.detach().clone() for k, p in held.items()},
            "warned": [str(w.message) for w in caught if "trainable parameters changed" in str(w.message)]}


def flat_alone_clipped(steps=3, max_norm=0.05):
    """FlatOSS without a wrapper, clipped: clip_grad_norm averages the gradients first, step() not again."""
    net = Net(seed=dist.get_rank())
    cls, kw = OPTIMIZER_SPECS["sgd"]
    optimizer = FlatOSS(net.parameters(), optim=cls, bucket_cap_mb=0.001, **kw)
    reference = Net(seed=0)
    plain = cls(reference.parameters(), **kw)
    norms = []
    with comm.counting() as counter:
        for step in range(steps):
            loss_of(net, *whole_batch(step)).backward()
            norms.append(optimizer.clip_grad_norm(max_norm).item())
            optimizer.step()
            optimizer.zero_grad()
    reference_norms = []
    for step in range(steps):  # the reference: DDP's average by hand, torch's clipping, a plain SGD
        loss_of(reference, *whole_batch(step)).backward()
        average_by_hand(reference)
        reference_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item())
        plain.step()
        plain.zero_grad()
    return {"params": params_of(net), "reference": params_of(reference), "norms": norms,
            "reference_norms": reference_norms, "reduce_scatters": counter.calls["reduce_scatter"],
            "buckets": len(optimizer.buckets)}


# -- OSS.step's contract (FairScale's, and torch's ZeroRedundancyOptimizer's) ---------------------------------
class ScaledSGD(torch.optim.SGD):
    """A step that takes a keyword argument (as apex's fused optimizers' do) and writes a key of its own into
    its param groups."""

    def step(self, closure=None, scale=1.0):
        for group in self.param_groups:
            group["last_scale"] = scale
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return super().step(closure)


class ClosurelessSGD(torch.optim.SGD):
    def step(self):  # takes no closure
        return super().step()


def step_contract(kind):
    """Two steps of the sharded optimizer `kind` over Net: a keyword argument for the wrapped optimizer's
    step, a key it adds to its groups, an optimizer whose step takes no closure, a closure's loss."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def sharded(params, optim, **kw):
        if kind == "oss":
            return OSS(params, optim=optim, **kw)
        return ZeroRedundancyOptimizer(params, optimizer_class=optim, **kw)

    out = {}
    for name, optim, step_kw in (("kwargs", ScaledSGD, {"scale": 0.5}), ("closureless", ClosurelessSGD, {})):
        net = Net(seed=0)
        optimizer = sharded(net.parameters(), optim, lr=0.1, momentum=0.9)
        for step in range(2):
            loss_of(net, *whole_batch(step)).backward()
            average_by_hand(net)
            out[name] = attempt(lambda: optimizer.step(**step_kw))
            optimizer.zero_grad()
        out[name] = out[name] if isinstance(out[name], dict) else {
            "params": params_of(net), "groups": [g.get("last_scale") for g in optimizer.param_groups]}
    net = Net(seed=0)
    optimizer = sharded(net.parameters(), torch.optim.SGD, lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = loss_of(net, *whole_batch(0))
        loss.backward()
        average_by_hand(net)
        return loss

    out["closure"] = {"loss": attempt(lambda: optimizer.step(closure=closure).item()), "params": params_of(net)}
    return out


# -- ShardedDataParallel's contract (FairScale's) --------------------------------------------------------------
class HeadNet(Net):
    """Net with a head that a step may leave unused (a classifier head in pre-training): on every rank, on
    rank 0 only, or on none."""

    def __init__(self, seed):
        super().__init__(seed)
        self.head = nn.Linear(3, 1)

    def forward(self, x, use_head=False):
        out = super().forward(x)
        return out + self.head(out) if use_head else out


HEAD_USE = ("none", "rank0", "all")  # who uses the head at steps 0, 1, 2


def train_with_head(kind):
    """Three steps of SGD with momentum (no weight decay) on HeadNet, the head used per HEAD_USE: our
    ShardedDataParallel, without or with find_unused_parameters, or torch's DDP (which needs it)."""
    net = HeadNet(seed=dist.get_rank())
    if kind == "torch":
        model, optimizer = TorchDDP(net, find_unused_parameters=True), torch.optim.SGD(net.parameters(), lr=0.1,
                                                                                         momentum=0.9)
    else:
        optimizer = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
        model = ShardedDataParallel(net, optimizer, find_unused_parameters=kind == "sdp_find_unused")
    head_grads = []
    for step, who in enumerate(HEAD_USE):
        use = who == "all" or (who == "rank0" and dist.get_rank() == 0)
        x, y = whole_batch(step)
        nn.functional.mse_loss(model(x, use_head=use), y).backward()
        head_grads.append(None if net.head.weight.grad is None else net.head.weight.grad.clone())
        optimizer.step()
        optimizer.zero_grad()
    owner = None if kind == "torch" else next(r for r in range(N) if any(
        p is net.head.weight for p in optimizer.owned_params(r)))
    return {"params": params_of(net), "head_grads": head_grads, "owner": owner}


def two_optimizers():
    """FairScale's ShardedDataParallel(module, [oss_1, oss_2]): two sharded optimizers over two parameter
    sets, each stepped in turn; against one plain SGD under torch's DDP."""
    net = Net(seed=dist.get_rank())
    params = list(net.parameters())
    first = OSS(params[:3], optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    second = OSS(params[3:], optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    model = ShardedDataParallel(net, [first, second])
    reference = Net(seed=dist.get_rank())
    reference_model = TorchDDP(reference)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for wrapped, optimizers in ((model, (first, second)), (reference_model, (plain,))):
            loss_of(wrapped, *whole_batch(step)).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    return {"params": params_of(net), "reference": params_of(reference),
            "overlapping": attempt(ShardedDataParallel, Net(seed=0), [OSS(params, lr=0.1), OSS(params[:1], lr=0.1)])}


def attributes():
    """torch DDP's attributes, and what the wrapper does not have looked up on the module (FairScale's)."""
    out = {}
    for name in ("sdp", "flat"):
        net = Net(seed=0)
        net.banana = "sweet"
        if name == "sdp":
            model = ShardedDataParallel(net, OSS(net.parameters(), lr=0.1))
        else:
            model = FlatShardedDataParallel(net, FlatOSS(net.parameters(), bucket_cap_mb=0.001, lr=0.1))
        out[name] = {k: attempt(getattr, model, k) for k in ("is_multi_device_module", "device_type", "banana")}
        out[name]["orange"] = hasattr(model, "orange")
        out[name]["module"] = model.module is net
    return out


def grads_requiring_grad():
    """A .grad that requires grad: set before the forward (FairScale's test), or made by create_graph=True."""
    net = Net(seed=0)
    net.a.weight.grad = torch.zeros_like(net.a.weight).requires_grad_()
    model = ShardedDataParallel(net, OSS(net.parameters(), lr=0.1))
    out = {"set": attempt(lambda: model(torch.ones(2, 6)))}
    net = Net(seed=0)
    model = ShardedDataParallel(net, OSS(net.parameters(), lr=0.1))
    out["create_graph"] = attempt(lambda: model(torch.ones(2, 6)).pow(2).sum().backward(create_graph=True))
    return out


def rank_cases():
    torch.set_num_threads(1)  # tiny models gain nothing from intra-op threads on a shared machine
    out = {"script": {}, "torch": {}}
    for opt_name in ("sgd", "adamw"):
        for clip, max_norm in CLIP.items():
            out["torch"][(opt_name, clip)] = torch_ddp(opt_name, max_norm)
            for strategy in ("oss", "flat"):
                out["script"][(strategy, opt_name, clip)] = attempt(fairscale_script, strategy, opt_name, max_norm)
    out["sdp"] = {
        "fp32": attempt(train_sdp),
        "broadcast_fp16": attempt(train_sdp, oss_kw={"broadcast_fp16": True}),
        "all_gather_fp16": attempt(train_sdp, oss_kw={"broadcast_fp16": True, "param_sync": "all_gather"}),
        "all_gather": attempt(train_sdp, oss_kw={"param_sync": "all_gather"}),
        "broadcast_buffer_size": attempt(train_sdp, oss_kw={"broadcast_buffer_size": 20}),
        "reduce_fp16": attempt(train_sdp, sdp_kw={"reduce_fp16": True}),
        "reduce_buffer_size_0": attempt(train_sdp, sdp_kw={"reduce_buffer_size": 0}),
        "reduce_buffer_size_200": attempt(train_sdp, sdp_kw={"reduce_buffer_size": 200}),
        "no_startup_sync_flag": attempt(train_sdp, sdp_kw={"sync_models_at_startup": False}),
    }
    out["flat"] = {
        "fp32": attempt(train_flat, oss_kw={"bucket_cap_mb": 0.001}),
        "broadcast_fp16": attempt(train_flat, oss_kw={"bucket_cap_mb": 0.001, "broadcast_fp16": True}),
        "reduce_fp16": attempt(train_flat, oss_kw={"bucket_cap_mb": 0.001}, sdp_kw={"reduce_fp16": True}),
        "broadcast_buffer_size": attempt(train_flat, oss_kw={"broadcast_buffer_size": 64}, wrap=False),
    }
    out["clip_filter"] = attempt(clip_with_filter)
    out["flat_alone_clipped"] = attempt(flat_alone_clipped)
    out["state_dict"] = attempt(state_dict_protocol)
    out["methods"] = attempt(buffers_and_methods)
    out["step_contract"] = {kind: step_contract(kind) for kind in ("oss", "torch_zero")}
    out["head"] = {kind: attempt(train_with_head, kind) for kind in ("sdp", "sdp_find_unused", "torch")}
    out["two_optimizers"] = attempt(two_optimizers)
    out["attributes"] = attributes()
    out["grad_grad"] = grads_requiring_grad()
    out["schedule"] = {"reference": reference_with_schedule()}
    for strategy, refresh in (("oss", "auto"), ("oss", "quiet"), ("oss", "call"), ("flat", "auto"), ("flat", "call"),
                              ("flat_alone", "call"), ("flat_alone", "none"), ("oss", "none")):
        out["schedule"][(strategy, refresh)] = attempt(with_schedule, strategy, refresh)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(rank_cases, world_size=N, device="cpu")


def ok(result):
    assert "error" not in result, result["error"]
    return result


# -- (a) the FairScale script gives torch's DDP's weights -------------------------------------------------------
@pytest.mark.parametrize("strategy", ("oss", "flat"))
@pytest.mark.parametrize("opt_name", ("sgd", "adamw"))
@pytest.mark.parametrize("clip", tuple(CLIP))
def test_fairscale_script_matches_torch_ddp(ranks, strategy, opt_name, clip):
    reference = ranks[0]["torch"][(opt_name, clip)]
    ours = [ok(r["script"][(strategy, opt_name, clip)]) for r in ranks]
    assert max_abs_diff(ours[0]["params"], reference["params"]) <= ATOL[clip]
    assert max_abs_diff(ours[1]["params"], ours[0]["params"]) == 0.0  # identical replicas
    assert ours[0]["norms"] == pytest.approx(reference["norms"], rel=1e-6)  # the norm before clipping
    if clip == "clipped":
        assert min(reference["norms"]) > CLIP[clip]  # clipping really scaled every step
    if strategy == "flat":
        assert ours[0]["buckets"] > 2  # broadcast_buffer_size=64 elements made several buckets
    # the training moved the weights, so equality means something
    assert max_abs_diff(reference["params"], params_of(Net(seed=0))) > 1e-3


@pytest.mark.parametrize("strategy", ("oss", "flat"))
@pytest.mark.parametrize("opt_name", ("sgd", "adamw"))
def test_checkpoint_from_rank_0_loads_into_a_plain_model_and_optimizer(ranks, strategy, opt_name):
    reference = ranks[0]["torch"][(opt_name, "exact")]
    plain = ok(ranks[0]["script"][(strategy, opt_name, "exact")])["plain"]
    assert max_abs_diff(plain["params"], reference["params"]) == 0.0
    mine, theirs = plain["optimizer"], reference["optimizer"]
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        for k, v in state.items():
            assert torch.equal(mine["state"][i][k], v), (i, k)


# -- (b) every new argument does what it says -------------------------------------------------------------------
def test_broadcast_fp16_sends_half_the_bytes_and_keeps_the_replicas_identical(ranks):
    for table, kind, fp32, fp16 in (("sdp", "broadcast", "fp32", "broadcast_fp16"),
                                    ("sdp", "all_gather", "all_gather", "all_gather_fp16"),
                                    ("flat", "all_gather", "fp32", "broadcast_fp16")):
        full, half = ok(ranks[0][table][fp32]), ok(ranks[0][table][fp16])
        assert half["bytes"][kind] == full["bytes"][kind] / 2 > 0, (table, fp16)
        assert max_abs_diff(ok(ranks[1][table][fp16])["params"], half["params"]) == 0.0
        assert fp16_representable(half["params"])  # the owner keeps the rounded values too
        assert 0 < max_abs_diff(half["params"], full["params"]) <= FP16_ATOL


def test_reduce_fp16_reduces_half_the_bytes_into_fp32_gradients(ranks):
    for table, kind in (("sdp", "reduce"), ("flat", "reduce_scatter")):
        full, half = ok(ranks[0][table]["fp32"]), ok(ranks[0][table]["reduce_fp16"])
        assert half["bytes"][kind] == full["bytes"][kind] / 2 > 0, table
        assert half["grad_dtypes"] == {torch.float32}
        assert max_abs_diff(ok(ranks[1][table]["reduce_fp16"])["params"], half["params"]) == 0.0
        assert 0 < max_abs_diff(half["params"], full["params"]) <= FP16_ATOL


def test_bucket_sizes_in_elements(ranks):
    sdp = ranks[0]["sdp"]
    trainable = sum(1 for p in Net(seed=0).parameters() if p.requires_grad)
    # reduce_buffer_size: 0 is a bucket per gradient; FairScale's default holds this model in one per owner
    assert ok(sdp["reduce_buffer_size_0"])["calls"]["reduce"] == 3 * trainable
    assert ok(sdp["fp32"])["calls"]["reduce"] == 3 * N
    assert 3 * N < ok(sdp["reduce_buffer_size_200"])["calls"]["reduce"] < 3 * trainable
    # broadcast_buffer_size: the owners' broadcasts cut into more calls, the same bytes, the same result
    cut, whole = ok(sdp["broadcast_buffer_size"]), ok(sdp["fp32"])
    assert cut["calls"]["broadcast"] > whole["calls"]["broadcast"]
    assert cut["bytes"]["broadcast"] == whole["bytes"]["broadcast"]
    for case in ("reduce_buffer_size_0", "reduce_buffer_size_200", "broadcast_buffer_size", "all_gather"):
        assert max_abs_diff(ok(sdp[case])["params"], whole["params"]) == 0.0, case
    # on FlatOSS, broadcast_buffer_size is the bucket size: several buckets, each reduce-scattered and gathered
    flat = ok(ranks[0]["flat"]["broadcast_buffer_size"])
    assert flat["buckets"] > 2 and flat["calls"]["all_gather"] == 3 * flat["buckets"]


def test_sync_models_at_startup_false_trusts_the_ranks_to_agree(ranks):
    # each rank built its own weights (seed = rank): without the startup broadcast the run starts from a mix
    # (each owner's update is broadcast at every step, so the replicas agree again afterwards)
    unsynced, synced = ok(ranks[0]["sdp"]["no_startup_sync_flag"]), ok(ranks[0]["sdp"]["fp32"])
    assert max_abs_diff(unsynced["params"], synced["params"]) > 1e-3


def test_clip_grad_norm_filter_counts_some_gradients_and_scales_all(ranks):
    for r in ranks:
        res = ok(r["clip_filter"])
        assert res["norm"] == pytest.approx(res["expected"], rel=1e-6) and res["norm"] > 0.01
        assert res["scaled"]


SHARDED_KEYS = ["local", "param_groups", "rank", "shard_numels", "world_size"]  # FlatOSS's own, one per rank


def test_flat_oss_alone_clips_the_averaged_gradients_once(ranks):
    for r in ranks:
        res = ok(r["flat_alone_clipped"])
        assert max_abs_diff(res["params"], res["reference"]) <= ATOL["clipped"]
        assert res["norms"] == pytest.approx(res["reference_norms"], rel=1e-6) and min(res["norms"]) > 0.05
        assert res["reduce_scatters"] == 3 * res["buckets"]  # one per bucket and step: step() did not redo it


def test_consolidate_state_dict_recipient_and_all_ranks(ranks):
    oss, flat = ([ok(r["state_dict"])[name] for r in ranks] for name in ("oss", "flat"))
    # the full state is on the recipient only; elsewhere OSS says what to call, FlatOSS gives its shard
    assert "consolidate_state_dict" in oss[0]["recipient_1"]["error"]
    assert oss[1]["recipient_1"] == flat[1]["recipient_1"] == ["param_groups", "state"]
    assert flat[0]["recipient_1"] == SHARDED_KEYS
    assert oss[0]["to_0"] == ["param_groups", "state"] and "error" in oss[1]["to_0"]
    assert flat[0]["after_step"] == SHARDED_KEYS  # a step makes the consolidated state stale: the shard again
    for got in (oss, flat):  # all_ranks=True: the same full state on every rank
        assert got[0]["all_ranks"].keys() == got[1]["all_ranks"].keys() and got[0]["all_ranks"]
        for i, state in got[0]["all_ranks"].items():
            for k, v in state.items():
                assert torch.equal(got[1]["all_ranks"][i][k], v)


def test_wrapper_methods(ranks):
    got = [ok(r["methods"]) for r in ranks]
    for r, res in enumerate(got):
        assert res["positional"] == (None, False, False)
        assert res["non_blocking"] == [0.0] * 3 and res["blocking"] == [10.0] * 3  # rank 0's buffers
        assert "no gradients are waiting" in res["reduce_without_no_sync"]["error"]
        assert res["flat_zero_grad"] == (True, True)
        assert "size them there" in res["flat_reduce_buffer_size"]["error"]
        assert "give the bucket size once" in res["two_bucket_sizes"]["error"]
        assert res["flat_filter"]["error"].startswith("NotImplementedError: FlatOSS.clip_grad_norm(filter_params_fn")


# -- (c) trainability changes; FlatOSS without a wrapper keeps what it holds identical --------------------------
@pytest.mark.parametrize("case", [("oss", "auto"), ("oss", "quiet"), ("oss", "call"), ("flat", "auto"),
                                  ("flat", "call"), ("flat_alone", "call")], ids="-".join)
def test_freezing_and_unfreezing_mid_training_matches_a_plain_optimizer(ranks, case):
    """Every parameter the optimizer holds ends identical on every rank (the ranks built different weights),
    and equal, bit for bit, to SGD with momentum on DDP-averaged gradients, through a freeze and an unfreeze.
    FlatOSS alone: before refresh_trainable() existed, the layer frozen at step 2 kept moving (momentum, a
    zero gradient) and the one unfrozen was never stepped."""
    reference = ranks[0]["schedule"]["reference"]
    for r in ranks:
        got = ok(r["schedule"][case])
        assert max_abs_diff(got["params"], reference) == 0.0
        assert bool(got["warned"]) == (case[1] == "auto")  # auto_refresh_trainable re-planned, and said so
    assert max_abs_diff(reference, params_of(Net(seed=0))) > 1e-3


@pytest.mark.parametrize("strategy", ("oss", "flat_alone"))
def test_a_change_of_trainable_parameters_without_refresh_is_an_error(ranks, strategy):
    for r in ranks:
        error = r["schedule"][(strategy, "none")]["error"]
        assert "refresh_trainable()" in error
        assert ("'b.weight'" in error) if strategy == "oss" else ("(frozen)" in error and "(unfrozen)" in error)


# -- (d) OSS.step's contract, against torch's ZeroRedundancyOptimizer -------------------------------------------
def test_step_passes_keyword_arguments_and_a_closure_only_when_given(ranks):
    """FairScale's and torch's step(closure=None, **kwargs): the keyword arguments go on to the wrapped
    optimizer's step, and an optimizer whose step takes no closure is called without one."""
    for r in ranks:
        ours, theirs = r["step_contract"]["oss"], r["step_contract"]["torch_zero"]
        for case in ("kwargs", "closureless", "closure"):
            assert "error" not in ours[case], ours[case]
            assert max_abs_diff(ours[case]["params"], theirs[case]["params"]) == 0.0, case
        assert ours["closure"]["loss"] == theirs["closure"]["loss"]
        assert max_abs_diff(ours["kwargs"]["params"], ours["closureless"]["params"]) > 1e-4  # scale=0.5 acted


def test_keys_the_optimizer_adds_during_step_appear_in_param_groups(ranks):
    for r in ranks:
        for kind in ("oss", "torch_zero"):
            assert r["step_contract"][kind]["kwargs"]["groups"] == [0.5], kind


# -- (e) ShardedDataParallel's contract -----------------------------------------------------------------------
def test_unused_trainable_parameters_need_no_switch(ranks):
    """A head unused on every rank (step 0), on rank 0 only (step 1), used everywhere (step 2): as under
    torch's DDP with find_unused_parameters=True, bit for bit. Without the switch, as FairScale's buckets
    give, the head's owner gets a zero gradient where no rank used it (torch's: None; with momentum and no
    weight decay the step is the same); find_unused_parameters=True gives torch's None."""
    for rank, r in enumerate(ranks):
        ours, found, theirs = ok(r["head"]["sdp"]), ok(r["head"]["sdp_find_unused"]), ok(r["head"]["torch"])
        assert max_abs_diff(ours["params"], theirs["params"]) == 0.0
        assert max_abs_diff(found["params"], theirs["params"]) == 0.0
        assert theirs["head_grads"][0] is None and found["head_grads"][0] is None
        if rank == ours["owner"]:
            assert torch.equal(ours["head_grads"][0], torch.zeros(1, 3))
            for step in (1, 2):  # the average, where some rank used it
                assert torch.equal(ours["head_grads"][step], theirs["head_grads"][step])
        else:
            assert ours["head_grads"] == [None] * 3  # ZeRO-2: only the owner keeps it
    assert max_abs_diff(ranks[0]["head"]["torch"]["params"], params_of(HeadNet(seed=0))) > 1e-3


def test_a_list_of_sharded_optimizers(ranks):
    for r in ranks:
        res = ok(r["two_optimizers"])
        assert max_abs_diff(res["params"], res["reference"]) == 0.0
        assert "stepped twice" in res["overlapping"]["error"]


def test_ddp_attributes_and_the_modules_own(ranks):
    for r in ranks:
        for name, res in r["attributes"].items():
            assert res == {"is_multi_device_module": False, "device_type": "cpu", "banana": "sweet",
                           "orange": False, "module": True}, name


def test_a_gradient_that_requires_grad_is_refused(ranks):
    for r in ranks:
        for case, res in r["grad_grad"].items():
            assert res is not None and res["error"].startswith("RuntimeError: ShardedDataParallel only works with gradients that do "
                                           "not require grad"), (case, res)
