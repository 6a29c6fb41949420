"""Chapter 12: pipeline parallelism -- the model cut between its layers, the batch cut into micro-batches.

Data parallelism gives every rank the whole model; tensor parallelism cuts every layer across ranks. Pipeline
parallelism cuts the model *between* layers: stage 0 holds the embeddings and the first blocks, stage 1 the
next blocks, ..., the last stage the final blocks, ln_f, the head and the loss. A rank holds only its stage's
parameters, gradients and optimizer state, and the only traffic is one activation (micro-batch x sequence x
hidden) forward across each stage boundary and its gradient backward: point to point, to a neighbour.

    modules = split_gpt(TinyGPT(config), num_stages=p, stage_indices=[rank])
    stage = PipelineStage(modules[0], stage_index=rank, num_stages=p, activation_shape=(b // m, T, h))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=gpt_loss)
    losses = []
    schedule.step(x, target=y, losses=losses)   # x matters on the first stage, y on the last
    optimizer.step()                            # each rank steps its own stage's parameters

The bubble. One batch through p stages keeps one stage busy at a time. GPipe cuts the batch into m
micro-batches and streams them: stage s starts micro-batch i as soon as stage s-1 has finished it, so after a
fill of p-1 slots every stage is busy, and after the last forward the backwards drain the same way. With a
forward taking t_f and a backward t_b on every stage, a step lasts (m + p - 1)(t_f + t_b) of which each stage
computes m(t_f + t_b): the idle share, the *bubble*, is (p - 1) / (m + p - 1). More micro-batches, less bubble.

The schedules differ in the order each stage runs its actions ("forward micro-batch i", "backward i"):

    schedule                  order on rank r (of p)                       bubble                 in flight
    ScheduleGPipe             every forward, then every backward           (p-1)/(m+p-1)          m
    Schedule1F1B              p-r-1 forwards, then one forward one         (p-1)/(m+p-1)          min(p-r, m)
                              backward, then the remaining backwards
    ScheduleInterleaved1F1B   v stages per rank (r, r+p, ...), 1F1B over   (p-1)/(v*m+p-1)        min(2(p-r-1)
                              (stage, micro-batch) in Megatron's order                            + (v-1)p + 1, v*m)

"In flight": micro-batches whose forward has run and whose backward has not, so whose activations the stage
still holds. GPipe holds all m; 1F1B (PipeDream-Flush, Megatron's default) starts a backward as soon as the
first micro-batch has come back, and from then on frees one micro-batch for each it admits: the same bubble
for a fraction of the activation memory. Interleaving (Megatron-LM, 2021) gives each rank v thinner stages, so
the fill and drain take slots v times shorter: the bubble shrinks by v, for v times more messages -- and for
more activations on the first ranks: its warm-up runs (v-1)p + 2(p-r-1) forwards of 1/v-stage pieces, so rank
0 holds about (p + (p-1)/v) micro-batches' worth where 1F1B holds p.

The bubble above is a share of the step's time (idle / total), which is what a measurement of one stage
sees; Megatron's paper states the same bubble relative to the ideal time instead, (p-1)/m and (p-1)/(v*m).

Messages. An activation and its gradient have the same shape, micro-batch x sequence x hidden, at every
boundary of a transformer, so each stage is told it once (`activation_shape`), as Megatron derives it from
its config: no shapes travel, and a receiver can allocate its buffer before the data arrives. Every send is
asynchronous (isend): a stage hands its result over and computes on, so a rank only ever blocks on a receive,
for a message its sender produces without needing anything more from this rank first (that the orders allow
this, measure/pipeline_timeline.py's simulate checks). Gloo, like NCCL, matches a pair's messages in the order
they were posted at each end, and moves a message only once its receive is posted (the sender announces it
and waits for the receiver's go-ahead). So each rank posts its receives from a peer in exactly the order that
peer sends -- which it knows: every rank can compute every rank's schedule -- and keeps one posted ahead, so
the message lands while it computes. With one stage per rank that is the order the messages are used in;
with interleaved stages on two ranks, activations and gradients share each direction, and a receive may be
posted well before its message is used.

The tied embedding. TinyGPT's lm_head uses wte's weight. Cut into stages, the first stage owns wte and the
last lm_head, on different ranks: each holds a copy, started equal, and after backward the two gradients are
summed across the two ranks (Megatron's "embedding group" all-reduce), so both copies take the same step.
Two ranks sum by exchanging: each sends its gradient and adds the other's -- the bytes of a ring all-reduce
on two ranks, and the same bits on both, as a + b == b + a in floating point. (step() therefore expects
zeroed gradients, as after optimizer.zero_grad(): carried-over gradients would be summed twice.) When the
first and last stage live on one rank (p = 1), they share the one parameter and autograd adds the two uses.

The loss is the mean over micro-batches: each micro-batch's loss is scaled by 1/m before its backward, so the
accumulated gradients are those of one process on the whole batch -- up to the order of the additions.

For teaching, `compute_time=(t_forward, t_backward)` makes every forward (backward) action last at least that
many seconds, sleeping for whatever its computation left: on a laptop, where real compute is tiny and noisy,
the bubble then has the size the formulas predict (like comm.throttled for the network; it changes when
things happen, never a value).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifsdp import events
from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device

FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
    """One step of a schedule: forward (or backward) micro-batch `microbatch` through stage `stage`."""
    kind: str        # FORWARD or BACKWARD
    stage: int       # the global stage index (0 .. num_stages - 1)
    microbatch: int

    def __str__(self) -> str:  # what the compute events are called: "F3 s1" (forward micro-batch 3, stage 1)
        return f"{self.kind}{self.microbatch} s{self.stage}"


# -- cutting TinyGPT into stages ---------------------------------------------------------------------------------------
def stages_of_rank(rank: int, num_ranks: int, virtual_stages: int = 1) -> list[int]:
    """The stages rank `rank` holds: rank r of p holds r, r + p, r + 2p, ... (Megatron's interleaved placement),
    so each stage's successor is on the next rank, and the last rank's on the first."""
    return [rank + k * num_ranks for k in range(virtual_stages)]


class GPTStageModule(nn.Module):
    """Stage `stage_index` of a TinyGPT cut into `num_stages` contiguous pieces: the embeddings on the first, an
    equal share of the blocks on each, ln_f and lm_head on the last. Parameter names are the whole model's
    ("blocks.5.fc.weight"), so a stage's state_dict is a slice of the model's."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, head: nn.Linear | None = None):
        super().__init__()
        per = len(model.blocks) // num_stages
        self.stage_index, self.num_stages = stage_index, num_stages
        first, last = stage_index == 0, stage_index == num_stages - 1
        self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
        mine = range(stage_index * per, (stage_index + 1) * per)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in mine})  # keyed "5": names stay "blocks.5..."
        self.ln_f, self.lm_head = (model.ln_f, head or model.lm_head) if last else (None, None)
        self.tied_embedding = None  # the name of the parameter another rank holds a copy of (set by split_gpt)

    def forward(self, x):
        if self.wte is not None:  # token ids in
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:  # logits out
            x = self.lm_head(self.ln_f(x))
        return x


def split_gpt(model: nn.Module, num_stages: int, stage_indices: list[int]) -> list[GPTStageModule]:
    """The stages `stage_indices` of `model` (a TinyGPT, built the same on every rank) cut into `num_stages`.

    The stage modules share the model's own submodules (no copy): what this rank does not hold is simply never
    referenced, and is freed with the model. A weight tied across ranks -- wte on the first stage, lm_head on the
    last, when one rank does not hold both -- becomes two parameters, started equal, each named by its stage's
    `tied_embedding`; the schedule sums their gradients after backward."""
    n = len(model.blocks)
    if num_stages < 1 or n % num_stages:
        raise ValueError(f"split_gpt: {n} blocks cannot be cut into {num_stages} stages of equal size; choose "
                         f"n_layer divisible by the number of stages (pipeline ranks x virtual stages)")
    bad = [s for s in stage_indices if not 0 <= s < num_stages]
    if bad:
        raise ValueError(f"split_gpt: stage indices {bad} outside 0 .. {num_stages - 1}")
    first, last = 0 in stage_indices, num_stages - 1 in stage_indices
    tied = model.lm_head.weight is model.wte.weight
    head = None
    if tied and last and not first:  # the copy: a head of its own, holding wte's values
        head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False,
                         device=model.wte.weight.device, dtype=model.wte.weight.dtype)
        head.weight = nn.Parameter(model.wte.weight.detach().clone())
    modules = [GPTStageModule(model, s, num_stages, head=head) for s in stage_indices]
    if tied and first != last:
        for m in modules:
            if m.wte is not None:
                m.tied_embedding = "wte.weight"
            if m.lm_head is not None:
                m.tied_embedding = "lm_head.weight"
    return modules


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TinyGPT's loss on a micro-batch: cross-entropy, the mean over its tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- a stage: compute, and what it keeps between a micro-batch's forward and its backward -----------------------------
class PipelineStage:
    """One stage of a pipeline: `submodule` run as stage `stage_index` of `num_stages`, on rank
    stage_index % p of `group` (p ranks, default: the world; num_stages = p x virtual stages per rank).

    activation_shape: the shape of what crosses every boundary (micro-batch, sequence, hidden), the same each
    way; the receiver allocates it before the message arrives. Not needed when there is one stage.
    A submodule whose `tied_embedding` names one of its parameters (split_gpt sets it) has that parameter's
    gradient summed with the copy's on the other end of the pipeline after each step."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, group=None,
                 activation_shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32):
        comm.require_process_group()
        self.submodule, self.stage_index, self.num_stages, self.group = submodule, stage_index, num_stages, group
        self.num_ranks, self.rank = comm.world_size(group), comm.rank(group)
        if num_stages % self.num_ranks:
            raise ValueError(f"PipelineStage: {num_stages} stages on {self.num_ranks} ranks; every rank must hold "
                             f"the same number of stages")
        if stage_index % self.num_ranks != self.rank:
            raise ValueError(f"PipelineStage: stage {stage_index} of {num_stages} lives on rank "
                             f"{stage_index % self.num_ranks} of the pipeline (stage s on rank s % p), not on rank "
                             f"{self.rank}")
        if activation_shape is None and num_stages > 1:
            raise ValueError("PipelineStage: give activation_shape=(micro-batch, sequence, hidden), the shape of "
                             "what crosses a stage boundary, so receivers can allocate it in advance")
        self.activation_shape, self.dtype = activation_shape and tuple(activation_shape), dtype
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        params = list(submodule.parameters())
        self.device = params[0].device if params else current_device()
        tied = getattr(submodule, "tied_embedding", None)
        self.tied_embedding = submodule.get_parameter(tied) if tied else None
        self._saved: dict[int, tuple] = {}  # micro-batch -> (input, output or scaled loss), forward to backward

    def forward_one_chunk(self, microbatch: int, x: torch.Tensor, target=None, loss_fn=None, scale: float = 1.0):
        """Run one micro-batch forward; keep what its backward needs. The last stage applies the loss and
        returns it (unscaled, detached); the others return their output, to send on."""
        if not self.is_first:
            x.requires_grad_()  # a leaf: its .grad after backward is what the previous stage needs
        out = self.submodule(x)
        if self.is_last:
            loss = loss_fn(out, target)
            self._saved[microbatch] = (x, loss * scale)  # 1/m: the mean over micro-batches
            return loss.detach()
        if self.activation_shape is not None and tuple(out.shape) != self.activation_shape:
            raise ValueError(f"stage {self.stage_index} produced an activation of shape {tuple(out.shape)}, but "
                             f"its neighbour expects activation_shape={self.activation_shape}")
        self._saved[microbatch] = (x, out)
        return out

    def backward_one_chunk(self, microbatch: int, grad_output: torch.Tensor | None = None):
        """Backward one micro-batch from its output's gradient (the loss, on the last stage); the parameters'
        gradients accumulate. Returns the gradient of the stage's input (None on the first stage), and frees
        everything the micro-batch's forward kept."""
        x, out = self._saved.pop(microbatch)
        torch.autograd.backward(out, grad_output)
        return None if self.is_first else x.grad


# -- the messages a rank receives, posted in its senders' order -------------------------------------------------------
# --8<-- [start:mailbox]
def _messages_sent(order: list[Action], num_stages: int):
    """What a rank whose schedule is `order` sends, in order:
    (kind, receiving stage, micro-batch)."""
    for a in order:
        if a.kind == FORWARD and a.stage < num_stages - 1:
            yield ("activation", a.stage + 1, a.microbatch)
        elif a.kind == BACKWARD and a.stage > 0:
            yield ("gradient", a.stage - 1, a.microbatch)


class _Mailbox:
    """This rank's receives for one step. Gloo matches a pair's messages in
    posting order, so receives from a sender are posted strictly in the order it
    sends. And one is always posted ahead, per sender: a message whose receive
    is not posted yet waits at the sender until the receiver asks (a round trip
    more, every message); posted ahead, it lands while this rank computes.
    Asking for a message the sender sends later posts the ones before it first
    (their buffers then wait here)."""

    def __init__(self, schedule: "PipelineSchedule"):
        self.schedule = schedule
        p, me = schedule.num_ranks, schedule.rank
        # sender -> deque of the messages it sends to this rank, in its order,
        # not yet posted
        self.expected = {}
        for src in range(p):
            if src != me:
                sent = _messages_sent(schedule.order(src), schedule.num_stages)
                self.expected[src] = deque(msg for msg in sent
                                           if msg[1] % p == me)
        self.posted: dict[tuple, tuple] = {}  # message -> (buffer, handle)
        for src in self.expected:
            self._post_next(src)

    def _post_next(self, src: int) -> None:
        if not self.expected[src]:
            return
        message = self.expected[src].popleft()
        buffer = torch.empty(self.schedule.activation_shape,
                             dtype=self.schedule.dtype,
                             device=self.schedule.device)
        tag = f"{message[0]} {message[2]} to s{message[1]}"
        handle = comm.recv(buffer, src, async_op=True, tag=tag,
                           group=self.schedule.group)
        self.posted[message] = (buffer, handle)

    def take(self, message: tuple) -> torch.Tensor:
        kind, stage, _ = message
        src = ((stage - 1 if kind == "activation" else stage + 1)
               % self.schedule.num_ranks)
        while message not in self.posted:
            self._post_next(src)
        buffer, handle = self.posted.pop(message)
        handle.wait()
        self._post_next(src)
        return buffer
# --8<-- [end:mailbox]


# -- the schedules: an order of actions, and one loop that runs any order ---------------------------------------------
class PipelineSchedule:
    """Runs this rank's stages through `order(rank)`, the schedule's list of actions, sending each result to the
    stage that needs it. Subclasses only say the order (GPipe, 1F1B, interleaved 1F1B)."""

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None,
                 compute_time: tuple[float, float] | None = None):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not self.stages:
            raise ValueError(f"{type(self).__name__}: no stages")
        s0 = self.stages[0]
        self.num_stages, self.num_ranks, self.rank, self.group = s0.num_stages, s0.num_ranks, s0.rank, s0.group
        self.activation_shape, self.dtype, self.device = s0.activation_shape, s0.dtype, s0.device
        self.virtual_stages = self.num_stages // self.num_ranks
        if sorted(s.stage_index for s in self.stages) != stages_of_rank(self.rank, self.num_ranks,
                                                                         self.virtual_stages):
            raise ValueError(f"{type(self).__name__}: rank {self.rank} of {self.num_ranks} must be given its stages "
                             f"{stages_of_rank(self.rank, self.num_ranks, self.virtual_stages)}, got "
                             f"{[s.stage_index for s in self.stages]}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be an integer >= 1, got {n_microbatches!r}")
        if any(s.is_last for s in self.stages) and loss_fn is None:
            raise ValueError(f"{type(self).__name__}: the last stage needs a loss_fn(output, target)")
        self.n_microbatches, self.loss_fn = n_microbatches, loss_fn
        self.compute_time = compute_time
        self._stage = {s.stage_index: s for s in self.stages}
        # one step's state: micro-batches, receives, sends in flight, tensors handed between this rank's stages
        self._inputs = self._targets = self._mailbox = None
        self._handed_over, self._sends, self._losses = {}, {}, []

    def order(self, rank: int) -> list[Action]:
        """The actions rank `rank` runs in one step, in order (every rank can compute every rank's)."""
        raise NotImplementedError

    # --8<-- [start:step]
    def step(self, *args, target=None, losses: list | None = None):
        """One pipelined forward and backward of a batch: `args` (the batch's
        inputs, on the rank of the first stage) and `target` (on the rank of the
        last) are cut into n_microbatches along dim 0. Gradients accumulate in the
        stages' parameters; the tied embedding's are summed. On the last stage, each
        micro-batch's loss is appended to `losses` and their mean returned;
        elsewhere, None."""
        m = self.n_microbatches
        self._inputs = (_split(args[0] if args else None, m, "input")
                        if self._stage.get(0) else None)
        self._targets = (_split(target, m, "target")
                         if self._stage.get(self.num_stages - 1) else None)
        self._mailbox, self._handed_over, self._sends, self._losses = (
            _Mailbox(self), {}, {}, [])
        for action in self.order(self.rank):
            if action.kind == FORWARD:
                self._forward(action)
            else:
                self._backward(action)
        # the gradients' sends (their receivers may still be computing)
        for handle in self._sends.values():
            handle.wait()
        self._sum_tied_embedding_grads()
        (step_losses, self._inputs, self._targets, self._mailbox, self._sends,
         self._losses) = self._losses, None, None, None, {}, []
        if losses is not None:
            losses.extend(step_losses)
        return torch.stack(step_losses).mean() if step_losses else None

    # -- the pieces of a step ---------------------------------------------------
    def _forward(self, action: Action) -> None:
        stage, i = self._stage[action.stage], action.microbatch
        x = (self._inputs[i] if stage.is_first
             else self._receive(("activation", stage.stage_index, i)))
        with self._computing(action):
            out = stage.forward_one_chunk(
                i, x, self._targets[i] if stage.is_last else None, self.loss_fn,
                scale=1.0 / self.n_microbatches)
        if stage.is_last:
            self._losses.append(out)
        else:
            self._send(("activation", stage.stage_index + 1, i), out.detach())

    def _backward(self, action: Action) -> None:
        stage, i = self._stage[action.stage], action.microbatch
        grad = (None if stage.is_last
                else self._receive(("gradient", stage.stage_index, i)))
        with self._computing(action):
            grad_input = stage.backward_one_chunk(i, grad)
        # the next stage used our activation (here is its gradient): let the
        # buffer go
        if not stage.is_last:
            handle = self._sends.pop(("activation", stage.stage_index + 1, i),
                                     None)
            if handle is not None:
                handle.wait()
        if not stage.is_first:
            self._send(("gradient", stage.stage_index - 1, i), grad_input)
    # --8<-- [end:step]

    def _send(self, message: tuple, tensor: torch.Tensor) -> None:
        """message: (kind, receiving stage, micro-batch)."""
        dst = message[1] % self.num_ranks
        if dst == self.rank:  # the receiving stage is this rank's own (one rank, virtual stages): no message
            self._handed_over[message] = tensor
            return
        tag = f"{message[0]} {message[2]} to s{message[1]}"
        self._sends[message] = comm.send(tensor.contiguous(), dst, async_op=True, tag=tag, group=self.group)

    def _receive(self, message: tuple) -> torch.Tensor:
        if message in self._handed_over:
            return self._handed_over.pop(message)
        return self._mailbox.take(message)

    @contextlib.contextmanager
    def _computing(self, action: Action):
        """Announce the action (timelines draw it; measure/pipeline_timeline.py counts the micro-batches in flight
        from the same spans), and with compute_time, make it last that long."""
        events.emit(events.COMPUTE_BEGIN, str(action))
        start = time.perf_counter()
        try:
            yield
            if self.compute_time is not None:
                left = start + self.compute_time[action.kind == BACKWARD] - time.perf_counter()
                if left > 0:
                    time.sleep(left)
        finally:
            events.emit(events.COMPUTE_END, str(action))

    # --8<-- [start:tied]
    def _sum_tied_embedding_grads(self) -> None:
        """The first and last stage's copies of the tied embedding: each adds the
        other's gradient."""
        for stage in self.stages:
            weight = stage.tied_embedding
            if weight is None:
                continue
            peer = 0 if stage.is_last else (self.num_stages - 1) % self.num_ranks
            mine = (weight.grad if weight.grad is not None
                    else torch.zeros_like(weight))
            theirs = torch.empty_like(mine)
            received = comm.recv(theirs, peer, async_op=True,
                                 tag="tied embedding", group=self.group)
            sent = comm.send(mine, peer, async_op=True, tag="tied embedding",
                             group=self.group)
            received.wait()
            sent.wait()  # before adding in place: `mine` is what is on the wire
            weight.grad = mine.add_(theirs)
    # --8<-- [end:tied]


def _split(tensor: torch.Tensor, m: int, what: str) -> tuple:
    if tensor is None:
        raise ValueError(f"the pipeline's {'first' if what == 'input' else 'last'} stage needs the batch's {what}")
    if tensor.shape[0] % m:
        raise ValueError(f"a batch of {tensor.shape[0]} does not cut into {m} equal micro-batches")
    return tensor.split(tensor.shape[0] // m)


class _OneStagePerRank(PipelineSchedule):
    def __init__(self, stage, n_microbatches: int, loss_fn: Callable | None = None,
                 compute_time: tuple[float, float] | None = None):
        super().__init__(stage, n_microbatches, loss_fn, compute_time)
        if self.virtual_stages != 1:
            raise ValueError(f"{type(self).__name__} runs one stage per rank, and this pipeline has "
                             f"{self.virtual_stages} per rank: use ScheduleInterleaved1F1B")


class ScheduleGPipe(_OneStagePerRank):
    """GPipe (Huang et al., 2019): every micro-batch forward, then every one backward. Simple, and every stage
    holds all m micro-batches' activations at the end of the forwards."""

    def order(self, rank: int) -> list[Action]:
        return gpipe_order(rank, self.num_ranks, self.n_microbatches)


class Schedule1F1B(_OneStagePerRank):
    """1F1B (PipeDream-Flush; Megatron's default): GPipe's bubble, but rank r holds at most p - r micro-batches."""

    def order(self, rank: int) -> list[Action]:
        return one_f_one_b_order(rank, self.num_ranks, self.n_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B (Narayanan et al., 2021): v stages per rank, the bubble divided by v. Takes this rank's
    stages (rank r: r, r + p, ...). As Megatron, micro-batches go through in groups of p, so m must divide by p."""

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None,
                 compute_time: tuple[float, float] | None = None):
        super().__init__(stages, n_microbatches, loss_fn, compute_time)
        if n_microbatches % self.num_ranks:
            raise ValueError(f"ScheduleInterleaved1F1B: {n_microbatches} micro-batches on {self.num_ranks} pipeline "
                             f"ranks; the interleaved order sends micro-batches in groups of p, so the number of "
                             f"micro-batches must be divisible by p (as in Megatron)")

    def order(self, rank: int) -> list[Action]:
        return interleaved_order(rank, self.num_ranks, self.virtual_stages, self.n_microbatches)


# -- the orders ----------------------------------------------------------------------------------------------------
def gpipe_order(rank: int, p: int, m: int) -> list[Action]:
    """All forwards, then all backwards, on stage `rank` of p."""
    return [Action(FORWARD, rank, i) for i in range(m)] + [Action(BACKWARD, rank, i) for i in range(m)]


# --8<-- [start:one_f_one_b]
def one_f_one_b_order(rank: int, p: int, m: int) -> list[Action]:
    """1F1B on stage `rank` of p. Micro-batch 0's backward can start on this
    stage once it has gone forward through the p - rank - 1 stages after it and
    back: that is how many forwards there is time for first (warm-up). Then each
    backward that frees a micro-batch is paired with a forward that admits the
    next (steady state), and the backwards left drain (cool-down)."""
    # BEGIN EXERCISE 12.2: 1F1B order: warm-up, forward/backward pairs, drain
    warmup = min(p - rank - 1, m)
    order = [Action(FORWARD, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(Action(FORWARD, rank, warmup + i))
        order.append(Action(BACKWARD, rank, i))
    order += [Action(BACKWARD, rank, i) for i in range(m - warmup, m)]
    return order
    # END EXERCISE
# --8<-- [end:one_f_one_b]


# --8<-- [start:interleaved]
def interleaved_order(rank: int, p: int, v: int, m: int) -> list[Action]:
    """Megatron's interleaved 1F1B on rank `rank` of p, holding stages
    rank, rank + p, ..., rank + (v-1)p.

    The rank's k-th forward is micro-batch (k // pv) * p + k % p of its stage
    number (k % pv) // p (a group of p micro-batches through its first stage,
    the same group through its second, ...), and the k-th backward the same
    micro-batch through its stages in reverse. Warm-up: before the first
    backward (micro-batch 0 through the rank's last stage) can start,
    micro-batch 0 must go through all its earlier stages -- (v - 1)p forwards
    here -- and then forward through the p - rank - 1 ranks after this one and
    back, 2(p - rank - 1) slots more."""
    total = m * v

    def action(kind: str, k: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    # BEGIN EXERCISE 12.4: interleaved order: warm-up, then 1F1B, then cool-down
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [action(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(FORWARD, warmup + k), action(BACKWARD, k)]
    order += [action(BACKWARD, k) for k in range(total - warmup, total)]
    return order
    # END EXERCISE
# --8<-- [end:interleaved]
