"""Chapter 3, the flat design of ZeRO-1 (minifsdp/flat.py: FlatOSS), proven against torch's DDP.

Tolerance policy (SPEC), against torch's DDP with a plain optimizer of the same class and hyper-parameters,
after 10 steps (ATOL below):
- N = 1 and 2: bit-exact. The sum of the gradients has one or two terms, and a + b is commutative, so
  the reduce-scatter and the all-reduce give the same bits; both sides scale by x * (1/N) first. Two
  things make the rest of the arithmetic identical too: the optimizers are element-wise (SGD with
  momentum, AdamW), so stepping a flat slice instead of per-parameter tensors changes no rounding; and
  each param starts 64-byte aligned in the flat buffer, as in a tensor of its own (the CPU matrix
  kernels round differently on unaligned data: packed end to end, the toy model ends ~1e-8 off at N = 2).
- N = 3 and 4: 1e-6. The reduce-scatter adds the N contributions in another order than DDP's all-reduce
  (whose buckets lay the gradients out differently), so each step differs by a few ulps. Measured after
  10 steps: up to 1.2e-7 (AdamW on the tiny GPT), 3e-8 with SGD.
The cases are those where every trainable parameter gets a gradient in every step: the flat design
steps a parameter without gradient with a zero one, where torch's optimizers skip it (see flat.py).
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp import MemoryMeter, comm, launch
from minifsdp.models import count_params
from minifsdp.train import OPTIMIZER_SPECS, batch, build_model, loss_of, max_abs_diff
from minifsdp.zero.flat import ALIGN_BYTES, FlatOSS
from mixed_dtypes import EXACT, FLAT_BF16, MIXES, REORDERED, SGD, diff_by_dtype, torch_ddp, train_mixed, within
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
ATOL = {1: 0.0, 2: 0.0, 3: 1e-6, 4: 1e-6}  # see the module docstring
MODELS = ("gpt", "toy")   # tiny GPT with tied embeddings; toy: odd shapes, a tied weight, a frozen layer
OPTIMS = ("sgd", "adamw")
STEPS = 10
GLOBAL_BATCH = 12         # divides by 1, 2, 3 and 4
BUCKET_CAP_MB = 0.02      # several buckets for the tiny GPT (~115 kB of parameters)
CAPS = {"gpt": (None, BUCKET_CAP_MB), "toy": (None,)}  # the toy (5 kB) is one bucket at any cap


def param_groups(model, opt):
    """AdamW as GPT-2 trains it (no weight decay on biases and norms): two groups. SGD: one."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if opt == "sgd":
        return trainable
    return [{"params": [p for p in trainable if p.dim() >= 2]},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def data(model, step):
    # toy_batch's mask uses `extra` on every sample when step % 3 == 0: every param gets a gradient
    return batch(model, 3 * step if model == "toy" else step, GLOBAL_BATCH, dist.get_rank(), dist.get_world_size(),
                 "cpu")


def padding(bucket):
    """The elements of a bucket's flat buffer that no param views."""
    mask = torch.ones(bucket.flat.numel(), dtype=torch.bool)
    for p, offset in zip(bucket.params, bucket.offsets):
        mask[offset: offset + p.numel()] = False
    return bucket.flat[mask]


def sync_the_rest(model):
    """FlatOSS broadcasts the params it steps; what it does not hold (a frozen layer, buffers) is ours to sync."""
    with torch.no_grad():
        for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
            comm.broadcast(t, src=0)


def run(strategy, model_name, opt_name, steps=STEPS, bucket_cap_mb=None, start=None, resume=None, first=0,
        save_at=None):
    """Train steps first..first+steps-1; return final params, losses, the optimizer, and what was saved
    (params and optimizer.state_dict()) once `save_at` steps were done."""
    model = build_model(model_name, seed=dist.get_rank())  # different on each rank: the broadcast must fix it
    if start is not None:
        model.load_state_dict(start)
    cls, kw = OPTIMIZER_SPECS[opt_name]
    if strategy == "torch_ddp":
        wrapped = TorchDDP(model)
        optimizer = cls(param_groups(model, opt_name), **kw)
    else:
        sync_the_rest(model)
        wrapped = model
        optimizer = FlatOSS(param_groups(model, opt_name), optim=cls, bucket_cap_mb=bucket_cap_mb, **kw)
    if resume is not None:
        optimizer.load_state_dict(resume)
    # SGD runs with a decaying LR: the scheduler writes FlatOSS.param_groups, which must reach the slices.
    scheduler = None if opt_name != "sgd" else torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1.0 / (1 + 0.3 * s), last_epoch=first - 1)
    losses, saved = [], None
    for step in range(first, first + steps):
        loss = loss_of(model_name, wrapped, data(model_name, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler:
            scheduler.step()
        losses.append(loss.item())
        if step + 1 == save_at:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, "losses": losses, "optimizer": optimizer, "saved": saved}


def state_diff(a, b):
    """Largest |a - b| over two torch-format optimizer state dicts, after checking they have the same shape."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    diff = 0.0
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k, v in a["state"][i].items():
            assert v.shape == b["state"][i][k].shape
            diff = max(diff, (v.float() - b["state"][i][k].float()).abs().max().item())
    return diff


# -- one launch per world size runs every case; the tests below read its results --------------------------------
def chapter_cases():
    # Tiny models gain nothing from intra-op threads, whose spin-waits cost ~10x the CPU on a busy machine.
    torch.set_num_threads(1)
    out = {"parity": {}, "final": {}, "consolidated": {}, "padding": {}, "resume": {}}
    for model in MODELS:
        for opt in OPTIMS:
            ref = run("torch_ddp", model, opt, save_at=STEPS // 2)
            for cap in CAPS[model]:
                ours = run("flat", model, opt, bucket_cap_mb=cap, save_at=STEPS // 2)
                out["parity"][(model, opt, cap)] = (max_abs_diff(ours["params"], ref["params"]),
                                                    ours["losses"] == ref["losses"])
                out["final"][(model, opt, cap)] = ours["params"]
                out["consolidated"][(model, opt, cap)] = state_diff(ours["optimizer"].consolidated_state_dict(),
                                                                    ref["optimizer"].state_dict())
                out["padding"][(model, opt, cap)] = all(not padding(b).any() for b in ours["optimizer"].buckets)
            if model == "gpt":
                out["resume"][opt] = resume(opt, ours, ref)
    out["layout"] = {cap: layout(cap) for cap in (None, BUCKET_CAP_MB)}
    out["measure"] = {opt: measure(opt) for opt in OPTIMS}
    if dist.get_world_size() in (2, 3):
        out["mixed"] = {mix: mixed_dtypes(mix) for mix in MIXES}
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(chapter_cases, world_size=n, device="cpu"), WORLD_SIZES)


# -- parity with torch's DDP -----------------------------------------------------------------------------------
@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("opt", OPTIMS)
def test_matches_torch_ddp(ranks, n, model, opt):
    for cap in CAPS[model]:
        for r in range(n):
            diff, same_losses = ranks[n][r]["parity"][(model, opt, cap)]
            assert diff <= ATOL[n], (
                f"rank {r} of {n}, {model} with {opt}, bucket_cap_mb={cap}: {diff:.3g} away from torch's DDP with "
                f"a plain optimizer, allowed {ATOL[n]:g}. Is each slice's gradient the average (times 1/N) of "
                f"that slice across the ranks, and are the stepped slices gathered back into every buffer? "
                f"(exercise 3.3)")
            if ATOL[n] == 0.0:
                assert same_losses, f"rank {r} of {n}: the losses differ from torch's DDP's (exercise 3.3)"
            # every replica ends identical, though each rank built its model from a different seed
            final = ranks[n][r]["final"][(model, opt, cap)]
            spread = max_abs_diff(final, ranks[n][0]["final"][(model, opt, cap)])
            assert spread == 0.0, (f"rank {r} ends {spread:.3g} away from rank 0's parameters: every replica "
                                   f"must get every rank's stepped slice (exercise 3.3)")
    # the training really moved the weights, so equality means something
    assert max_abs_diff(ranks[n][0]["final"][(model, opt, None)], build_model(model, seed=0).state_dict()) > 1e-3


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_padding_stays_zero(ranks, n):
    for r in range(n):
        dirty = [case for case, clean in ranks[n][r]["padding"].items() if not clean]
        assert not dirty, (f"rank {r} of {n}: the padding of the flat buffers is no longer zero after training, in "
                           f"{dirty}: does every slice of the buffer get the gathered values? (exercise 3.3)")


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_consolidated_state_dict_is_a_torch_optimizers(ranks, n):
    # same indices, same param groups (hyper-parameters, and the lr the scheduler set), and per-parameter
    # state cut back out of the flat slices, equal to the state torch's optimizer built under DDP
    for r in range(n):
        for case, diff in ranks[n][r]["consolidated"].items():
            assert diff <= ATOL[n], case


# -- parameters of several dtypes: a flat buffer per dtype ------------------------------------------------------
def mixed_dtypes(mix):
    """FlatOSS over fp32 with fp64 (or bf16) layers in one param group (tests/mixed_dtypes.py), one bucket
    per dtype and several, against torch's DDP with a plain SGD; and its buckets' dtypes."""
    reference = train_mixed(mix, torch_ddp)
    out = {}
    for cap in (None, 0.0005):
        optimizers = []

        def flat(net):
            optimizers.append(FlatOSS(net.parameters(), optim=torch.optim.SGD, bucket_cap_mb=cap, **SGD))
            return net, optimizers[0]

        params = train_mixed(mix, flat)
        out[cap] = {"params": params, "diff": diff_by_dtype(params, reference),
                    "buckets": [({p.dtype for p in b.params}, b.flat.dtype) for b in optimizers[0].buckets],
                    "padding": all(not padding(b).any() for b in optimizers[0].buckets)}
    return out


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("mix", MIXES)
def test_a_group_of_mixed_dtypes_gets_a_flat_buffer_per_dtype(ranks, n, mix):
    """Each element travels and is stepped in its own dtype: identical replicas, torch's DDP's numbers
    (bit for bit at N = 2 but for bf16's kernels, see tests/mixed_dtypes.py)."""
    atol = {**(EXACT if n == 2 else REORDERED), torch.bfloat16: FLAT_BF16}
    for r in range(n):
        for cap, res in ranks[n][r]["mixed"][mix].items():
            assert max_abs_diff(res["params"], ranks[n][0]["mixed"][mix][cap]["params"]) == 0.0, cap
            assert within(res["diff"], atol), (cap, res["diff"])
            assert all(dtypes == {flat} for dtypes, flat in res["buckets"]), res["buckets"]
            assert (len(res["buckets"]) == 2 if cap is None else len(res["buckets"]) > 2) and res["padding"]


# -- the layout: aligned, padded, equal shards; frozen params out; tied params once ----------------------------
def layout(cap):
    out = {}
    for name in MODELS:
        model = build_model(name, seed=0)
        opt = FlatOSS(model.parameters(), optim=torch.optim.SGD, bucket_cap_mb=cap, lr=0.1)
        names = {p: k for k, p in model.named_parameters()}
        out[name] = {
            "buckets": [{"names": [names[p] for p in b.params], "offsets": b.offsets,
                         "numels": [p.numel() for p in b.params], "padded": b.flat.numel(), "start": b.start,
                         "chunk": b.shard.numel()} for b in opt.buckets],
            "psi": count_params(model, trainable_only=True),
            "views": all(p.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
                         for b in opt.buckets for p in b.params),
        }
    return out


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("cap", (None, BUCKET_CAP_MB), ids=("one_bucket", "buckets"))
def test_layout_is_flat_aligned_padded_and_evenly_sharded(ranks, n, cap):
    align = ALIGN_BYTES // 4
    unit = math.lcm(align, n)
    for model in MODELS:
        mine = [r["layout"][cap][model] for r in ranks[n]]
        buckets = mine[0]["buckets"]
        names = [name for b in buckets for name in b["names"]]
        assert "frozen.weight" not in names  # never laid out, never communicated
        assert len(names) == len(set(names))  # the tied weight once
        assert sum(sum(b["numels"]) for b in buckets) == mine[0]["psi"]
        if cap is None:
            assert len(buckets) == 1  # one bucket per group: rank r owns the r-th contiguous 1/N
        elif model == "gpt":
            assert len(buckets) > 2
        for r, rank_layout in enumerate(mine):
            assert rank_layout["views"]  # the params live in the flat buffer
            for b in rank_layout["buckets"]:
                assert b["padded"] % n == 0 and b["chunk"] == b["padded"] // n and b["start"] == r * b["chunk"]
                end = 0
                for offset, numel in zip(b["offsets"], b["numels"]):
                    assert offset % align == 0 and 0 <= offset - end < align  # aligned, the least gap
                    end = offset + numel
                assert b["padded"] % unit == 0 and 0 <= b["padded"] - end < unit
        # load balance: the real elements a rank owns differ from another rank's by at most the padding
        owned = [sum(max(0, min(o + k, (r + 1) * b["chunk"]) - max(o, r * b["chunk"]))
                     for b in buckets for o, k in zip(b["offsets"], b["numels"])) for r in range(n)]
        pad = sum(b["padded"] - sum(b["numels"]) for b in buckets)
        assert sum(owned) == mine[0]["psi"]
        assert max(owned) - min(owned) <= pad


# -- memory and communication ---------------------------------------------------------------------------------
def measure(opt_name):
    """Two steps of the tiny GPT under FlatOSS: bytes sent by the second, and what this rank then holds."""
    model = build_model("gpt", seed=0)
    cls, kw = OPTIMIZER_SPECS[opt_name]
    opt = FlatOSS(model.parameters(), optim=cls, bucket_cap_mb=BUCKET_CAP_MB, **kw)
    meter = MemoryMeter(model, opt)
    for step in range(2):
        loss_of("gpt", model, data("gpt", step)).backward()
        with comm.counting() as counter:
            opt.step()
        if step == 0:
            opt.zero_grad()
    after = meter.live()
    meter.close()
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "meter": after,
            "padded": [b.flat.numel() for b in opt.buckets],
            "full_grad_bytes": sum(p.grad.numel() * 4 for p in model.parameters()),
            "shard_grad_bytes": sum(b.shard.grad.numel() * 4 for b in opt.buckets),
            "psi": count_params(model)}


@pytest.mark.mechanism
@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", OPTIMS)
def test_bytes_per_step_are_ddps_up_to_padding(ranks, n, opt):
    m = ranks[n][0]["measure"][opt]
    half = 4 * sum(m["padded"]) * (n - 1) / n  # each half of the all-reduce: padded bytes x (N-1)/N
    sent = ", ".join(f"{kind} {b:,.0f} B" for kind, b in sorted(m["bytes"].items())) or "nothing"
    assert m["bytes"] == {"reduce_scatter": half, "all_gather": half}, (
        f"at N = {n} one step sent {sent}; expected a reduce-scatter of {half:,.0f} B and an all-gather of "
        f"{half:,.0f} B (the padded buckets, {sum(m['padded']):,} elements, times 4 B x (N-1)/N each): DDP's bytes. "
        f"Is the gradient all-reduced and this rank's slice kept? That computes the same average for twice the "
        f"bytes (exercise 3.3)")
    buckets = len(m["padded"])
    assert m["calls"] == {"reduce_scatter": buckets, "all_gather": buckets}, (
        f"at N = {n} one step made {m['calls']} calls, expected one reduce-scatter and one all-gather per bucket "
        f"({buckets} buckets) (exercise 3.3)")
    ddp = 2 * 4 * m["psi"] * (n - 1) / n
    assert ddp <= 2 * half <= ddp * 1.05  # DDP's 2Ψ(N-1)/N, plus the padding


@pytest.mark.mechanism
@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", OPTIMS)
def test_each_rank_holds_the_state_of_its_slice_only(ranks, n, opt):
    for r in range(n):
        m = ranks[n][r]["measure"][opt]
        shard_elements = sum(m["padded"]) // n
        # SGD: a momentum buffer per slice; AdamW: exp_avg, exp_avg_sq, and a 4-byte step per slice
        expected = 4 * shard_elements if opt == "sgd" else 8 * shard_elements + 4 * len(m["padded"])
        assert m["meter"]["optim"] == expected, (
            f"rank {r} of {n} holds {m['meter']['optim']:,} B of {opt} state, expected {expected:,} B, the state of "
            f"its slice of each bucket ({shard_elements:,} elements): does the local optimizer step the slices "
            f"(exercise 3.3)?")
        per_element = 4 if opt == "sgd" else 8  # ... that is 4Ψ/N or 8Ψ/N, plus the padding and the steps
        assert per_element * m["psi"] / n <= expected <= 1.05 * per_element * m["psi"] / n + 4 * len(m["padded"])
        # ZeRO-1 keeps the full gradients (4Ψ), and adds the reduced slice (4Ψ/N plus padding); the meter
        # counts both as gradients (the slice is the gradient of what the optimizer steps)
        assert m["full_grad_bytes"] == 4 * m["psi"]
        assert m["shard_grad_bytes"] == 4 * shard_elements, (
            f"rank {r} of {n}: the slices' gradients hold {m['shard_grad_bytes']:,} B, expected "
            f"{4 * shard_elements:,} B, one gradient the size of its slice per bucket (exercise 3.3)")
        assert m["meter"]["grads"] == m["full_grad_bytes"] + m["shard_grad_bytes"], (
            f"rank {r} of {n} holds {m['meter']['grads']:,} B of gradients after the step, expected the full "
            f"{m['full_grad_bytes']:,} B plus the slices' {m['shard_grad_bytes']:,} B: is a full-size reduced copy "
            f"kept alive behind the slice's gradient (exercise 3.3)?")


# -- checkpoints ---------------------------------------------------------------------------------------------
def resume(opt, whole, reference):
    """Restart the tiny GPT from what was saved half way: the same as never stopping (`whole`)."""
    first = STEPS // 2
    params, sharded = whole["saved"]
    again = run("flat", "gpt", opt, steps=STEPS - first, bucket_cap_mb=BUCKET_CAP_MB, start=params,
                resume=sharded, first=first)
    # a plain torch optimizer's state dict (from DDP), cut into the flat slices
    params, plain = reference["saved"]
    from_torch = run("flat", "gpt", opt, steps=STEPS - first, bucket_cap_mb=BUCKET_CAP_MB, start=params,
                     resume=plain, first=first)
    return {"sharded": max_abs_diff(again["params"], whole["params"]),
            "from_torch": max_abs_diff(from_torch["params"], whole["params"]), "keys": sorted(sharded)}


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", OPTIMS)
def test_state_dict_round_trips(ranks, n, opt):
    for r in range(n):
        got = ranks[n][r]["resume"][opt]
        assert got["keys"] == ["local", "param_groups", "rank", "shard_numels", "world_size"]
        assert got["sharded"] == 0.0
        assert got["from_torch"] <= ATOL[n]


def frozen_weights_after_construction():
    torch.manual_seed(dist.get_rank())  # each rank builds different weights
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    FlatOSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    return [p.detach().clone() for p in model.parameters()]


def test_frozen_parameters_it_is_given_start_as_rank_0s():
    """Used without DDP, FlatOSS is what makes the replicas equal: the frozen ones too, not only those it
    lays out (before: each rank kept its own frozen weights, silently)."""
    first, second = launch(frozen_weights_after_construction, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
