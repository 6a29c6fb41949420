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
freed while kernels were still queued -- see `DeviceLag` for the worst case of that, the one
limit_all_gathers bounds. On the meta device attention takes the CPU's flash kernel (models.causal_attention),
which saves what a GPU's would.

Precisions:
    fp32         everything in fp32: parameters 4, gradients 4, AdamW 8 bytes per parameter.
    bf16         minifsdp's MixedPrecision(param_dtype=bfloat16) (chapter 8): fp32 parameters (the masters),
                 fp32 gradients, AdamW's fp32 moments; bf16 copies only while a unit computes, bf16 on the wire.
    bf16-master  the ZeRO paper's accounting: the model held in bf16 (parameters 2, gradients 2 bytes) and
                 MasterAdamW keeping fp32 master + moments (K = 12) -- sharded, under OSS, with its owner.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import torch

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp.prefetch import AllGatherLimiter
from minifsdp.measure import analytic
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


# --8<-- [start:device_lag]
class _HeldUntilSynced:
    """A freed buffer's memory as the device still holds it: released when the
    CPU waits for the device."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory

    def synchronize(self) -> None:
        self.memory = None


class DeviceLag(AllGatherLimiter):
    """FSDP's rate limiter (chapter 7) with a GPU as far behind the CPU as it
    can be.

    On a GPU, reshard() frees a unit's full parameters in the CPU's program
    order, but the caching allocator may hand the memory out again only once the
    GPU has run the kernels queued before the free (the buffer was
    record_stream'ed). A CPU far ahead keeps issuing all-gathers into new memory
    meanwhile. On the meta device (and on the CPU) a free is immediate, so the
    simulator would never see it; this limiter makes it visible: each free
    leaves a meta tensor of the buffer's size -- memory the allocator cannot
    reuse yet, counted under "unsharded" -- until the CPU waits for that free.
    With limit_all_gathers, the CPU waits for the oldest free before an
    all-gather once `limit` (2) are pending; without, it never waits: the worst
    case, a device that has run nothing yet, until the CPU synchronises
    (`synchronize_all`, which the simulator calls after forward and after
    backward, where a training loop reads the loss or the optimizer waits for
    the gradients)."""

    def __init__(self, meter: MemoryMeter, limit: float = 2):
        super().__init__(limit=limit)
        self.meter = meter

    def freed(self, buffer: torch.Tensor) -> None:
        held = torch.empty(buffer.numel(), dtype=buffer.dtype,
                           device=buffer.device)
        self.meter.watch([held], "unsharded")
        self.pending.append(_HeldUntilSynced(held))

    def synchronize_all(self) -> None:
        while self.pending:
            self.pending.popleft().synchronize()
# --8<-- [end:device_lag]


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


# -- reports -------------------------------------------------------------------------------------------------------
def fmt(b: float | None) -> str:
    if b is None:
        return "—"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


COLUMNS = (("params", "parameters"), ("unsharded", "unsharded units"), ("grads", "gradients"),
           ("optim", "optimizer state"), ("other", "activations + other"), ("total", "total"))


def describe(spec: dict, psi: int) -> str:
    c = Spec(**spec).config()
    layers = f", {spec['layers']} layers" if spec["layers"] is not None else ""
    return (f"{spec['model']}{layers} (Ψ = {psi:,}), {STRATEGY_NAMES[spec['strategy']]}, {spec['precision']}, "
            f"N = {spec['world_size']:,}, micro-batch {spec['micro_batch']} × {spec['seq_len']:,} tokens"
            f"{', activation checkpointing per layer' if spec['checkpoint_activations'] else ''}"
            f" ({c.n_layers} decoder layers of dim {c.dim})")


def phase_table(result: dict) -> str:
    """Rank 0's memory per phase, by category: at the moment of each phase's peak, and after the step."""
    lines = ["| phase | " + " | ".join(label for _, label in COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for phase in ("after wrapping", "peak of forward", "peak of backward", "peak of optimizer step",
                  "after optimizer step"):
        m = result["phases"][phase]
        lines.append(f"| {phase} | " + " | ".join(fmt(m[c]) for c, _ in COLUMNS) + " |")
    return "\n".join(lines)


def checks(result: dict) -> list[tuple[str, float, float, str]]:
    """(quantity, measured, analytic, why they may differ) for what the analytic model covers."""
    a, phases, most = result["analytic"], result["phases"], result["most"]
    after = phases["after optimizer step"]
    strategy = result["spec"]["strategy"]
    padding = {"fsdp": "each unit padded to a multiple of N, each parameter aligned to 64 bytes",
               "fully_shard": "each parameter's rows padded to a multiple of N"}.get(strategy, "nothing")
    shares = {"oss": "; rank 0's share of whole tensors is not Ψ/N (OSS's greedy partition)",
              "sdp": "; rank 0's share of whole tensors is not Ψ/N (OSS's greedy partition)"}.get(strategy, "")
    rows = [("parameters after wrapping", phases["after wrapping"]["params"], a["model states"]["params"], padding),
            ("model states after the step (parameters + gradients + optimizer)",
             after["params"] + after["grads"] + after["optim"], a["model states"]["total"],
             f"{padding if padding != 'nothing' else 'no padding'}; AdamW's 4-byte step per tensor{shares}")]
    if "unsharded" in a:
        in_backward = "the root + the layer computing + the next one's all-gather (BACKWARD_PRE)" \
            if strategy == "fsdp" else \
            "the root + the layer computing (the next one's all-gather lands in a flat buffer, \"other\", " \
            "until its copy-out)"
        rows += [("unsharded units, most at once in forward", most["forward"]["unsharded"],
                  a["unsharded"]["forward"], "the root unit, kept from forward to backward, + the layer computing"),
                 ("unsharded units, most at once in backward", most["backward"]["unsharded"],
                  a["unsharded"]["backward"], in_backward)]
    return rows


def checks_table(result: dict) -> str:
    lines = ["| quantity | measured | analytic | measured / analytic | what the analytic figure counts, or leaves "
             "out |", "|---|---|---|---|---|"]
    for what, measured, model, why in checks(result):
        lines.append(f"| {what} | {fmt(measured)} | {fmt(model)} | {measured / model:.4f} | {why} |")
    return "\n".join(lines)


def comm_table(result: dict) -> str:
    a = result["analytic"]
    measured = comm_totals(result)
    calls = collections.Counter()
    for phase in result["comm"].values():
        calls.update(phase["calls"])
    lines = ["| collective | calls | bytes sent by rank 0 (counted) | analytic |", "|---|---|---|---|"]
    for kind in sorted(set(measured) | set(a["comm"])):
        lines.append(f"| {kind} | {calls.get(kind, 0):,} | {fmt(measured.get(kind, 0))} "
                     f"| {fmt(a['comm'].get(kind))} |")
    lines.append(f"| total | {sum(calls.values()):,} | {fmt(sum(measured.values()))} | {fmt(sum(a['comm'].values()))} "
                 f"(ZeRO paper: {fmt(a['comm total, ZeRO paper'])}) |")
    return "\n".join(lines)


def report(result: dict) -> str:
    spec = result["spec"]
    steps = "the second of two steps" if spec["warmup"] else "one step"
    return (f"**Rank 0 of {result['world_size']:,}: {describe(spec, result['psi'])}**\n\n"
            f"Meta tensors under a fake process group; memory by MemoryMeter, bytes by comm.counting(); "
            f"{steps}; simulated in {result['seconds']:.1f} s.\n\n"
            f"{phase_table(result)}\n\n{checks_table(result)}\n\n{comm_table(result)}\n")


# -- sweeps and the figure -----------------------------------------------------------------------------------------
def sweep(models, world_sizes, strategies, precision: str = "fp32", **fields) -> list[dict]:
    results = []
    for model in models:
        for n in world_sizes:
            for strategy in strategies:
                r = simulate(Spec(model=model, world_size=n, strategy=strategy, precision=precision, **fields))
                print(f"  {model} N={n:>5} {strategy:<12} {r['seconds']:6.1f} s", flush=True)
                results.append(r)
    return results


SWEEP_FIELDS = ("states", "analytic", "ratio", "peak", "sent", "sent_analytic")


def sweep_cells(results: list[dict]) -> dict[tuple[str, int, str], dict[str, str]]:
    """(model, N, strategy) -> the sweep's figures as printed: model states after the step, measured and analytic,
    their ratio, the peak of the step, the bytes sent per step, counted and the ZeRO paper's."""
    cells = {}
    for r in results:
        s, after = r["spec"], r["phases"]["after optimizer step"]
        measured = after["params"] + after["grads"] + after["optim"]
        model = r["analytic"]["model states"]["total"]
        peak = max(r["phases"][p]["total"] for p in ("peak of forward", "peak of backward", "peak of optimizer step"))
        cells[(s["model"], s["world_size"], s["strategy"])] = dict(zip(SWEEP_FIELDS, (
            fmt(measured), fmt(model), f"{measured / model:.4f}", fmt(peak), fmt(sum(comm_totals(r).values())),
            fmt(r["analytic"]["comm total, ZeRO paper"]))))
    return cells


def sweep_layout(cells: dict[tuple[str, int, str], dict[str, str]]) -> str:
    """A tab per model; in it a table per quantity, a row per N and the strategies side by side (split into
    tables of MAX_COLUMNS where there are more), the analytic figures folded under them."""
    from minifsdp.reports.format import MAX_COLUMNS, md_folded, md_table, md_tabs

    def tables(model, fields):
        ns = sorted({n for m, n, _ in cells if m == model})
        strategies = list(dict.fromkeys(s for m, _, s in cells if m == model))
        out = []
        for field, caption in fields:
            for i in range(0, len(strategies), MAX_COLUMNS - 1):
                chunk = strategies[i:i + MAX_COLUMNS - 1]
                out.append(md_table(["N", *chunk], [[f"{n:,}", *(cells[(model, n, s)][field] if (model, n, s) in cells
                                                              else "-" for s in chunk)] for n in ns], caption=caption))
        return "\n\n".join(out)

    shown = (("states", "Model states after the step, measured"), ("peak", "Peak of the step"),
             ("sent", "Bytes sent per step"))
    folded = (("analytic", "Model states, analytic"), ("ratio", "Model states, measured / analytic"),
              ("sent_analytic", "Bytes sent per step, analytic (ZeRO paper)"))
    models = list(dict.fromkeys(m for m, _, _ in cells))
    return md_tabs([(model, tables(model, shown) + "\n\n" + md_folded("The analytic figures, and measured / analytic",
                                                                     tables(model, folded)))
                    for model in models])


def sweep_table(results: list[dict]) -> str:
    return sweep_layout(sweep_cells(results))


MARKERS = {"ddp": "o", "oss": "s", "sdp": "^", "fsdp": "D", "fully_shard": "v"}


def _colours() -> dict:
    from minifsdp.reports import style

    return {"ddp": style.LINES["blue"], "oss": style.LINES["orange"], "sdp": style.LINES["green"],
            "fsdp": style.LINES["red"], "fully_shard": style.LINES["purple"]}


def plot_scaling(results: list[dict], path: str) -> None:
    """Memory per rank against N, log-log, one panel per model, one above the other: each strategy's analytic
    model states as a line, rank 0's measured model states (after the step) as filled markers on it, and the
    measured peak of the step (activations included) as hollow markers. In the charts' style (reports/style.py)."""
    from minifsdp.reports import style

    style.charts(_plot_scaling)(results, path)


def _plot_scaling(results: list[dict], path: str) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    from minifsdp.reports import style

    colours = _colours()
    models = list(dict.fromkeys(r["spec"]["model"] for r in results))
    fig, axes = style.figure(1.5 + 2.9 * len(models), len(models), 1, sharex=True, squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in results if r["spec"]["model"] == model]
        psi = mine[0]["psi"]
        for strategy in dict.fromkeys(r["spec"]["strategy"] for r in mine):
            rs = sorted((r for r in mine if r["spec"]["strategy"] == strategy), key=lambda r: r["world_size"])
            ns = [r["world_size"] for r in rs]
            grid = [2 ** (k / 8) for k in range(int(8 * math.log2(min(ns))), int(8 * math.log2(max(ns))) + 1)]
            per_param = STATE_BYTES[rs[0]["spec"]["precision"]]
            curve = [analytic.model_state_bytes(psi, x, STAGES[strategy], per_param)["total"] for x in grid]
            color, marker = colours[strategy], MARKERS[strategy]
            ax.plot(grid, [c / 1e9 for c in curve], "-", color=color, lw=1.5)
            states = [sum(r["phases"]["after optimizer step"][c] for c in ("params", "grads", "optim")) for r in rs]
            peaks = [max(r["phases"][p]["total"] for p in ("peak of forward", "peak of backward",
                                                            "peak of optimizer step")) for r in rs]
            ax.plot(ns, [s / 1e9 for s in states], marker, color=color, ms=6, ls="none", label=strategy)
            ax.plot(ns, [p / 1e9 for p in peaks], marker, color=color, ms=7, ls="none", mfc="none", mew=1.3)
        ns_all = sorted({r["world_size"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ns_all))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(base=10))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("GB per rank (rank 0)")
        ax.set_title(f"{model} (Ψ = {psi / 1e9:.2f} B)", loc="left", fontsize=10)
        ax.grid(True, which="major")
    axes[-1, 0].set_xlabel("ranks N")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles += [Line2D([], [], color=style.MUTED, lw=1.5), Line2D([], [], marker="o", color=style.MUTED, ls="none"),
                Line2D([], [], marker="o", color=style.MUTED, ls="none", mfc="none")]
    labels += ["analytic model states", "measured model states", "measured peak of the step"]
    fig.legend(handles, labels, loc="outside lower center", ncol=3)
    spec = results[0]["spec"]
    fig.suptitle(f"Rank 0 of N, {spec['precision']} AdamW, {spec['micro_batch']} × {spec['seq_len']:,} tokens: "
                 f"model states and the peak of a step")
    style.save(fig, path)


# -- the worked examples -------------------------------------------------------------------------------------------
def example_fsdp_notes() -> dict:
    """The PyTorch FSDP notes' example: 1.6B-parameter fp32 blocks (one unit each) on 8 ranks, 10 of them.

    - 0.8 GB per collective per rank: the payload, each rank's shard of a unit, P·4/N = 1.6e9 · 4 / 8. The
      counter counts bytes *sent* on a ring, (N − 1)/N of the full buffer = 7 payloads; payload = sent / (N − 1).
    - 24 GB: the payloads of one step added up -- 10 blocks × 3 collectives (all-gather in forward, all-gather
      and reduce-scatter in backward) × 0.8 GB. Not memory: 10 unsharded blocks at once would be 64 GB.
    - 14.4 GB: the buffers at FSDP's peak, 2 communication buffers of 0.8 GB + 2 unsharded blocks of 6.4 GB:
      one block computing while the next one's all-gather lands. Measured with forward_prefetch=True and
      BACKWARD_PRE (two blocks unsharded at once in both passes). minifsdp's FlatParameter all-gathers in fp32
      straight from the shard into the unsharded buffer, and reduce-scatters in place: no communication
      buffers apart from those, so its peak holds the 12.8 GB of blocks, not 14.4."""
    spec = Spec(model="fsdp-notes", world_size=8, strategy="fsdp", seq_len=8, forward_prefetch=True, record=True)
    result = simulate(spec)
    n = spec.world_size
    blocks = [e for e in result["events"] if not e[2].endswith("(root)")]  # the notes leave the root out
    block = [u for u in result["units"] if u["name"] != "(root)"][0]
    return {"result": result, "block_numel": block["numel"], "block_padded": block["padded"],
            "payload_per_collective": {sent / (n - 1) for _, sent, _ in blocks},
            "collectives_per_step": len(blocks),
            "payloads_per_step": sum(sent / (n - 1) for _, sent, _ in blocks),
            "unsharded_peak": max(result["most"]["forward"]["unsharded"], result["most"]["backward"]["unsharded"]),
            "unsharded_peak_forward": result["most"]["forward"]["unsharded"],
            "unsharded_peak_backward": result["most"]["backward"]["unsharded"],
            "root_numel": sum(u["numel"] for u in result["units"] if u["name"] == "(root)"),
            "analytic_buffers": analytic.fsdp_buffer_bytes(block["numel"], n)}


ZERO_PAPER_GB = {"ddp": 120.0, "oss": 31.4, "sdp": 16.6, "fsdp": 1.9}  # its figure 1: Ψ = 7.5B, N = 64, K = 12


def example_zero(precisions=("bf16-master", "bf16")) -> dict:
    """The ZeRO paper's figure 1: Ψ = 7.5B on 64 GPUs with mixed-precision Adam (K = 12): model states per GPU
    of 120 GB (DDP, 16Ψ), 31.4 GB (ZeRO-1, 4Ψ + 12Ψ/N), 16.6 GB (ZeRO-2, 2Ψ + 14Ψ/N), 1.9 GB (ZeRO-3, 16Ψ/N).

    Model states here: parameters + gradients + optimizer state after the optimizer step, measured (the
    gradients are still there; ZeRO-3's full parameters are not: they are freed at the end of backward).
    The paper's accounting is "bf16-master" (MasterAdamW over a bf16 model); minifsdp's own MixedPrecision
    ("bf16") keeps the fp32 master as the parameter and fp32 gradients: the same 16 bytes per parameter, so
    the same DDP and ZeRO-3 totals, but ZeRO-1 and -2 shard less of them (8Ψ + 8Ψ/N and 4Ψ + 12Ψ/N)."""
    out = {}
    for precision in precisions:
        for strategy in ("ddp", "oss", "sdp", "fsdp"):
            # (one step: the model states after it are those after any step)
            r = simulate(Spec(model="zero-7.5b", world_size=64, strategy=strategy, precision=precision,
                              seq_len=8, warmup=False))
            after = r["phases"]["after optimizer step"]
            out[(precision, strategy)] = {"result": r, "params": after["params"], "grads": after["grads"],
                                          "optim": after["optim"],
                                          "states": after["params"] + after["grads"] + after["optim"],
                                          "analytic": r["analytic"]["model states"]["total"]}
    return out


def example_limit_all_gathers(world_size: int = 64, layers: int | None = None, seq_len: int = 4096) -> dict:
    """The FSDP paper's caching-allocator observation, at scale: 7b in bf16 on `world_size` ranks, the GPU as far
    behind the CPU as it can be (DeviceLag). Peak memory of full parameters (allocated, or freed but not yet
    reusable) with limit_all_gathers and without."""
    out = {}
    for limit in (True, False):
        r = simulate(Spec(model="7b", world_size=world_size, strategy="fsdp", precision="bf16", seq_len=seq_len,
                          layers=layers, limit_all_gathers=limit, device_lag=True))
        out[limit] = {"result": r, "forward": r["most"]["forward"]["unsharded"],
                      "backward": r["most"]["backward"]["unsharded"],
                      "peak": max(r["phases"][p]["total"] for p in ("peak of forward", "peak of backward"))}
    layer = [u for u in out[True]["result"]["units"] if u["name"] != "(root)"][0]["numel"]
    root = sum(u["numel"] for u in out[True]["result"]["units"] if u["name"] == "(root)")
    out["layer_bytes"], out["root_bytes"] = 2 * layer, 2 * root
    out["layers"] = layers or MODELS["7b"].n_layers
    return out


EXAMPLES = ("fsdp-notes", "zero-7.5b", "limit-all-gathers")


def zero_table(rows: list[list[str]]) -> str:
    """The ZeRO paper's four figures next to the simulator's, a row per stage: [stage, the paper, bf16-master's
    states, params, grads, optimizer, states rounded as the paper does, analytic, bf16's states, analytic], in
    GB as printed. What the states add up from is folded under it (six columns fit the docs' column)."""
    from minifsdp.reports.format import md_folded, md_table

    main = md_table(["stage", "the paper", "bf16-master: measured (rounded)", "analytic",
                     "bf16 (minifsdp's MixedPrecision): measured", "analytic"],
                    [[r[0], r[1], f"{r[2]} ({r[6]})", r[7], r[8], r[9]] for r in rows])
    split = md_table(["stage", "bf16-master: measured", "= params", "+ grads", "+ optimizer"],
                     [[r[0], r[2], r[3], r[4], r[5]] for r in rows])
    return main + "\n\n" + md_folded("bf16-master's model states: parameters, gradients and optimizer state", split)


def worked_examples_report(names=EXAMPLES) -> str:
    parts = []
    if "fsdp-notes" in names:
        e = example_fsdp_notes()
        gb = 1e9
        (payload,) = e["payload_per_collective"]
        r = e["result"]
        parts += [
            "**PyTorch FSDP notes: 1.6B-parameter fp32 blocks on 8 ranks**\n",
            f"`python -m minifsdp simulate --example fsdp-notes`: a model of 10 blocks of {e['block_numel']:,} "
            f"parameters (each block one FSDP unit, padded to {e['block_padded']:,}) and a root unit of "
            f"{e['root_numel']:,} (embedding, final norm, head), fp32, FSDP with forward_prefetch=True and "
            f"BACKWARD_PRE, rank 0 of 8, on meta tensors; the second step measured.\n",
            "| the notes | their figure | measured by the simulator | what it is |", "|---|---|---|---|",
            f"| payload per collective per rank | 0.8 GB | {payload / gb:.3f} GB | each rank's shard of a block, "
            f"P·4/N; the counter's bytes sent on the ring / (N − 1) |",
            f"| communications per step (10 blocks) | 30 | {e['collectives_per_step']} | all-gather in forward, "
            f"all-gather and reduce-scatter in backward, per block |",
            f"| total payload per step | 24 GB | {e['payloads_per_step'] / gb:.1f} GB | 30 × 0.8 GB: bytes "
            f"communicated per rank, not memory (10 blocks unsharded at once would be 64 GB) |",
            f"| unsharded blocks at the peak | 2 × 6.4 = 12.8 GB | forward {e['unsharded_peak_forward'] / gb:.1f} "
            f"GB, backward {e['unsharded_peak_backward'] / gb:.1f} GB | one block computing, the next one's "
            f"all-gather in flight (+ the root's {e['root_numel'] * 4 / 1e6:.2f} MB, kept from forward to "
            f"backward) |",
            "| communication buffers | 2 × 0.8 = 1.6 GB | 0 | minifsdp all-gathers from the shard itself into "
            "the unsharded buffer and reduce-scatters in place: none in fp32 (with bf16 compute, the cast "
            "shard, P·2/N, is one) |",
            f"| buffers in all | 14.4 GB | {e['unsharded_peak'] / gb:.1f} GB | analytic.fsdp_buffer_bytes: "
            f"{e['analytic_buffers']['total'] / gb:.1f} GB |",
            "",
            f"The notes also count the reduce-scatter's buffers in backward, \"2x buffer size\". At rank 0's "
            f"backward peak the meter finds {r['phases']['peak of backward']['other'] / gb:.1f} GB of gradients in "
            f"flight besides the two unsharded blocks: this block's per-parameter gradients, computed and not yet "
            f"concatenated into its flat gradient (6.4 GB), and the previous block's flat gradient, whose "
            f"reduce-scatter is in flight (6.4 GB); plus {r['phases']['peak of backward']['grads'] / gb:.1f} GB "
            f"of gradient shards already reduced. Just before the concatenation minifsdp frees the block's full "
            f"parameters and waits for the previous reduce-scatter (chapter 6), so the concatenation itself adds "
            f"nothing to the peak.\n"]
    if "zero-7.5b" in names:
        z = example_zero()
        psi = z[("bf16-master", "ddp")]["result"]["psi"]
        share = z[("bf16-master", "oss")]["result"]["stepped"] / (psi / 64)
        parts += [
            "**The ZeRO paper: Ψ = 7.5B on 64 GPUs, mixed-precision Adam (K = 12)**\n",
            f"`python -m minifsdp simulate --example zero-7.5b`: the paper's figure-1 model as a Llama-style "
            f"model of Ψ = {psi:,} (72 layers of dim 3072, Megatron-LM 8.3B's depth and width), rank 0 of 64, "
            f"one step; model states = parameters + gradients + optimizer state after the optimizer step (those "
            f"of any step), in GB (1e9 bytes).\n",
            zero_table([[label, f"{ZERO_PAPER_GB[strategy]}", *(f"{v / 1e9:.3f}" for v in (
                              z[("bf16-master", strategy)][k] for k in ("states", "params", "grads", "optim"))),
                          f"{z[('bf16-master', strategy)]['states'] / 1e9:.1f}",
                          *(f"{z[(precision, strategy)][k] / 1e9:.3f}" for precision, k in (
                              ("bf16-master", "analytic"), ("bf16", "states"), ("bf16", "analytic")))]
                         for strategy, label in (("ddp", "DDP (16Ψ)"), ("oss", "ZeRO-1, OSS (4Ψ + 12Ψ/N)"),
                                                 ("sdp", "ZeRO-2, SDP (2Ψ + 14Ψ/N)"),
                                                 ("fsdp", "ZeRO-3, FSDP (16Ψ/N)"))])]
        parts += ["",
                  "bf16-master is the paper's accounting: the model held in bf16 (parameters 2, gradients 2 bytes) and "
                  "`MasterAdamW` keeping fp32 master weights, momentum and variance (K = 12) for the parameters it "
                  "steps. minifsdp's own `MixedPrecision` keeps the fp32 master *as* the parameter (4 bytes), fp32 "
                  "gradients (4) and AdamW's moments (8), and makes bf16 copies only while computing: the same 16 "
                  "bytes per parameter, so DDP and ZeRO-3 agree with the paper, but ZeRO-1 shards only 8 of them "
                  "(8Ψ + 8Ψ/N) and ZeRO-2 only 12 (4Ψ + 12Ψ/N). The last digits: Ψ is not exactly 7.5B "
                  f"(16Ψ = {16 * psi / 1e9:.3f} GB), OSS gives rank 0 whole tensors ({share:.4f} Ψ/N here), FSDP "
                  "pads each unit to a multiple of N, and AdamW keeps a 4-byte step per tensor (MasterAdamW a "
                  "Python int).\n"]
    if "limit-all-gathers" in names:
        e = example_limit_all_gathers()
        parts += [
            "**The FSDP paper: the rate limiter, at 7B on 64 ranks**\n",
            "`python -m minifsdp simulate --example limit-all-gathers`: 7b, bf16 compute, FSDP (one unit per "
            "decoder layer, BACKWARD_PRE), rank 0 of 64, with `DeviceLag`: a GPU as far behind the CPU as it "
            "can be, so that a unit's freed buffer stays allocated until the CPU waits for that free. "
            "Peak memory of full parameters (in use, or freed by the CPU and not yet by the device):\n",
            "| | peak of forward | peak of backward | in layers (bf16) |", "|---|---|---|---|"]
        for limit in (True, False):
            f, b = e[limit]["forward"], e[limit]["backward"]
            in_layers = [(x - e["root_bytes"]) / e["layer_bytes"] for x in (f, b)]
            parts.append(f"| limit_all_gathers={limit} | {fmt(f)} | {fmt(b)} | "
                         f"{in_layers[0]:.1f} / {in_layers[1]:.1f} |")
        parts += ["",
                  f"A layer is {fmt(e['layer_bytes'])} in bf16; the root unit (embedding, norm, head), "
                  f"{fmt(e['root_bytes'])}, is held from forward to backward. With limit_all_gathers the CPU waits "
                  f"for the oldest free once two are pending, before it all-gathers into new memory: in forward "
                  f"the layer computing and one freed but not yet released by the device; in backward one more, "
                  f"the layer prefetched. Without it nothing bounds them: every layer, all {e['layers']}, is held "
                  f"until the CPU synchronises -- the whole model unsharded, at every step. On CPU ranks and on "
                  f"meta, compute is synchronous and the limiter never waits (without DeviceLag both rows read "
                  f"the root + one layer in forward, + two in backward); on a GPU the truth lies between the two "
                  f"rows, depending on how far the CPU runs ahead.\n"]
    return "\n".join(parts)


def run_simulate(models=("7b",), world_sizes=(8,), strategies=("fsdp",), precision: str = "fp32", seq_len: int = 4096,
                 micro_batch: int = 1, checkpoint_activations: bool = False, layers: int | None = None,
                 markdown: str | None = None, plot: str | None = None, examples=()) -> list[dict] | str:
    """The command line's entry: worked examples, one detailed report, or a sweep (table and figure)."""
    from minifsdp.reports.format import write_report

    if examples:
        names = EXAMPLES if "all" in examples else examples
        for name in names:
            if name not in EXAMPLES:
                raise ValueError(f"unknown example {name!r}: choose from {', '.join(EXAMPLES)} or all")
        text = worked_examples_report(names)
        write_report(text, markdown)
        return text
    fields = dict(precision=precision, seq_len=seq_len, micro_batch=micro_batch,
                  checkpoint_activations=checkpoint_activations, layers=layers)
    for model in models:  # every argument checked before the first (long) run
        for strategy in strategies:
            Spec(model=model, strategy=strategy, world_size=world_sizes[0], **fields).check()
    if len(models) * len(world_sizes) * len(strategies) == 1 and not plot:
        result = simulate(Spec(model=models[0], world_size=world_sizes[0], strategy=strategies[0], **fields))
        write_report(report(result), markdown)
        return [result]
    results = sweep(models, world_sizes, strategies, **fields)
    text = (f"**Rank 0's memory and bytes against N: {', '.join(models)}, {precision}, micro-batch {micro_batch} × "
            f"{seq_len:,} tokens{', activation checkpointing' if checkpoint_activations else ''}**\n\n"
            f"Meta tensors under a fake process group, the second of two steps. Model states: parameters + "
            f"gradients + optimizer state after the optimizer step (analytic: analytic.model_state_bytes); the "
            f"peak includes activations and ZeRO-3's unsharded units; bytes: comm.counting() (analytic: "
            f"analytic.comm_bytes_per_step, the ZeRO paper's 2Ψ or 3Ψ; minifsdp's OSS runs under DDP and "
            f"broadcasts the parameters too: 3Ψ).\n\n{sweep_table(results)}\n")
    write_report(text, markdown)
    if plot:
        plot_scaling(results, plot)
        print(f"\nwrote {plot}")
    return results
