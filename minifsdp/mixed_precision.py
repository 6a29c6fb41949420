"""Chapter 8: mixed precision and CPU offload -- the policies, the loss scaler, and their checks.

Mixed precision trains with two copies of every number's precision: the optimizer keeps and steps fp32
*master* parameters, while forward and backward compute with a bf16 or fp16 *cast* of them. Sharding
makes the cast cheap to communicate: FSDP casts its fp32 shard to `param_dtype` *before* the all-gather,
so the wire carries 2 bytes per parameter instead of 4, and the full parameters it builds are half the
size. Gradients come out of backward in `param_dtype`, are averaged in `reduce_dtype` (bf16 halves the
reduce-scatter too; fp32 keeps the sum exact to more bits), and land on the shard as fp32 for the step.

    model = FSDP(TinyGPT(), auto_wrap_policy=..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters())        # the fp32 master shards

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. A loss scaler multiplies the loss by a
large S so the gradients are S times larger in fp16, and divides them by S (in fp32) before the step; if
any gradient overflowed, the step is skipped and S halves. With sharded gradients each rank sees only its
shard's overflow, so the ranks must *agree* -- one all-reduce of one flag -- or some would step and some
not, and the replicas would silently drift apart. That is ShardedGradScaler.

CPUOffload(offload_params=True) keeps the fp32 shards, their gradients and so the optimizer state in host
memory: the device holds only the units being computed (and the activations). Each unshard copies the
shard to the device first; each gradient shard is copied back. Only FSDP offloads here, as in PyTorch.

    python -m minifsdp precision --world-size 2      # memory and bytes per rank: fp32, bf16, bf16 + offload
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_leaves, tree_map

from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device

LOW_PRECISION = (torch.bfloat16, torch.float16)


# --8<-- [start:policies]
# --8<-- [start:policy]
@dataclass(frozen=True)
class MixedPrecision:
    """PyTorch FSDP's policy. None means "leave it in the parameters' own
    dtype (fp32)".

    param_dtype:  what forward and backward compute in (the all-gathered
                  parameters' dtype).
    reduce_dtype: what gradients are averaged in; None: param_dtype.
    buffer_dtype: what buffers (e.g. BatchNorm statistics) are kept in;
                  None: as built.
    _module_classes_to_ignore: FSDP with an auto_wrap_policy only, as in
                  PyTorch's FSDP1 (its spelling and its default, BatchNorm):
                  every module of these classes becomes a unit of its own
                  without mixed precision, its floating inputs cast to fp32
                  and its outputs back (keep_full_precision).
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    _module_classes_to_ignore: tuple = (_BatchNorm,)
    # --8<-- [end:policy]

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(self, field)
            if (dtype is not None
                    and dtype not in (torch.float32, *LOW_PRECISION)):
                raise ValueError(f"MixedPrecision({field}={dtype}): only "
                                 f"torch.float32, torch.bfloat16 and "
                                 f"torch.float16 are supported")
        if {self.param_dtype, self.reduce_dtype} >= set(LOW_PRECISION):
            raise ValueError(
                f"MixedPrecision(param_dtype={self.param_dtype}, "
                f"reduce_dtype={self.reduce_dtype}) mixes the two 16-bit "
                f"formats: bf16 gradients can exceed fp16's range (65504), "
                f"and fp16 ones lose bf16's range for nothing. Reduce in the "
                f"same dtype or in fp32")

    @property
    def grad_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype or self.param_dtype

    @property
    def uses_fp16(self) -> bool:
        return torch.float16 in (self.param_dtype, self.reduce_dtype)


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded parameters (and so their gradients and optimizer
    state) in host memory."""
    offload_params: bool = False
# --8<-- [end:policies]


def require_policy(policy) -> None:
    """mixed_precision is a MixedPrecision (or None). FairScale's FSDP took a bool: its spelling is named."""
    if isinstance(policy, bool):
        raise TypeError(f"mixed_precision={policy} is FairScale's spelling; here, as in PyTorch, it takes a policy: "
                        f"FairScale's mixed_precision=True (compute_dtype and buffer_dtype fp16, reduced in fp16) "
                        f"is MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16), and "
                        f"fp32_reduce_scatter=True adds reduce_dtype=torch.float32")


def check_master_dtype(policy: MixedPrecision | None, params) -> None:
    """Mixed precision keeps fp32 master parameters: a model already in bf16 has none to keep."""
    require_policy(policy)
    if policy is None or policy.param_dtype is None:
        return
    for name, p in params:
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"mixed_precision keeps fp32 master parameters and casts them to "
                             f"{policy.param_dtype} to compute, but parameter {name!r} is {p.dtype}. Build the "
                             f"model in fp32 (or drop mixed_precision to train entirely in {p.dtype})")


def cast_buffers(module: torch.nn.Module, policy: MixedPrecision | None, recurse: bool = True) -> None:
    if policy is not None and policy.buffer_dtype is not None:
        for b in module.buffers(recurse=recurse):
            if b.is_floating_point():
                b.data = b.data.to(policy.buffer_dtype)


# --8<-- [start:keep_full_precision]
def keep_full_precision(module: torch.nn.Module) -> None:
    """A module left out of mixed precision
    (MixedPrecision._module_classes_to_ignore) computes in fp32 among layers
    that compute in param_dtype: its floating inputs are cast to fp32 before
    its forward, and its floating outputs back to the inputs' dtype after, so
    the layers after it see param_dtype again. The hooks of PyTorch's FSDP1,
    registered last, after any of the user's."""
    def to_fp32(mod, args):
        dtypes = {t.dtype for t in tree_leaves(args)
                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        # None: nothing to cast back
        mod._input_dtype = next(iter(dtypes - {torch.float32}), None)
        return tree_map(
            lambda t: t.float()
            if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            args)

    def back(mod, args, output):
        dtype = mod._input_dtype
        if dtype is None:
            return output
        return tree_map(
            lambda t: t.to(dtype)
            if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            output)

    module.register_forward_pre_hook(to_fp32)
    module.register_forward_hook(back)
# --8<-- [end:keep_full_precision]


def cast_inputs(policy: MixedPrecision | None, args, kwargs):
    """Floating-point inputs in param_dtype (as FSDP's root does), so the first layer is low-precision too;
    integer inputs (token ids) are left alone."""
    if policy is None or policy.param_dtype is None:
        return args, kwargs

    def cast(t):
        return t.to(policy.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return tree_map(cast, args), tree_map(cast, kwargs)


# --8<-- [start:scaler]
# how many losses a ShardedGradScaler has scaled in this process
# (see warn_if_unscaled)
_scaled_losses = 0


class ShardedGradScaler:
    """Dynamic loss scaling for fp16 whose skip decision is the same on every
    rank (torch.amp.GradScaler's arguments and behaviour, plus that
    agreement).

        scaler.scale(loss).backward()
        # unscale, and step only if no rank saw an inf or a nan
        scaler.step(optimizer)
        # halve the scale after an overflow; double it after growth_interval
        scaler.update()
    """

    def __init__(self, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        self.scale_value, self.growth_factor, self.backoff_factor = (
            init_scale, growth_factor, backoff_factor)
        self.growth_interval, self.enabled = growth_interval, enabled
        self._growth_tracker = 0
        # id(optimizer) -> this step's agreed flag, once unscaled
        self._found_inf = {}
        # per step: did *this rank's* gradients overflow (for the tests)
        self.local_found_inf = []

    def get_scale(self) -> float:
        return self.scale_value if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        global _scaled_losses
        _scaled_losses += 1
        # in fp32: an fp16 loss times 2**16 would itself overflow
        return loss.float() * self.scale_value if self.enabled else loss

    # --8<-- [start:unscale]
    def unscale_(self, optimizer) -> None:
        """Divide this rank's gradients by the scale (in their fp32 dtype) and
        agree on overflow."""
        if not self.enabled or id(optimizer) in self._found_inf:
            return
        grads = [p.grad for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        # BEGIN EXERCISE 8.2: unscale, flag overflow, agree on it, record both
        # where the collective runs (offload: not the grads)
        found_inf = torch.zeros(1, device=current_device())
        for g in grads:
            g.mul_(1.0 / self.scale_value)  # a power of two: exact in fp32
            found_inf += (~torch.isfinite(g)).any().to(found_inf.device)
        self.local_found_inf.append(bool(found_inf.item()))
        # the ranks must agree: skip the step everywhere if any rank overflowed
        comm.all_reduce(found_inf, op=comm.ReduceOp.MAX, tag="found_inf")
        self._found_inf[id(optimizer)] = bool(found_inf.item())
        # END EXERCISE

    def step(self, optimizer, *args, **kwargs):
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        self.unscale_(optimizer)
        return (None if self._found_inf[id(optimizer)]
                else optimizer.step(*args, **kwargs))
    # --8<-- [end:unscale]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """After the step: back off after an overflow, grow after
        growth_interval clean steps -- or, as torch's update(new_scale), take
        the scale given (the growth count is left as it is)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self.scale_value = float(new_scale)
        elif any(self._found_inf.values()):
            self.scale_value *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = self.scale_value * self.growth_factor
                # the scaled loss is fp32: stay finite there
                if grown <= torch.finfo(torch.float32).max:
                    self.scale_value = grown
                self._growth_tracker = 0
        self._found_inf = {}

    def state_dict(self) -> dict:
        return {"scale": self.scale_value,
                "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self._growth_tracker = (
            state["scale"], state["growth_tracker"])
# --8<-- [end:scaler]


def warn_if_unscaled(policy: MixedPrecision | None, scaled_before_forward: int) -> None:
    """Called at the end of a backward: fp16 gradients and no loss scaled since the forward."""
    if policy is not None and policy.uses_fp16 and _scaled_losses == scaled_before_forward:
        warnings.warn("mixed precision in float16 without a loss scaler: gradients below ~6e-8 flush to zero "
                      "and large ones overflow to inf. Use minifsdp.ShardedGradScaler (scaler.scale(loss)"
                      ".backward(); scaler.step(optimizer); scaler.update()), or bfloat16", stacklevel=2)


def scaled_losses() -> int:
    return _scaled_losses


# --8<-- [start:master_adamw]
class MasterAdamW(torch.optim.Optimizer):
    """AdamW for a model held in 16 bits, keeping the fp32 *master* copy of each parameter in its state: the
    ZeRO paper's mixed-precision Adam. Per parameter: the 16-bit parameter (2 bytes) and gradient (2), and
    in the optimizer K = 12 bytes -- master (4), momentum (4), variance (4). Each step updates the master
    with the gradient cast to fp32 (torch.optim.AdamW's update), then writes the master, rounded, into the
    parameter.

    minifsdp's MixedPrecision (above) keeps the same 16 bytes otherwise: the fp32 master *is* the parameter
    (4), its gradient is fp32 (4), AdamW's moments (8), and the 16-bit copy exists only while a unit
    computes. The totals agree; the split does not -- and a ZeRO stage shards some parts and not others,
    so ZeRO-1 and ZeRO-2 cost 4 + 4 + 8/N and 4 + (4 + 8)/N bytes under MixedPrecision, against the
    paper's 2 + 2 + 12/N and 2 + (2 + 12)/N here (chapter 13 measures both). Wrapped by OSS as any
    optimizer class is: OSS(params, optim=MasterAdamW, lr=...), each rank keeping the masters it steps."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # (the step count is a Python int: no tensor, the 12 bytes are all there is)
                    state["step"] = 0
                    state["master"] = p.detach().to(torch.float32, copy=True)
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                grad = p.grad.to(torch.float32)
                master.mul_(1 - group["lr"] * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                correction1, correction2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                denom = (exp_avg_sq.sqrt() / correction2 ** 0.5).add_(group["eps"])
                master.addcdiv_(exp_avg, denom, value=-group["lr"] / correction1)
                p.copy_(master)  # rounded to the parameter's 16 bits
        return loss
# --8<-- [end:master_adamw]


# -- chapter 1's DistributedDataParallel (and OSS and SDP on it): the whole model cast in forward --------------
# --8<-- [start:replicas]
class ReplicaPrecision:
    """How DistributedDataParallel computes and averages under a policy
    (None: as built, every step in the parameters' own dtype). With
    param_dtype, forward runs on a cast of the fp32 parameters (and of the
    floating-point inputs); the casts are part of the autograd graph, so each
    gradient arrives in fp32 .grad as the exact upcast of the low-precision
    one, and DDP's hooks fire as usual. Buckets are averaged in reduce_dtype."""

    def __init__(self, policy: MixedPrecision | None, module: torch.nn.Module):
        # the fp32 parameters are the master weights
        check_master_dtype(policy, module.named_parameters())
        cast_buffers(module, policy)
        self.policy = policy
        # (a loss scaler counts what it scales: see after_backward)
        self._scaled_before_forward = scaled_losses()

    def forward(self, module: torch.nn.Module, args, kwargs):
        """The module's forward, on a param_dtype cast of its parameters."""
        self._scaled_before_forward = scaled_losses()
        args, kwargs = cast_inputs(self.policy, args, kwargs)
        if self.policy is None or self.policy.param_dtype is None:
            return module(*args, **kwargs)
        cast = {name: p.to(self.policy.param_dtype)
                for name, p in module.named_parameters()}
        return torch.func.functional_call(module, cast, args, kwargs)

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of gradients of `dtype` is averaged in."""
        if self.policy is None or self.policy.grad_dtype is None:
            return dtype
        return self.policy.grad_dtype

    def after_backward(self) -> None:
        """Warn about an fp16 backward that no loss scaler scaled."""
        warn_if_unscaled(self.policy, self._scaled_before_forward)
# --8<-- [end:replicas]
