"""Chapter 11: torch's own tooling works on minifsdp's fully_shard, as on torch's.

1. A script written for torch's FSDP2 runs with only the import changed. The script does what torch's FSDP2
   example and torchtitan do: build the GPT under torch.device("meta"); fully_shard each block and the root
   (with a MixedPrecisionPolicy in one variant); model.to_empty(device="cpu"); initialise it from rank 0's full
   state dict with set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True); the explicit
   prefetch lists of torch's example (each block prefetches the next 2 in forward, the previous 2 in
   backward) and model.unshard() before each forward; AdamW and clip_grad_norm_; then get_model_state_dict
   and get_optimizer_state_dict (full; full with cpu_offload, which only rank 0 receives; sharded), a DCP save
   of {"model": ..., "optim": ...}, and a resume from rank 0's full dicts into a fresh meta-built model
   (set_optimizer_state_dict, broadcast from rank 0, as the example's Checkpointer does). Run once with
   `import torch.distributed.fsdp as api` and once with `import minifsdp.fsdp2 as api`, at 3 ranks: the same
   losses, the same state dicts (every tensor of the model's and the optimizer's; the sharded ones shard by
   shard), the same DCP checkpoint on disk -- bit-exact.
2. Checkpoints move between the two through DCP, both ways, across world sizes: torch's fully_shard at 2 ranks
   saves (get_state_dict + dcp.save); minifsdp's fully_shard at 3 ranks loads it (dcp.load into
   get_state_dict's dicts, then set_state_dict) and trains on, with the same losses, bit for bit, as torch's
   fully_shard doing the same resume at 3 ranks. minifsdp at 3 then saves, and torch's and minifsdp's
   fully_shard at 2 ranks resume from that, again with the same losses. The state right after a load is the
   saved state, exactly (model, optimizer moments and step, the hyper-parameters). Chapter 10's
   minifsdp.checkpoint.save / load does the same between the two (torch's at 2 -> minifsdp's at 3, and back),
   and ends where the DCP route does.
3. torch.distributed.tensor.distribute_tensor of a full tensor, into a parameter's device_mesh and
   placements, gives exactly that parameter's local shard, for every parameter, at 3 ranks: the GPT (32
   rows -> 11, 11, 10) and a model whose (1, 13) parameter leaves ranks 1 and 2 an empty shard.

Tolerance: none; every comparison is exact. Why it can be: the two fully_shards compute the same bits
(tests/test_ch11_fully_shard.py), and what torch's state-dict functions and DCP do is copy: a full state
dict is an all-gather of the shards, a broadcast from rank 0 is a copy into each shard, a DCP load at
another world size copies the saved shards' rows into the new ones. Nothing in minifsdp/fsdp2 needed to
change for this: torch.distributed.checkpoint.state_dict looks for FSDP1's FullyShardedDataParallel
(FSDP.fsdp_modules) only; for fully_shard -- torch's or minifsdp's -- it calls the model's own state_dict()
and load_state_dict(), whose values are DTensors, and gathers, broadcasts or distributes them by their
device_mesh and placements. minifsdp's parameters are DTensors with torch's layout (Shard(0), cut as
torch.chunk cuts), and a parameter replaced or refilled since fully_shard (to_empty, a load) is taken up at
the first unshard (FSDPParam.refresh_sharded).

Three launches: torch at 2 ranks trains and saves; at 3 ranks, parts 1 and 3 and the resumes from 2 (minifsdp
saves); at 2 ranks, the resumes from 3. The comparisons are made here, in the test process.

Nothing is computed twice to be compared with itself: the script takes each kind of state dict once and uses
it for the checks, the DCP save (the sharded ones, which get_state_dict would make again) and the
Checkpointer's resume (the full, offloaded ones); torch's fully_shard resumes through DCP only (through chapter
10's route it would load the same state into the same model: torch's to torch's, not between the two), and
minifsdp's at 2 ranks through DCP only (chapter 10's route there would be minifsdp's to minifsdp's). A resume
compares its state with another resume at the same world size by each rank's shards (the full state only
where a load at another world size compares with it).
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from minifsdp import checkpoint, launch
from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.train import batch, loss_of

CONFIG = GPTConfig(n_layer=3)  # three blocks: block 0 prefetches 1 and 2 in forward, block 2 prefetches 1 and 0
PREFETCH = 2                   # in backward (torch's example: num_to_forward_prefetch = num_to_backward_prefetch = 2)
STEPS = 2                      # steps of the script (part 1)
SAVED_AT, RESUMED = 2, 2       # part 2: steps before the first save, steps after each resume
GLOBAL_BATCH = 12              # divides by 2 and 3
MAX_NORM = 0.5
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def api(impl):
    """Where a script imports fully_shard, FSDPModule and MixedPrecisionPolicy from: the one line that changes."""
    if impl == "minifsdp":
        import minifsdp.fsdp2 as mod
    else:
        import torch.distributed.fsdp as mod
    return mod


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def data(step):
    return batch("gpt", step, GLOBAL_BATCH, dist.get_rank(), dist.get_world_size(), "cpu", CONFIG)


# -- 1. torch's FSDP2 script, with either import ---------------------------------------------------------------------
def build(impl, mp=False):
    """torch's example: the model built on the meta device (no memory), each block and then the root sharded,
    memory given with to_empty (uninitialised: a load or an init fills it)."""
    fsdp = api(impl)
    with torch.device("meta"):
        model = TinyGPT(CONFIG, seed=0)
    options = {"mp_policy": fsdp.MixedPrecisionPolicy(**BF16)} if mp else {}
    for block in model.blocks:
        fsdp.fully_shard(block, **options)
    fsdp.fully_shard(model, **options)
    model.to_empty(device="cpu")
    return model


def set_prefetch(model, k=PREFETCH):
    """torch's example, word for word but for the names: its set_modules_to_forward_prefetch and
    set_modules_to_backward_prefetch helpers."""
    for i, layer in enumerate(model.blocks):
        if i >= len(model.blocks) - k:
            break
        layer.set_modules_to_forward_prefetch([model.blocks[i + j] for j in range(1, k + 1)])
    for i, layer in enumerate(model.blocks):
        if i < k:
            continue
        layer.set_modules_to_backward_prefetch([model.blocks[i - j] for j in range(1, k + 1)])


def step(model, opt, i):
    model.unshard()  # torch's example with explicit prefetching: the root's all-gather before its forward
    loss = loss_of("gpt", model, data(i))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def portable(tree):
    """What a rank sends back: tensors detached and cloned, a DTensor as ("DTensor", its local shard, placements)."""
    if isinstance(tree, DTensor):
        return ("DTensor", tree.to_local().detach().clone(), tuple(map(str, tree.placements)))
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: portable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(portable(v) for v in tree)
    return tree


def script(impl, mp, save_dir):
    fsdp = api(impl)
    full = {}  # loaded on rank 0 only; the others receive it by broadcast
    model = build(impl, mp)
    checks = {"fsdp_modules": all(isinstance(m, fsdp.FSDPModule) for m in [model, *model.blocks]),
              "dtensors": all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())}
    if dist.get_rank() == 0:
        full = TinyGPT(CONFIG, seed=0).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    set_prefetch(model)
    if mp:  # torch's example's inspect_mixed_precision: unsharded, the root's own parameters are in bf16
        model.unshard()
        checks["bf16_unsharded"] = all(p.dtype == torch.bfloat16 for p in model.parameters(recurse=False))
        model.reshard()
        checks["fp32_sharded"] = all(p.dtype == torch.float32 for p in model.parameters())
    opt = adamw(model)
    losses = [step(model, opt, i) for i in range(STEPS)]
    out = {"checks": checks, "losses": torch.stack(losses)}
    dicts = {name: {"model": get_model_state_dict(model, options=options),
                    "optim": get_optimizer_state_dict(model, opt, options=options)}
             for name, options in {"full": StateDictOptions(full_state_dict=True),
                                   "full_cpu": StateDictOptions(full_state_dict=True, cpu_offload=True),
                                   "sharded": StateDictOptions()}.items()}
    out.update({name: portable(d) for name, d in dicts.items()})
    dcp.save(dicts["sharded"], checkpoint_id=save_dir)  # get_state_dict's defaults: the sharded dicts
    # torch's example's Checkpointer: resume a fresh model from rank 0's full (cpu_offload) dicts, by broadcast
    # (the ones just taken: the same calls, the same state)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    msd, osd = dicts["full_cpu"]["model"], dicts["full_cpu"]["optim"]
    fresh = build(impl, mp)
    set_model_state_dict(fresh, msd, options=from_rank0)
    fresh_opt = adamw(fresh)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=from_rank0)
    set_prefetch(fresh)
    out["next"] = torch.stack([step(model, opt, STEPS), step(fresh, fresh_opt, STEPS)])  # the same step, twice
    out["distribute_after_training"] = distribute_matches(model, {k: p.detach().full_tensor() for k, p in
                                                                  model.named_parameters()})
    return out


# -- 3. distribute_tensor of a full tensor: the parameter's own shard -----------------------------------------------
class Uneven(nn.Module):
    """A (1, 13) parameter (one row: ranks 1 and 2 of 3 hold none of it), Linear(13, 7) and Linear(7, 3)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(1, 13))
        self.inp, self.out = nn.Linear(13, 7), nn.Linear(7, 3)


def distribute_matches(model, full):
    """For every parameter: (distribute_tensor(full tensor, its mesh, its placements) is the same DTensor, and
    its local shard has the same bits; this rank's number of rows)."""
    out = {}
    for name, p in model.named_parameters():
        d = distribute_tensor(full[name], p.device_mesh, p.placements)
        same = (d.device_mesh == p.device_mesh and d.placements == p.placements and d.shape == p.shape
                and d.stride() == p.stride() and d.to_local().shape == p.to_local().shape
                and torch.equal(d.to_local(), p.to_local()))
        out[name] = (same, p.to_local().shape[0])
    return out


def distribute_cases(impl):
    out = {}
    for name, make in {"gpt": lambda: TinyGPT(CONFIG, seed=0), "uneven": Uneven}.items():
        full = {k: v.detach().clone() for k, v in make().named_parameters()}
        model = make()
        api(impl).fully_shard(model)
        out[name] = distribute_matches(model, full)
    return out


# -- 2. checkpoints across the two fully_shards and world sizes ----------------------------------------------------
def full_state(model, opt):
    options = StateDictOptions(full_state_dict=True)
    return portable({"model": get_model_state_dict(model, options=options),
                     "optim": get_optimizer_state_dict(model, opt, options=options)})


def sharded_state(model, opt):
    """This rank's shards of the same dicts: what two runs at one world size, cut alike, compare by."""
    return portable({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)})


def dcp_save(model, opt, path):
    """torchtitan's way: the sharded state dicts of get_state_dict, written by DCP (each rank its shards)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(model, opt, path):
    """DCP loads in place, into the dicts get_state_dict makes for this model (its shards at this world
    size); set_state_dict then puts them into the model and the optimizer."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def train_and_save(impl, dcp_path, minifsdp_path):
    """Train SAVED_AT steps, then save both ways: DCP through torch's state-dict functions, and chapter 10's."""
    model = TinyGPT(CONFIG, seed=0)
    for block in model.blocks:
        api(impl).fully_shard(block)
    api(impl).fully_shard(model)
    opt = adamw(model)
    losses = [step(model, opt, i) for i in range(SAVED_AT)]
    dcp_save(model, opt, dcp_path)
    checkpoint.save(minifsdp_path, model, opt)
    return {"losses": torch.stack(losses), "state": full_state(model, opt)}


def resume(impl, route, path, save_to=None):
    """A fresh meta-built model and a fresh optimizer (torch's defaults: lr 1e-3, weight decay 1e-2, to be
    replaced by the checkpoint's), loaded from `path` by `route`, trained RESUMED steps; save_to: then saved
    (DCP, chapter 10's), and its full state returned as "saved" (to compare with a load at another world
    size; "state", this rank's shards, compares with another resume at this world size)."""
    model = build(impl)
    opt = torch.optim.AdamW(model.parameters())
    if route == "dcp":
        dcp_load(model, opt, path)
    else:
        checkpoint.load(path, model, opt)
    loaded = full_state(model, opt)
    losses = [step(model, opt, SAVED_AT + i) for i in range(RESUMED)]
    out = {"loaded": loaded, "losses": torch.stack(losses), "state": sharded_state(model, opt)}
    if save_to is not None:
        dcp_save(model, opt, save_to[0])
        checkpoint.save(save_to[1], model, opt)
        out["saved"] = full_state(model, opt)
    return out


# -- the three launches ---------------------------------------------------------------------------------------------
def at_2_save(d):
    return train_and_save("torch", f"{d}/torch2", f"{d}/torch2_minifsdp")


def at_3(d):
    out = {("script", impl, mp): script(impl, mp, f"{d}/script_{impl}_{mp}")
           for mp in (False, True) for impl in ("torch", "minifsdp")}
    out["distribute"] = {impl: distribute_cases(impl) for impl in ("torch", "minifsdp")}
    # torch's resume once, through DCP: through chapter 10's route it would load the same state and take the
    # same steps (torch's to torch's is not between the two)
    out[("resume", "torch", "dcp")] = resume("torch", "dcp", f"{d}/torch2")
    out[("resume", "minifsdp", "minifsdp")] = resume("minifsdp", "minifsdp", f"{d}/torch2_minifsdp")
    out[("resume", "minifsdp", "dcp")] = resume("minifsdp", "dcp", f"{d}/torch2",
                                                save_to=(f"{d}/minifsdp3", f"{d}/minifsdp3_minifsdp"))
    return out


def at_2_resume(d):
    # minifsdp's through chapter 10's route would be minifsdp's to minifsdp's: not between the two
    return {(impl, route): resume(impl, route, f"{d}/minifsdp3" if route == "dcp" else f"{d}/minifsdp3_minifsdp")
            for impl, route in (("torch", "dcp"), ("minifsdp", "dcp"), ("torch", "minifsdp"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("interop"))
    saved = launch(at_2_save, world_size=2, args=(d,), device="cpu")
    at3 = launch(at_3, world_size=3, args=(d,), device="cpu")
    at2 = launch(at_2_resume, world_size=2, args=(d,), device="cpu")
    return {"dir": d, "saved": saved, "at3": at3, "at2": at2}


def differences(a, b, where=""):
    """Where two results differ: tensors by dtype, shape and bits (torch.equal), everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(set(a) ^ set(b), key=str)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


# -- 1 ----------------------------------------------------------------------------------------------------------------
@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_torch_script_runs_with_only_the_import_changed(runs, mp):
    for r in range(3):
        ours, theirs = runs["at3"][r][("script", "minifsdp", mp)], runs["at3"][r][("script", "torch", mp)]
        assert all(ours["checks"].values()) and ours["checks"] == theirs["checks"], ours["checks"]
        assert torch.equal(ours["losses"], theirs["losses"])
        for name in ("full", "full_cpu", "sharded"):
            assert differences(ours[name], theirs[name]) == [], name
        assert torch.equal(ours["next"], theirs["next"])
        assert ours["next"][0] == ours["next"][1]  # the fresh model, resumed from rank 0's dicts: the same step
        full = ours["full"]
        assert set(full["model"]) == set(TinyGPT(CONFIG).state_dict())
        assert all(isinstance(v, torch.Tensor) for v in full["model"].values())
        assert set(full["optim"]["state"]["wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
        assert full["optim"]["state"]["wte.weight"]["step"].item() == STEPS
        # cpu_offload: only rank 0 receives the full dicts (torch's rule), the same ones
        if r == 0:
            assert differences(ours["full_cpu"], ours["full"]) == []
        else:
            assert ours["full_cpu"] == {"model": {}, "optim": {}}
        # sharded: this rank's DTensor shards, Shard(0)
        assert all(v[0] == "DTensor" and v[2] == ("S(0)",) for v in ours["sharded"]["model"].values())


@pytest.mark.exercise("11.1", "11.2")
@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_the_dcp_checkpoints_of_the_script_are_the_same(runs, mp, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    loaded = {}
    for impl in ("torch", "minifsdp"):
        dcp_to_torch_save(f"{runs['dir']}/script_{impl}_{mp}", tmp_path / impl)
        loaded[impl] = torch.load(tmp_path / impl, weights_only=True)
    assert differences(loaded["minifsdp"], loaded["torch"]) == []
    # ...and it holds the full state the script's ranks had
    assert differences(loaded["minifsdp"]["model"], runs["at3"][0][("script", "minifsdp", mp)]["full"]["model"]) == []


# -- 2 ----------------------------------------------------------------------------------------------------------------
@pytest.mark.exercise("11.1", "11.2")
def test_torch_at_2_to_minifsdp_at_3_through_dcp(runs):
    saved = runs["saved"][0]["state"]
    for r in range(3):
        ours, theirs = runs["at3"][r][("resume", "minifsdp", "dcp")], runs["at3"][r][("resume", "torch", "dcp")]
        assert differences(ours["loaded"], saved) == []  # what torch's fully_shard saved, exactly
        assert differences(theirs["loaded"], saved) == []
        assert torch.equal(ours["losses"], theirs["losses"])
        assert differences(ours["state"], theirs["state"]) == []


@pytest.mark.exercise("11.1", "11.2")
def test_minifsdp_at_3_to_torch_at_2_through_dcp(runs):
    saved = runs["at3"][0][("resume", "minifsdp", "dcp")]["saved"]
    for r in range(2):
        ours, theirs = runs["at2"][r][("minifsdp", "dcp")], runs["at2"][r][("torch", "dcp")]
        assert differences(theirs["loaded"], saved) == []  # what minifsdp's fully_shard saved, exactly
        assert differences(ours["loaded"], saved) == []
        assert torch.equal(ours["losses"], theirs["losses"])
        assert differences(ours["state"], theirs["state"]) == []


@pytest.mark.exercise("11.1", "11.2")
def test_minifsdp_checkpoint_between_the_two(runs):
    """Chapter 10's save and load between the two: torch's at 2 -> minifsdp's at 3; minifsdp's at 3 -> torch's
    at 2. The same as torch's resume through DCP, to the bit."""
    for r in range(3):
        res = runs["at3"][r]
        assert differences(res[("resume", "minifsdp", "minifsdp")], res[("resume", "torch", "dcp")]) == []
    for r in range(2):
        assert differences(runs["at2"][r][("torch", "minifsdp")], runs["at2"][r][("torch", "dcp")]) == []


# -- 3 ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", [pytest.param("minifsdp", marks=pytest.mark.exercise("11.1", "11.2")), "torch"])
def test_distribute_tensor_gives_each_parameters_shard(runs, impl):
    for r in range(3):
        cases = runs["at3"][r]["distribute"][impl]
        for model, params in cases.items():
            assert all(same for same, _ in params.values()), (model, params)
        assert cases["uneven"]["gain"][1] == (1 if r == 0 else 0)  # ranks 1 and 2: an empty shard
        assert cases["gpt"]["wpe.weight"][1] == (11, 11, 10)[r]    # 32 rows, torch.chunk's cut
        after = runs["at3"][r][("script", impl, False)]["distribute_after_training"]
        assert all(same for same, _ in after.values())
