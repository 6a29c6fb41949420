"""Chapter 10: FullyShardedDataParallel's state dicts, as PyTorch's FSDP1 gives them, at a fraction of the memory.

- FULL_STATE_DICT is gathered one unit at a time: the same bits as gathering the whole model at once
  (chapter 6's way), with one unit's buffers as working memory instead of the model's (measured by
  minifsdp/reports/state_dict_memory.py, checked here); rank0_only leaves the other ranks nothing to hold.
- SHARDED_STATE_DICT needs no collective: ShardedTensors whose local shards are views into the flat shards.
  They load back in place, and through torch.distributed.checkpoint at another world size. A 0-dim
  parameter lies on one rank. ShardedStateDictConfig(_use_dtensor=True) still gives DTensors, Shard(0).
- FSDP.optim_state_dict / optim_state_dict_to_load: the optimizer state by original name, full tensors.
  Against torch's FSDP1 (CPU, gloo, one unit per Block, use_orig_params=False) after the same three steps
  of AdamW and of SGD with momentum: the same names, keys, param_groups and values, bit for bit. (Tolerance
  0: every parameter of TinyGPT is a multiple of 16 elements, so FSDP1's end-to-end packing is 64-byte
  aligned like minifsdp's and the two compute the same bits -- unlike tests/test_fsdp1_dropin.py's odd
  sizes, 1e-6 apart.) Each side's dict loads into the other exactly, and both train on to the same bits.
- Round trips: saved at N = 2, loaded at N = 3 (read back: the same dict, exactly), trained on: equal to
  the N = 2 run that never stopped within 1e-6 (measured 7e-9 for SGD, 6e-8 for AdamW: the last steps'
  sums over 3 ranks, not 2).
  Not compared with a run at N = 3 from the start: there AdamW already parts by 1.5e-4 -- elements whose
  gradient is rounding noise take lr-sized steps of either sign, and 2 and 3 ranks round differently.
  From a plain, single-process optimizer's state dict (ids replaced by names): read back exactly, and
  trained on equal to the plain run within 1e-6 (measured 7e-9 for SGD, 1e-7 for AdamW).

Two launches (N = 2, then N = 3, which reads what N = 2 wrote); each case returns what its tests check.
"""

import copy
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp import launch
from minifsdp.distributed import comm
from minifsdp.fsdp import FSDP, FullStateDictConfig, ModuleWrapPolicy, ShardedStateDictConfig, StateDictType
from minifsdp.fsdp import FullOptimStateDictConfig
from minifsdp.fsdp.state_dict import _all_units_at_once
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports.state_dict_memory import measure_state_dict_memory
from minifsdp.train import OPTIMIZERS, batch, loss_of, max_abs_diff

FULL, SHARDED = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT
STEPS, MORE = 3, 2  # steps before a state dict is taken, and after it is loaded
OPTIM = ("adamw", "sgd")


class Gated(nn.Module):
    """A block with a 0-dim parameter: one element of the flat buffer, so it lies on one rank only."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.gate * torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, 13)
        self.blocks = nn.Sequential(Gated(13), Gated(13))
        self.head = nn.Linear(13, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3) + seed)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x))) * self.scale


def net(seed=0, policy=True):
    return FSDP(Net(seed), auto_wrap_policy=ModuleWrapPolicy({Gated}) if policy else None)


def gpt(name, seed=0):
    model = FSDP(TinyGPT(seed=seed), auto_wrap_policy=ModuleWrapPolicy({Block}))
    return model, OPTIMIZERS[name](model.parameters())


def torch_gpt(name, seed=0):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    model = TorchFSDP(TinyGPT(seed=seed), device_id=torch.device("cpu"), auto_wrap_policy=TorchPolicy({Block}),
                      use_orig_params=False)
    return model, OPTIMIZERS[name](model.parameters())


def train(model, opt, steps, first=0, r=None, n=None):
    r, n = (dist.get_rank(), dist.get_world_size()) if r is None else (r, n)
    for step in range(first, first + steps):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()


def box(t, offsets, sizes):
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def gathers_during(fn):
    with comm.counting(record=True) as counter:
        result = fn()
    return result, counter


class Collectives(TorchDispatchMode):
    """Every collective issued inside the block, by minifsdp or by torch (each is a c10d op)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# -- cases --------------------------------------------------------------------------------------------------------
def full_cases():
    model, opt = gpt("adamw")
    train(model, opt, STEPS)
    (unit_by_unit, counter), at_once = gathers_during(model.state_dict), _all_units_at_once(model)
    with FSDP.state_dict_type(model, FULL, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        rank0_only = model.state_dict()
    return {"unit by unit": unit_by_unit, "at once": at_once, "rank0_only": rank0_only,
            "all_gathers": [e.tag for e in counter.events],
            "flats": [f.name for u in model.units() for f in u.flat_params]}


def sharded_cases(tmp):
    n, out = dist.get_world_size(), {}
    model, other = net(0), net(1)
    out["full"], out["other before"] = model.state_dict(), other.state_dict()
    with FSDP.state_dict_type(model, SHARDED), Collectives() as spy:
        pieces = model.state_dict()
    out["collectives"] = spy.ops
    out["types"] = {k: type(v).__name__ for k, v in pieces.items()}
    shards = {f.param.untyped_storage().data_ptr() for u in model.units() for f in u.flat_params}
    out["views, right elements"] = {k: all(s.tensor.untyped_storage().data_ptr() in shards and torch.equal(
        s.tensor, box(out["full"][k], s.metadata.shard_offsets, s.metadata.shard_sizes)) for s in v.local_shards())
        for k, v in pieces.items() if hasattr(v, "local_shards")}
    out["plain, right value"] = {k: torch.equal(v, out["full"][k]) for k, v in pieces.items()
                                 if not hasattr(v, "local_shards")}
    with FSDP.state_dict_type(other, SHARDED), Collectives() as spy:
        out["load"] = str(other.load_state_dict(pieces))
    out["load collectives"] = spy.ops
    out["other after"] = other.state_dict()
    # one unit for the whole model: its shards hold other pieces, which a load refuses, naming them
    one_unit = net(1, policy=False)
    before = one_unit.state_dict()
    with FSDP.state_dict_type(one_unit, SHARDED):
        try:
            one_unit.load_state_dict(pieces)
            out["other layout"] = None
        except RuntimeError as e:
            out["other layout"] = str(e)
    out["other layout unchanged"] = max_abs_diff(one_unit.state_dict(), before)
    # DTensors, PyTorch's config class accepted: one all-gather per unit
    from torch.distributed.fsdp import ShardedStateDictConfig as TorchConfig
    with FSDP.state_dict_type(model, SHARDED, TorchConfig(_use_dtensor=True)):
        dtensors, counter = gathers_during(model.state_dict)
    out["dtensor placements"] = {k: (type(v).__name__, type(v.placements[0]).__name__,
                                     getattr(v.placements[0], "dim", None)) for k, v in dtensors.items()}
    out["dtensor whole"] = max_abs_diff({k: v.full_tensor() for k, v in dtensors.items()}, out["full"])
    out["dtensor all_gathers"] = counter.calls["all_gather"]
    third = net(2)
    with FSDP.state_dict_type(third, SHARDED, ShardedStateDictConfig(_use_dtensor=True)):
        third.load_state_dict(dtensors)
    out["dtensor loaded"] = max_abs_diff(third.state_dict(), out["full"])
    # through torch.distributed.checkpoint: N = 2 writes, N = 3 reads into its own pieces, in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if n == 2:
            dcp.save({"model": pieces}, checkpoint_id=f"{tmp}/sharded")
        else:
            fresh = net(3)
            with FSDP.state_dict_type(fresh, SHARDED):
                mine = fresh.state_dict()
                dcp.load({"model": mine}, checkpoint_id=f"{tmp}/sharded")
                fresh.load_state_dict(mine)
            out["from N = 2"] = fresh.state_dict()
    return out


def optim_vs_torch(name):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    ours, our_opt = gpt(name)
    theirs, their_opt = torch_gpt(name)
    train(ours, our_opt, STEPS)
    train(theirs, their_opt, STEPS)
    osd, counter = gathers_during(lambda: FSDP.optim_state_dict(ours, our_opt))
    # (torch's shares its step tensors with the optimizer, which goes on counting in them: a copy)
    out = {"ours": osd, "theirs": copy.deepcopy(TorchFSDP.optim_state_dict(theirs, their_opt)),
           "all_gathers": counter.calls["all_gather"], "flats": sum(len(u.flat_params) for u in ours.units())}
    # torch's dict into minifsdp, read back; trained on beside torch's
    loaded, loaded_opt = gpt(name, seed=1)
    loaded.load_state_dict(theirs.state_dict())
    loaded_opt.load_state_dict(FSDP.optim_state_dict_to_load(loaded, loaded_opt, out["theirs"]))
    out["torch's, read back"] = FSDP.optim_state_dict(loaded, loaded_opt)
    train(loaded, loaded_opt, MORE, first=STEPS)
    train(theirs, their_opt, MORE, first=STEPS)
    out["trained on"] = max_abs_diff(loaded.state_dict(), theirs.state_dict())
    # ours into torch's FSDP1, read back by torch
    into, into_opt = torch_gpt(name, seed=1)
    into_opt.load_state_dict(TorchFSDP.optim_state_dict_to_load(into, into_opt, osd))
    out["ours, read back by torch"] = TorchFSDP.optim_state_dict(into, into_opt)
    # rank0_only: only rank 0 gets it; when loading, only rank 0 needs to have it
    config = FullOptimStateDictConfig(rank0_only=True)
    fresh, fresh_opt = gpt(name, seed=1)
    with FSDP.state_dict_type(ours, FULL, optim_state_dict_config=config):
        out["rank0_only"] = FSDP.optim_state_dict(ours, our_opt)
    with FSDP.state_dict_type(fresh, FULL, optim_state_dict_config=config):
        from_rank0 = FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd if dist.get_rank() == 0 else {})
    everyone = FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd)
    out["rank0_only load"] = (from_rank0.keys() == everyone.keys() and from_rank0["param_groups"] == everyone[
        "param_groups"] and all(torch.equal(from_rank0["state"][i][k], everyone["state"][i][k])
                                for i in everyone["state"] for k in everyone["state"][i]))
    return out


def round_trip(tmp, name):
    """N = 2 saves; N = 3 loads it (and a plain optimizer's), trains on, and compares with continuous runs."""
    n, out = dist.get_world_size(), {}
    path = f"{tmp}/round-trip-{name}.pt"
    if n == 2:
        model, opt = gpt(name)
        train(model, opt, STEPS)
        saved = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        train(model, opt, MORE, first=STEPS)  # the run that never stopped
        saved["continuous"] = model.state_dict()
        if dist.get_rank() == 0:
            torch.save(saved, path)
        dist.barrier()
        return out
    saved = torch.load(path, weights_only=True)
    resumed, resumed_opt = gpt(name, seed=1)
    resumed.load_state_dict(saved["model"])
    FSDP.optim_state_dict_to_load(resumed, resumed_opt, saved["optim"], load_directly=True)
    out["read back"] = _osd_diff(FSDP.optim_state_dict(resumed, resumed_opt), saved["optim"])
    train(resumed, resumed_opt, MORE, first=STEPS)
    out["resumed"] = max_abs_diff(resumed.state_dict(), saved["continuous"])
    # a plain single-process run's optimizer state dict, its ids replaced by the parameters' names
    plain = TinyGPT()
    plain_opt = OPTIMIZERS[name](plain.parameters())
    train(plain, plain_opt, STEPS, r=0, n=1)
    names = [k for k, _ in plain.named_parameters()]
    by_name = plain_opt.state_dict()
    by_name = {"state": {names[i]: s for i, s in by_name["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in by_name["param_groups"]]}
    from_plain, from_plain_opt = gpt(name, seed=1)
    from_plain.load_state_dict(plain.state_dict())
    FSDP.optim_state_dict_to_load(from_plain, from_plain_opt, by_name, load_directly=True)
    out["plain, read back"] = _osd_diff(FSDP.optim_state_dict(from_plain, from_plain_opt), by_name, ordered=False)
    train(from_plain, from_plain_opt, MORE, first=STEPS)
    train(plain, plain_opt, MORE, first=STEPS, r=0, n=1)
    out["from plain"] = max_abs_diff(from_plain.state_dict(), plain.state_dict())
    return out


def _osd_diff(a, b, ordered=True):
    """Largest difference between two optimizer state dicts by name (None if their structure differs).
    ordered=False: names and keys may come in another order (a plain model lists its parameters module by
    module, FSDP unit by unit; AdamW makes step first, FSDP1's format lists it last)."""
    arrange = (lambda x: x) if ordered else sorted
    if arrange([(k, arrange(list(v))) for k, v in a["state"].items()]) != \
            arrange([(k, arrange(list(v))) for k, v in b["state"].items()]):
        return None
    if [{**g, "params": arrange(g["params"])} for g in a["param_groups"]] != \
            [{**g, "params": arrange(g["params"])} for g in b["param_groups"]]:
        return None
    return max((a["state"][k][key].double() - b["state"][k][key].double()).abs().max().item()
               for k in a["state"] for key in a["state"][k])


def cases(tmp):
    out = {"full": full_cases(), "sharded": sharded_cases(tmp)}
    for name in OPTIM:
        if dist.get_world_size() == 2:
            out["vs torch", name] = optim_vs_torch(name)
        out["round trip", name] = round_trip(tmp, name)
    out["memory"] = frozen_gc(measure_state_dict_memory, GPTConfig(vocab_size=96, block_size=32, n_layer=4,
                                                                    n_head=2, n_embd=32))
    return out


def frozen_gc(fn, *args):
    """fn(*args) with the objects that exist now left out of garbage collection. The meter collects garbage
    before each of its four measurements, and a full collection scans every object of torch the rank holds
    (0.2-0.4 s each); what the measurement frees is made after the freeze, and still collected. (Garbage from
    before stays as it is throughout: the measured figures are differences, and it is in none.)"""
    gc.freeze()
    try:
        return fn(*args)
    finally:
        gc.unfreeze()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp_state_dicts"))
    return {n: launch(cases, world_size=n, args=(tmp,), device="cpu") for n in (2, 3)}  # 3 reads what 2 wrote


# -- full state dicts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", (2, 3))
def test_full_state_dict_unit_by_unit_is_bit_identical_one_all_gather_per_unit(ranks, n):
    for r in range(n):
        res = ranks[n][r]["full"]
        assert list(res["unit by unit"]) == list(res["at once"])
        assert max_abs_diff(res["unit by unit"], res["at once"]) == 0.0
        assert res["all_gathers"] == [f"unshard {name}" for name in res["flats"]]  # one unit, then the next
        if r == 0:
            assert max_abs_diff(res["rank0_only"], res["at once"]) == 0.0
            assert all(v.device.type == "cpu" for v in res["rank0_only"].values())
        else:
            assert res["rank0_only"] == {}


@pytest.mark.parametrize("n", (2, 3))
def test_unit_by_unit_working_memory_is_the_largest_unit(ranks, n):
    for r in range(n):
        m = ranks[n][r]["memory"]
        units = m["units padded"]
        assert m["whole model at once"]["working"] == sum(units.values())
        for way in ("unit by unit", "unit by unit, rank0_only", "unit by unit, rank0_only, offload_to_cpu"):
            assert m[way]["working"] == max(units.values()), way
        assert m["unit by unit"]["result"] == m["whole model at once"]["result"] > 0
        assert m["unit by unit"]["peak"] < m["whole model at once"]["peak"]
        held = m["unit by unit, rank0_only"]["result"]
        assert held == (m["unit by unit"]["result"] if r == 0 else 0)


# -- sharded state dicts ------------------------------------------------------------------------------------------
@pytest.mark.mechanism
@pytest.mark.exercise("10.1", "10.2")
@pytest.mark.parametrize("n", (2, 3))
def test_sharded_state_dict_is_views_into_the_shards_with_no_collective(ranks, n):
    full_keys = list(ranks[n][0]["sharded"]["full"])
    for r in range(n):
        res = ranks[n][r]["sharded"]
        assert res["collectives"] == [] and res["load collectives"] == [], (
            f"N = {n}, rank {r}: SHARDED_STATE_DICT issued the c10d ops {res['collectives'] or 'none'} to save and "
            f"{res['load collectives'] or 'none'} to load, expected none (exercise 10.2): every rank's boxes follow "
            f"from the layout, so no rank asks another for them")
        wrong = [k for k, ok in {**res["views, right elements"], **res["plain, right value"]}.items() if not ok]
        assert not wrong, (
            f"N = {n}, rank {r}: the pieces of {wrong} are not views into the unit's flat shard holding the "
            f"elements their boxes name (exercise 10.2): a copy loads into nothing; is each view cut at the box's "
            f"place in the shard?")
        for k, kind in res["types"].items():
            expected = "ShardedTensor" if k != "scale" and not k.endswith("gate") else "Tensor"
            assert kind == expected, (
                f"N = {n}, rank {r}: {k} is a {kind} in the sharded state dict, expected a {expected} (exercise "
                f"10.2): a parameter of a flat shard is a ShardedTensor of its boxes, a 0-dim one a plain tensor on "
                f"the rank that holds its element, a buffer a plain tensor")
    # every parameter on some rank; a 0-dim one on exactly one (the rank whose shard holds its element)
    for k in full_keys:
        holders = [r for r in range(n) if k in ranks[n][r]["sharded"]["types"]]
        expected = [holders[0]] if k.endswith("gate") and holders else list(range(n))
        assert holders == expected, (
            f"N = {n}: {k} is in the sharded state dicts of ranks {holders}, expected "
            f"{'one rank' if k.endswith('gate') else expected} (exercise 10.2): a 0-dim parameter is one element, "
            f"on the one rank whose shard holds it; every other tensor is described on every rank")


@pytest.mark.exercise("10.1", "10.2")
@pytest.mark.parametrize("n", (2, 3))
def test_sharded_state_dict_loads_in_place_and_refuses_another_layout(ranks, n):
    for r in range(n):
        res = ranks[n][r]["sharded"]
        assert res["load"] == "<All keys matched successfully>", f"N = {n}, rank {r}: the load said {res['load']}"
        assert max_abs_diff(res["other before"], res["full"]) > 0  # it held other weights ...
        assert max_abs_diff(res["other after"], res["full"]) == 0.0, (  # ... and now holds these, exactly
            f"N = {n}, rank {r}: after loading the sharded state dict, the model is "
            f"{max_abs_diff(res['other after'], res['full']):.3g} away from the one saved, expected exactly it "
            f"(exercise 10.2): are the pieces views into the shard, so that a load writes into it?")
        error = res["other layout"]
        assert error is not None and "nothing was loaded" in error and "blocks.0.fc.weight" in error, error
        assert res["other layout unchanged"] == 0.0


@pytest.mark.parametrize("n", (2, 3))
def test_use_dtensor_gives_shard0_dtensors_one_unit_at_a_time(ranks, n):
    for r in range(n):
        res = ranks[n][r]["sharded"]
        for k, placement in res["dtensor placements"].items():
            assert placement == (("DTensor", "Replicate", None) if k.endswith("gate") else ("DTensor", "Shard", 0)), k
        assert res["dtensor whole"] == 0.0 and res["dtensor loaded"] == 0.0
        assert res["dtensor all_gathers"] == 3  # one per unit (the root's, and each Gated's)


@pytest.mark.exercise("10.1", "10.2")
def test_sharded_checkpoint_from_two_ranks_loads_at_three(ranks):
    for r in range(3):
        diff = max_abs_diff(ranks[3][r]["sharded"]["from N = 2"], ranks[2][0]["sharded"]["full"])
        assert diff == 0.0, (
            f"rank {r} of 3 loaded the sharded checkpoint saved at N = 2 {diff:.3g} away from the model saved, "
            f"expected exactly it (exercises 10.1, 10.2): do the boxes of both world sizes name the right elements "
            f"of each tensor, and are this rank's boxes views into its shard?")


# -- optimizer state dicts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", OPTIM)
def test_optim_state_dict_is_torch_fsdp1s(ranks, name):
    for r in range(2):
        res = ranks[2][r]["vs torch", name]
        ours, theirs = res["ours"], res["theirs"]
        assert list(ours) == list(theirs) == ["state", "param_groups"]
        assert list(ours["state"]) == list(theirs["state"])  # the original names, in the same order
        for k in theirs["state"]:
            assert list(ours["state"][k]) == list(theirs["state"][k]), k
            for key, value in theirs["state"][k].items():
                assert ours["state"][k][key].shape == value.shape and ours["state"][k][key].device.type == "cpu"
                torch.testing.assert_close(ours["state"][k][key], value, rtol=0, atol=0)  # (module docstring)
        assert ours["param_groups"] == theirs["param_groups"]
        assert res["all_gathers"] == res["flats"] * (2 if name == "adamw" else 1)  # per unit, per state tensor


@pytest.mark.parametrize("name", OPTIM)
def test_optim_state_dicts_load_both_ways_between_minifsdp_and_torch(ranks, name):
    for r in range(2):
        res = ranks[2][r]["vs torch", name]
        assert _osd_diff(res["torch's, read back"], res["theirs"]) == 0.0
        assert _osd_diff(res["ours, read back by torch"], res["ours"]) == 0.0
        assert res["trained on"] == 0.0


@pytest.mark.parametrize("name", OPTIM)
def test_rank0_only_optim_state_dict(ranks, name):
    for r in range(2):
        res = ranks[2][r]["vs torch", name]
        if r == 0:
            assert _osd_diff(res["rank0_only"], res["ours"]) == 0.0
        else:
            assert res["rank0_only"] == {}
        assert res["rank0_only load"]


@pytest.mark.parametrize("name", OPTIM)
def test_saved_at_two_ranks_loaded_at_three_trains_on_as_a_continuous_run(ranks, name):
    for r in range(3):
        res = ranks[3][r]["round trip", name]
        assert res["read back"] == 0.0  # the N = 2 state dict, exactly, from the N = 3 shards
        assert res["resumed"] <= 1e-6
        assert res["plain, read back"] == 0.0
        assert res["from plain"] <= 1e-6
