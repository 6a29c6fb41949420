"""Chapter 10: save and load training state for every strategy, at any world size (minifsdp/checkpoint).

The heart of it: a run saved at step 2 and resumed -- by the same strategy or another, on the same number of
ranks or another -- reaches step 3 where the uninterrupted run does. Both step-3 checkpoints are turned into
plain dicts (dcp_to_torch_save) and compared: every parameter, every optimizer state tensor of every parameter
(momentum_buffer; exp_avg, exp_avg_sq and the step count, which must match exactly). The model is the default
GPT with one block (MODEL): the same kinds of tensors as with two, 15 parameters to save and compare, not 26.

Which resumes, and why these. checkpoint/state.py reaches each strategy's state through one of five layouts
(strategy_of(), which test_load_returns_step_extra_strategy_and_world_size checks against LAYOUTS): replicated
(DDP), oss (OSS and SDP: each parameter's optimizer state whole, on its owner), flat (the flat ZeRO-1 and ZeRO-2:
rank r's chunk of every flat bucket), fsdp (minifsdp's FSDP with and without resharding after forward, in bf16,
with CPU offload: pieces of each unit's flat shard; at one rank NO_SHARD, plain views) and dtensor (torch's
fully_shard). What a save writes and a load reads in place depends on the layout and the world size, not on
which strategy of a layout runs it, nor on the optimizer: a momentum buffer, exp_avg and exp_avg_sq are cut as
their parameter is, in either direction, and AdamW's 0-dim step is whole wherever a piece of its parameter is.
What the strategies of one layout do differently is train, which the same-size resumes check bit for bit. So:
- the same world size (SAME): every strategy, with SGD-momentum and with AdamW, at 3 ranks (uneven shards, and
  DDP's rebuilt buckets change the sums there), and FSDP at 1 rank too (NO_SHARD);
- another world size (MOVES): the first strategy of each layout from 2 to 3 ranks with one optimizer and from
  3 to 2 with the other, swapped from one layout to the next, so each optimizer goes up and down; FSDP also
  4 -> 1 and 1 -> 4 (sharded to NO_SHARD and back), and FSDP in bf16 3 -> 2;
- another strategy (OTHERS), at another world size too: each strategy's checkpoint resumed by another one, so
  every layout is written by one and read by another;
- every N -> M of 1..4 for FSDP (AdamW): loaded, then saved again at once, gives back the same checkpoint, bit
  for bit -- no step after the load, so no tolerance.
FSDP in mixed precision or with CPU offload needs a sharded unit: at one rank FSDP runs NO_SHARD, which takes
neither (as PyTorch's), so those two run at 2 and 3 ranks only.

Tolerance (measured over the jobs of RESUMES, the largest of compare()'s values, and with STOP = 4 for two
steps after the load):
- same strategy, same world size: bit-exact, and the whole checkpoint (random generators, step, extra, the
  hyper-parameters) identical. A load puts back the very bits that were saved, and the resumed run repeats
  the same arithmetic in the same order -- DDP's buckets included: rebuilt in the order gradients arrived
  after its first backward, they group the all-reduce's sums, so the checkpoint keeps them (without that,
  DDP and OSS at 3 ranks were 3.7e-9 off).
- another world size or another strategy, fp32: 1e-6 absolute (measured: 6.0e-8 on the parameters, one last
  bit of a LayerNorm weight near 1; 3.0e-8 on the momentum). The loaded state is exact; what differs is the
  step after it: the global batch is the same, but it is split into another number of slices, whose
  gradients are summed in another order (and each strategy reduces in buckets and chunks of its own), so the
  last bit of some gradients differs. (Two steps after the load: 6.0e-8 and 3.5e-8.)
- bf16 mixed precision, another world size or strategy: 4e-3 absolute (measured: 4.9e-4 on the momentum, and
  on the parameters 2.4e-5 with SGD, 5.9e-4 with AdamW; two steps after the load: 8.2e-4, 5.9e-5, 6.1e-4).
  The same cause, but the gradients are reduced in bf16, whose 8-bit mantissa rounds in relative steps of
  2^-8, not fp32's 2^-24: a gradient, and the momentum buffer it is added to, differ by such a step (4.9e-4 =
  2^-11, the step between 1/16 and 1/8); SGD moves the fp32 master parameters by lr (0.05) times it, AdamW
  divides by the root of v, so where gradients are small the step changes by a fair part of its lr (3e-3).

The ranks are launched once per world size for all the uninterrupted runs, then once per world size for all
the resumed ones (module-scoped fixtures); the other checks -- a rank killed in the middle of a save, a
checkpoint that does not fit the model, rotation, unsafe metadata, random generators, `extra` -- are small.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from minifsdp import CPUOffload, GPTConfig, MixedPrecision, RankFailedError, checkpoint, launch
from minifsdp.state_dict import get_full_state_dict
from minifsdp.train import STRATEGIES, batch, build_model, loss_of

GB = 12            # the global batch, whatever the world size: 12 divides by 1, 2, 3 and 4
MODEL = GPTConfig(n_layer=1)  # the default GPT with one block (FSDP: the root's unit and the block's)
START, STOP = 2, 3  # the uninterrupted run saves at both; a resumed run loads START, trains to STOP and saves
OPTIMS = ("sgd", "adamw")
TOL = {"fp32": 1e-6, "bf16": 4e-3}

# name: (strategy, bf16 mixed precision, CPU offload)
CONFIGS = {
    "ddp": ("ddp", False, False),
    "oss": ("oss", False, False),
    "sdp": ("sdp", False, False),
    "oss_flat": ("oss_flat", False, False),
    "sdp_flat": ("sdp_flat", False, False),
    "fsdp": ("fsdp", False, False),
    "fsdp_nraf": ("fsdp_nraf", False, False),
    "torch_fsdp2": ("torch_fsdp2", False, False),
    "fsdp_bf16": ("fsdp", True, False),
    "fsdp_offload": ("fsdp", False, True),
    "torch_fsdp2_bf16": ("torch_fsdp2", True, False),  # only resumes fsdp_bf16: the same policy, torch's code
}
SOURCES = [c for c in CONFIGS if c != "torch_fsdp2_bf16"]

# The layouts checkpoint/state.py tells apart (what strategy_of() returns, checked by the tests), each with the
# strategies whose state reaches a checkpoint through it; the first of each goes through 2 -> 3 and 3 -> 2.
LAYOUTS = {"replicated": ("ddp",), "oss": ("oss", "sdp"), "flat": ("oss_flat", "sdp_flat"),
           "fsdp": ("fsdp", "fsdp_nraf", "fsdp_bf16", "fsdp_offload"), "dtensor": ("torch_fsdp2", "torch_fsdp2_bf16")}
# (source, optimizer, N, M, target). Saved and resumed at the same N, bit for bit: every strategy, both optimizers,
# at 3 ranks (uneven shards; DDP's rebuilt buckets matter), and FSDP at 1 (NO_SHARD, plain views of a flat buffer)
SAME = [(c, o, n, n, c) for c in SOURCES for o in OPTIMS for n in ((1, 3) if c == "fsdp" else (3,))]
# Another world size, same strategy: each layout up (2 -> 3) and down (3 -> 2), one optimizer each way, the other
# way round for the next layout; FSDP also sharded -> NO_SHARD and back, and in bf16 (a tolerance of its own)
MOVES = [(layout[0], o, n, m, layout[0]) for i, layout in enumerate(LAYOUTS.values())
         for (n, m), o in zip(((2, 3), (3, 2)), OPTIMS[::-1] if i % 2 else OPTIMS)] \
    + [("fsdp", "adamw", 4, 1, "fsdp"), ("fsdp", "sgd", 1, 4, "fsdp"), ("fsdp_bf16", "sgd", 3, 2, "fsdp_bf16")]
# Another strategy, at another world size: each strategy's checkpoint resumed by another, every layout written
# by one and read by another; the first four are the ones the chapter names
OTHERS = [("fsdp", "adamw", 4, 1, "ddp"), ("fsdp", "adamw", 4, 3, "oss"), ("sdp", "sgd", 2, 3, "oss_flat"),
          ("torch_fsdp2", "sgd", 2, 3, "fsdp"), ("ddp", "sgd", 3, 2, "fsdp_offload"),
          ("oss", "adamw", 3, 2, "sdp_flat"), ("oss_flat", "sgd", 3, 2, "torch_fsdp2"),
          ("sdp_flat", "adamw", 3, 2, "fsdp_nraf"), ("fsdp_nraf", "sgd", 3, 2, "sdp"),
          ("fsdp_bf16", "adamw", 3, 2, "torch_fsdp2_bf16"), ("fsdp_offload", "adamw", 3, 2, "fsdp")]
RESUMES = sorted(set(SAME + MOVES + OTHERS), key=lambda j: (j[3], j[0], j[1], j[2], j[4]))
RUNS = sorted({(j[0], j[1], j[2]) for j in RESUMES})  # (config, optimizer, N): the uninterrupted runs they start from


def _id(job):
    src, optim, n, m, dst = job
    return f"{src}-{optim}-{n}to{m}" + ("" if dst == src else f"-as-{dst}")


# the strategies whose flat shards are saved as boxes of the original parameters (flat_chunks.py, exercises 10.x)
FLAT = {c for c, (strategy, _, _) in CONFIGS.items() if strategy in ("fsdp", "fsdp_nraf", "oss_flat", "sdp_flat")}
BOXES = pytest.mark.exercise("10.1", "10.2")


def _job(job):
    return pytest.param(job, id=_id(job), marks=BOXES if {job[0], job[4]} & FLAT else ())


def build(config, optim, gpt_config=None):
    strategy, bf16, offload = CONFIGS[config]
    return STRATEGIES[strategy].build(build_model("gpt", seed=0, gpt_config=gpt_config), optim, False,
                                      mp=MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None,
                                      offload=CPUOffload(offload_params=True) if offload else None)


def train_steps(model, opt, start, stop):
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(start, stop):
        loss_of("gpt", model, batch("gpt", step, GB, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()


def extra_of(config, optim, step):
    return {"step": step, "config": config, "optim": optim, "seen": [step * GB, "samples", [1, 2]],
            "loader": {"epoch": 0, "files": ["a.bin", "b.bin"]}}


def run_dir(root, config, optim, n):
    return Path(root) / f"{config}-{optim}-n{n}"


def resumed_dir(root, job):
    return Path(root) / f"resumed-{_id(job)}"


# -- the ranks ------------------------------------------------------------------------------------------------------
def uninterrupted(root, jobs):
    """Each (config, optimizer): train 0 -> STOP, saving at START and STOP; draw from the generator just after
    the save at START, where a resumed run draws just after its load."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for config, optim in jobs:
        model, opt = build(config, optim, MODEL)
        torch.manual_seed(1000 * n + r)  # each rank a generator of its own (building a TinyGPT reseeds it)
        train_steps(model, opt, 0, START)
        checkpoint.save(run_dir(root, config, optim, n), model, opt, step=START, extra=extra_of(config, optim, START))
        draw = torch.rand(3)
        train_steps(model, opt, START, STOP)
        checkpoint.save(run_dir(root, config, optim, n), model, opt, step=STOP, extra=extra_of(config, optim, STOP))
        full = get_full_state_dict(model)
        out[config, optim] = {"draw": draw, "full": full if r == 0 else None}
    return out


def resume(root, jobs):
    """Each (source, optimizer, N, M, target): build the target, load the source's START, train to STOP, save."""
    out = {}
    for job in jobs:
        src, optim, n, _, dst = job
        model, opt = build(dst, optim, MODEL)
        torch.manual_seed(12345)  # not what was saved: the load must put each rank's generator back
        info = checkpoint.load(run_dir(root, src, optim, n) / f"step_{START:08d}", model, opt)
        draw = torch.rand(3)
        train_steps(model, opt, START, STOP)
        checkpoint.save(resumed_dir(root, job), model, opt, step=STOP, extra=extra_of(src, optim, STOP))
        out[job] = {"draw": draw, "info": {k: info[k] for k in ("step", "extra", "strategy", "world_size")},
                    "layout": checkpoint.strategy_of(model, opt)}
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ch10")


@pytest.fixture(scope="module")
def runs(root):
    return {n: launch(uninterrupted, world_size=n, device="cpu", args=(root, [(c, o) for c, o, k in RUNS if k == n]))
            for n in (1, 2, 3, 4)}


@pytest.fixture(scope="module")
def resumed(root, runs):
    out = {}
    for m in (1, 2, 3, 4):
        jobs = [j for j in RESUMES if j[3] == m]
        for r, res in enumerate(launch(resume, world_size=m, device="cpu", args=(root, jobs))):
            out.update({(*job, r): v for job, v in res.items()})
    return out


# -- reading a checkpoint back as plain tensors ---------------------------------------------------------------------
def plain(path) -> dict:
    """The checkpoint at `path` as one dict of full tensors, through torch's own converter."""
    dcp_to_torch_save(path, f"{path}.pt")
    return torch.load(f"{path}.pt", weights_only=True)


@functools.cache
def uninterrupted_at(root, config, optim, n, step=STOP) -> dict:
    """An uninterrupted run's checkpoint, read once: several resumed runs are compared with each."""
    return plain(run_dir(root, config, optim, n) / f"step_{step:08d}")


def max_diff(a: dict, b: dict, skip=("step",)) -> float:
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if k not in skip), default=0.0)


def compare(a: dict, b: dict) -> dict:
    """The largest difference of the parameters and of the optimizer state, after checking that the two hold
    the same names, keys, shapes and dtypes and the same step counts."""
    assert a["model"].keys() == b["model"].keys()
    assert {k: (v.shape, v.dtype) for k, v in a["model"].items()} == \
        {k: (v.shape, v.dtype) for k, v in b["model"].items()}
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert {n: sorted(s) for n, s in sa.items()} == {n: sorted(s) for n, s in sb.items()}
    assert set(sa) == {n for n, p in build_model("gpt", 0, MODEL).named_parameters()}  # every parameter has state
    for name in sa:
        assert {k: (v.shape, v.dtype) for k, v in sa[name].items()} == \
            {k: (v.shape, v.dtype) for k, v in sb[name].items()}, name
        if "step" in sa[name]:
            assert torch.equal(sa[name]["step"], sb[name]["step"]), name
    return {"model": max_diff(a["model"], b["model"]),
            "optim": max((max_diff(sa[n], sb[n]) for n in sa), default=0.0)}


def differs(a, b, at="") -> str:
    """What tells two checkpoints (nested dicts of tensors) apart, in words: a key in one only, a shape or dtype,
    or the largest difference and where."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{at or 'the checkpoint'}: keys in one only: {sorted(map(str, set(a) ^ set(b)))[:6]}"
        worst = [differs(a[k], b[k], f"{at}.{k}" if at else str(k)) for k in a]
        return next((w for w in worst if not w.startswith("0 ")), "0 apart")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return f"{at}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        return f"{at}: {d:.3g} apart" if d else "0 apart"
    return "0 apart" if a == b else f"{at}: {a!r} against {b!r}"


BOXES_HINT = ("(exercises 10.1, 10.2): do the boxes name the elements each rank's shard holds, and are this rank's "
              "boxes views into its shard, so that a load writes into it?")


def identical(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


# -- 1, 2: resume = continuous, every strategy, world size and optimizer; and across strategies ---------------------
@pytest.mark.parametrize("job", [_job(j) for j in RESUMES])
def test_resume_equals_the_uninterrupted_run(root, runs, resumed, job):
    src, optim, n, m, dst = job
    continuous = uninterrupted_at(root, src, optim, n)
    after = plain(resumed_dir(root, job) / f"step_{STOP:08d}")
    diff = compare(continuous, after)
    hint = BOXES_HINT if {src, dst} & FLAT else "(what the strategy's state_dict gives must be all it holds)"
    if (n, dst) == (m, src):
        assert diff == {"model": 0.0, "optim": 0.0}, (
            f"{_id(job)}: resumed, the parameters end {diff['model']:.3g} and the optimizer state {diff['optim']:.3g} "
            f"from the run that never stopped, expected the same bits {hint}")
        assert identical(continuous, after), (  # generators, step, extra, hyper-parameters, buckets too
            f"{_id(job)}: the resumed run's checkpoint is not the uninterrupted one's: {differs(continuous, after)}")
    else:
        tol = TOL["bf16" if CONFIGS[src][1] else "fp32"]
        assert diff["model"] <= tol and diff["optim"] <= tol, (
            f"{_id(job)}: resumed, the parameters end {diff['model']:.3g} and the optimizer state {diff['optim']:.3g} "
            f"from the run that never stopped, expected at most {tol:g} {hint}")


# -- 8, 9: random generators, step and extra --------------------------------------------------------------------
@pytest.mark.parametrize("job", [j for j in RESUMES if j[2] == j[3] and j[0] == j[4]], ids=_id)
def test_load_puts_back_each_ranks_generator(runs, resumed, job):
    src, optim, n, _, _ = job
    draws = [resumed[(*job, r)]["draw"] for r in range(n)]
    for r in range(n):
        assert torch.equal(draws[r], runs[n][r][src, optim]["draw"]), r
    assert n == 1 or not torch.equal(draws[0], draws[1])  # each rank its own: a mix-up would show


@pytest.mark.parametrize("job", RESUMES, ids=_id)
def test_load_returns_step_extra_strategy_and_world_size(resumed, job):
    src, optim, n, m, dst = job
    layout = {config: kind for kind, configs in LAYOUTS.items() for config in configs}  # what the jobs rest on
    for r in range(m):
        info = resumed[(*job, r)]["info"]
        assert info == {"step": START, "extra": extra_of(src, optim, START), "strategy": layout[src],
                        "world_size": n}
        assert resumed[(*job, r)]["layout"] == layout[dst]


# -- 3: the checkpoint holds the full model, and converts to a file any plain model loads ---------------------------
@pytest.mark.parametrize("config, optim, n", [pytest.param(*run, id="-".join(map(str, run)),
                                                           marks=BOXES if run[0] in FLAT else ()) for run in RUNS])
def test_checkpoint_holds_the_full_parameters(root, runs, config, optim, n):
    saved = uninterrupted_at(root, config, optim, n)["model"]
    full = runs[n][0][config, optim]["full"]
    assert identical(saved, full), (
        f"{config}-{optim} at N = {n}: the checkpoint's parameters are not the model's: {differs(full, saved)} "
        + (BOXES_HINT if config in FLAT else ""))


@BOXES
@pytest.mark.parametrize("optim", OPTIMS)
def test_fsdp_checkpoint_loads_into_an_unwrapped_model(root, runs, tmp_path, optim):
    dcp_to_torch_save(run_dir(root, "fsdp", optim, 3) / f"step_{STOP:08d}", tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    model = build_model("gpt", seed=1, gpt_config=MODEL)
    full = runs[3][0]["fsdp", optim]["full"]
    assert not torch.equal(model.wpe.weight, full["wpe.weight"])
    model.load_state_dict(state, strict=True)
    assert identical({k: v for k, v in model.state_dict().items()}, full)
    assert model.lm_head.weight is model.wte.weight  # still tied


# -- 4: a rank killed in the middle of a save leaves the previous checkpoint -----------------------------------------
def save_then_die(path, copy_to):
    r = dist.get_rank()
    model, opt = build("fsdp", "adamw", MODEL)
    train_steps(model, opt, 0, 1)
    checkpoint.save(path, model, opt, extra={"which": "first"})
    if r == 0:
        shutil.copytree(path, copy_to)
    dist.barrier()
    train_steps(model, opt, 1, 2)
    if r == 1:  # rank 0 writes its file; rank 1 dies before it writes its own
        from torch.distributed.checkpoint import FileSystemWriter

        FileSystemWriter.write_data = lambda *args, **kwargs: os._exit(1)
    checkpoint.save(path, model, opt, extra={"which": "second"})
    return "the second save finished"


def load_after_crash(path, window, resaved):
    model, opt = build("fsdp", "adamw", MODEL)
    info = checkpoint.load(path, model, opt)
    checkpoint.save(resaved, model, opt)  # what was loaded, optimizer state included, written back out
    full = get_full_state_dict(model)
    model, opt = build("fsdp", "adamw", MODEL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window_info = checkpoint.load(window, model, opt)
    return {"extra": info["extra"], "full": full, "window_extra": window_info["extra"],
            "window_path": str(window_info["path"]), "window_full": get_full_state_dict(model),
            "warnings": [str(w.message) for w in caught]}


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash")
    path, first = d / "ckpt", d / "first_copy"
    with pytest.raises(RankFailedError) as failure:
        launch(save_then_die, world_size=2, device="cpu", args=(path, first))
    partial_left = (d / "ckpt.partial").exists()
    shutil.copytree(first, d / "window.old")  # as if a save died between its two renames: no `window`
    out = launch(load_after_crash, world_size=2, device="cpu", args=(path, d / "window", d / "resaved"))[0]
    return {"error": failure.value, "dir": d, "partial_left": partial_left, **out}


def test_a_killed_rank_fails_the_launch(crash):
    assert crash["error"].rank == 1 and "exited (code 1)" in str(crash["error"])


def test_a_killed_save_leaves_the_previous_checkpoint(crash):
    d = crash["dir"]
    first = plain(d / "first_copy")
    assert identical(plain(d / "ckpt"), first)  # not a byte of the second save in it
    assert crash["extra"] == {"which": "first"}
    assert identical(crash["full"], first["model"])
    assert identical(plain(d / "resaved")["optim"], first["optim"])  # the optimizer state, exactly


def test_a_save_interrupted_between_renames_loads_the_previous_one(crash):
    assert crash["window_extra"] == {"which": "first"} and crash["window_path"].endswith("window.old")
    assert identical(crash["window_full"], plain(crash["dir"] / "first_copy")["model"])
    assert any("interrupted" in w for w in crash["warnings"]), crash["warnings"]


# -- 5, 6: checkpoints that do not fit, and rotation --------------------------------------------------------------
def attempt(path, gpt_config=None, optim="adamw", strict=True, with_optimizer=True):
    """Load `path` into a model (of `gpt_config`) trained one step: (the error or None, what load returned,
    the full parameters and the optimizer state before and after)."""
    model, opt = build("fsdp", optim, gpt_config)
    train_steps(model, opt, 0, 1)
    before, opt_before = get_full_state_dict(model), copy.deepcopy(opt.state_dict())
    try:
        info, error = checkpoint.load(path, model, opt if with_optimizer else None, strict=strict), None
    except Exception as e:  # noqa: BLE001 -- the tests check its type and message
        info, error = None, f"{type(e).__name__}: {e}"
    info = info and {k: info[k] for k in ("missing_keys", "unexpected_keys", "step")}
    return {"error": error, "info": info, "before": before, "after": get_full_state_dict(model),
            "opt_before": opt_before, "opt_after": copy.deepcopy(opt.state_dict())}


def misfits(root):
    root = Path(root)
    r = dist.get_rank()
    model, opt = build("fsdp", "adamw")
    train_steps(model, opt, 0, 2)
    checkpoint.save(root / "adamw", model, opt, step=2)
    checkpoint.save(root / "no_optimizer", model)
    out = {"saved": get_full_state_dict(model)}
    path = root / "adamw"
    out["wider"] = attempt(path, GPTConfig(n_embd=48))
    out["wider_lenient"] = attempt(path, GPTConfig(n_embd=48), strict=False)
    out["vocab"] = attempt(path, GPTConfig(vocab_size=128))
    out["deeper"] = attempt(path, GPTConfig(n_layer=3))
    out["shallower"] = attempt(path, GPTConfig(n_layer=1))
    out["deeper_lenient"] = attempt(path, GPTConfig(n_layer=3), strict=False)
    out["shallower_lenient"] = attempt(path, GPTConfig(n_layer=1), strict=False)
    out["sgd"] = attempt(path, optim="sgd")
    out["no_optimizer"] = attempt(root / "no_optimizer")
    out["no_optimizer_model_only"] = attempt(root / "no_optimizer", with_optimizer=False)
    out["model_only"] = attempt(path, with_optimizer=False)

    # rotation: four saves, keep the newest two; an unfinished step_* is not a checkpoint
    model, opt = build("sdp", "adamw")
    for step in range(1, 5):
        train_steps(model, opt, step - 1, step)
        checkpoint.save(root / "rotating", model, opt, step=step, keep_last=2)
    out["kept"] = sorted(os.listdir(root / "rotating"))
    out["newest"] = get_full_state_dict(model)
    dist.barrier()  # every rank has listed the directory before rank 0 adds to it
    if r == 0:
        (root / "rotating" / "step_00000099").mkdir()  # no .metadata: a save that never finished
    dist.barrier()
    model, opt = build("sdp", "adamw")
    info = checkpoint.load(root / "rotating", model, opt)
    out["rotating_loaded"] = (info["step"], info["path"].name, get_full_state_dict(model))
    return out


@pytest.fixture(scope="module")
def misfit(tmp_path_factory):
    return launch(misfits, world_size=2, device="cpu", args=(tmp_path_factory.mktemp("misfit"),))


def _unchanged(case):
    return identical(case["after"], case["before"]) and identical(case["opt_after"], case["opt_before"])


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case, names", [("wider", ["wpe.weight", "blocks.0.fc.weight", "lm_head.weight"]),
                                         ("wider_lenient", ["wpe.weight"]),
                                         ("vocab", ["wte.weight", "lm_head.weight"])])
def test_a_mis_shaped_checkpoint_is_refused_naming_both_shapes(misfit, rank, case, names):
    r = misfit[rank][case]
    assert r["error"] is not None and r["error"].startswith("RuntimeError"), r["error"]
    for name in names:
        model_shape, saved_shape = tuple(r["before"][name].shape), tuple(misfit[rank]["saved"][name].shape)
        assert f"'{name}'" in r["error"] and str(model_shape) in r["error"] and str(saved_shape) in r["error"]
    assert _unchanged(r)


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_and_unexpected_keys_are_listed(misfit, rank):
    deeper, shallower = misfit[rank]["deeper"], misfit[rank]["shallower"]
    block_keys = [k for k in misfit[rank]["saved"] if k.startswith("blocks.1.")]
    for key in block_keys:
        assert f"missing key '{key.replace('blocks.1.', 'blocks.2.')}'" in deeper["error"], deeper["error"]
        assert f"unexpected key '{key}'" in shallower["error"], shallower["error"]
    assert _unchanged(deeper) and _unchanged(shallower)


@BOXES
@pytest.mark.parametrize("rank", [0, 1])
def test_not_strict_loads_the_rest_and_lists_the_others(misfit, rank):
    saved = misfit[rank]["saved"]
    deeper, shallower = misfit[rank]["deeper_lenient"], misfit[rank]["shallower_lenient"]
    assert deeper["error"] is None and shallower["error"] is None
    assert deeper["info"]["missing_keys"] == sorted(k for k in deeper["before"] if k.startswith("blocks.2."))
    assert deeper["info"]["unexpected_keys"] == [] and shallower["info"]["missing_keys"] == []
    assert shallower["info"]["unexpected_keys"] == sorted(k for k in saved if k.startswith("blocks.1."))
    for k, v in deeper["after"].items():  # blocks 0-1 and the rest from the checkpoint; block 2 kept its own
        assert torch.equal(v, deeper["before"][k] if k.startswith("blocks.2.") else saved[k]), k
    assert identical(shallower["after"], {k: v for k, v in saved.items() if not k.startswith("blocks.1.")})
    # the optimizer state too: the checkpoint's AdamW had taken 2 steps, these optimizers 1; one flat shard per
    # unit (the root and each block), and only block 2's has nothing in the checkpoint
    def steps(case):
        return sorted(float(state["step"]) for state in case["opt_after"]["state"].values())
    assert steps(deeper) == [1.0, 2.0, 2.0, 2.0] and steps(shallower) == [2.0, 2.0]


@pytest.mark.parametrize("rank", [0, 1])
def test_another_optimizer_is_refused(misfit, rank):
    r = misfit[rank]["sgd"]
    assert r["error"].startswith("RuntimeError") and "AdamW" in r["error"] and "SGD" in r["error"], r["error"]
    assert _unchanged(r)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_checkpoint_without_optimizer_state_is_refused_to_an_optimizer(misfit, rank):
    r = misfit[rank]["no_optimizer"]
    assert r["error"].startswith("RuntimeError") and "without an optimizer" in r["error"], r["error"]
    assert _unchanged(r)
    for case in ("no_optimizer_model_only", "model_only"):  # the model alone loads from either
        assert misfit[rank][case]["error"] is None
        assert identical(misfit[rank][case]["after"], misfit[rank]["saved"])


def test_keep_last_keeps_the_newest_and_load_takes_the_newest(misfit):
    for r in misfit:
        assert r["kept"] == ["step_00000003", "step_00000004"]
        step, name, full = r["rotating_loaded"]
        assert (step, name) == (4, "step_00000004")
        assert identical(full, r["newest"])


# -- 7: metadata that would run code is refused --------------------------------------------------------------------
class RunsCode:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: what it says
@pytest.mark.parametrize("where", ["whole", "inside"])
def test_metadata_that_runs_code_is_refused(root, runs, tmp_path, where):
    evil = tmp_path / "evil"
    shutil.copytree(run_dir(root, "ddp", "sgd", 3) / f"step_{STOP:08d}", evil)
    checkpoint.load(evil, build_model("gpt", seed=0, gpt_config=MODEL))  # loads as it is
    marker = tmp_path / "pwned"
    payload = RunsCode(f"touch {marker}")
    if where == "inside":  # hidden in a real DCP Metadata, which the loader otherwise accepts
        with open(evil / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        metadata.planner_data["innocent"] = payload
        payload = metadata
    (evil / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        checkpoint.load(evil, build_model("gpt", seed=0, gpt_config=MODEL))
    assert not marker.exists()


# -- FSDP under any wrapping: units are a layout, not part of the checkpoint ---------------------------------------
WRAPPINGS = ("one unit", "per block", "by size")


def fsdp_wrapped(wrapping):
    from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy, SizeBasedWrapPolicy
    from minifsdp.models import Block

    policy = {"one unit": None, "per block": ModuleWrapPolicy({Block}),
              "by size": SizeBasedWrapPolicy(min_num_params=4000)}[wrapping]
    model = FullyShardedDataParallel(build_model("gpt", seed=0), auto_wrap_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def save_wrapped(path, wrapping):
    model, opt = fsdp_wrapped(wrapping)
    train_steps(model, opt, 0, START)
    checkpoint.save(path, model, opt)
    return len(model.units())


def load_and_save_again(path, wrapping, again):
    """Load into another wrapping at another world size, and save at once: a load then a save is the identity."""
    model, opt = fsdp_wrapped(wrapping)
    checkpoint.load(path, model, opt)
    checkpoint.save(again, model, opt)
    return len(model.units())


@BOXES
@pytest.mark.parametrize("src, dst", [("one unit", "per block"), ("per block", "by size"), ("by size", "one unit")])
def test_fsdp_checkpoints_load_across_wrappings(tmp_path, src, dst):
    units = launch(save_wrapped, world_size=2, args=(tmp_path / "a", src))[0]
    units_after = launch(load_and_save_again, world_size=3, args=(tmp_path / "a", dst, tmp_path / "b"))[0]
    assert units != units_after  # the layouts differ: other units, other shards
    a, b = plain(tmp_path / "a"), plain(tmp_path / "b")
    assert identical(a["model"], b["model"]) and identical(a["optim"], b["optim"]), (
        f"saved at N = 2 with {src}, loaded at N = 3 with {dst} and saved again: the two checkpoints differ, "
        f"{differs(a, b)} {BOXES_HINT}")


# -- every N -> M: a load, then a save, gives back the same checkpoint ---------------------------------------------
def load_each_and_save_again(root, config, optim, sources):
    """Load each source world size's START checkpoint at this world size and save it again at once."""
    m = dist.get_world_size()
    for n in sources:
        model, opt = build(config, optim, MODEL)
        checkpoint.load(run_dir(root, config, optim, n) / f"step_{START:08d}", model, opt)
        checkpoint.save(Path(root) / f"again-{config}-{optim}-n{n}-m{m}", model, opt)


@pytest.fixture(scope="module")
def saved_again(root, runs):
    for m in (1, 2, 3, 4):
        launch(load_each_and_save_again, world_size=m, device="cpu", args=(root, "fsdp", "adamw", (1, 2, 3, 4)))
    return root


@BOXES
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_every_world_size_loads_every_other_exactly(saved_again, n, m):
    before = uninterrupted_at(saved_again, "fsdp", "adamw", n, START)
    after = plain(Path(saved_again) / f"again-fsdp-adamw-n{n}-m{m}")
    assert identical(before["model"], after["model"]) and identical(before["optim"], after["optim"]), (
        f"FSDP's checkpoint saved at N = {n}, loaded at N = {m} and saved again differs from it: "
        f"{differs({k: before[k] for k in ('model', 'optim')}, {k: after[k] for k in ('model', 'optim')})} {BOXES_HINT}")
