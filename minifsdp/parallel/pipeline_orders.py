"""Chapter 12: the pipeline schedules as orders -- which action ("forward micro-batch i through stage s", "backward
i") each rank runs when, for GPipe, 1F1B and interleaved 1F1B. Pure functions of (rank, p, v, m): every rank can
compute every rank's order, which is how the runtime (pipeline.py) knows whom to expect messages from.

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
                              (stage, micro-batch) pieces                                         + (v-1)p + 1, v*m)

"In flight": micro-batches whose forward has run and whose backward has not, so whose activations the stage
still holds. GPipe holds all m; 1F1B (PipeDream-Flush, Megatron's default) starts a backward as soon as the
first micro-batch has come back, and from then on frees one micro-batch for each it admits: the same bubble
for a fraction of the activation memory. Interleaving (Megatron-LM, 2021) gives each rank v thinner stages, so
the fill and drain take slots v times shorter: the bubble shrinks by v, for v times more messages -- and for
more activations on the first ranks: rank 0 holds about (p + (p-1)/v) micro-batches' worth of whole-stage
activations where 1F1B holds p.

The bubble above is a share of the step's time (idle / total), which is what a measurement of one stage
sees; Megatron's paper states the same bubble relative to the ideal time instead, (p-1)/m and (p-1)/(v*m).
"""

from __future__ import annotations

from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
    """One step of a schedule: forward (or backward) micro-batch `microbatch` through stage `stage`."""
    kind: str        # FORWARD or BACKWARD
    stage: int       # the global stage index (0 .. num_stages - 1)
    microbatch: int

    def __str__(self) -> str:  # what the compute events are called: "F3 s1" (forward micro-batch 3, stage 1)
        return f"{self.kind}{self.microbatch} s{self.stage}"


def stages_of_rank(rank: int, num_ranks: int, virtual_stages: int = 1) -> list[int]:
    """The stages rank `rank` holds: rank r of p holds r, r + p, r + 2p, ... (Megatron's interleaved placement),
    so each stage's successor is on the next rank, and the last rank's on the first."""
    return [rank + k * num_ranks for k in range(virtual_stages)]


def gpipe_order(rank: int, p: int, m: int) -> list[Action]:
    """All forwards, then all backwards, on stage `rank` of p."""
    return [Action(FORWARD, rank, i) for i in range(m)] + [Action(BACKWARD, rank, i) for i in range(m)]


# --8<-- [start:one_f_one_b]
def one_f_one_b_order(rank: int, p: int, m: int) -> list[Action]:
    """1F1B on stage `rank` of p: each of the stage's m forwards and m
    backwards once, each kind in micro-batch order; at most min(p - rank, m)
    micro-batches forward and not yet backward at any point; and, run by every
    rank of the pipeline, no more bubble than GPipe's, (p - 1)/(m + p - 1)."""
    # BEGIN EXERCISE 12.2: 1F1B order: GPipe's bubble, at most p - rank held
    # Warm-up: micro-batch 0's backward reaches this stage only after it has
    # gone forward through the p - rank - 1 stages after it and back; that is
    # how many forwards there is time for first.
    warmup = min(p - rank - 1, m)
    order = [Action(FORWARD, rank, i) for i in range(warmup)]
    # Steady state: each backward that frees a micro-batch is paired with a
    # forward that admits the next, so p - rank are held at most.
    for i in range(m - warmup):
        order.append(Action(FORWARD, rank, warmup + i))
        order.append(Action(BACKWARD, rank, i))
    # Cool-down: the backwards left.
    order += [Action(BACKWARD, rank, i) for i in range(m - warmup, m)]
    return order
    # END EXERCISE
# --8<-- [end:one_f_one_b]


# --8<-- [start:interleaved]
def interleaved_order(rank: int, p: int, v: int, m: int) -> list[Action]:
    """Interleaved 1F1B on rank `rank` of p, holding stages rank, rank + p,
    ..., rank + (v-1)p, for m micro-batches (m a multiple of p): each of the
    rank's v*m forwards and v*m backwards once, each stage's forwards and
    backwards in micro-batch order; at most min(2(p - rank - 1) + (v - 1)p + 1,
    v*m) (stage, micro-batch) pieces forward and not yet backward at any point;
    and, run by every rank, a bubble of (p - 1)/(v*m + p - 1), v times
    thinner than 1F1B's."""
    # BEGIN EXERCISE 12.4: interleaved order: v stages per rank, bubble / v
    # Megatron's order. The rank's k-th forward is micro-batch
    # (k // pv) * p + k % p through its stage number (k % pv) // p: a group of
    # p micro-batches through its first stage, the same group through its
    # second, ...; the k-th backward the same micro-batch through its stages
    # in reverse.
    total = m * v

    def action(kind: str, k: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    # Warm-up: before the first backward (micro-batch 0 through the rank's
    # last stage), micro-batch 0 goes through the rank's earlier stages --
    # (v - 1)p forwards here -- then forward through the p - rank - 1 ranks
    # after this one and back: 2(p - rank - 1) slots more.
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [action(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(FORWARD, warmup + k), action(BACKWARD, k)]
    order += [action(BACKWARD, k) for k in range(total - warmup, total)]
    return order
    # END EXERCISE
# --8<-- [end:interleaved]
