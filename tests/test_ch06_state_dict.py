"""Chapter 6: loading a full state dict into a FullyShardedDataParallel model checks it first.

Like nn.Module.load_state_dict (strict by default), every key must be one the unwrapped model had, every
one of those must be there, and every shape must match the original parameter's; the error names each
problem, and is raised before anything is written, so the model keeps what it had. strict=False allows
missing and unexpected keys (and returns them); a wrong shape still raises.

Two ranks, the default TinyGPT, one unit per Block. The ranks are launched once (the `ranks` fixture); each
case returns what its test checks: the error message (or None), and the full state dict before and after.
"""

import functools

import pytest
import torch

from minifsdp import launch
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import ModuleWrapPolicy
from minifsdp.models import Block, TinyGPT
from minifsdp.state_dict import get_full_state_dict, set_full_state_dict

pytestmark = pytest.mark.exercise("5.3")  # a full state dict is read and written through unshard()

WEIGHT = "blocks.0.fc.weight"  # a parameter inside a nested unit: its shard lives in Block 0's flat parameter
NEW = "blocks.1.no_such.weight"


def _try_load(model, sd, how="method", **kwargs):
    """(the error message, or None; what the load returned; the full state dict afterwards)."""
    load = model.load_full_state_dict if how == "method" else functools.partial(set_full_state_dict, model)
    try:
        returned, error = load(sd, **kwargs), None
    except Exception as e:  # noqa: BLE001 -- the tests check its type: a bare KeyError is not good enough
        returned, error = None, f"{type(e).__name__}: {e}"
    return error, returned, model.full_state_dict()


def cases():
    model = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    before = model.full_state_dict()
    out = {"before": before}
    # each edit also changes a valid weight that is written first (wpe: the root unit's, untied), so a load
    # that wrote some weights before failing shows in the state dict afterwards
    wpe = before["wpe.weight"] + 1.0

    wrong_shape = {**before, "wpe.weight": wpe, WEIGHT: before[WEIGHT][0]}  # (out, in) -> (in,): broadcasts
    out["wrong_shape"] = _try_load(model, wrong_shape)
    out["unknown"] = _try_load(model, {**before, "wpe.weight": wpe, NEW: torch.zeros(3)})
    missing = {k: v for k, v in before.items() if k != WEIGHT} | {"wpe.weight": wpe}
    out["missing"] = _try_load(model, missing)
    no_bias = {k: v for k, v in wrong_shape.items() if k != "ln_f.bias"}
    out["all_wrong"] = _try_load(model, {**no_bias, NEW: torch.zeros(3)})  # missing, unexpected, wrong shape
    # strict=False through set_full_state_dict: a missing and an unknown key are allowed, the rest is loaded
    out["not_strict"] = _try_load(model, {**missing, NEW: torch.zeros(3)}, how="function", strict=False)
    out["not_strict_shape"] = _try_load(model, wrong_shape, strict=False)  # a wrong shape is never allowed
    # a correct round trip: every weight edited, loaded, read back exactly
    edited = {k: v * 2.0 + 0.5 for k, v in before.items()}
    out["round_trip"] = (edited, *_try_load(model, edited, how="function"))
    out["after_round_trip"] = get_full_state_dict(model)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(cases, world_size=2, device="cpu")


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _sd_after(case):
    return case[2]


@pytest.mark.parametrize("rank", [0, 1])
def test_wrong_shape_raises_naming_key_and_shapes_and_changes_nothing(ranks, rank):
    r = ranks[rank]
    error = r["wrong_shape"][0]
    assert error is not None, "a (in,) tensor loaded into an (out, in) weight: it broadcast silently"
    assert error.startswith(("ValueError", "RuntimeError")), error
    expected, got = tuple(r["before"][WEIGHT].shape), tuple(r["before"][WEIGHT][0].shape)
    assert WEIGHT in error and str(expected) in error and str(got) in error, error
    assert _equal(_sd_after(r["wrong_shape"]), r["before"])  # not even the valid wpe.weight was written


@pytest.mark.parametrize("rank", [0, 1])
def test_unknown_key_raises_naming_it(ranks, rank):
    r = ranks[rank]
    error = r["unknown"][0]
    assert error is not None and NEW in error, error
    assert _equal(_sd_after(r["unknown"]), r["before"])


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_key_raises_naming_it_and_changes_nothing(ranks, rank):
    r = ranks[rank]
    error = r["missing"][0]
    assert error is not None and error.startswith(("ValueError", "RuntimeError")), error  # not a bare KeyError
    assert WEIGHT in error, error
    assert _equal(_sd_after(r["missing"]), r["before"])  # wpe.weight came before the missing key: kept


@pytest.mark.parametrize("rank", [0, 1])
def test_one_error_names_every_problem(ranks, rank):
    r = ranks[rank]
    error = r["all_wrong"][0]
    assert error is not None
    for name in ("ln_f.bias", NEW, WEIGHT):  # missing, unexpected, wrong shape: all in one message
        assert name in error, error
    assert _equal(_sd_after(r["all_wrong"]), r["before"])


@pytest.mark.parametrize("rank", [0, 1])
def test_not_strict_returns_missing_and_unexpected_and_loads_the_rest(ranks, rank):
    r = ranks[rank]
    error, returned, after = r["not_strict"]
    assert error is None, error
    assert list(returned.missing_keys) == [WEIGHT] and list(returned.unexpected_keys) == [NEW]
    assert returned == (returned.missing_keys, returned.unexpected_keys)  # a NamedTuple, as torch's
    assert torch.equal(after["wpe.weight"], r["before"]["wpe.weight"] + 1.0)  # the rest was loaded
    assert torch.equal(after[WEIGHT], r["before"][WEIGHT])  # the missing one kept its value
    assert _equal({k: v for k, v in after.items() if k != "wpe.weight"},
                  {k: v for k, v in r["before"].items() if k != "wpe.weight"})


@pytest.mark.parametrize("rank", [0, 1])
def test_not_strict_still_refuses_a_wrong_shape(ranks, rank):
    r = ranks[rank]
    error = r["not_strict_shape"][0]
    assert error is not None and WEIGHT in error, error
    # the state dict the not_strict case left behind is unchanged
    assert _equal(_sd_after(r["not_strict_shape"]), _sd_after(r["not_strict"]))


@pytest.mark.parametrize("rank", [0, 1])
def test_round_trip_loads_exactly(ranks, rank):
    edited, error, returned, after = ranks[rank]["round_trip"]
    assert error is None, error
    assert _equal(after, edited)
    assert _equal(ranks[rank]["after_round_trip"], edited)
    assert list(returned.missing_keys) == [] and list(returned.unexpected_keys) == []
