"""Chapter 2: where the memory goes. The analytic model, the memory meter, and the communication counter,
each checked against exact figures (no tolerance: these are counts of bytes, not floating-point maths)."""

import pytest
import torch

from minifsdp import MemoryMeter, analytic, comm, launch
from minifsdp.ddp import DistributedDataParallel
from minifsdp.measure.meter import optimizer_tensors
from minifsdp.models import GPTConfig, TinyGPT, ToyModel, gpt_batch
from minifsdp.train import OPTIMIZERS, train

GB = 10**9


# -- the analytic model (exercise 2.1): its properties first, then the figures --------------------------------
STATES = ("params", "grads", "optim")
# bytes per parameter of (params, grads, optimizer state): fp32 AdamW, fp32 SGD with momentum, mixed
# precision with K = 12, and an optimizer state of its own size, so that no two states are the same size
PRECISIONS = (analytic.FP32_ADAM, analytic.FP32_SGD_MOMENTUM, analytic.mixed_precision_adam(), (2, 3, 5))
GRID = [(psi, n, bpp) for psi in (1, 1000, 7_500_000_000) for n in (1, 2, 3, 4, 64) for bpp in PRECISIONS]


def sharded(psi, n, stage, bpp) -> list[str]:
    """The states a stage's model divides by N (n > 1), in STATES order; checks each is whole or exactly 1/N."""
    got = analytic.model_state_bytes(psi, n, stage, bpp)
    out = []
    for state, per_param in zip(STATES, bpp):
        full = per_param * psi
        assert got[state] in (full, full / n), (
            f"stage {stage}, Ψ = {psi:,}, N = {n}, {bpp} bytes a parameter: {state} = {got[state]:,} B, expected "
            f"the whole {full:,} B or its 1/N, {full / n:,} B (exercise 2.1): a rank keeps a state whole, or "
            f"its own 1/N share of it, nothing in between")
        if n > 1 and got[state] != full:
            out.append(state)
    total = sum(got[state] for state in STATES)
    assert got["total"] == total, (
        f"stage {stage}: total {got['total']:,} B, expected the sum of the three states, {total:,} B (exercise "
        f"2.1): is every state in the dictionary, as a number of bytes?")
    return out


@pytest.mark.exercise("2.1")
def test_stage_0_and_a_single_rank_keep_every_state_whole():
    for psi, n, bpp in GRID:
        for stage in range(4) if n == 1 else (0,):
            got = analytic.model_state_bytes(psi, n, stage, bpp)
            full = {state: float(b * psi) for state, b in zip(STATES, bpp)}
            assert {state: got[state] for state in STATES} == full, (
                f"stage {stage}, Ψ = {psi:,}, N = {n}: {got}, expected every state whole, {full} (exercise 2.1): "
                f"DDP (stage 0) keeps a full replica, and one rank has no one to share with")


@pytest.mark.exercise("2.1")
def test_each_stage_shards_what_the_one_before_did_and_one_state_more():
    for psi, n, bpp in GRID:
        if n == 1:
            continue
        before: list[str] = []
        for stage in range(4):
            now = sharded(psi, n, stage, bpp)
            assert set(before) <= set(now) and len(now) == stage, (
                f"Ψ = {psi:,}, N = {n}, {bpp} bytes a parameter: stage {stage} divides {now or 'nothing'} by N, "
                f"stage {stage - 1} divided {before or 'nothing'}; expected every state the stage before "
                f"divided and exactly one more (exercise 2.1)")
            before = now


@pytest.mark.exercise("2.1")
def test_the_order_follows_who_needs_each_state():
    # the optimizer state: read by the step alone, one owner per element is enough -> first;
    # the gradients: computed by every rank, their average needed by the owner only -> second;
    # the parameters: needed whole by every rank, in forward and in backward -> last
    expected = {1: ["optim"], 2: ["grads", "optim"], 3: ["params", "grads", "optim"]}
    why = {1: "only the optimizer's step reads the optimizer state, so one owner per element is enough",
           2: "every rank computes every gradient, but only the owner needs its average",
           3: "every rank needs every parameter whole, in forward and again in backward"}
    for psi, n, bpp in GRID:
        for stage in (1, 2, 3) if n > 1 else ():
            got = sharded(psi, n, stage, bpp)
            assert got == expected[stage], (
                f"Ψ = {psi:,}, N = {n}, {bpp} bytes a parameter: stage {stage} divides {got} by N, expected "
                f"{expected[stage]} (exercise 2.1): {why[stage]}")


@pytest.mark.exercise("2.1")
def test_zero_stages_fp32_adam():
    psi, n = 1000, 4
    per_stage = [analytic.model_state_bytes(psi, n, s)["total"] for s in range(4)]
    expected = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    assert per_stage == expected, (
        f"fp32 AdamW, Ψ = 1,000, N = 4: stages 0 to 3 total {per_stage} B, expected {expected} B, "
        f"16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N and 16Ψ/N (exercise 2.1)")
    stage2 = analytic.model_state_bytes(psi, n, 2)
    assert stage2 == {"params": 4000.0, "grads": 1000.0, "optim": 2000.0, "total": 7000.0}, (
        f"fp32 AdamW, Ψ = 1,000, N = 4, stage 2: {stage2}, expected params 4,000 B, grads 1,000 B, optim "
        f"2,000 B (exercise 2.1): the same total with params and grads swapped shards the wrong one")


@pytest.mark.exercise("2.1")
def test_zero_paper_example_mixed_precision():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device
    mp = analytic.mixed_precision_adam()
    got = [round(analytic.model_state_bytes(7_500_000_000, 64, s, mp)["total"] / GB, 1) for s in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9], (
        f"the ZeRO paper's example (Ψ = 7.5B, N = 64, K = 12): stages 0 to 3 give {got} GB, expected the "
        f"paper's [120.0, 31.4, 16.6, 1.9] GB (exercise 2.1)")


def test_fsdp_notes_worked_example_exactly():
    # PyTorch FSDP notes: 10 transformer blocks of 1.6B fp32 parameters, 8 ranks.
    block, n = 1_600_000_000, 8
    comm_per_step = analytic.fsdp_step_collectives([block] * 10, n, dtype_bytes=4)
    assert comm_per_step.payload_per_collective == 0.8 * GB
    assert comm_per_step.collectives_per_unit == 3
    assert comm_per_step.total == 24 * GB
    buffers = analytic.fsdp_buffer_bytes(block, n, dtype_bytes=4)
    assert buffers == {"comm": 1.6 * GB, "unsharded": 12.8 * GB, "total": 14.4 * GB}


def test_comm_theory():
    assert analytic.comm_bytes_per_step(1000, 4, 0) == 2 * 1000 * 4 * 3 / 4
    assert analytic.comm_bytes_per_step(1000, 4, 3) == 1.5 * analytic.comm_bytes_per_step(1000, 4, 1)
    assert analytic.comm_bytes_per_step(1000, 1, 0) == 0
    assert comm.ring_bytes("all_reduce", 1200, 3) == 1600
    assert comm.ring_bytes("reduce_scatter", 1200, 3) == comm.ring_bytes("all_gather", 1200, 3) == 800


def test_bad_stage_is_named():
    with pytest.raises(ValueError, match="stage must be 0"):
        analytic.model_state_bytes(10, 2, 4)


# -- the meter, on the CPU -------------------------------------------------------------------------------
def distinct_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("make_model", [lambda: TinyGPT(), lambda: ToyModel()], ids=["gpt_tied", "toy_frozen"])
def test_meter_categories_are_exact_sums(make_model, optimizer):
    model = make_model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    meter = MemoryMeter(model, opt)
    with meter:
        for _ in range(2):
            x = torch.randn(4, 7) if isinstance(model, ToyModel) else gpt_batch(model.config, 0, 4)[0]
            out = model(x)
            out.float().pow(2).mean().backward()
            opt.step()
        live = meter.live()
    params = list(model.parameters())
    assert live["params"] == distinct_bytes(params) == 4 * sum(p.numel() for p in params)
    assert live["grads"] == distinct_bytes([p.grad for p in params if p.grad is not None])
    assert live["optim"] == distinct_bytes(optimizer_tensors(opt))
    trainable = [p for p in params if p.requires_grad]
    psi = sum(p.numel() for p in trainable)
    expected_optim = (analytic.adam_state_bytes(psi, len(trainable)) if optimizer == "adamw"
                      else analytic.sgd_momentum_state_bytes(psi))
    assert live["optim"] == expected_optim
    assert meter.peak >= live["params"] + live["grads"] + live["optim"]
    meter.close()


def test_meter_tracks_live_and_peak_exactly():
    meter = MemoryMeter()
    with meter:
        a = torch.empty(1000)               # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        view = a[10:20]                     # a view: no new storage
        del a                               # the view keeps the storage alive
        assert meter.live()["other"] == 8000
        del view
        assert meter.live()["other"] == 4000
        c = torch.empty(250)                # 1000 B
        assert meter.live()["total"] == 5000
    assert meter.peak == 8000
    del b, c
    assert meter.live()["total"] == 0


def test_gradients_are_labelled_grads_at_the_peak_of_backward():
    model = ToyModel()
    meter = MemoryMeter(model)
    with meter:
        model(torch.randn(64, 7)).sum().backward()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert meter.live()["grads"] == 4 * trainable
    assert meter.peak_by_category["params"] == 4 * sum(p.numel() for p in model.parameters())
    assert 0 < meter.peak_by_category["grads"] <= 4 * trainable


def test_meter_works_on_meta_tensors():
    # the size of a model too big for the machine, without allocating it
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(n_layer=48, n_embd=1600, n_head=25, vocab_size=50304, block_size=1024))
    meter = MemoryMeter(model)
    assert meter.live()["params"] == 4 * sum(p.numel() for p in model.parameters()) > 6 * GB


# -- DDP per rank: measured vs analytic, bytes vs theory ---------------------------------------------------
def ddp_measurements():
    out = {}
    for optimizer in ("sgd", "adamw"):
        out[optimizer] = train(strategy="ddp", model="gpt", optimizer=optimizer, steps=2, global_batch=12)
    # several buckets: the bytes are the same, only split into more calls
    model = DistributedDataParallel(TinyGPT(), bucket_cap_mb=0.02)
    x, y = gpt_batch(model.module.config, 0, 4)
    with comm.counting() as c:
        model(x, y).backward()
    out["small_buckets"] = (dict(c.bytes), dict(c.calls), len(model._buckets))
    return out


@pytest.fixture(scope="module")
def measured():
    return {n: launch(ddp_measurements, world_size=n, device="cpu") for n in (1, 2, 3, 4)}


@pytest.mark.mechanism
@pytest.mark.exercise("1.2", "1.3")
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_ddp_bytes_per_step_equal_theory(measured, n):
    for rank_result in measured[n]:
        res = rank_result["sgd"]
        theory = analytic.comm_bytes_per_step(res["psi"], n, stage=0)
        assert res["comm_bytes"].keys() <= {"all_reduce"}, (
            f"N = {n}: DDP issued {sorted(res['comm_bytes'])}, expected all-reduces only (exercise 1.2): a "
            f"bucket's average is one all-reduce")
        per_step = sum(res["comm_bytes"].values()) / res["steps"]
        assert per_step == pytest.approx(theory, rel=1e-12, abs=0), (
            f"N = {n}: DDP sent {per_step:,.1f} B a step, expected 2Ψ(N-1)/N × 4 = {theory:,.1f} B for "
            f"Ψ = {res['psi']:,} (exercise 1.2): is each bucket all-reduced once, through comm, with nothing else "
            f"sent?")
        sent, calls, n_buckets = rank_result["small_buckets"]
        total = sum(sent.values())
        assert total == pytest.approx(theory, rel=1e-12, abs=0), (
            f"N = {n}, buckets of 0.02 MB: DDP sent {total:,.1f} B, expected {theory:,.1f} B (exercise 1.2): "
            f"more buckets mean more calls, not more bytes")
        got = calls.get("all_reduce", 0)
        assert n == 1 or got == n_buckets > 1, (
            f"N = {n}, buckets of 0.02 MB: {got} all-reduces for {n_buckets} buckets, expected one per bucket "
            f"and more than one bucket (exercise 1.2): is every bucket launched once?")


@pytest.mark.exercise("1.2", "1.3", "2.1")
@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ddp_model_states_measured_equal_analytic(measured, n, optimizer):
    res = measured[n][0][optimizer]
    psi = res["psi"]
    bpp = analytic.FP32_ADAM if optimizer == "adamw" else analytic.FP32_SGD_MOMENTUM
    model = analytic.model_state_bytes(psi, n, 0, bpp)
    states = res["after_step"]
    for state in ("params", "grads"):
        assert states[state] == model[state], (
            f"N = {n}, {optimizer}: the meter measured {states[state]:,} B of {state} after the step, the "
            f"analytic model says {model[state]:,.0f} B: DDP keeps every state whole (exercise 2.1), and every "
            f".grad keeps its own storage (exercise 1.3)")
    n_tensors = len(TinyGPT().state_dict()) - 1  # the tied weight is one parameter
    step_counters = 4 * n_tensors if optimizer == "adamw" else 0
    assert states["optim"] == model["optim"] + step_counters, (
        f"N = {n}, {optimizer}: the meter measured {states['optim']:,} B of optimizer state, expected the "
        f"model's {model['optim']:,.0f} B plus {step_counters:,} B of AdamW step counters (exercise 2.1): DDP "
        f"keeps the optimizer state whole")
    # DDP replicates everything: the model states do not shrink with N; the activations do (smaller slice)
    assert res["peak"] > model["total"], (
        f"N = {n}, {optimizer}: the peak, {res['peak']:,} B, is not above the model states' "
        f"{model['total']:,.0f} B (exercise 2.1): DDP's model states are a full replica at every N")


@pytest.mark.exercise("1.2", "1.3")
def test_ddp_activations_shrink_with_the_local_batch(measured):
    other = [measured[n][0]["adamw"]["peak_by_category"]["other"] for n in (1, 2, 4)]
    assert other[0] > other[1] > other[2], (
        f"activations and temporaries at the peak: {other[0]:,} B, {other[1]:,} B and {other[2]:,} B at "
        f"N = 1, 2 and 4, expected to shrink with each rank's slice of the batch (exercises 1.2 and 1.3): "
        f"does a bucket keep memory alive after its all-reduce?")
