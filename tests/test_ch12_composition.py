"""Chapter 12: the parallelisms composed on a 2 x 2 mesh of 4 ranks, against one process on the whole batch.

- DP x TP: init_mesh((2, 2), ("dp", "tp")). Each row is a tensor-parallel replica of TinyGPT (t = 2); the two
  replicas each take half of the global batch of 8, and average their gradients over the columns: minifsdp's
  DistributedDataParallel around the sequence-parallel model, or minifsdp's FSDP (FlatParameter, FULL_SHARD over
  the dp group) around the tensor-parallel one, the FSDP chapters' sharding on the data-parallel dimension only.
- PP x DP: init_mesh((2, 2), ("dp", "pp")). Each row is a pipeline of 2 stages (1F1B, and interleaved 1F1B with
  2 virtual stages per rank), each replica half of the batch in micro-batches of 2; after each pipeline step the
  stages' gradients are averaged over the columns (compose.allreduce_gradients), then the optimizer steps.

Tolerances, and why: the losses and the parameters after STEPS = 3 steps within 1e-5 of one process's TinyGPT on
the whole batch (SGD with momentum and AdamW). The compositions add their sums in other orders than one process
(the replicas' halves averaged by a collective, the tensor-parallel partial sums, the sequence-first layout, the
micro-batches accumulated one by one: chapter 12's tensor and pipeline tests say which and how much). Measured,
parameters: 7.5e-9 with SGD in every composition; with AdamW 1.3e-6 (DP x TP, DDP and FSDP) and 1.2e-7 (PP x DP);
losses 4.8e-7 (one ulp of the loss) at most.

Bytes per step, on each group, against the formulas (b = 4 sequences per replica, s = 16 tokens, h = 32):
- DP x TP: the "tp" group sends chapter 12's tensor-parallel bytes for b = 4 (the same as tests/test_ch12_tensor
  _parallel.py: 109,056 with sequence parallelism, 82,688 without, at t = 2); the "dp" group sends the
  data-parallel wrapper's bytes of this rank's slices: DDP one all-reduce, 2 * 4 * psi_local * (d-1)/d; FSDP
  (one unit, the root, which keeps its parameters from forward to backward) all-gathers once and
  reduce-scatters once its flat parameter.
- PP x DP: the "pp" group sends each micro-batch's activation and gradient across the boundary (the pipeline
  tests' count) and the tied embedding's exchange; the "dp" group one all-reduce of the stages' gradients,
  2 * 4 * psi_stage * (d-1)/d.
"""

import pytest
import torch
from torch import nn

from minifsdp import DistributedDataParallel, comm, launch
from minifsdp.distributed.mesh import init_mesh
from minifsdp.fsdp import FullyShardedDataParallel
from minifsdp.models import GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, TensorParallelGPT, gpt_loss,
                               split_gpt, stages_of_rank)
from minifsdp.parallel.compose import allreduce_gradients
from minifsdp.parallel.mappings import full_tensor
from minifsdp.reports.parallel.tp import tp_step_bytes_formula
from minifsdp.train import OPTIMIZERS

STEPS, BATCH, MICRO = 3, 8, 2
TP_CONFIG = GPTConfig(n_head=4, n_embd=32, vocab_size=96, n_layer=2, block_size=16)
PP_CONFIG = GPTConfig(n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=96)
ATOL = 1e-5
CASES = [("dp_tp_sp", "sgd"), ("dp_tp_sp", "adamw"), ("fsdp_tp", "sgd"), ("fsdp_tp", "adamw"),
         ("pp_dp", "sgd"), ("pp_dp", "adamw"), ("pp_dp_interleaved", "sgd")]
# the exercises each kind runs: the tensor-parallel GPT's f, g and vocab-parallel loss; the pipeline's order
EXERCISES = {"dp_tp_sp": ("12.1", "12.3"), "fsdp_tp": ("12.1", "12.3"), "pp_dp": ("12.2",),
             "pp_dp_interleaved": ("12.4",)}


def graded(kind, *values, mechanism=False):
    return pytest.param(*values, marks=[pytest.mark.exercise(*EXERCISES[kind])] + [pytest.mark.mechanism] * mechanism)


def reference(config, opt_name):
    """One process, the whole batch: the losses, and the parameters after STEPS steps."""
    model = TinyGPT(config, seed=0)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = gpt_batch(config, step, BATCH)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def replica_half(config, step, d, replica):
    x, y = gpt_batch(config, step, BATCH)
    per = BATCH // d
    return x[replica * per: (replica + 1) * per], y[replica * per: (replica + 1) * per]


def dp_tp_run(kind, opt_name):
    mesh = init_mesh((2, 2), ("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    sp = kind == "dp_tp_sp"
    inner = TensorParallelGPT.from_gpt(TinyGPT(TP_CONFIG, seed=0), group=tp, sequence_parallel=sp)
    split = dict(inner.named_parameters())  # this rank's slices, each saying how it is split (before FSDP flattens)
    psi_local = sum(p.numel() for p in split.values())
    model = DistributedDataParallel(inner, process_group=dp) if kind == "dp_tp_sp" else \
        FullyShardedDataParallel(inner, process_group=dp)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    with comm.counting() as counter:
        for step in range(STEPS):
            loss = model(*replica_half(TP_CONFIG, step, 2, comm.rank(dp)))
            loss.backward()
            if sp:
                inner.allreduce_sequence_parallel_grads()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    # the whole model's loss is the mean of the replicas' (equal halves)
    mean = torch.stack(losses)
    comm.all_reduce(mean, group=dp)
    if kind == "fsdp_tp":  # the unit's full flat parameter over dp, each original a view of it: this rank's slice
        with model.summon_full_params():
            params = {n: full_tensor(_attribute(inner, n), split[n], tp) for n in split}
        params["lm_head.weight"] = params["wte.weight"]
    else:
        params = inner.full_state_dict()
    return {"losses": (mean / 2).tolist(), "params": {k: v.detach().clone() for k, v in params.items()},
            "bytes": {g: dict(k) for g, k in counter.by_group.items()},
            "psi_local": psi_local}


def _attribute(module, name):
    *path, leaf = name.split(".")
    return getattr(module.get_submodule(".".join(path)), leaf)


def pp_dp_run(kind, opt_name):
    mesh = init_mesh((2, 2), ("dp", "pp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    p, r, v = 2, comm.rank(pp), 2 if kind == "pp_dp_interleaved" else 1
    indices = stages_of_rank(r, p, v)
    modules = nn.ModuleList(split_gpt(TinyGPT(PP_CONFIG, seed=0), p * v, indices))
    shape = (BATCH // 2 // MICRO, PP_CONFIG.block_size, PP_CONFIG.n_embd)
    stages = [PipelineStage(mod, s, p * v, group=pp, activation_shape=shape) for mod, s in zip(modules, indices)]
    schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=gpt_loss) if v > 1 else \
        Schedule1F1B(stages[0], MICRO, loss_fn=gpt_loss)
    opt = OPTIMIZERS[opt_name](modules.parameters())
    losses = []
    with comm.counting() as counter:
        for step in range(STEPS):
            x, y = replica_half(PP_CONFIG, step, 2, comm.rank(dp))
            loss = schedule.step(x, target=y)
            allreduce_gradients(modules, group=dp)
            opt.step()
            opt.zero_grad()
            losses.append(loss)
    mean = None
    if losses[0] is not None:  # the last stage's ranks (a column of the mesh): the mean of the replicas' losses
        mean = torch.stack(losses)
        comm.all_reduce(mean, group=dp)
        mean = (mean / 2).tolist()
    # every rank's stage parameters, gathered within the pipeline, under TinyGPT's names
    mine = {k: v.detach().clone() for mod in modules for k, v in mod.named_parameters()}
    params = {}
    for theirs in comm.all_gather_object(mine, group=pp):
        params.update(theirs)
    return {"losses": mean, "params": params, "bytes": {g: dict(k) for g, k in counter.by_group.items()},
            "psi_stage": sum(q.numel() for q in modules.parameters()), "stages": indices}


def rank_cases():
    out = {}
    for kind, opt_name in CASES:
        run = dp_tp_run if kind.startswith(("dp_tp", "fsdp_tp")) else pp_dp_run
        out[(kind, opt_name)] = run(kind, opt_name)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(rank_cases, world_size=4, device="cpu")


@pytest.fixture(scope="module")
def refs():
    return {(c, opt): reference(config, opt) for c, config in (("tp", TP_CONFIG), ("pp", PP_CONFIG))
            for opt in ("sgd", "adamw")}


def max_diff(params, ref):
    return max((params["wte.weight" if k == "lm_head.weight" else k] - v).abs().max().item()
               for k, v in ref.items() if not k.startswith("lm_head") or k in params)


@pytest.mark.parametrize("case", [graded(case[0], case) for case in CASES], ids="-".join)
def test_equals_one_process(ranks, refs, case):
    kind, opt_name = case
    ref_losses, ref_params = refs[("tp" if "tp" in kind else "pp", opt_name)]
    for r, res in enumerate(ranks):
        out = res[case]
        assert set(ref_params) <= set(out["params"]) | {"lm_head.weight"}, r
        assert max_diff(out["params"], ref_params) <= ATOL, (r, max_diff(out["params"], ref_params))
        if out["losses"] is not None:  # (the pipelines' losses are on their last stage)
            assert max(abs(a - b) for a, b in zip(out["losses"], ref_losses)) <= ATOL, r


@pytest.mark.parametrize("kind", [graded(kind, kind, mechanism=True) for kind in ("dp_tp_sp", "fsdp_tp")])
def test_dp_x_tp_bytes_per_group(ranks, kind):
    d = 2
    for res in ranks:
        out = res[(kind, "sgd")]
        per_step = {g: {k: b / STEPS for k, b in kinds.items()} for g, kinds in out["bytes"].items()}
        # the replica's own tensor-parallel bytes, for its half of the batch, unchanged by dp
        assert per_step["tp"] == tp_step_bytes_formula(TP_CONFIG, BATCH // d, 2, sequence_parallel=kind == "dp_tp_sp")
        slices = 4 * out["psi_local"]  # bytes of this rank's slices: the data-parallel payload (14,912 numbers)
        if kind == "dp_tp_sp":  # DDP: one all-reduce of the gradients
            assert per_step["dp"] == {"all_reduce": 2 * slices * (d - 1) / d}
        else:  # FSDP, one unit (the root keeps its parameters from forward to backward): one all-gather, one
            # reduce-scatter (the flat parameter needs no padding here: 14,912 numbers divide by 2 and align)
            assert per_step["dp"] == {"all_gather": slices * (d - 1) / d, "reduce_scatter": slices * (d - 1) / d}


@pytest.mark.parametrize("kind", [graded(kind, kind) for kind in ("pp_dp", "pp_dp_interleaved")])
def test_pp_x_dp_bytes_per_group(ranks, kind):
    d, c = 2, PP_CONFIG
    message = (BATCH // d // MICRO) * c.block_size * c.n_embd * 4  # one micro-batch's activation (or gradient)
    num_stages = 4 if kind == "pp_dp_interleaved" else 2
    for res in ranks:
        out = res[(kind, "sgd")]
        per_step = {g: {k: b / STEPS for k, b in kinds.items()} for g, kinds in out["bytes"].items()}
        stages = out["stages"]
        # each stage but the last sends each micro-batch's activation on; each but the first its gradient back
        sends = MICRO * message * sum((s < num_stages - 1) + (s > 0) for s in stages)
        tie = c.vocab_size * c.n_embd * 4 if {0, num_stages - 1} & set(stages) else 0  # the tied embedding's
        assert per_step["pp"] == {"send": sends + tie, "recv": 0.0}
        assert per_step["dp"] == {"all_reduce": 2 * 4 * out["psi_stage"] * (d - 1) / d}
