"""Chapter 12: pipeline parallelism's runtime -- the schedules, which run a rank's stages through their order and
send each result to the stage that needs it.

A rank holds its stages (pipeline_stage.py: the model cut between its layers) and runs them through its schedule's
order of actions (pipeline_orders.py: GPipe, 1F1B, interleaved 1F1B). The only traffic is one activation
(micro-batch x sequence x hidden) forward across each stage boundary and its gradient backward: point to point, to
a neighbour.

    modules = split_gpt(TinyGPT(config), num_stages=p, stage_indices=[rank])
    stage = PipelineStage(modules[0], stage_index=rank, num_stages=p, activation_shape=(b // m, T, h))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=gpt_loss)
    losses = []
    schedule.step(x, target=y, losses=losses)   # x matters on the first stage, y on the last
    optimizer.step()                            # each rank steps its own stage's parameters

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
from typing import Callable

import torch

from minifsdp import events
from minifsdp.distributed import comm
from minifsdp.parallel.pipeline_orders import (BACKWARD, FORWARD, Action, gpipe_order, interleaved_order,
                                               one_f_one_b_order, stages_of_rank)


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

    # --8<-- [start:mailbox_take]
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
    # --8<-- [end:mailbox_take]
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
    # --8<-- [start:actions]
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
    # --8<-- [end:actions]
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
