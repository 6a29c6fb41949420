"""Chapter 6's diagrams show what the package does (chapters/diagrams/ch06_runtime.py).

- fsdp_wrap_units: the units each wrap policy makes of the tour GPT, their sizes, and what the FlatParameter
  of the root and of a block holds, in its order.
- fsdp_step: the order of one step's collectives under FULL_SHARD without prefetching, and which units hold
  their full parameters while each block computes, forward and backward.
- fsdp1_strategies: each sharding strategy's shard and replicate groups at four ranks, which part of a unit
  each rank holds, and the collectives a unit goes through.
"""

import importlib

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from minifsdp import comm, events, launch  # noqa: E402
from minifsdp.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from minifsdp.fsdp import ModuleWrapPolicy, ShardingStrategy, SizeBasedWrapPolicy  # noqa: E402
from minifsdp.models import Block, GPTConfig, TinyGPT  # noqa: E402

from diagram_modules import diagram_module  # noqa: E402

ch06 = diagram_module("ch06_runtime")


# -- units and wrap policies --------------------------------------------------------------------------------------
def _units():
    from minifsdp.reports.tour import TOUR_MODEL

    out = {}
    for name, policy in (("class", ModuleWrapPolicy({Block})), ("size", SizeBasedWrapPolicy(ch06.SIZE_POLICY_MIN))):
        net = TinyGPT(TOUR_MODEL)
        module_names = {m: n for n, m in net.named_modules()}
        model = FSDP(net, auto_wrap_policy=policy, backward_prefetch=None)
        units = []
        for unit_name, unit in model.named_units():
            flat = unit.flat_params[0]
            prefix = "" if unit_name == "" else unit_name + "."
            seen, params = set(), []
            for (module, attr), i in zip(flat.places, flat.index):
                if i not in seen:
                    seen.add(i)
                    params.append((f"{module_names[module]}.{attr}".removeprefix(prefix), flat.numels[i]))
            units.append((unit_name or "(root)", flat.numel, params))
        out[name] = units
    return out


@pytest.fixture(scope="module")
def units():
    return launch(_units, world_size=1, device="cpu")[0]


def test_the_units_each_policy_makes(units):
    assert [(u, n) for u, n, _ in units["class"]] == ch06.UNITS_BY_CLASS
    assert [(u, n) for u, n, _ in units["size"]] == ch06.UNITS_BY_SIZE
    # the tree's sizes are the model's
    net = TinyGPT(importlib.import_module("minifsdp.reports.tour").TOUR_MODEL)
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in net.named_modules()}
    for depth, name, numel, _, _ in ch06.WRAP_TREE:
        if name == "TinyGPT":
            assert numel == sizes[""]
        elif name == "blocks.1-3":
            assert numel == sum(sizes[f"blocks.{k}"] for k in (1, 2, 3))
        elif name == "lm_head":
            assert net.lm_head.weight is net.wte.weight and numel == 0  # tied: no parameter of its own
        else:
            assert numel == sizes[name if depth == 1 else f"blocks.0.{name}"], name


def test_what_each_flat_parameter_holds(units):
    held = {u: params for u, _, params in units["class"]}
    for unit, params in ch06.FLAT_BY_CLASS:
        assert held[unit] == params, unit
    assert all(sum(n for _, n in params) == dict(ch06.UNITS_BY_CLASS)[u] for u, params in ch06.FLAT_BY_CLASS)


# -- one step, unit by unit ---------------------------------------------------------------------------------------
def _one_step(raf: bool):
    model = FSDP(TinyGPT(GPTConfig(n_layer=3), seed=0), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 backward_prefetch=None, reshard_after_forward=raf)
    x = torch.randint(0, 64, (2, 16))
    held = {}

    def on_begin(name):
        held[name] = sorted(u.unit_name for u in model.units() if any(f.is_unsharded for f in u.flat_params))

    events.subscribe(events.COMPUTE_BEGIN, on_begin)
    try:
        with comm.counting(record=True) as forward:
            loss = model(x, x)
        with comm.counting(record=True) as backward:
            loss.backward()
    finally:
        events.unsubscribe(events.COMPUTE_BEGIN, on_begin)
    return {"forward": [(e.kind, e.tag.split(" ", 1)[1]) for e in forward.events],
            "backward": [(e.kind, e.tag.split(" ", 1)[1]) for e in backward.events], "held": held}


def _both_steps():
    return {"raf": _one_step(True), "nraf": _one_step(False)}


@pytest.fixture(scope="module")
def steps():
    return launch(_both_steps, world_size=2, device="cpu")[0]


def _collectives(schedule):
    kinds = {"AG": "all_gather", "RS": "reduce_scatter"}
    return [(kinds[what], unit) for unit, what, _, _ in schedule if what in kinds]


def test_the_step_s_collectives_come_in_the_drawn_order(steps):
    for mode, backward in (("raf", ch06.STEP_BACKWARD), ("nraf", ch06.STEP_BACKWARD_NRAF)):
        assert steps[mode]["forward"] == _collectives(ch06.STEP_FORWARD), mode
        assert steps[mode]["backward"] == _collectives(backward), mode
    # drawn in issue order, and no collective drawn before the one issued ahead of it
    for schedule in (ch06.STEP_FORWARD, ch06.STEP_BACKWARD, ch06.STEP_BACKWARD_NRAF):
        starts = [a for _, what, a, _ in schedule if what in ("AG", "RS")]
        assert starts == sorted(starts)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_drawn_bands_are_the_units_unsharded_while_each_block_computes(steps, phase):
    step = steps["raf"]
    schedule = ch06.STEP_FORWARD if phase == "forward" else ch06.STEP_BACKWARD
    root_kept_to = 14 if phase == "forward" else None
    bands = {u: ch06.step_unsharded(schedule, u, root_kept_to, kept=u == "(root)" and root_kept_to is not None)
             for u in ch06.STEP_UNITS}
    boxes = [(u, a, b) for u, what, a, b in schedule if what in ("fwd", "bwd")]
    assert [u for u, _, _ in boxes] == (ch06.STEP_UNITS[1:] if phase == "forward" else ch06.STEP_UNITS[:0:-1])
    for unit, a, b in boxes:
        drawn = sorted(u for u, (s, e) in bands.items() if s <= a and b <= e)
        assert drawn == step["held"][f"{phase} {unit}"], (phase, unit)


@pytest.mark.parametrize("mode", ["raf", "nraf"])
def test_raf_and_nraf_bands_are_the_units_unsharded_while_each_block_computes(steps, mode):
    backward = ch06.STEP_BACKWARD if mode == "raf" else ch06.STEP_BACKWARD_NRAF
    shift = max(b for _, _, _, b in ch06.STEP_FORWARD)
    bands = ch06.raf_bands(ch06.STEP_FORWARD, backward, keep=mode == "nraf")
    for phase, schedule, offset in (("forward", ch06.STEP_FORWARD, 0), ("backward", backward, shift)):
        for unit, what, a, b in schedule:
            if what in ("fwd", "bwd"):
                drawn = sorted(u for u, spans in bands.items()
                               if any(s <= offset + a and offset + b <= e for s, e in spans))
                assert drawn == steps[mode]["held"][f"{phase} {unit}"], (mode, phase, unit)


# -- the runtime's hooks -------------------------------------------------------------------------------------------
def _hooks_of_one_step():
    model = FSDP(TinyGPT(GPTConfig(n_layer=2), seed=0), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 backward_prefetch=None)
    unit = dict(model.named_units())["blocks.0"]
    calls = []

    def spy(owner, name):
        method = getattr(owner, name)

        def called(*args, **kwargs):
            out = method(*args, **kwargs)
            calls.append((name, unit.training_state.name))
            return out
        setattr(owner, name, called)  # on the instance: the hooks look their method up when they run

    for name in ("pre_forward", "post_forward", "pre_backward", "_before_concat", "post_backward"):
        spy(unit, name)
    spy(model, "finish_backward")
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()
    return calls


def test_the_hooks_run_in_the_drawn_order_and_leave_the_drawn_state():
    calls = launch(_hooks_of_one_step, world_size=1, device="cpu")[0]
    drawn = [(method, state) for method, _, _, state in ch06.HOOKS if method is not None]
    assert [name for name, _ in calls] == [method for method, _ in drawn]
    for (name, state), (_, drawn_state) in zip(calls, drawn):
        assert drawn_state in (None, state), name
    assert calls[-2] == ("post_backward", "POST_BACKWARD") and calls[-1] == ("finish_backward", "IDLE")


# -- FSDP1's strategies as process groups --------------------------------------------------------------------------
def _strategies():
    from minifsdp.distributed.mesh import init_mesh
    from minifsdp.fsdp.fsdp1.arguments import ReplicatedFlatParameter

    def ranks(group):
        return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)

    out = {}
    for name, _, _, _ in ch06.STRATEGIES:
        extra = {"device_mesh": init_mesh((2, 2), ("replicate", "shard"))} if name == "HYBRID_SHARD" else {}
        model = FSDP(TinyGPT(GPTConfig(n_layer=1)), sharding_strategy=ShardingStrategy[name],
                     backward_prefetch=None, **extra)
        flat = model.flat_params[0]
        replicate = flat.replicate_group
        replicated = isinstance(flat, ReplicatedFlatParameter) or replicate is not None
        x = torch.randint(0, 64, (2, 16))
        with comm.counting(record=True) as c:
            model(x, x).backward()
        out[name] = {"shard": ranks(flat.group), "part": flat.rank, "replicate": ranks(replicate) if replicated
                     else None, "raf": model.reshard_after_forward, "kinds": sorted({e.kind for e in c.events})}
    return out


@pytest.fixture(scope="module")
def strategies():
    return launch(_strategies, world_size=4, device="cpu")


def test_each_strategy_s_groups_and_collectives(strategies):
    for name, shard, replicate, raf in ch06.STRATEGIES:
        for r, got in enumerate(strategies):
            got = got[name]
            group = next(g for g in shard if r in g)
            assert got["shard"] == group and got["part"] == group.index(r), (name, r)
            assert got["replicate"] == (None if replicate is None else next(g for g in replicate if r in g)), name
            assert got["raf"] == raf, name
            gathers = ["all_gather"] if len(group) > 1 else []
            assert got["kinds"] == sorted(gathers + ch06.strategy_collectives(shard, replicate)), name
