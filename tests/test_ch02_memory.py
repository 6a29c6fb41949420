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


# -- the analytic model ----------------------------------------------------------------------------------
@pytest.mark.exercise("2.1")
def test_zero_stages_fp32_adam():
    psi, n = 1000, 4
    per_stage = [analytic.model_state_bytes(psi, n, s)["total"] for s in range(4)]
    assert per_stage == [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    assert analytic.model_state_bytes(psi, n, 2) == {"params": 4000.0, "grads": 1000.0, "optim": 2000.0,
                                                     "total": 7000.0}


@pytest.mark.exercise("2.1")
def test_zero_paper_example_mixed_precision():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device
    mp = analytic.mixed_precision_adam()
    got = [analytic.model_state_bytes(7_500_000_000, 64, s, mp)["total"] / GB for s in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


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
        assert res["comm_bytes"].keys() <= {"all_reduce"}
        assert sum(res["comm_bytes"].values()) / res["steps"] == pytest.approx(theory, rel=1e-12, abs=0)
        sent, calls, n_buckets = rank_result["small_buckets"]
        assert sum(sent.values()) == pytest.approx(theory, rel=1e-12, abs=0)
        assert n == 1 or calls["all_reduce"] == n_buckets > 1


@pytest.mark.exercise("1.2", "1.3", "2.1")
@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ddp_model_states_measured_equal_analytic(measured, n, optimizer):
    res = measured[n][0][optimizer]
    psi = res["psi"]
    bpp = analytic.FP32_ADAM if optimizer == "adamw" else analytic.FP32_SGD_MOMENTUM
    model = analytic.model_state_bytes(psi, n, 0, bpp)
    states = res["after_step"]
    assert states["params"] == model["params"] and states["grads"] == model["grads"]
    n_tensors = len(TinyGPT().state_dict()) - 1  # the tied weight is one parameter
    step_counters = 4 * n_tensors if optimizer == "adamw" else 0
    assert states["optim"] == model["optim"] + step_counters
    # DDP replicates everything: the model states do not shrink with N; the activations do (smaller slice)
    assert res["peak"] > model["total"]


@pytest.mark.exercise("1.2", "1.3")
def test_ddp_activations_shrink_with_the_local_batch(measured):
    other = [measured[n][0]["adamw"]["peak_by_category"]["other"] for n in (1, 2, 4)]
    assert other[0] > other[1] > other[2]
