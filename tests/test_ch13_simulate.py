"""Chapter 13: the simulator -- minifsdp's own wrappers as rank 0 of N, on meta tensors, under a fake process group.

What is checked, each against exact figures (bytes are counts, not floating-point maths):
- the model: Llama-2's shapes give the published parameter counts;
- the meta run *is* the real run: at N = 8, rank 0's memory per phase (every category, at every peak) and
  its bytes per collective are the same on meta tensors as on real CPU tensors, for DDP, OSS, SDP, FSDP and
  fully_shard, in fp32 and bf16;
- and both equal the analytic model -- exactly where rank 0's share is exactly what the model assumes, within
  a stated tolerance where it is not (see test_the_analytic_model_within_what_it_leaves_out);
- the seeds' worked examples, at their true scale, to the papers' rounding;
- 7B at 1,024 ranks runs, here with 2 and 4 decoder layers (a few seconds each); the full 32 layers are timed
  by bench/simulate_speed.py (about 3 s on 2 cores, the command about 6 s with Python's start-up);
- clear errors for what the simulator does not know.
"""

import pytest
import torch

from minifsdp.measure.simulate import MODELS, STAGES, Spec, comm_totals, expected, simulate
from minifsdp.mixed_precision import MasterAdamW
from minifsdp.models import LLAMA_CONFIGS, PUBLISHED_PARAMS, Llama, count_params, llama_param_count
from minifsdp.reports.simulate import checks
from minifsdp.reports.worked_examples import example_fsdp_notes, example_limit_all_gathers

GB = 10**9
TINY = dict(model="tiny", world_size=8, seq_len=32)


# -- the model ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_published_parameter_counts(name):
    """Llama-2 7B/13B/70B and TinyLlama-1.1B as their checkpoints hold them, to the parameter; GPT-3 175B as its
    paper rounds it (175.0B: the shape holds 174.6B)."""
    with torch.device("meta"):
        model = Llama(LLAMA_CONFIGS[name])
    psi = count_params(model)
    assert psi == llama_param_count(LLAMA_CONFIGS[name])
    if name == "175b":
        assert psi == 174_604_259_328 and round(psi / 1e9, -1) == 170 and abs(psi / 175e9 - 1) < 0.003
    else:
        assert psi == PUBLISHED_PARAMS[name]
    assert not any(p.untyped_storage().data_ptr() for p in model.parameters())  # meta: no memory at all


def test_master_adamw_steps_as_adamw():
    """MasterAdamW on an fp32 parameter takes torch's AdamW steps bit for bit (its master is then a copy)."""
    torch.manual_seed(0)
    w, g = torch.randn(10, 5), torch.randn(10, 5)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    a, b = MasterAdamW([ours], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1)
    for i in range(5):
        ours.grad, theirs.grad = g * (i + 1), g * (i + 1)
        a.step()
        b.step()
    assert torch.equal(ours, theirs)
    assert sorted(a.state[ours]) == ["exp_avg", "exp_avg_sq", "master", "step"]


# -- (a) the meta run is the real run ------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", list(STAGES))
def test_meta_equals_real_cpu_tensors_at_8_ranks(strategy, precision):
    """The same wrapper and step on meta tensors and on real CPU tensors (both rank 0 of 8 under the fake process
    group): every category at every phase's peak, each category's own highest, and every collective's bytes
    and calls -- equal. The real run's meter re-reads every storage's size at every op (refresh=True), as the
    other chapters' meters do; the meta run trusts the wrappers' announced resizes: equal too."""
    meta = simulate(Spec(strategy=strategy, precision=precision, **TINY))
    real = simulate(Spec(strategy=strategy, precision=precision, device="cpu", refresh=True, **TINY))
    assert meta["phases"] == real["phases"]
    assert meta["most"] == real["most"]
    assert meta["comm"] == real["comm"]
    assert meta["phases"]["peak of backward"]["total"] > meta["phases"]["after optimizer step"]["total"] > 0


@pytest.mark.parametrize("strategy", list(STAGES))
def test_the_analytic_model_within_what_it_leaves_out(strategy):
    """Rank 0 of 8, fp32, against analytic.py. Measured on the tiny model (Ψ = 434,816):

    - bytes per collective kind: equal to the byte (ring bytes; ZeRO-3: every unit gathered twice but the root,
      kept from forward to backward).
    - ZeRO-3's full parameters, most at once: equal (the root + one layer in forward; FSDP + the prefetched
      layer in backward; fully_shard's prefetch lands in a flat buffer until its copy-out).
    - model states after the step, against model_state_bytes (which assumes exactly Ψ/N a rank):
      DDP and FSDP +0.001 % (AdamW's 4-byte `step` per tensor; FSDP's units need no padding here),
      fully_shard +0.01 % (each parameter's rows padded to a multiple of N), OSS +1.4 % and SDP +3.6 %:
      OSS gives rank 0 whole tensors, 1.130 Ψ/N of them, and the model states follow that share exactly.
    """
    r = simulate(Spec(strategy=strategy, **TINY))
    for kind, b in r["analytic"]["comm"].items():
        assert comm_totals(r)[kind] == pytest.approx(b, rel=1e-12)
    rows = {what: (measured, model) for what, measured, model, _ in checks(r)}
    for what, (measured, model) in rows.items():
        if what.startswith("unsharded"):
            assert measured == model, what
    measured, model = rows["model states after the step (parameters + gradients + optimizer)"]
    tolerance = {"ddp": 1e-4, "fsdp": 1e-4, "fully_shard": 1e-3, "oss": 0.02, "sdp": 0.04}[strategy]
    assert 0 <= measured / model - 1 < tolerance
    if strategy in ("oss", "sdp"):  # exact at rank 0's own share: what ZeRO-1/2 shard follows it
        psi, share, tensors = r["psi"], r["stepped"], r["stepped_tensors"]
        assert share / (psi / 8) == pytest.approx(1.130, abs=1e-3)
        grads = 4 * psi if strategy == "oss" else 4 * share
        assert measured == 4 * psi + grads + 8 * share + 4 * tensors


# -- (b) the worked examples -------------------------------------------------------------------------------------
def test_fsdp_notes_example_measured():
    """PyTorch FSDP notes: 1.6B-parameter fp32 blocks on 8 ranks. 0.8 GB per collective per rank (P·4/N); 30
    collectives and 24 GB of payload per step for 10 blocks (communicated, not resident); two unsharded
    blocks at once, 12.8 GB (of the notes' 14.4 GB; the other 1.6 GB, two communication buffers, minifsdp
    does not allocate in fp32: it gathers from the shard itself and reduce-scatters in place)."""
    e = example_fsdp_notes()
    assert e["block_numel"] == e["block_padded"] == 1_600_000_000
    assert e["payload_per_collective"] == {0.8 * GB}
    assert e["collectives_per_step"] == 30
    assert e["payloads_per_step"] == pytest.approx(24 * GB, rel=1e-12)
    root = e["root_numel"] * 4
    assert e["unsharded_peak_forward"] == e["unsharded_peak_backward"] == 12.8 * GB + root
    assert e["analytic_buffers"]["total"] == 14.4 * GB


def test_zero_paper_example_measured():
    """The ZeRO paper's figure 1 (Ψ = 7.5B, N = 64, K = 12): 120, 31.4, 16.6 and 1.9 GB of model states per rank,
    measured on rank 0 running minifsdp's DDP, OSS, SDP and FSDP over a bf16 model with MasterAdamW (fp32
    master, momentum and variance), rounded as the paper rounds."""
    paper = {"ddp": 120.0, "oss": 31.4, "sdp": 16.6, "fsdp": 1.9}
    for strategy, gb in paper.items():
        r = simulate(Spec(model="zero-7.5b", world_size=64, strategy=strategy, precision="bf16-master", seq_len=8,
                          warmup=False))
        after = r["phases"]["after optimizer step"]
        states = after["params"] + after["grads"] + after["optim"]
        assert round(states / GB, 1) == gb, strategy
        psi = r["psi"]
        assert after["params"] == (2 * psi if strategy != "fsdp" else pytest.approx(2 * psi / 64, rel=1e-4))
        if strategy == "ddp":  # the 12 bytes of the paper's K, all in the optimizer
            assert after["optim"] == 12 * psi


def test_limit_all_gathers_bounds_the_units_in_flight():
    """The FSDP paper's rate limiter, with the device as far behind the CPU as it can be (DeviceLag): full
    parameters held at once, in layers beyond the root. With the limit: 2 in forward (one computing, one freed
    and not yet released), 3 in backward (+ the prefetched one); without: every layer of the model. (7b's
    shapes with 6 layers here; `simulate --example limit-all-gathers` runs all 32.)"""
    e = example_limit_all_gathers(world_size=64, layers=6, seq_len=16)
    layers = {limit: [(e[limit][p] - e["root_bytes"]) / e["layer_bytes"] for p in ("forward", "backward")]
              for limit in (True, False)}
    assert layers == {True: [2, 3], False: [6, 6]}


# -- (c) 7B at 1,024 ranks ---------------------------------------------------------------------------------------
def test_7b_at_1024_ranks_per_layer_quantities_scale():
    """7B's shapes as rank 0 of 1,024, FSDP, fp32, 4,096 tokens -- with 2 and with 4 decoder layers instead of 32
    (each a second or two here; bench/simulate_speed.py times all 32: about 3 s). Two more layers add exactly
    two layers' worth of everything per layer: sharded model states (16 bytes per padded parameter / N), bytes
    sent (two all-gathers and a reduce-scatter per layer), and activations; the root and the two unsharded
    layers of the backward peak do not change."""
    runs = {k: simulate(Spec(model="7b", world_size=1024, strategy="fsdp", layers=k)) for k in (2, 4)}
    layer = MODELS["7b"].dim * (4 * MODELS["7b"].dim + 3 * MODELS["7b"].ffn_hidden + 2)
    padded = -(-layer // 1024) * 1024
    assert [u["padded"] for u in runs[4]["units"][1:]] == [padded] * 4
    states = {k: sum(r["phases"]["after optimizer step"][c] for c in ("params", "grads", "optim"))
              for k, r in runs.items()}
    assert states[4] - states[2] == 2 * (16 * padded // 1024 + 4)  # + AdamW's step per unit
    sent = {k: comm_totals(r) for k, r in runs.items()}
    assert sent[4]["all_gather"] - sent[2]["all_gather"] == 2 * 2 * padded * 4 * 1023 / 1024
    assert sent[4]["reduce_scatter"] - sent[2]["reduce_scatter"] == 2 * padded * 4 * 1023 / 1024
    assert runs[2]["most"]["backward"]["unsharded"] == runs[4]["most"]["backward"]["unsharded"]
    assert runs[4]["most"]["backward"]["unsharded"] == expected(runs[4])["unsharded"]["backward"]
    act = {k: r["phases"]["peak of forward"]["other"] for k, r in runs.items()}
    assert act[4] > act[2]
    per_layer = (act[4] - act[2]) / 2
    assert 1.0 * GB < per_layer < 1.6 * GB  # fp32, 4,096 tokens: what one layer saves for backward


# -- (d) clear errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(model="8b"), "unknown model '8b': choose from 1b, 7b, 13b, 70b, 175b"),
    (dict(strategy="zero4"), "unknown strategy 'zero4': choose from ddp, oss, sdp, fsdp, fully_shard"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(strategy="ddp", precision="bf16", checkpoint_activations=True), "FSDP and fully_shard only"),
    (dict(strategy="ddp", device_lag=True), "strategy must be 'fsdp'"),
])
def test_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate(Spec(**fields))


def test_the_command_line_names_what_it_does_not_know(capsys):
    from minifsdp.__main__ import main
    for args, message in ((["--model", "8b"], "unknown model '8b'"), (["--strategy", "zero4"], "unknown strategy"),
                          (["--example", "nope"], "unknown example 'nope'")):
        assert main(["simulate", *args]) == 2
        assert message in capsys.readouterr().err
