"""The parity matrix: every strategy of chapters 1 to 6, on small models built to trip data-parallel code up,
trained next to torch's own DistributedDataParallel (or, where a strategy differs from it on purpose, next
to torch's FSDP1) at 1 to 4 ranks, with SGD + momentum and AdamW. The models are in parity_models.py.

    rows = run_parity(world_sizes=(1, 2, 3, 4))          # one row per case
    python -m minifsdp parity --world-sizes 1 2 3 4 --markdown chapters/generated/parity.md

One launch per world size runs every case of it. A case trains STEPS steps on each rank's slice of the
same global batches, from weights built with a different seed on every rank (so it is only right if the
strategy makes every replica start from rank 0's), and compares the final parameters, by their names in
the unwrapped model, and the buffers, on every rank.

The rules of the comparison live here, once, for the report and for tests/test_parity_matrix.py:
  - `oracle(strategy, model)`: what a case is compared with -- torch's DDP, or torch's FSDP1 with the
    same units where the strategy differs from DDP by design (a zero gradient for a parameter no rank
    used; BatchNorm statistics kept per rank);
  - `tolerance(world_size, dtype)`: 0.0 (bit-exact) where the sums are added in the same order as DDP's;
    a bound in units of the dtype's epsilon where they are not.
"""

from __future__ import annotations

import functools
import warnings

import torch

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy, SizeBasedWrapPolicy
from minifsdp.reports.format import md_tabs, write_report
from minifsdp.reports.parity_models import GLOBAL_BATCH, MODELS, loss
from minifsdp.state_dict import get_full_state_dict
from minifsdp.train import OPTIMIZER_SPECS, OPTIMIZERS, STRATEGIES, max_abs_diff
from minifsdp.zero import FlatOSS, FlatShardedDataParallel

STEPS = 3
FLAT_BUCKET_MB = 4e-4  # ~100 fp32 elements: several flat buckets even on these tiny models
WORLD_SIZES = (1, 2, 3, 4)


# -- the strategies, and the two references ------------------------------------------------------------------
WRAPS = ("whole", "by_class", "by_size")


def _policy(wrap: str, model_cls):
    return {"whole": None, "by_class": ModuleWrapPolicy(model_cls.blocks),
            "by_size": SizeBasedWrapPolicy(model_cls.min_num_params)}[wrap]


def _torch_policy(wrap: str, model_cls):
    """The same units, as torch's FSDP1 is told them."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    return {"whole": None, "by_class": TorchModuleWrapPolicy(model_cls.blocks),
            "by_size": functools.partial(size_based_auto_wrap_policy, min_num_params=model_cls.min_num_params)}[wrap]


def _from_train(name):
    """A strategy exactly as the training harness (chapters 1-4) builds it."""
    return lambda net, optimizer, model_cls: STRATEGIES[name].build(net, optimizer, _find_unused(model_cls))


def _find_unused(model_cls) -> bool:
    return getattr(model_cls, "find_unused", False)


def _flat(stage):
    def build(net, optimizer, model_cls):
        cls, kw = OPTIMIZER_SPECS[optimizer]
        opt = FlatOSS(net.parameters(), optim=cls, bucket_cap_mb=FLAT_BUCKET_MB, **kw)
        if stage == 2:
            return FlatShardedDataParallel(net, opt), opt
        comm.broadcast_tensors(list(net.buffers()))  # FlatOSS alone leaves the buffers to its caller
        return net, opt
    return build


def _fsdp(reshard_after_forward, wrap):
    def build(net, optimizer, model_cls):
        wrapped = FullyShardedDataParallel(net, auto_wrap_policy=_policy(wrap, model_cls),
                                           reshard_after_forward=reshard_after_forward)
        return wrapped, OPTIMIZERS[optimizer](wrapped.parameters())  # over the shards: built after wrapping
    return build


def _torch_fsdp1(wrap):
    def build(net, optimizer, model_cls):
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        # its sync_module_states needs a GPU: broadcast rank 0's weights and buffers here instead
        comm.broadcast_tensors(list(net.parameters()) + list(net.buffers()))
        wrapped = TorchFSDP(net, auto_wrap_policy=_torch_policy(wrap, model_cls), device_id=torch.device("cpu"),
                            use_orig_params=False)
        return wrapped, OPTIMIZERS[optimizer](wrapped.parameters())
    return build


STRATEGIES_UNDER_TEST = {
    "ddp": _from_train("ddp"),
    "oss": _from_train("oss"),            # OSS under our DDP, as chapter 3 trains it
    "oss_flat": _flat(1),
    "sdp": _from_train("sdp"),
    "sdp_flat": _flat(2),
    **{f"fsdp{'' if raf else '_nraf'}/{wrap}": _fsdp(raf, wrap) for raf in (True, False) for wrap in WRAPS},
}
REFERENCES = {"torch_ddp": _from_train("torch_ddp"), **{f"torch_fsdp1/{wrap}": _torch_fsdp1(wrap) for wrap in WRAPS}}


def _control(net, optimizer, model_cls):
    """Not a strategy: our DDP with every gradient averaged over N + 1 ranks instead of N -- the kind of bug
    the matrix exists to catch. Each rank's gradient is scaled before DDP's reduction sees it. Trained with
    SGD only: AdamW divides by the gradient's own scale, so a constant factor all but vanishes there."""
    n = comm.world_size()
    for p in net.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g * (n / (n + 1)))
    return STRATEGIES["ddp"].build(net, optimizer, _find_unused(model_cls))


CONTROL, CONTROL_OPTIMIZER = "ddp_grads_over_n_plus_1", "sgd"
BUILDERS = {**STRATEGIES_UNDER_TEST, **REFERENCES, CONTROL: _control}


# -- the rules: what each case is compared with, and how closely ---------------------------------------------
# --8<-- [start:rules]
# Flat buffers step every element every step: a parameter that no rank used
# gets a zero gradient, so momentum and weight decay move it, where torch's
# DDP leaves .grad None and its optimizers skip it.
ZERO_GRAD_WHEN_UNUSED = {s for s in STRATEGIES_UNDER_TEST
                         if s.startswith(("fsdp", "oss_flat", "sdp_flat"))}
# Nothing re-broadcasts rank 0's buffers before each forward: BatchNorm
# statistics stay each rank's own.
LOCAL_BUFFERS = {s for s in STRATEGIES_UNDER_TEST
                 if s.startswith(("fsdp", "oss_flat"))}

# Past two ranks the N contributions to an element are added in another order
# than DDP's all-reduce adds them (a ring reduce-scatter starts each chunk at
# another rank), so a gradient may round differently by a few ulps of itself.
# An element-wise optimizer passes that on to the update, times lr: far below
# an ulp of the parameter, but enough to round the parameter to a neighbouring
# value -- about one ulp of it per step. The parameters here are below 4,
# where an ulp is at most 2 ulps of 1; we allow 8 times that per step:
ULPS_PER_STEP = 16


def oracle(strategy: str, model: str) -> tuple[str, str]:
    """(reference for the parameters, reference for the buffers) of a case."""
    # the flat designs are one unit's semantics
    wrap = strategy.split("/")[1] if "/" in strategy else "whole"
    fsdp1 = f"torch_fsdp1/{wrap}"
    zero_grads = (_find_unused(MODELS[model])
                  and strategy in ZERO_GRAD_WHEN_UNUSED)
    params = fsdp1 if zero_grads else "torch_ddp"
    local_buffers = strategy in LOCAL_BUFFERS and _has_buffers(model)
    buffers = fsdp1 if local_buffers else "torch_ddp"
    return params, buffers


@functools.cache
def _has_buffers(model: str) -> bool:
    return any(True for _ in MODELS[model](seed=0).buffers())


def tolerance(world_size: int, dtype: torch.dtype, steps: int = STEPS) -> float:
    """Largest |ours - reference| allowed: 0.0 (bit-exact) where the reduction
    order is DDP's -- one rank, or two, where each element's sum is one
    commutative addition and the 1/2 before it exact."""
    if world_size <= 2:
        return 0.0
    return ULPS_PER_STEP * steps * torch.finfo(dtype).eps
# --8<-- [end:rules]


# -- one rank's cases ----------------------------------------------------------------------------------------
def _train(kind: str, model: str, optimizer: str) -> dict:
    """Train one case on this rank; its final parameters and buffers (unwrapped names), and its units."""
    model_cls = MODELS[model]
    net = model_cls(seed=comm.rank())  # different on every rank: the strategy must start them all from rank 0's
    params, buffers = ({n for n, _ in net.named_parameters(remove_duplicate=False)},
                       {n for n, _ in net.named_buffers()})
    with warnings.catch_warnings():  # torch's FSDP1 warns that it is deprecated, on every call
        warnings.simplefilter("ignore")
        wrapped, opt = BUILDERS[kind](net, optimizer, model_cls)
        n, r = comm.world_size(), comm.rank()
        for step in range(STEPS):
            *inputs, target = (t[r * GLOBAL_BATCH // n: (r + 1) * GLOBAL_BATCH // n] for t in model_cls.batch(step))
            loss(model_cls, wrapped(*inputs), target).backward()
            opt.step()
            opt.zero_grad()
        state = _full_state(wrapped)
    return {"params": {k: v for k, v in state.items() if k in params},
            "buffers": {k: v for k, v in state.items() if k in buffers}, "units": _units(wrapped)}


def _full_state(wrapped) -> dict:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if not isinstance(wrapped, TorchFSDP):
        return get_full_state_dict(wrapped)
    with TorchFSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        return {k: v.detach().clone() for k, v in wrapped.state_dict().items()}


def _units(wrapped) -> list[str] | None:
    """The units' names as in the unwrapped model (the root is ''), for ours and for torch's FSDP1."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if isinstance(wrapped, FullyShardedDataParallel):
        return sorted(name for name, _ in wrapped.named_units())
    if isinstance(wrapped, TorchFSDP):
        return sorted(name.replace("_fsdp_wrapped_module.", "").removeprefix("_fsdp_wrapped_module")
                      for name, m in wrapped.named_modules() if isinstance(m, TorchFSDP))
    return None


def _rank_cases(strategies: list[str]) -> list[dict]:
    """Every case of this world size, on this rank."""
    reference = functools.cache(_train)  # each reference is trained once and compared with many cases
    out = []
    for model, model_cls in MODELS.items():
        initial = {k: v.detach().clone() for k, v in model_cls(seed=0).named_parameters(remove_duplicate=False)}
        for optimizer in OPTIMIZERS:
            ddp = reference("torch_ddp", model, optimizer)
            for strategy in strategies:
                if strategy == CONTROL and optimizer != CONTROL_OPTIMIZER:
                    continue
                ours = _train(strategy, model, optimizer)
                param_ref, buffer_ref = oracle(strategy, model)
                params, buffers = reference(param_ref, model, optimizer), reference(buffer_ref, model, optimizer)
                out.append({
                    "strategy": strategy, "model": model, "optimizer": optimizer, "world_size": comm.world_size(),
                    "param_oracle": param_ref, "buffer_oracle": buffer_ref,
                    "param_diff": max_abs_diff(ours["params"], params["params"]),
                    "buffer_diff": max_abs_diff(ours["buffers"], buffers["buffers"]),
                    # against torch's DDP even where it is not the reference: what the other reference is worth
                    "param_diff_vs_ddp": max_abs_diff(ours["params"], ddp["params"]),
                    "buffer_diff_vs_ddp": max_abs_diff(ours["buffers"], ddp["buffers"]),
                    "moved": max_abs_diff(ddp["params"], initial),  # the training did something
                    "units": ours["units"], "oracle_units": params["units"] or buffers["units"],
                    "tolerance": tolerance(comm.world_size(), next(iter(initial.values())).dtype),
                })
    return out


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """One row per case: the worst difference over the ranks (every rank checked its own buffers)."""
    rows = []
    for cases in zip(*per_rank):
        row = dict(cases[0])
        for key in ("param_diff", "buffer_diff", "param_diff_vs_ddp", "buffer_diff_vs_ddp"):
            values = [c[key] for c in cases if c[key] is not None]
            row[key] = max(values) if values else None
        rows.append(row)
    return rows


def passes(row: dict) -> bool:
    return all(row[k] is None or row[k] <= row["tolerance"] for k in ("param_diff", "buffer_diff"))


def run_parity(world_sizes=WORLD_SIZES, strategies=None) -> list[dict]:
    """Every case at each world size (one launch each), the control included; one row per case."""
    strategies = list(strategies or STRATEGIES_UNDER_TEST) + [CONTROL]
    rows = []
    for n in world_sizes:
        rows += _merge(launch(_rank_cases, n, kwargs={"strategies": strategies}, device="cpu"))
    return rows


# -- the report ----------------------------------------------------------------------------------------------
LABELS = {"ddp": "DDP", "oss": "OSS (+ DDP)", "oss_flat": "FlatOSS", "sdp": "SDP", "sdp_flat": "FlatSDP",
          **{f"fsdp{'' if raf else '_nraf'}/{wrap}": f"FSDP {'RAF' if raf else 'NRAF'}, {wrap.replace('_', ' ')}"
             for raf in (True, False) for wrap in WRAPS}}


def _worst(rows) -> float:
    return max((d for r in rows for d in (r["param_diff"], r["buffer_diff"]) if d is not None), default=0.0)


def _cell(rows) -> str:
    """The worst |diff| where the rule is bit-exact ('=' if it is), then where it is a tolerance; '✗' marks
    a case outside its rule."""
    parts = []
    for exact in (True, False):
        group = [r for r in rows if (r["tolerance"] == 0.0) == exact]
        if group:
            worst = _worst(group)
            parts.append(("=" if worst == 0.0 else f"{worst:.1e}") + ("" if all(map(passes, group)) else " ✗"))
    return " / ".join(parts)


def format_markdown(rows: list[dict]) -> str:
    cases = [r for r in rows if r["strategy"] != CONTROL]
    control = [r for r in rows if r["strategy"] == CONTROL]
    world_sizes = sorted({r["world_size"] for r in cases})
    strategies = list(dict.fromkeys(r["strategy"] for r in cases))
    models = list(dict.fromkeys(r["model"] for r in cases))

    def table(key, columns, heading, within=cases):
        lines = [f"| strategy | {' | '.join(map(heading, columns))} | cases |", "|---|" + "---|" * (len(columns) + 1)]
        for s in strategies:
            mine = [r for r in within if r["strategy"] == s]
            cells = [_cell([r for r in mine if r[key] == c]) for c in columns]
            lines.append(f"| {LABELS[s]} | {' | '.join(cells)} | {len(mine)} |")
        return "\n".join(lines)

    def model_heading(model):  # † where some strategy is held to torch's FSDP1 instead of DDP
        return model + (" †" if any(r["model"] == model and "fsdp1" in r["param_oracle"] + r["buffer_oracle"]
                                    for r in cases) else "")

    def rule(n):
        if tolerance(n, torch.float32) == 0.0:
            return f"N = {n}: bit-exact"
        return f"N = {n}: {tolerance(n, torch.float32):.1e} (fp32), {tolerance(n, torch.float64):.1e} (fp64)"

    held = {}  # (model, "param" or "buffer") -> the strategies held to torch's FSDP1 there
    for r in cases:
        for what in ("param", "buffer"):
            if r[f"{what}_oracle"] != "torch_ddp":
                held.setdefault((r["model"], what), []).append(LABELS[r["strategy"]].split(",")[0])
    what_why = {"param": ("parameters", "a parameter no rank used gets a zero gradient"),
                "buffer": ("buffers", "BatchNorm statistics stay each rank's own")}
    footnote = "; ".join(f"the {what_why[what][0]} of `{model}` under {', '.join(dict.fromkeys(names))} "
                         f"({what_why[what][1]})" for (model, what), names in held.items())

    return "\n".join([
        (f"{len(cases)} cases: {len(strategies)} strategies × {len(models)} models × "
         f"{len({r['optimizer'] for r in cases})} optimizers (SGD with momentum, AdamW) × world sizes "
         f"{', '.join(map(str, world_sizes))}, {STEPS} steps each; **{sum(map(passes, cases))} of {len(cases)} "
         f"within their rule** ({'; '.join(map(rule, world_sizes))}). A cell is the worst |ours − reference| "
         f"over every parameter and buffer, on every rank, with either optimizer: = is bit-exact, ✗ a case "
         f"outside its rule."),
        "", "By world size:", "", table("world_size", world_sizes, lambda n: f"N = {n}"),
        # a tab per model: seven models side by side would scroll sideways in the docs' column
        "", "By model:", "", md_tabs([(model_heading(m), table("world_size", world_sizes, lambda n: f"N = {n}",
                                                                [r for r in cases if r["model"] == m]))
                                      for m in models]),
        "", (f"† Held to torch's FSDP1 with the same units, where the strategy differs from DDP by design: "
             f"{footnote}. Everything else is held to torch's DDP."),
        "", (f"Control, not a strategy: our DDP averaging every gradient over N + 1 ranks, with SGD, is off by "
             f"{min(map(_worst, ([r] for r in control))):.1e} to {_worst(control):.1e}, and "
             f"{'caught in every one' if not any(map(passes, control)) else 'NOT caught in some'} of its "
             f"{len(control)} cases."),
    ])


def run_parity_report(world_sizes=WORLD_SIZES, markdown: str | None = None) -> int:
    """Print (and write) the tables; the exit status is 1 if any case is outside its rule."""
    rows = run_parity(world_sizes)
    write_report(format_markdown(rows), markdown)
    return 0 if all(passes(r) for r in rows if r["strategy"] != CONTROL) else 1
