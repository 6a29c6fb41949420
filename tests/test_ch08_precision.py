"""Chapter 8: mixed precision (bf16, fp16 with a loss scaler) and CPU offload, for DDP, OSS, SDP and FSDP.

The reference for low precision is not fp32 with a loose tolerance but one process that makes the same
casts (train.py's _emulated_backward): every rank's slice computed with a param_dtype cast of the fp32
parameters, each rank's gradient cast to reduce_dtype and multiplied by 1/N, the N added in rank order in
reduce_dtype, the fp32 step. Tolerances:
- N = 1, 2: bit-exact. Two addends sum the same in any order.
- N = 3, 4: gloo adds the N gradients in an order that depends on the element's position in the buffer,
  not in rank order. Reduced in bf16 / fp16, each addition rounds to 8 (or 11) bits: up to 2^-8 of a
  gradient element. Reduced in fp32 the sums differ only in the last fp32 bit (4e-9 measured with SGD) --
  but the next step casts the parameters to bf16 again, and a parameter that moved by one fp32 bit across
  a bf16 rounding boundary computes with a value one bf16 step (2^-8 relative) away. So both get the same
  bounds: SGD 1e-3 (measured about 1e-4 after 3 steps). AdamW's step is about lr whatever the gradient's
  size, so an element whose tiny gradient rounds to the other sign moves up to 2 lr further per step:
  2 lr x steps.
torch's FSDP2 (fully_shard with MixedPrecisionPolicy) on the same model gets the same bounds.

Two steps a run: the second steps on optimizer state and, with a scaler, on a scale it grew after the first.
(The bounds above were measured over three steps.) The scaler's agreement across ranks takes three steps of
its own: a clean one, one that overflows, and one after the back-off. CPU offload is trained with both
optimizers in fp32 and with SGD in bf16: what bf16 adds to offload is the cast of the copied shard and the
bf16 gradient copied back, which the optimizer never sees (it steps the fp32 shards in either precision).
For the same reason bf16 reduced in fp32 trains each strategy with one optimizer (SGD where the bytes tests
read it: FSDP, DDP, SDP; AdamW for OSS and torch's FSDP2): reduce_dtype changes how the gradients are summed,
and the optimizer receives fp32 gradients under either bf16 policy, so what it adds was shown in plain bf16,
where every strategy trains with both.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from minifsdp import comm, launch
from minifsdp.ddp import DistributedDataParallel as DDP
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import ModuleWrapPolicy
from minifsdp.mixed_precision import CPUOffload, MixedPrecision, ShardedGradScaler
from minifsdp.models import Block, TinyGPT
from minifsdp.train import OPTIMIZER_SPECS, batch, loss_of, max_abs_diff, train
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 2
AGREEMENT_STEPS = 3  # scaler_agreement: before, at and after the overflow
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
POLICIES = {"bf16": MixedPrecision(param_dtype=BF16), "bf16_reduce_fp32": MixedPrecision(BF16, reduce_dtype=F32),
            "fp16": MixedPrecision(param_dtype=F16)}
SCALER = dict(init_scale=2.0 ** 12, growth_interval=1)  # grows after the first step: the schedule is exercised
STRATEGIES = ("fsdp", "ddp", "oss", "sdp", "torch_fsdp2")
LOW = {"sgd": 1e-3, "adamw": 2 * OPTIMIZER_SPECS["adamw"][1]["lr"] * STEPS}  # N = 3, 4 only: see above


def _policy_runs(policy):
    if policy == "bf16_reduce_fp32":  # one optimizer each (see above)
        return [("fsdp", "sgd"), ("ddp", "sgd"), ("sdp", "sgd"), ("oss", "adamw"), ("torch_fsdp2", "adamw")]
    return [(s, opt) for s in STRATEGIES for opt in ("sgd", "adamw")
            if not (policy == "fp16" and s == "torch_fsdp2")]  # FSDP2 has no sharded scaler of ours


def _kwargs(policy, opt):
    kw = dict(optimizer=opt, steps=STEPS, measure=False, mixed_precision=POLICIES[policy])
    if policy == "fp16":
        kw["scaler"] = SCALER
    return kw


def emulated_cases(n):
    """The references, in one process playing n ranks."""
    return {(policy, opt): train("emulated", emulate_world_size=n, **_kwargs(policy, opt))
            for policy in POLICIES for opt in ("sgd", "adamw")}


def scaler_agreement():
    """FSDP in fp16; in step 1 one gradient element overflows on rank 0 only: the element's owner (rank 0)
    sees the inf in its shard, the other ranks see finite shards -- and must skip the step all the same."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=POLICIES["fp16"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = ShardedGradScaler(init_scale=2.0 ** 12)
    flat = model.flat_params[0]  # the root's: its element 0 is in rank 0's shard
    step_now = [0]

    def overflow(grad):
        if step_now[0] == 1 and r == 0:
            grad = grad.clone()
            grad[0] = float("inf")
        return grad

    flat.param.register_hook(overflow)
    taken = []  # the steps this rank's optimizer really took
    opt.register_step_post_hook(lambda *args: taken.append(step_now[0]))
    scales, sent, reductions = [], [], []
    all_reduce = comm.all_reduce

    def seen(tensor, op=comm.ReduceOp.SUM, *args, **kwargs):  # which reduction, of how many numbers, how wide
        reductions.append((str(op).rsplit(".", 1)[-1], tensor.numel(), tensor.element_size()))
        return all_reduce(tensor, op, *args, **kwargs)

    for step in range(AGREEMENT_STEPS):
        step_now[0] = step
        scaler.scale(loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu"))).backward()
        comm.all_reduce = seen
        try:
            with comm.counting() as counter:
                scaler.step(opt)
        finally:
            comm.all_reduce = all_reduce
        sent.append((dict(counter.calls), dict(counter.bytes)))
        scales.append(scaler.get_scale())
        scaler.update()
        opt.zero_grad()
    return {"local": scaler.local_found_inf, "scales": scales, "taken": taken, "sent": sent,
            "reductions": reductions}


def fp16_without_scaler_warns():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("fsdp", "ddp", "fsdp_bf16"):
        policy = POLICIES["bf16" if kind == "fsdp_bf16" else "fp16"]
        net = TinyGPT()
        model = DDP(net, mixed_precision=policy) if kind == "ddp" else \
            FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=policy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_of("gpt", model, batch("gpt", 0, 12, r, n, "cpu")).backward()
            scaled = ShardedGradScaler().scale(loss_of("gpt", model, batch("gpt", 1, 12, r, n, "cpu")))
            n_before = len(caught)
            scaled.backward()
        out[kind] = ([str(w.message) for w in caught[:n_before]], len(caught) - n_before)
    return out


def master_state_dict():
    """summon_full_params / full_state_dict give the fp32 masters, and writing them back keeps them."""
    model = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=POLICIES["bf16"])
    before = model.full_state_dict()
    edited = {k: v + 1e-3 for k, v in before.items()}  # not representable in bf16: lost if cast anywhere
    model.load_full_state_dict(edited)
    return {"dtypes": {str(v.dtype) for v in before.values()}, "before": before, "after": model.full_state_dict(),
            "edited": edited, "reference": TinyGPT().state_dict()}


def chapter_cases():
    out = {}
    for policy in POLICIES:
        for s, opt in _policy_runs(policy):
            out[(policy, s, opt)] = train(s, **_kwargs(policy, opt))
    for opt in ("sgd", "adamw"):  # CPU offload: bit-exact against the same run without it; bytes copied
        # the memory meter only where a test reads memory: fp32 with AdamW (16 bytes per parameter)
        out[("fp32", "fsdp", opt)] = train("fsdp", optimizer=opt, steps=STEPS, measure=opt == "adamw")
        out[("fp32_offload", "fsdp", opt)] = train("fsdp", optimizer=opt, steps=STEPS, measure=False,
                                                  cpu_offload=CPUOffload(offload_params=True))
    out[("bf16_offload", "fsdp", "sgd")] = train("fsdp", optimizer="sgd", steps=STEPS, measure=False,
                                                mixed_precision=POLICIES["bf16"],
                                                cpu_offload=CPUOffload(offload_params=True))
    out[("bf16_measured", "fsdp")] = train("fsdp", optimizer="adamw", steps=STEPS, mixed_precision=POLICIES["bf16"])
    model = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    out["units"] = [(u is model, [f.shard_numel for f in u.flat_params]) for u in model.units()]
    out["agreement"] = scaler_agreement()
    out["warnings"] = fp16_without_scaler_warns()
    out["masters"] = master_state_dict()
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(chapter_cases, world_size=n, device="cpu"), WORLD_SIZES)


@pytest.fixture(scope="module")
def reference():
    return PerWorldSize(lambda n: launch(emulated_cases, world_size=1, args=(n,), device="cpu")[0], WORLD_SIZES)


# -- parity ---------------------------------------------------------------------------------------------------

@pytest.mark.exercise("8.1", "8.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_low_precision_equals_the_emulated_casts(ranks, reference, n, policy):
    for s, opt in _policy_runs(policy):
        tol = 0.0 if n <= 2 else LOW[opt]
        for r in range(n):
            got, ref = ranks[n][r][(policy, s, opt)], reference[n][(policy, opt)]
            diff = max_abs_diff(got["params"], ref["params"])
            assert diff <= tol, f"{s} {opt} rank {r}: {diff:.3g} > {tol}"
            if policy == "fp16":  # the scaler took the same decisions as the reference's
                assert got["scales"] == ref["scales"] and got["skipped"] == ref["skipped"], (
                    f"{s} {opt} rank {r}: scales {got['scales']} and skipped steps {got['skipped']}, expected "
                    f"{ref['scales']} and {ref['skipped']} (exercise 8.2)")
                assert ref["scales"][-1] > ref["scales"][0]  # and the schedule moved: it grew


@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_low_precision_really_is_low(ranks, n):
    """Not fp32 in disguise: bf16 and fp32 training end up measurably apart (fp32 at N = 3, 4 differs from
    itself by reduction order only at the 1e-9 level)."""
    bf16, fp32 = ranks[n][0][("bf16", "fsdp", "sgd")], ranks[n][0][("fp32", "fsdp", "sgd")]
    diff = max_abs_diff(bf16["params"], fp32["params"])
    assert diff > 1e-5, (f"rank 0 of {n}: bf16 and fp32 training ended {diff:.3g} apart, expected more than 1e-5 "
                         f"(exercise 8.1): is the shard sent in param_dtype, or still in fp32?")


@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_cpu_offload_changes_no_value(ranks, n, policy):
    for opt in ("sgd", "adamw") if policy == "fp32" else ("sgd",):
        plain = ranks[n][0][(policy if policy == "fp32" else "bf16", "fsdp", opt)]
        offloaded = ranks[n][0][(f"{policy}_offload", "fsdp", opt)]
        diff = max_abs_diff(plain["params"], offloaded["params"])
        assert diff == 0.0, (f"{policy}, {opt}, rank 0 of {n}: offloading moved the parameters by up to {diff:.3g}, "
                             f"expected 0 (exercise 8.1): the shard is copied as it is, and cast on the device")


# -- bytes ------------------------------------------------------------------------------------------------------

@pytest.mark.mechanism
@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("n", [2, 3, 4])
def test_bf16_halves_the_bytes_it_should(ranks, n):
    res = ranks[n][0]
    fp32 = res[("fp32", "fsdp", "sgd")]["comm_bytes"]
    bf16, bf16_f32 = res[("bf16", "fsdp", "sgd")]["comm_bytes"], res[("bf16_reduce_fp32", "fsdp", "sgd")]["comm_bytes"]
    assert bf16["all_gather"] * 2 == fp32["all_gather"], (  # the shard is cast before it is sent
        f"rank 0 of {n}: FSDP's all-gathers carried {bf16['all_gather']:,.0f} B in bf16 and "
        f"{fp32['all_gather']:,.0f} B in fp32, expected exactly half (exercise 8.1): is the shard cast to "
        f"param_dtype before it is sent, rather than the gathered buffer afterwards?")
    assert bf16_f32["all_gather"] == bf16["all_gather"], (
        f"rank 0 of {n}: the all-gathers carried {bf16_f32['all_gather']:,.0f} B with reduce_dtype=fp32 and "
        f"{bf16['all_gather']:,.0f} B without, expected the same: param_dtype alone sets what is gathered "
        f"(exercise 8.1)")
    # the gradients: chapter 8's reduce_scatter_grad and the replicas' buckets, not an exercise
    assert bf16["reduce_scatter"] * 2 == fp32["reduce_scatter"], (
        f"rank 0 of {n}: reduce-scatters of {bf16['reduce_scatter']:,.0f} B in bf16, "
        f"{fp32['reduce_scatter']:,.0f} B in fp32: expected half, the gradients averaged in reduce_dtype")
    assert bf16_f32["reduce_scatter"] == fp32["reduce_scatter"], (  # reduce_dtype=fp32: full size
        f"rank 0 of {n}: reduce-scatters of {bf16_f32['reduce_scatter']:,.0f} B with reduce_dtype=fp32, "
        f"{fp32['reduce_scatter']:,.0f} B in fp32: expected the same")
    for s, kind in (("ddp", "all_reduce"), ("sdp", "reduce")):  # their buckets, cast to reduce_dtype
        low, high = (res[(policy, s, "sgd")]["comm_bytes"][kind] for policy in ("bf16", "bf16_reduce_fp32"))
        assert low * 2 == high, (f"rank 0 of {n}: {s}'s {kind}s carried {low:,.0f} B reduced in bf16, {high:,.0f} "
                                 f"B in fp32: expected half")


@pytest.mark.mechanism
@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_all_gather_carries_param_dtype_bytes(ranks, n):
    """The shard is cast before it is sent: every all-gather of a step (the root's once, each block's in forward
    and again in backward) carries 2 bytes per element of the padded flat parameter in bf16, as many all-gathers
    as in fp32, and nothing else goes on the wire but the gradients' reduce-scatters."""
    units = ranks[n][0]["units"]
    gathers = sum(len(shards) * (1 if is_root else 2) for is_root, shards in units)
    gathered = sum(sum(shards) * n * (1 if is_root else 2) for is_root, shards in units)  # elements, padded
    for policy, itemsize in (("bf16", 2), ("fp32", 4)):
        for r in range(n):
            run = ranks[n][r][(policy, "fsdp", "sgd")]
            calls, sent = run["comm_calls"]["all_gather"], run["comm_bytes"]["all_gather"]
            expected = STEPS * itemsize * gathered * (n - 1) / n
            assert calls == STEPS * gathers, (
                f"{policy}, rank {r} of {n}: {calls:,} all-gathers in {STEPS} steps, expected {STEPS * gathers:,}, "
                f"one per unshard (exercise 8.1): does what a rank sends cross the wire in one all-gather, "
                f"and nothing else?")
            assert sent == expected, (
                f"{policy}, rank {r} of {n}: the all-gathers carried {sent:,.0f} B in {STEPS} steps, expected "
                f"{expected:,.0f} B, {itemsize} B per padded element x (N - 1)/N (exercise 8.1): is the shard "
                f"cast to param_dtype before it is sent, rather than gathered in fp32 and cast afterwards?")
            kinds = sorted(run["comm_calls"])
            assert kinds == ["all_gather", "reduce_scatter"], (
                f"{policy}, rank {r} of {n}: collectives of kinds {kinds}, expected only all_gather and "
                f"reduce_scatter (exercise 8.1): nothing but the cast shard should be sent to unshard")


@pytest.mark.mechanism
@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_offload_copies_each_shard_in_and_each_gradient_shard_out(ranks, n):
    """Per step: the fp32 shard to the device at every unshard (the root once, every block twice: forward
    and backward), and every reduced gradient shard back, in reduce_dtype."""
    units = ranks[n][0]["units"]
    into = 4 * sum(sum(shards) * (1 if is_root else 2) for is_root, shards in units)
    for policy, grad_bytes in (("fp32", 4), ("bf16", 2)):
        copies = ranks[n][0][(f"{policy}_offload", "fsdp", "sgd")]["comm_copies"]
        into_got, out_got = copies.get("host_to_device", 0), copies.get("device_to_host", 0)
        assert into_got == STEPS * into, (
            f"{policy} with offload, rank 0 of {n}: {into_got:,.0f} B copied host to device in {STEPS} steps, "
            f"expected {STEPS * into:,.0f} B, the fp32 shard at every unshard (exercise 8.1): is the shard brought "
            f"to the device through comm's counted copy, once per unshard, before it is cast?")
        out_expected = STEPS * grad_bytes * sum(sum(s) for _, s in units)
        assert out_got == out_expected, (  # chapter 8's grad_offload, not an exercise
            f"{policy} with offload, rank 0 of {n}: {out_got:,.0f} B copied device to host in {STEPS} steps, "
            f"expected {out_expected:,.0f} B, every gradient shard in reduce_dtype")
        plain = ranks[n][0][(policy if policy == "fp32" else "bf16", "fsdp", "sgd")]["comm_copies"]
        assert not plain, (f"{policy} without offload, rank 0 of {n}: copies {dict(plain)}, expected none "
                           f"(exercise 8.1): is the shard copied to the device even when it is not offloaded?")


# -- memory -----------------------------------------------------------------------------------------------------

@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_model_states_keep_16_bytes_per_parameter_and_the_unsharded_units_halve(ranks, n):
    """fp32 master shard 4 + fp32 gradient shard 4 + AdamW 8 = 16Ψ/N in either precision -- the ZeRO
    paper's (2+2+K)Ψ/N with K = 12 -- while the full parameters of a unit, alive only while it computes,
    take 2 bytes per parameter instead of 4. (AdamW also keeps a 4-byte step count per flat parameter.)"""
    units = ranks[n][0]["units"]
    shard_numel = sum(sum(s) for _, s in units)
    step_counts = 4 * sum(len(s) for _, s in units)
    fp32, bf16 = ranks[n][0][("fp32", "fsdp", "adamw")], ranks[n][0][("bf16_measured", "fsdp")]
    for m in (fp32, bf16):
        after = m["after_step"]
        states = after["params"] + after["grads"] + after["optim"]
        assert states == 16 * shard_numel + step_counts, (
            f"rank 0 of {n}: model states of {states:,} B after the step, expected 16 B x {shard_numel:,} shard "
            f"elements + {step_counts} B of step counts = {16 * shard_numel + step_counts:,} B (exercise 8.1): "
            f"is the fp32 master shard kept as it is, not replaced by its cast?")
    unsharded = {k: m["category_peak"]["params"] - 4 * shard_numel for k, m in (("fp32", fp32), ("bf16", bf16))}
    assert unsharded["fp32"] > 0 and unsharded["bf16"] * 2 == unsharded["fp32"], (
        f"rank 0 of {n}: the full parameters peaked at {unsharded['bf16']:,} B in bf16 and {unsharded['fp32']:,} B "
        f"in fp32, expected exactly half (exercise 8.1): does the cast shard, and nothing in fp32, fill the buffer?")
    assert bf16["peak"] < fp32["peak"]  # activations in bf16 too


# -- the loss scaler --------------------------------------------------------------------------------------------

@pytest.mark.exercise("8.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_scaler_skips_on_every_rank_when_one_shard_overflows(ranks, n):
    runs = [ranks[n][r]["agreement"] for r in range(n)]
    local = [run["local"][1] for run in runs]
    assert local == [True] + [False] * (n - 1), (  # only rank 0's shard saw it
        f"local_found_inf at the step that overflows, rank by rank: {local}, expected True on rank 0 only, "
        f"whose shard holds the inf (exercise 8.2): is each rank's own answer recorded, before the ranks agree?")
    for r, run in enumerate(runs):
        assert run["scales"] == [2.0 ** 12, 2.0 ** 12, 2.0 ** 11], (  # ... yet every rank backed off
            f"rank {r} of {n}: scales after each of three steps {run['scales']}, expected [4096, 4096, 2048]: "
            f"every rank halves its scale after the step in which any rank overflowed (exercise 8.2)")
        assert run["taken"] == [0, 2], (  # and skipped step 1: no rank stepped its shards alone
            f"rank {r} of {n}: the optimizer stepped in steps {run['taken']}, expected [0, 2]: step 1 overflowed "
            f"on rank 0, so every rank skips it (exercise 8.2): does each rank decide from the agreed answer?")


@pytest.mark.mechanism
@pytest.mark.exercise("8.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_ranks_agree_with_one_all_reduce_of_one_number(ranks, n):
    """Each scaler.step() sends one thing, on every rank, whether or not it overflowed: one all-reduce of one
    number through comm, 2 x its bytes x (N-1)/N -- not every gradient, not a gather of every rank's answer.
    Which reduction, and what the number counts, is the design's."""
    for r in range(n):
        run = ranks[n][r]["agreement"]
        for i, ((calls, sent), reductions) in enumerate(zip(run["sent"], run["reductions"] + [None] * AGREEMENT_STEPS)):
            when = f"rank {r} of {n}, step {i} ({'rank 0 overflows' if i == 1 else 'no overflow'})"
            assert calls == {"all_reduce": 1}, (
                f"{when}: scaler.step() issued {calls or 'no collective'} through comm, expected one all_reduce "
                f"(exercise 8.2): " + (
                    "every rank must enter the agreement at every step, overflow or not, and through comm, "
                    "which counts it" if not calls else
                    "one number per rank, combined into the same answer on every rank, is all the agreement "
                    "needs; anything more grows with N or with the gradients"))
            _, numel, width = reductions
            assert numel == 1, (
                f"{when}: the all-reduce carried {numel:,} numbers, expected one (exercise 8.2): the ranks only "
                f"need to agree on whether any of them overflowed, not on the gradients")
            expected = 2 * width * (n - 1) / n
            assert sent == {"all_reduce": expected}, (
                f"{when}: sent {sent}, expected {expected:,.0f} B, a ring all-reduce of one {width}-byte number "
                f"(exercise 8.2)")


def _scaler_run(ours, set_scale_at=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kw = dict(init_scale=2.0 ** 127, growth_interval=3)  # overflows, backs off, grows, overflows again ...
    scaler = ShardedGradScaler(**kw) if ours else torch.amp.GradScaler("cpu", **kw)
    scales = []
    for step in range(40):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(net(x).pow(2).mean() * 4).backward()  # 4 x 2^127 is beyond fp32
        scaler.step(opt)
        scaler.update(2.0 ** 100 if step == set_scale_at else None)  # torch's update(new_scale)
        scales.append(float(scaler.get_scale()))
        opt.zero_grad()
    return scales, [p.detach().clone() for p in net.parameters()]


@pytest.mark.exercise("8.2")
def test_scaler_behaves_like_torchs_grad_scaler():
    """One process: the same scale schedule, skips and parameters as torch.amp.GradScaler."""
    ours, theirs = launch(_scaler_run, world_size=1, args=(True,), device="cpu")[0], _scaler_run(False)
    scales = ours[0]
    assert scales == theirs[0]
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))


# -- bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", WORLD_SIZES)
def test_fp16_without_a_scaler_warns_and_with_one_does_not(ranks, n):
    for kind in ("fsdp", "ddp"):
        before, after = ranks[n][0]["warnings"][kind]
        assert any("ShardedGradScaler" in w for w in before), before
        assert after == 0
    assert not ranks[n][0]["warnings"]["fsdp_bf16"][0]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_state_dicts_hold_the_fp32_masters(ranks, n):
    m = ranks[n][0]["masters"]
    assert m["dtypes"] == {"torch.float32"}
    assert max_abs_diff(m["before"], m["reference"]) == 0.0
    assert max_abs_diff(m["after"], m["edited"]) == 0.0


@pytest.mark.parametrize("kwargs, complaint", [
    (dict(param_dtype=torch.int8), "only torch.float32, torch.bfloat16 and torch.float16"),
    (dict(param_dtype=torch.float64), "only torch.float32"),
    (dict(param_dtype=BF16, reduce_dtype=F16), "mixes the two 16-bit formats"),
    (dict(param_dtype=F16, reduce_dtype=BF16), "mixes the two 16-bit formats"),
])
def test_unsupported_dtype_combinations_are_refused(kwargs, complaint):
    with pytest.raises(ValueError, match=complaint):
        MixedPrecision(**kwargs)


def _bad_inputs():
    errors = {}
    for kind in ("fsdp", "ddp"):
        net = TinyGPT().to(BF16)
        try:
            FSDP(net, mixed_precision=POLICIES["bf16"]) if kind == "fsdp" else DDP(net, mixed_precision=POLICIES["bf16"])
        except ValueError as e:
            errors[f"{kind} bf16 model"] = str(e)
    try:
        train("ddp", steps=1, cpu_offload=CPUOffload(offload_params=True))
    except ValueError as e:
        errors["ddp offload"] = str(e)
    net = TinyGPT()
    before = torch.optim.SGD(net.parameters(), lr=0.1)  # built on the parameters FSDP is about to take
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True))
    try:  # caught at the first forward, before a step could silently train nothing
        loss_of("gpt", model, batch("gpt", 0, 12, 0, 1, "cpu")).backward()
    except RuntimeError as e:
        errors["optimizer built before"] = str(e)
    del before
    assert all(getattr(p, "_offloaded", False) and p.device.type == "cpu" for p in model.parameters())
    # An offloaded shard that is no longer on the CPU (model.cuda() after wrapping does that on a GPU
    # machine): a CPU-only machine has one other device to put a parameter on, meta.
    model.to("meta")
    try:
        loss_of("gpt", model, batch("gpt", 0, 12, 0, 1, "cpu")).backward()
    except RuntimeError as e:
        errors["moved"] = str(e)
    return errors


def test_bad_input_gets_a_message_that_names_the_problem():
    errors = launch(_bad_inputs, world_size=1, device="cpu")[0]
    assert "keeps fp32 master parameters" in errors["fsdp bf16 model"] and "torch.bfloat16" in errors["fsdp bf16 model"]
    assert "keeps fp32 master parameters" in errors["ddp bf16 model"]
    assert "cpu_offload is FullyShardedDataParallel's option" in errors["ddp offload"]
    assert "build the optimizer after wrapping" in errors["optimizer built before"]
    assert "host memory" in errors["moved"] and "meta" in errors["moved"]


@pytest.mark.exercise("8.2")
def test_scaler_update_takes_a_new_scale_as_torchs():
    """update(new_scale) sets the scale, and the schedule goes on from there as torch's does."""
    ours = launch(_scaler_run, world_size=1, args=(True, 20), device="cpu")[0]
    theirs = _scaler_run(False, 20)
    assert ours[0] == theirs[0] and ours[0][20] == 2.0 ** 100
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
