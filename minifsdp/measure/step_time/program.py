"""Chapter 13: a step as a program, and the two-stream simulation that times it.

A program is compute segments, collectives issued, and waits, in the order minifsdp's runtime issues them.
`simulate` runs one on two kinds of stream -- one compute stream, one FIFO channel per process group -- and the
step time falls out, with the waits where they fall. Nothing takes max(compute, communication). The programs of the
strategies are strategies.py's; a step recorded by chapter 7's timeline becomes a program here too
(`program_from_recording`), and both give an order of tokens to compare (`issue_sequence`, `recorded_sequence`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from minifsdp.measure.timeline import Span, hidden_fraction


@dataclass(frozen=True)
class Compute:
    name: str
    seconds: float


@dataclass(frozen=True)
class Collective:
    """Issued at this point of the program; it starts once its channel has carried everything issued on it
    before (one FIFO per process group, as NCCL runs a group's collectives on one stream), the compute issued
    before it is done, and the collectives in `after` are complete."""
    tag: str
    kind: str
    channel: str
    seconds: float
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wait:
    """The compute stream stops until the collective `tag` is complete."""
    tag: str


@dataclass
class Simulated:
    step: float               # seconds from the first op to the end of the last one, compute or collective
    compute: float            # the compute segments, added up
    comm: float               # the collectives' durations, added up
    waiting: float            # the time the compute stream sat blocked
    spans: list[Span] = field(default_factory=list)

    @property
    def hidden(self) -> float:
        return hidden_fraction(self.spans)


# --8<-- [start:simulate]
def simulate(program) -> Simulated:
    """Run a program on one compute stream and one FIFO channel per process
    group."""
    now = 0.0                    # the compute stream's clock
    free = defaultdict(float)    # channel -> when all it was given is carried
    done: dict[str, float] = {}  # collective tag -> when it completes
    spans, compute, comm, waiting = [], 0.0, 0.0, 0.0
    for op in program:
        if isinstance(op, Compute):
            spans.append(Span("compute", op.name, now, now + op.seconds))
            now += op.seconds
            compute += op.seconds
            continue
        if not isinstance(op, (Collective, Wait)):
            raise TypeError(f"not a program step: {op!r}")
        # BEGIN EXERCISE 13.2: when a collective runs (FIFO); what a wait costs
        if isinstance(op, Collective):
            start = max([now, free[op.channel]] + [done[t] for t in op.after])
            done[op.tag] = free[op.channel] = start + op.seconds
            spans.append(Span(op.kind, op.tag, start, start + op.seconds))
            comm += op.seconds
        elif done[op.tag] > now:
            # a Wait on a collective still running: the compute stream sits
            # until it ends
            spans.append(Span("wait", op.tag, now, done[op.tag]))
            waiting += done[op.tag] - now
            now = done[op.tag]
        # END EXERCISE
    end = max([now] + list(done.values()))
    return Simulated(end, compute, comm, waiting,
                     sorted(spans, key=lambda s: s.start))
# --8<-- [end:simulate]


# -- a recorded minifsdp step (chapter 7's recorder, fed in) -----------------------------------------------------
def issue_sequence(program) -> list[str]:
    """A program's order as tokens -- each collective ("all_gather blocks.1") and each block's compute
    ("compute backward blocks.1") -- to compare with a recorded step's (`recorded_sequence`). The root's
    compute is left out: in a real step it is cut into many slivers around the blocks."""
    out = []
    for op in program:
        if isinstance(op, Collective) and op.channel != "replicate":
            out.append(f"{op.kind} {op.tag.rsplit(' ', 1)[1]}")
        elif isinstance(op, Compute) and "(root)" not in op.name and op.name != "optimizer":
            out.append(f"compute {op.name}")
    return out


def recorded_sequence(events, segments) -> list[str]:
    """The same tokens from a recording: `events` [(issued, kind, tag)] from a comm counter with record=True,
    `segments` [(start, name)] from a Timeline's compute segments."""
    marks = [(t, f"{kind} {tag.rsplit(' ', 1)[1]}") for t, kind, tag in events]
    marks += [(t, f"compute {name}") for t, name in segments if "(root)" not in name]
    out = []
    for _, token in sorted(marks):
        if not (out and out[-1] == token and token.startswith("compute")):
            out.append(token)
    return out


def program_from_recording(events, waits, end: float, seconds) -> list:
    """A recorded step (host times from its start) as a program: the host computes between the moments it
    issued a collective or blocked, and blocks where it blocked. `events`: [(issued, kind, tag, nbytes)];
    `waits`: [(start, end, tag)]; `seconds(kind, nbytes)` gives each collective its duration (measured, or
    predicted by alpha-beta)."""
    marks = [(t, 0, (kind, tag, nbytes)) for t, kind, tag, nbytes in events] + [(s, 1, (e, tag)) for s, e, tag in waits]
    prog, cursor, latest = [], 0.0, {}
    for k, (t, what, data) in enumerate(sorted(marks, key=lambda m: (m[0], m[1]))):
        if t > cursor:
            prog.append(Compute("host", t - cursor))
            cursor = t
        if what == 0:
            kind, tag, nbytes = data
            latest[tag] = f"{tag} #{k}"
            prog.append(Collective(latest[tag], kind, "world", seconds(kind, nbytes)))
        else:
            wait_end, tag = data
            if tag in latest:
                prog.append(Wait(latest[tag]))
            cursor = max(cursor, wait_end)
    if end > cursor:
        prog.append(Compute("host", end - cursor))
    return prog
