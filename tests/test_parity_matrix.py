"""The parity matrix (minifsdp/reports/parity.py): every strategy -- DDP, OSS under our DDP, FlatOSS, SDP,
FlatSDP, and FSDP with and without resharding after forward, with the whole model as one unit, units nested
by class and units nested by size -- on seven small models (odd shapes with a 0-dim and a 1-element
parameter; tied embedding and head; frozen parameters and a wholly frozen block; a parameter unused on some
steps; BatchNorm and a registered buffer; a block called twice in a forward; float64), with SGD + momentum
and AdamW, at 1, 2, 3 and 4 ranks: 616 cases, 3 steps each, every rank starting from weights of its own.

The rules, encoded once in parity.oracle() and parity.tolerance() (the report applies the same):
- Reference: torch's DistributedDataParallel (find_unused_parameters where the model needs it) with the
  same optimizer on the same per-rank data. Final parameters are compared by their names in the unwrapped
  model, and buffers on every rank.
- Bit-exact (max |diff| == 0.0) at 1 and 2 ranks: the same reduction order as torch's DDP -- each element's
  sum is one commutative addition, and the 1/2 before it exact.
- At 3 and 4 ranks the N contributions are added in another order (gloo's reduce-scatter or reduce versus
  its all-reduce), and a parameter may round to a neighbouring value about once a step: 8 ulps per step of
  a parameter below 4, 16 x 3 x eps of the model's dtype -- 5.7e-6 in fp32, 1.1e-14 in float64. The worst
  measured are 6e-8 and 2e-16, 1 to 2% of these; the report prints them.
- Deliberate differences get another reference, never a looser tolerance:
  (a) a parameter no rank used in a step gets a zero gradient in a flat buffer (FlatOSS, FlatSDP, FSDP), so
      momentum and weight decay still move it: the `unused` model's parameters are held, under those
      strategies, to torch's FSDP1 (use_orig_params=False) with the same units, which does the same;
  (b) FSDP and FlatOSS alone never re-broadcast buffers: BatchNorm statistics stay each rank's own, as in
      torch's FSDP1, so their buffers are held to torch's FSDP1 on every rank; their parameters agree
      with torch's DDP, and are held to it.
- Not vacuous: the reference's weights moved; a control (our DDP averaging over N + 1 ranks) is caught in
  every case; the deliberate differences really are differences from DDP; the nested wraps nest, and as
  torch's FSDP1 nests them.

Ranks are started once per world size (four launches); every test below only reads the rows.
"""

import pytest
import torch

from minifsdp.reports import parity

CASES = [(s, m, o, n) for n in parity.WORLD_SIZES for s in parity.STRATEGIES_UNDER_TEST for m in parity.MODELS
         for o in parity.OPTIMIZERS]


@pytest.fixture(scope="module")
def rows():
    return {(r["strategy"], r["model"], r["optimizer"], r["world_size"]): r for r in parity.run_parity()}


@pytest.mark.parametrize("strategy, model, optimizer, world_size", CASES,
                         ids=[f"{s}-{m}-{o}-N{n}" for s, m, o, n in CASES])
def test_matches_its_reference(rows, strategy, model, optimizer, world_size):
    row = rows[strategy, model, optimizer, world_size]
    where = f"against {row['param_oracle']} (parameters) and {row['buffer_oracle']} (buffers)"
    assert row["param_diff"] <= row["tolerance"], f"parameters off by {row['param_diff']:.3e} {where}"
    if row["buffer_diff"] is not None:
        assert row["buffer_diff"] <= row["tolerance"], f"buffers off by {row['buffer_diff']:.3e} {where}"


def test_every_case_ran(rows):
    assert set(CASES) <= set(rows) and len(CASES) == 616


def test_the_rules():
    assert [parity.tolerance(n, torch.float32) for n in (1, 2)] == [0.0, 0.0]
    assert parity.tolerance(3, torch.float32) == parity.tolerance(4, torch.float32) == pytest.approx(5.7e-6, rel=0.01)
    assert parity.tolerance(3, torch.float64) == pytest.approx(1.07e-14, rel=0.01)
    assert parity.oracle("fsdp_nraf/by_size", "unused") == ("torch_fsdp1/by_size", "torch_ddp")
    assert parity.oracle("sdp_flat", "unused") == ("torch_fsdp1/whole", "torch_ddp")
    assert parity.oracle("sdp", "unused") == ("torch_ddp", "torch_ddp")  # OSS and SDP skip a missing gradient
    assert parity.oracle("fsdp/by_class", "batchnorm") == ("torch_ddp", "torch_fsdp1/by_class")
    assert parity.oracle("sdp_flat", "batchnorm") == ("torch_ddp", "torch_ddp")  # DDP's buffer broadcast
    assert parity.oracle("fsdp/whole", "tied") == ("torch_ddp", "torch_ddp")


def test_the_weights_moved(rows):
    """A comparison of weights that never left their initial values would prove nothing."""
    for (strategy, model, optimizer, n), row in rows.items():
        assert row["moved"] > 1e-3, (model, optimizer, n)


def test_a_wrong_gradient_average_is_caught(rows):
    control = [r for r in rows.values() if r["strategy"] == parity.CONTROL]
    assert len(control) == len(parity.MODELS) * len(parity.WORLD_SIZES)
    for row in control:
        assert row["param_diff"] > 1e-3, (row["model"], row["world_size"])
        assert not parity.passes(row)


@pytest.mark.parametrize("world_size", parity.WORLD_SIZES)
def test_the_deliberate_differences_are_real(rows, world_size):
    """Held to torch's DDP, the zero gradients of an unused parameter and the per-rank BatchNorm statistics
    would fail far beyond any tolerance: the other reference is needed, not a looser one."""
    for strategy in parity.ZERO_GRAD_WHEN_UNUSED:
        for optimizer in parity.OPTIMIZERS:
            assert rows[strategy, "unused", optimizer, world_size]["param_diff_vs_ddp"] > 1e-3
    for strategy in parity.LOCAL_BUFFERS:
        row = rows[strategy, "batchnorm", "sgd", world_size]
        if world_size > 1:  # (one rank's own statistics are rank 0's)
            assert row["buffer_diff_vs_ddp"] > 1e-3


def test_units_nest_as_in_torch_fsdp1(rows):
    for (strategy, model, optimizer, n), row in rows.items():
        if strategy.startswith("fsdp"):
            assert (len(row["units"]) > 1) == (not strategy.endswith("/whole")), (strategy, model, row["units"])
            if row["oracle_units"] is not None:
                assert row["units"] == row["oracle_units"], (strategy, model)
    # the two policies cut differently where the model allows it
    assert rows["fsdp/by_class", "reused", "sgd", 2]["units"] == ["", "shared"]
    assert rows["fsdp/by_size", "reused", "sgd", 2]["units"] == ["", "shared.lin"]


def test_the_report_renders_the_same_rows(rows):
    text = parity.format_markdown(list(rows.values()))
    within = sum(parity.passes(r) for r in rows.values() if r["strategy"] != parity.CONTROL)
    assert f"{within} of 616 within their rule" in text
    assert text.count("| FSDP NRAF, by size |") == 1 + len(parity.MODELS)  # a row by world size, one per model's tab
