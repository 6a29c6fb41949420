"""Chapter 4, the flat design of ZeRO-2 (minifsdp/flat.py: FlatShardedDataParallel), proven against torch's DDP.

Tolerance policy (SPEC), against torch's DDP with a plain optimizer of the same class and hyper-parameters,
after 10 steps (ATOL below), for the reasons given in tests/test_ch03_flat.py:
- N = 1 and 2: bit-exact (one or two terms per sum; element-wise optimizers; params 64-byte aligned).
- N = 3 and 4: 1e-6. The reduce-scatter adds the N contributions in another order than DDP's all-reduce;
  measured after 10 steps: up to 1.2e-7.
Against ZeRO-1 in the same flat layout (FlatOSS alone) ZeRO-2 is bit-exact at every N, unused params and
all: the same reduce-scatter of the same flat gradients, only moved into backward.
The comparisons with torch use steps where every trainable param gets a gradient: the flat design steps a
param without one with a zero gradient, where torch's optimizers skip it (see flat.py).
"""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp import MemoryMeter, comm, launch
from minifsdp.models import count_params
from minifsdp.train import OPTIMIZER_SPECS, batch, build_model, loss_of, max_abs_diff
from minifsdp.zero.flat import FlatOSS
from minifsdp.zero.flat_sdp import FlatShardedDataParallel
from mixed_dtypes import EXACT, FLAT_BF16, MIXES, REORDERED, SGD, diff_by_dtype, torch_ddp, train_mixed, within
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
ATOL = {1: 0.0, 2: 0.0, 3: 1e-6, 4: 1e-6}  # see the module docstring
MODELS = ("gpt", "toy")
OPTIMS = ("sgd", "adamw")
STEPS = 10
GLOBAL_BATCH = 12
CAP_MB = {"gpt": 0.02, "toy": 0.001}  # several buckets each: the GPT has ~115 kB of params, the toy ~5 kB


def data(model, step, masked=False):
    # the toy's `extra` gets a gradient on every rank when step % 3 == 0; `masked` uses every step
    if model == "toy" and not masked:
        step = 3 * step
    return batch(model, step, GLOBAL_BATCH, dist.get_rank(), dist.get_world_size(), "cpu")


def param_groups(model, opt):
    """AdamW as GPT-2 trains it (no weight decay on biases and norms): two groups, whose buckets
    interleave in backward. SGD: one."""
    if opt == "sgd":
        return list(model.parameters())
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def build(strategy, model_name, opt_name):
    model = build_model(model_name, seed=dist.get_rank())  # different on each rank: the broadcast must fix it
    cls, kw = OPTIMIZER_SPECS[opt_name]
    if strategy == "torch_ddp":
        return model, TorchDDP(model), cls(param_groups(model, opt_name), **kw)
    optimizer = FlatOSS(param_groups(model, opt_name), optim=cls, bucket_cap_mb=CAP_MB[model_name], **kw)
    if strategy == "zero1":  # FlatOSS alone: what it does not hold (the frozen layer) is ours to sync
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    comm.broadcast(p, src=0)
        return model, model, optimizer
    return model, FlatShardedDataParallel(model, optimizer), optimizer


def run(strategy, model_name, opt_name, masked=False):
    model, wrapped, optimizer = build(strategy, model_name, opt_name)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model_name, wrapped, data(model_name, step, masked))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


# -- one launch per world size runs every case; the tests below read its results --------------------------------
def chapter_cases():
    # Tiny models gain nothing from intra-op threads, whose spin-waits cost ~10x the CPU on a busy machine.
    torch.set_num_threads(1)
    n = dist.get_world_size()
    out = {"parity": {}, "final": {}, "zero1": {}}
    for model in MODELS:
        for opt in OPTIMS:
            theirs, their_losses = run("torch_ddp", model, opt)
            ours, our_losses = run("zero2", model, opt)
            out["parity"][(model, opt)] = (max_abs_diff(ours, theirs), our_losses == their_losses)
            out["final"][(model, opt)] = ours
    # the toy's mask leaves `extra` unused on some ranks, or on all of them, in 2 steps out of 3
    for opt in OPTIMS:
        out["zero1"][opt] = max_abs_diff(run("zero2", "toy", opt, masked=True)[0],
                                         run("zero1", "toy", opt, masked=True)[0])
    out["measure"] = measure()
    out["accumulate"] = {how: (accumulate("zero2", how), accumulate("torch_ddp", how))
                         for how in ("no_sync", "twice")}
    if n == 2:
        out["bad"] = bad_input()
    if n in (2, 3):
        out["mixed"] = {mix: mixed_dtypes(mix) for mix in MIXES}
    return out


def mixed_dtypes(mix):
    """FlatShardedDataParallel over fp32 with fp64 (or bf16) layers (tests/mixed_dtypes.py), against torch's
    DDP with a plain SGD."""
    def flat_sdp(net):
        optimizer = FlatOSS(net.parameters(), optim=torch.optim.SGD, bucket_cap_mb=0.0005, **SGD)
        return FlatShardedDataParallel(net, optimizer), optimizer

    params = train_mixed(mix, flat_sdp)
    return {"params": params, "diff": diff_by_dtype(params, train_mixed(mix, torch_ddp))}


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("mix", MIXES)
def test_mixed_dtypes_are_reduce_scattered_each_in_its_own_dtype(ranks, n, mix):
    atol = {**(EXACT if n == 2 else REORDERED), torch.bfloat16: FLAT_BF16}  # see tests/mixed_dtypes.py
    for r in range(n):
        res = ranks[n][r]["mixed"][mix]
        assert max_abs_diff(res["params"], ranks[n][0]["mixed"][mix]["params"]) == 0.0
        assert within(res["diff"], atol), res["diff"]


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(chapter_cases, world_size=n, device="cpu"), WORLD_SIZES)


# -- parity ---------------------------------------------------------------------------------------------------
@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("opt", OPTIMS)
def test_matches_torch_ddp(ranks, n, model, opt):
    for r in range(n):
        diff, same_losses = ranks[n][r]["parity"][(model, opt)]
        assert diff <= ATOL[n], (
            f"rank {r} of {n}, {model} with {opt}: {diff:.3g} away from torch's DDP with a plain optimizer, allowed "
            f"{ATOL[n]:g}. Does each slice's gradient become the sum over the ranks of that slice, times 1/N, "
            f"added to a gradient already there? (exercise 4.2)")
        if ATOL[n] == 0.0:
            assert same_losses, f"rank {r} of {n}: the losses differ from torch's DDP's (exercise 4.2)"
        # every replica ends identical, though each rank built its model from a different seed
        spread = max_abs_diff(ranks[n][r]["final"][(model, opt)], ranks[n][0]["final"][(model, opt)])
        assert spread == 0.0, f"rank {r} ends {spread:.3g} away from rank 0's parameters (exercise 4.2)"
    assert max_abs_diff(ranks[n][0]["final"][(model, opt)], build_model(model, seed=0).state_dict()) > 1e-3


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_unused_params_do_not_hang_and_zero2_is_zero1_bit_for_bit(ranks, n):
    for r in range(n):
        diffs = ranks[n][r]["zero1"]
        assert diffs == {"sgd": 0.0, "adamw": 0.0}, (
            f"rank {r} of {n}: ZeRO-2 ends {diffs} away from the flat ZeRO-1 with the same buckets, where it must be "
            f"bit-exact: the same reduce-scatter, only moved into backward (exercise 4.2)")


# -- memory, communication, overlap -----------------------------------------------------------------------------
def measure():
    """The tiny GPT with AdamW: one step to build the state, then one measured step."""
    model = build_model("gpt", seed=0)
    cls, kw = OPTIMIZER_SPECS["adamw"]
    optimizer = FlatOSS(model.parameters(), optim=cls, bucket_cap_mb=CAP_MB["gpt"], **kw)
    meter = MemoryMeter(model, optimizer)  # before the wrapper: its hooks label each .grad before ours frees it
    ready_at = {}

    def stamp(name):
        def hook(p):
            ready_at.setdefault(name, time.perf_counter())
        return hook

    for name, p in model.named_parameters():  # before the wrapper's too: the moment each gradient is ready
        p.register_post_accumulate_grad_hook(stamp(name))
    wrapped = FlatShardedDataParallel(model, optimizer)
    names = {p: name for name, p in model.named_parameters()}
    out = {}
    for step in range(2):
        ready_at.clear()
        with comm.counting(record=True) as counter:
            loss_of("gpt", wrapped, data("gpt", step)).backward()
            out["after_backward"] = meter.live()
            out["full_grads"] = [name for name, p in model.named_parameters() if p.grad is not None]
            out["shard_grad_bytes"] = sum(b.shard.grad.numel() * 4 for b in optimizer.buckets)
            optimizer.step()
        out["after_step"] = meter.live()
        optimizer.zero_grad()
    meter.close()
    issued = [e.issued for e in counter.events if e.kind == "reduce_scatter"]
    return dict(out, bytes=dict(counter.bytes), calls=dict(counter.calls), psi=count_params(model),
                padded=[b.flat.numel() for b in optimizer.buckets],
                first_reduce_scatter_before_last_grad=bool(issued) and issued[0] < ready_at["wte.weight"],
                # in launch order (tag bucketK): the moment each of the bucket's gradients was ready
                ready=[[ready_at[names[p]] for p in b.params] for b in wrapped._flat_buckets],
                issued=[(e.tag, e.issued) for e in counter.events if e.kind == "reduce_scatter"],
                waits=[(w.tag, w.start) for w in counter.waits if w.tag.startswith("bucket")])


@pytest.mark.mechanism
@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bytes_per_step_are_ddps_up_to_padding(ranks, n):
    m = ranks[n][0]["measure"]
    half = 4 * sum(m["padded"]) * (n - 1) / n  # each half of the all-reduce: padded bytes x (N-1)/N
    sent = ", ".join(f"{kind} {b:,.0f} B" for kind, b in sorted(m["bytes"].items())) or "nothing"
    assert m["bytes"] == {"reduce_scatter": half, "all_gather": half}, (
        f"at N = {n} one step sent {sent}; expected a reduce-scatter of {half:,.0f} B in backward and an "
        f"all-gather of {half:,.0f} B in the step (the padded buckets, {sum(m['padded']):,} elements, times "
        f"4 B x (N-1)/N each). Is each bucket all-reduced and this rank's slice kept? The same average, for "
        f"twice the bytes (exercise 4.2)")
    buckets = len(m["padded"])
    assert m["calls"] == {"reduce_scatter": buckets, "all_gather": buckets}, (
        f"at N = {n} one step made {m['calls']} calls, expected one reduce-scatter and one all-gather per bucket "
        f"({buckets} buckets) (exercise 4.2)")
    ddp = 2 * 4 * m["psi"] * (n - 1) / n
    assert ddp <= 2 * half <= 1.05 * ddp  # DDP's 2Ψ(N-1)/N, plus the padding


@pytest.mark.mechanism
@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_each_rank_ends_backward_with_the_gradients_of_its_slice_only(ranks, n):
    for r in range(n):
        m = ranks[n][r]["measure"]
        shard_elements = sum(m["padded"]) // n
        full = m["full_grads"]
        assert full == [], (  # every full .grad was freed once its bucket was sent
            f"rank {r} of {n} ends backward with the full gradients of {len(full)} parameters "
            f"({', '.join(full[:3])}{' ...' if len(full) > 3 else ''}): each .grad must go once it is copied into "
            f"the flat input of its bucket's reduce-scatter (exercise 4.2)")
        assert m["shard_grad_bytes"] == 4 * shard_elements, (  # 4Ψ/N, plus the padding
            f"rank {r} of {n}: the slices' gradients hold {m['shard_grad_bytes']:,} B, expected "
            f"{4 * shard_elements:,} B, one gradient the size of this rank's slice per bucket (exercise 4.2)")
        assert m["after_backward"]["grads"] == m["shard_grad_bytes"], (  # and nothing else: the full ones are gone
            f"rank {r} of {n} holds {m['after_backward']['grads']:,} B of gradients after backward, expected only "
            f"its slices' {m['shard_grad_bytes']:,} B: is a full-size flat input, or a full-size result with the "
            f"slice cut out of it, still alive? (exercise 4.2)")
        assert 4 * m["psi"] / n <= m["shard_grad_bytes"] <= 1.05 * 4 * m["psi"] / n
        # and, as in ZeRO-1, the optimizer state of its slice only: exp_avg, exp_avg_sq, a step per slice
        assert m["after_step"]["optim"] == 8 * shard_elements + 4 * len(m["padded"])


@pytest.mark.mechanism
@pytest.mark.exercise("4.2")
def test_reduce_scatters_start_during_backward(ranks):
    # the first bucket (the last layers) went out before backward reached the embedding
    for n in WORLD_SIZES:
        assert len(ranks[n][0]["measure"]["padded"]) > 2
        assert ranks[n][0]["measure"]["first_reduce_scatter_before_last_grad"], (
            f"at N = {n} no reduce-scatter was issued before backward reached the embedding: each bucket's must go "
            f"out in backward, when the bucket is complete, not after backward (exercise 4.2)")


@pytest.mark.mechanism
@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_each_reduce_scatter_is_waited_for_only_once_the_next_bucket_is_computed(ranks, n):
    # asynchronous: bucket k's reduce-scatter travels while backward computes bucket k + 1's gradients, and
    # is waited for (a wait comm records, by tag) only when bucket k + 1 goes out -- not at once
    m = ranks[n][0]["measure"]
    tags = [tag for tag, _ in m["issued"]]
    assert tags == [f"bucket{k}" for k in range(len(m["padded"]))], (
        f"at N = {n} the reduce-scatters were tagged {tags}, expected bucket0 to bucket{len(m['padded']) - 1}, one "
        f"per bucket in launch order, tagged with its index (exercise 4.2)")
    for k, (tag, issued) in enumerate(m["issued"][:-1]):
        started = [t for w, t in m["waits"] if w == tag]
        early = [t - min(m["ready"][k + 1]) for t in started if t <= min(m["ready"][k + 1])]
        assert not early, (
            f"at N = {n} the reduce-scatter of {tag} was waited for {-min(early) * 1e3:.2f} ms before the first "
            f"gradient of bucket{k + 1} was ready: it must travel while backward computes the next bucket, and be "
            f"waited for only when that one goes out. Is it waited for at once, where it is issued? (exercise 4.2)")


# -- accumulation -----------------------------------------------------------------------------------------------
def accumulate(strategy, how):
    """Two micro-batches per step: the first inside no_sync(), or both synced (their gradients add up).

    Both synced, DDP all-reduces the sum (average of the first + this rank's second) while we add two
    reduced chunks: the same maths, another rounding, so that case is bit-exact only at N = 1.
    """
    model, wrapped, optimizer = build(strategy, "gpt", "sgd")
    n, r = dist.get_world_size(), dist.get_rank()
    kept = True
    with comm.counting() as counter:
        for step in range(3):
            x, y = batch("gpt", step, 8 * n, r, n, "cpu")
            with wrapped.no_sync() if how == "no_sync" else contextlib.nullcontext():
                (wrapped(x[:4], y[:4]) / 2).backward()
            kept &= all(p.grad is not None for p in model.parameters()) == (how == "no_sync")
            (wrapped(x[4:], y[4:]) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    sent = counter.calls.get("reduce_scatter", counter.calls.get("all_reduce", 0))
    return {k: v.clone() for k, v in model.state_dict().items()}, sent, kept


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("how", ("no_sync", "twice"))
def test_accumulation_matches_torch(ranks, n, how):
    (ours, sent, kept), (theirs, _, _) = ranks[n][0]["accumulate"][how]
    assert max_abs_diff(ours, theirs) <= (ATOL[n] if how == "no_sync" or n == 1 else 1e-6)
    assert kept  # inside no_sync() the full gradients stay; outside they are freed
    buckets = len(ranks[n][0]["measure"]["padded"])
    assert sent == buckets * 3 * (1 if how == "no_sync" else 2)  # nothing is sent inside no_sync()


# -- bad input ------------------------------------------------------------------------------------------------
def bad_input():
    def error(make):
        try:
            make()
        except (TypeError, ValueError) as e:
            return type(e).__name__, str(e)
        return None

    model, other = build_model("toy", seed=0), build_model("toy", seed=0)
    return {
        "plain_optimizer": error(lambda: FlatShardedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))),
        "other_params": error(lambda: FlatShardedDataParallel(
            model, FlatOSS(other.parameters(), lr=0.1, bucket_cap_mb=0.001))),
        "one_bucket": error(lambda: FlatShardedDataParallel(model, FlatOSS(model.parameters(), lr=0.1))),
    }


def test_bad_input_is_a_clear_error(ranks):
    bad = ranks[2][0]["bad"]
    kind, message = bad["plain_optimizer"]
    assert kind == "TypeError" and "needs a FlatOSS" in message and "SGD" in message
    kind, message = bad["other_params"]
    assert kind == "ValueError" and "'inp.weight'" in message and "not in the FlatOSS" in message
    kind, message = bad["one_bucket"]
    assert kind == "ValueError" and "bucket_cap_mb" in message
