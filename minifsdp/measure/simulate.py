"""Chapter 13: the package's own wrappers as rank 0 of N -- meta tensors, a fake process group, up to 1,024 ranks.

Readers run minifsdp on 2 CPU ranks and ask about 7B-70B models on hundreds of GPUs. The simulator answers
with the same code: it builds a Llama-style model on the meta device (shapes, no memory), starts rank 0 of N
in this process under torch's fake process group (`launch(..., backend="fake")`: every collective returns at
once and moves nothing), wraps the model in minifsdp's DDP, OSS (ZeRO-1), ShardedDataParallel (ZeRO-2),
FullyShardedDataParallel (ZeRO-3, one unit per decoder layer) or fully_shard, and runs training steps:
forward, backward, AdamW. The meter (meter.py) counts every meta storage as if it were real, the counter
(comm.counting) every collective's bytes, exactly as on CPU ranks. Nothing is modelled that the code does
not do: what is printed is what the wrappers allocate and send.

    python -m minifsdp simulate --model 7b --world-size 1024 --strategy fsdp --precision bf16
    python -m minifsdp simulate --model 7b 70b --world-sizes 8 64 1024 --strategy ddp fsdp --plot scaling.svg
    python -m minifsdp simulate --example zero-7.5b

Two steps run; the second is measured. The first is the warm-up every real job has: AdamW makes its state,
DDP rebuilds its buckets in the order gradients arrived, FSDP records the order of its units (prefetching
starts with the second step). Rank 0 is measured, as everywhere in minifsdp; OSS's greedy partition gives
other ranks other shares.

What a meta run cannot tell: time (nothing is computed), values (no loss, no numerics), the caching
allocator's fragmentation and a GPU's workspaces, and when a GPU would really free a buffer that the CPU
freed while kernels were still queued -- see `DeviceLag` (device_lag.py) for the worst case of that, the one
limit_all_gathers bounds. On the meta device attention takes the CPU's flash kernel (models.causal_attention),
which saves what a GPU's would.

Precisions:
    fp32         everything in fp32: parameters 4, gradients 4, AdamW 8 bytes per parameter.
    bf16         minifsdp's MixedPrecision(param_dtype=bfloat16) (chapter 8): fp32 parameters (the masters),
                 fp32 gradients, AdamW's fp32 moments; bf16 copies only while a unit computes, bf16 on the wire.
    bf16-master  the ZeRO paper's accounting: the model held in bf16 (parameters 2, gradients 2 bytes) and
                 MasterAdamW keeping fp32 master + moments (K = 12) -- sharded, under OSS, with its owner.

The command's tables and figure are minifsdp/reports/simulate.py's; the seeds' worked examples,
minifsdp/reports/worked_examples.py's.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import torch

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.measure import analytic
from minifsdp.measure.device_lag import DeviceLag
from minifsdp.measure.meter import CATEGORIES, MemoryMeter
from minifsdp.models import LLAMA_CONFIGS, Llama, LlamaBlock, LlamaConfig, count_params

STAGES = {"ddp": 0, "oss": 1, "sdp": 2, "fsdp": 3, "fully_shard": 3}
STRATEGY_NAMES = {"ddp": "DDP", "oss": "OSS (ZeRO-1, under DDP)", "sdp": "ShardedDataParallel (ZeRO-2)",
                  "fsdp": "FSDP (FlatParameter, ZeRO-3)", "fully_shard": "fully_shard (FSDP2, ZeRO-3)"}
PRECISIONS = ("fp32", "bf16", "bf16-master")
# bytes per parameter of (parameters, gradients, optimizer state) that stay between steps, per precision
STATE_BYTES = {"fp32": analytic.FP32_ADAM, "bf16": analytic.FP32_ADAM, "bf16-master": analytic.mixed_precision_adam(12)}

# The models: Llama-2's shapes (models.LLAMA_CONFIGS) and those of the worked examples.
MODELS: dict[str, LlamaConfig] = {
    **LLAMA_CONFIGS,
    # The ZeRO paper's example model, Ψ = 7.5B (its figure 1): the depth and width of Megatron-LM's 8.3B GPT
    # (72 layers, hidden 3072, 24 heads), the ZeRO paper's own baseline family, with a SwiGLU MLP of 6,912 --
    # Ψ = 7,501,433,856. (Its tensors are also ones OSS's greedy partition deals out evenly at N = 64:
    # rank 0 gets 0.9997 Ψ/N.)
    "zero-7.5b": LlamaConfig(dim=3072, n_layers=72, n_heads=24, ffn_hidden=6912, vocab_size=32000),
    # The PyTorch FSDP notes' example: 10 transformer blocks of exactly 1.6B fp32 parameters each (attention
    # 4 x 8000^2, a 2-matrix MLP of 83,999, two norms: 1,600,000,000); a vocabulary of 8, so that the root
    # unit (embedding, final norm, head) is 136,000 parameters, which the notes leave out.
    "fsdp-notes": LlamaConfig(dim=8000, n_layers=10, n_heads=80, ffn_hidden=83999, vocab_size=8, mlp="gelu"),
    # small enough to run on real CPU tensors too (the tests compare the two)
    "tiny": LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=256, max_seq_len=64),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One simulated job: what rank 0 of `world_size` runs."""
    model: str = "7b"
    world_size: int = 8
    strategy: str = "fsdp"
    precision: str = "fp32"
    seq_len: int = 4096
    micro_batch: int = 1
    checkpoint_activations: bool = False
    layers: int | None = None      # a model with fewer (or more) decoder layers than its config's
    device: str = "meta"           # "cpu": real tensors (small models only), to check the meta run against
    forward_prefetch: bool = False  # FSDP (BACKWARD_PRE is on by default, as in PyTorch)
    limit_all_gathers: bool = True  # FSDP
    device_lag: bool = False       # FSDP: frees take effect late, as on a GPU far behind the CPU (DeviceLag)
    record: bool = False           # keep every collective of the measured step: (kind, bytes sent, tag)
    refresh: bool = False          # the meter re-reads every storage's size at every op (a check; slow)
    warmup: bool = True            # run a first, unmeasured step (False: measure the first step -- for model
                                   # states; fully_shard's unsharded parameters, made in it, then count as "other")

    def check(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}: choose from {', '.join(MODELS)}")
        if self.strategy not in STAGES:
            raise ValueError(f"unknown strategy {self.strategy!r}: choose from {', '.join(STAGES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: choose from {', '.join(PRECISIONS)}")
        if self.device not in ("meta", "cpu"):
            raise ValueError(f"device must be 'meta' or 'cpu', not {self.device!r}")
        for name in ("world_size", "seq_len", "micro_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers!r}")
        if self.seq_len > self.config().max_seq_len and self.config().learned_positions:
            raise ValueError(f"{self.model} has learned positions up to {self.config().max_seq_len} tokens; "
                             f"seq_len={self.seq_len} is longer")
        if self.checkpoint_activations and self.precision == "bf16" and STAGES[self.strategy] < 3:
            raise ValueError(f"checkpoint_activations with precision='bf16' runs under FSDP and fully_shard only: "
                             f"minifsdp's DDP (under {self.strategy!r}) casts the parameters for the length of "
                             f"forward (torch.func.functional_call), so a layer recomputed in backward would "
                             f"compute in fp32, and torch.utils.checkpoint refuses. (fp32 and bf16-master work)")
        if self.device_lag and self.strategy != "fsdp":
            raise ValueError("device_lag models FSDP's rate limiter: strategy must be 'fsdp'")

    def config(self) -> LlamaConfig:
        c = MODELS[self.model]
        return c if self.layers is None else dataclasses.replace(c, n_layers=self.layers)


# -- wrapping ------------------------------------------------------------------------------------------------------
def _optimizer_class(spec: Spec):
    from minifsdp.mixed_precision import MasterAdamW
    return MasterAdamW if spec.precision == "bf16-master" else torch.optim.AdamW


def wrap(model: torch.nn.Module, spec: Spec):
    """(wrapped model, optimizer): the strategy as a user would write it, one unit per decoder layer."""
    from minifsdp.mixed_precision import MixedPrecision

    opt_class, kw = _optimizer_class(spec), dict(lr=1e-4, weight_decay=0.1)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if spec.precision == "bf16" else None
    if spec.strategy == "ddp":
        from minifsdp.ddp import DistributedDataParallel
        wrapped = DistributedDataParallel(model, mixed_precision=mp)
        return wrapped, opt_class(wrapped.parameters(), **kw)
    if spec.strategy == "oss":
        from minifsdp.ddp import DistributedDataParallel
        from minifsdp.zero import OSS
        return DistributedDataParallel(model, mixed_precision=mp), OSS(model.parameters(), optim=opt_class, **kw)
    if spec.strategy == "sdp":
        from minifsdp.zero import OSS, ShardedDataParallel
        optimizer = OSS(model.parameters(), optim=opt_class, **kw)
        return ShardedDataParallel(model, optimizer, mixed_precision=mp), optimizer
    if spec.strategy == "fsdp":
        from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
        # device_id: a model built on the meta device stays there (FSDP would otherwise materialise it on
        # this rank's device, chapter 9); its units are "initialised" by reset_parameters(), on meta
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaBlock}), mixed_precision=mp,
                                           forward_prefetch=spec.forward_prefetch,
                                           limit_all_gathers=spec.limit_all_gathers,
                                           device_id=torch.device(spec.device) if spec.device == "meta" else None)
        return wrapped, opt_class(wrapped.parameters(), **kw)
    from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if spec.precision == "bf16" else None)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, opt_class(model.parameters(), **kw)


def unsharded_buffers(wrapped, strategy: str) -> list[torch.Tensor]:
    """The storages ZeRO-3 keeps its full parameters in while a unit computes (0 bytes while sharded)."""
    if strategy == "fsdp":
        return [flat._full for unit in wrapped.units() for flat in unit.flat_params]
    if strategy == "fully_shard":
        return [p.unsharded for m in wrapped.modules() if hasattr(m, "_fsdp") for p in m._fsdp.group.params
                if p.unsharded is not None]
    return []


def units(wrapped, strategy: str, n: int) -> list[dict]:
    """ZeRO-3's units: name, parameters, and the padded size the collectives move (N shards)."""
    if strategy == "fsdp":
        return [{"name": u.unit_name, "numel": sum(f.numel for f in u.flat_params),
                 "padded": sum(f.shard_numel * n for f in u.flat_params)} for u in wrapped.units()]
    if strategy == "fully_shard":
        return [{"name": name or "(root)", "numel": m._fsdp.group.numel(),
                 "padded": sum(p.padded_numel for p in m._fsdp.group.params) * n}
                for name, m in wrapped.named_modules() if hasattr(m, "_fsdp")]
    return []


def stepped(optimizer) -> tuple[int, int]:
    """(elements, tensors) of the parameters this rank's optimizer steps (its share, for the sharded ones)."""
    params = optimizer.owned_params(optimizer.rank) if hasattr(optimizer, "owned_params") else \
        [p for g in optimizer.param_groups for p in g["params"]]
    return sum(getattr(p, "_local_tensor", p).numel() for p in params), len(params)


class StepMeter(MemoryMeter):
    """The meter, with one addition for splitting a peak right: before it records a new peak it labels the
    gradients of `grad_params`. ZeRO-2's owners and ZeRO-3 get their averaged gradients by assignment (no hook
    sees that), so those would otherwise count as "other" until the optimizer's step labels them. (Listed
    once, and only for the wrappers that assign: a walk of 700 parameters at every new peak costs seconds.)"""

    def __init__(self, *args, grad_params=(), **kwargs):
        self._grad_params = list(grad_params)
        self._grads_seen = [None] * len(self._grad_params)
        super().__init__(*args, **kwargs)

    def _update_peak(self) -> None:
        if self._grad_params and sum(self._by_cat.values()) > self.peak:
            for i, p in enumerate(self._grad_params):
                grad = p.grad
                if grad is not None and grad is not self._grads_seen[i]:
                    self._set_category(getattr(grad, "_local_tensor", grad).untyped_storage(), "grads")
                self._grads_seen[i] = grad
        super()._update_peak()


def _install_device_lag(wrapped, meter: MemoryMeter, limit_all_gathers: bool) -> DeviceLag:
    lag = DeviceLag(meter, limit=2 if limit_all_gathers else math.inf)
    wrapped.root_state.limiter = lag  # the one every unit of the model shares
    return lag


# -- one simulated rank --------------------------------------------------------------------------------------------
# --8<-- [start:rank0]
def rank0(spec: Spec) -> dict:
    """Rank 0's memory per phase and bytes per collective for one training step
    (the second). Runs inside launch(..., backend="fake") -- or, for a check, on
    real CPU tensors under the same fake group."""
    from minifsdp.fsdp.checkpointing import checkpoint_module

    spec.check()
    start = time.perf_counter()
    n, device = comm.world_size(), torch.device(spec.device)
    # --8<-- [start:meta_model]
    # every parameter made on `device`: on meta, shapes without memory
    with device:
        model = Llama(spec.config())
    if spec.precision == "bf16-master":
        model.to(torch.bfloat16)
    psi = count_params(model)
    # FSDP(checkpoint(layer)): recomputed inside the unit's backward
    if spec.checkpoint_activations:
        for layer in model.layers:
            checkpoint_module(layer)
    wrapped, optimizer = wrap(model, spec)
    # --8<-- [end:meta_model]
    # refresh=False: every resize in minifsdp's wrappers is announced
    # (events.STORAGE_RESIZED), so the meter need not re-read every live
    # storage's size at every op -- what would make a 70B model slow
    grad_params = (list(wrapped.parameters())
                   if STAGES[spec.strategy] >= 2 else ())
    meter = StepMeter(wrapped, optimizer,
                      categories=CATEGORIES + ("unsharded",),
                      refresh=spec.refresh, grad_params=grad_params)
    meter.watch(unsharded_buffers(wrapped, spec.strategy), "unsharded")
    lag = (_install_device_lag(wrapped, meter, spec.limit_all_gathers)
           if spec.device_lag else None)
    phases = {"after wrapping": meter.live()}
    tokens = torch.zeros(spec.micro_batch, spec.seq_len, dtype=torch.long,
                         device=device)

    if spec.warmup:  # step 1, the warm-up: not measured
        wrapped(tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if lag is not None:
            lag.synchronize_all()
        # (fully_shard makes them in step 1)
        meter.watch(unsharded_buffers(wrapped, spec.strategy), "unsharded")

    comm_by_phase, events, most = {}, [], {}
    with meter:
        for phase, run in (("forward", lambda: wrapped(tokens, tokens)),
                           ("backward", lambda: loss.backward()),
                           ("optimizer step", optimizer.step)):
            meter.reset_peak()
            with comm.counting(record=spec.record) as counter:
                out = run()
            events += [(e.kind, e.nbytes, e.tag) for e in counter.events]
            if phase == "forward":
                loss = out
            if lag is not None and phase != "optimizer step":
                lag.synchronize_all()
            phases[f"peak of {phase}"] = meter.peak_snapshot()
            # each category's own highest in the phase
            most[phase] = dict(meter.category_peak)
            comm_by_phase[phase] = {"bytes": dict(counter.bytes),
                                    "calls": dict(counter.calls)}
        phases["after optimizer step"] = meter.live()
    meter.close()
    return {"spec": dataclasses.asdict(spec), "psi": psi, "world_size": n,
            "phases": phases, "most": most, "comm": comm_by_phase,
            "events": events, "units": units(wrapped, spec.strategy, n),
            "stepped": stepped(optimizer)[0],
            "stepped_tensors": stepped(optimizer)[1],
            "seconds": time.perf_counter() - start}
# --8<-- [end:rank0]


def simulate(spec: Spec | None = None, **fields) -> dict:
    """Run `spec` (or Spec(**fields)) as rank 0 of spec.world_size; the result, with the analytic model beside."""
    spec = spec or Spec(**fields)
    spec.check()
    result = launch(rank0, world_size=spec.world_size, backend="fake", args=(spec,))[0]
    result["analytic"] = expected(result)
    return result


# -- the analytic model, phase by phase ----------------------------------------------------------------------------
def comm_totals(result: dict) -> dict[str, float]:
    """Bytes sent per collective kind over the whole measured step."""
    out = collections.defaultdict(float)
    for phase in result["comm"].values():
        for kind, b in phase["bytes"].items():
            out[kind] += b
    return dict(out)


def expected(result: dict) -> dict:
    """What analytic.py says rank 0 should hold and send, for the result's strategy, precision and N.

    Model states: analytic.model_state_bytes with the precision's bytes per parameter -- it assumes every
    rank holds exactly Ψ/N, so it ignores padding (FSDP pads each unit to a multiple of N and aligns each
    parameter to 64 bytes; fully_shard pads each parameter's rows to a multiple of N), AdamW's 4-byte `step`
    per tensor, and OSS's partition by whole tensors (rank 0's share is not exactly Ψ/N).
    ZeRO-3's full parameters: the root unit from forward to the end of backward, plus one decoder layer
    computing (two with forward_prefetch) in forward, and two in backward (computing, and prefetched:
    analytic.fsdp_buffer_bytes's "unsharded").
    Bytes: analytic.comm_bytes_per_step for the ZeRO stage, and per collective what each wrapper sends."""
    spec, psi, n = result["spec"], result["psi"], result["world_size"]
    strategy, precision, stage = spec["strategy"], spec["precision"], STAGES[spec["strategy"]]
    states = analytic.model_state_bytes(psi, n, stage, STATE_BYTES[precision])
    param_bytes = STATE_BYTES[precision][0]                       # what OSS broadcasts
    compute_bytes = 2 if precision != "fp32" else 4               # what ZeRO-3 all-gathers
    grad_bytes = 2 if precision != "fp32" else 4                  # what the gradients are averaged in
    ring = (n - 1) / n
    out = {"model states": states}
    kinds = {"ddp": {"all_reduce": 2 * psi * grad_bytes * ring},
             "oss": {"all_reduce": 2 * psi * grad_bytes * ring, "broadcast": psi * param_bytes * ring},
             "sdp": {"reduce": psi * grad_bytes * ring, "broadcast": psi * param_bytes * ring}}
    if stage == 3:
        layers = [u for u in result["units"] if u["name"] != "(root)"]
        root = sum(u["numel"] for u in result["units"] if u["name"] == "(root)")
        layer = layers[0]["numel"] if layers else 0
        # every unit all-gathered in forward and in backward, except the root, kept in between
        kinds[strategy] = {"all_gather": (2 * psi - root) * compute_bytes * ring,
                           "reduce_scatter": psi * grad_bytes * ring}
        in_forward = 2 if spec["forward_prefetch"] and strategy == "fsdp" else 1
        # FSDP's prefetched all-gather lands in the next unit's unsharded buffer itself; fully_shard's lands in
        # a flat buffer ("other"), copied out into the unsharded parameters only when that unit starts
        in_backward = analytic.fsdp_buffer_bytes(layer, n, compute_bytes)["unsharded"] if strategy == "fsdp" \
            else layer * compute_bytes
        out["unsharded"] = {"forward": (root + in_forward * layer) * compute_bytes,
                            "backward": root * compute_bytes + in_backward}
    out["comm"] = kinds[strategy]
    out["comm total, ZeRO paper"] = analytic.comm_bytes_per_step(psi, n, stage, grad_bytes)
    return out
