"""What the counters see of each collective: bytes and calls, and, for timelines, when it ran.

comm.py issues every collective; this module keeps the books on them. Each call is counted in every
counter open on this rank (`counting()`, which comm re-exports as `comm.counting`):

    with comm.counting() as counter:
        train_step()
    counter.bytes["all_reduce"], counter.by_group["dp"], counter.total()

A counter opened with `record=True` also keeps a CommEvent per collective (issued, on the wire, done)
and a Wait per time this rank was blocked on one, which chapter 7's timelines draw. The host clock says
when: the backend's completion callback where it has one, else the moment a wait returned. On a GPU the
host clock only says when the CPU queued the work, so CUDA events bracket each collective instead
(cuda_timing.py), read once the timeline ends.

For teaching, `throttled(...)` puts a simulated slow link under every collective (chapter 7): a wait
does not return before the link would have delivered. It changes when, never what.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from minifsdp.distributed import cuda_timing


@dataclass
class CommEvent:
    kind: str
    nbytes: float  # logical bytes this rank sends
    issued: float  # time.perf_counter() when the call was made
    # ... and when it completed: the backend's own report where it gives one (NCCL, most of gloo), else the
    # throttled link's end, else the moment a wait() returned (later than the truth if nobody waited at once)
    done: float = float("nan")
    tag: str = ""
    start: float = float("nan")  # when the (simulated) link began moving it: after the collectives ahead of it
    group: str = "world"         # the process group's name (comm.group_name)
    # on a GPU, (start, end) CUDA events in place of the host's `start` and `done`, which there only say when
    # the CPU queued the work: start once the collectives ahead of it in its group are done and its input
    # is ready, end once it is complete
    cuda: tuple | None = None


@dataclass
class Wait:
    """This rank was blocked from `start` to `end`, waiting for the collective tagged `tag`."""
    start: float
    end: float
    tag: str
    # on a GPU, (arrival, done) CUDA events: a wait blocks the stream, not the CPU, from the moment the stream
    # reaches it (arrival) until the collective is done -- not at all if it was done by then
    cuda: tuple | None = None


@dataclass
class CommCounter:
    """Bytes sent and calls made by this rank, per collective kind (all groups together), and per group."""
    bytes: dict = field(default_factory=lambda: defaultdict(float))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    by_group: dict = field(default_factory=lambda: defaultdict(functools.partial(defaultdict, float)))  # name -> kind -> bytes
    record: bool = False
    events: list = field(default_factory=list)   # CommEvent per collective, in issue order (record=True)
    waits: list = field(default_factory=list)    # Wait per blocking wait (record=True)
    copies: dict = field(default_factory=lambda: defaultdict(float))  # host <-> device bytes (comm.copy_to)

    def total(self) -> float:
        return sum(self.bytes.values())


_active: list[CommCounter] = []


@contextlib.contextmanager
def counting(record: bool = False):
    """Count (and optionally record) every collective this rank makes inside the block. Counters nest."""
    counter = CommCounter(record=record)
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


def count_copy(direction: str, nbytes: int) -> None:
    """A host <-> device copy (comm.copy_to): traffic too, kept apart from the network's bytes."""
    for c in _active:
        c.copies[direction] += nbytes


# --8<-- [start:throttle]
@dataclass
class _Link:
    """A simulated network: one channel, collectives cross it one after
    another in issue order (as on one NCCL stream), each taking latency +
    bytes sent / bandwidth."""
    bandwidth: float  # bytes per second one rank sends
    latency: float    # seconds per collective
    free_at: float = 0.0

    def schedule(self, issued: float, nbytes: float) -> tuple[float, float]:
        start = max(issued, self.free_at)
        self.free_at = start + self.latency + nbytes / self.bandwidth
        return start, self.free_at


_link: _Link | None = None


@contextlib.contextmanager
def throttled(bandwidth: float = 50e6, latency: float = 1e-3):
    """Inside the block, no collective completes before a slow simulated
    network would have carried it: `bandwidth` bytes/s per rank, `latency`
    seconds each. For timelines on a laptop only -- it changes when a wait
    returns, never a value."""
    global _link
    if bandwidth <= 0 or latency < 0:
        raise ValueError(
            f"throttled(bandwidth={bandwidth}, latency={latency}): "
            f"need bandwidth > 0, latency >= 0")
    outer, _link = _link, _Link(bandwidth, latency)
    try:
        yield _link
    finally:
        _link = outer
# --8<-- [end:throttle]


@dataclass
class Record:
    """The books on one collective, from its issue to the end of its wait: the CommEvent each recording
    counter holds, when the throttled link delivers it (0: no link), and on a GPU its CUDA timing."""
    tag: str = ""
    not_before: float = 0.0
    events: list = field(default_factory=list)
    timing: tuple | None = None  # cuda_timing.begin's (stream, start), until the collective is issued
    cuda_done: object = None     # on a GPU, while recording: the event that marks the collective done

    def issued(self, work) -> None:
        """After the call: have the GPU, or the backend's callback, say when it completes."""
        if self.timing is not None:
            cuda = cuda_timing.end(self.timing, work)
            for e in self.events:
                e.cuda = cuda
            self.cuda_done = cuda[1]
        elif self.events and work is not None:
            _stamp_completion(work, self.events, self.not_before)

    @contextlib.contextmanager
    def waiting(self, pending: bool):
        """Around the backend's wait (`pending`: not yet waited for): then hold on until the link has
        delivered, and note how long this rank was blocked. Nothing is noted if the wait raises."""
        arrival = cuda_timing.stamp() if self.cuda_done is not None and pending else None
        t0 = time.perf_counter()
        yield
        now = time.perf_counter()    # (after the real collective: the link's delay runs from its issue, not ours)
        if self.not_before > now:   # the simulated network has not delivered it yet
            time.sleep(self.not_before - now)
        t1 = time.perf_counter()
        for e in self.events:
            if math.isnan(e.done):  # no completion seen by the backend's callback: waiting is when we know
                e.done = t1
        for c in _active:
            if c.record and (arrival is not None or t1 > t0):
                cuda = None if arrival is None else (arrival, self.cuda_done)
                c.waits.append(Wait(t0, t1, self.tag, cuda=cuda))

    def delivered(self) -> bool:
        """The throttled link (if any) has delivered it."""
        return time.perf_counter() >= self.not_before


def begin(kind: str, sent: float, tag: str, group_name: str, group=None, device=None) -> Record:
    """Before the call: count `sent` bytes in every open counter, put the collective on the throttled link
    (if any), and where a counter records, an event for it -- on a GPU, with its CUDA timing begun."""
    issued = time.perf_counter()
    start, not_before = issued, 0.0
    if _link is not None:  # chapter 7: a simulated slow link
        start, not_before = _link.schedule(issued, sent)
    record = Record(tag, not_before)
    for c in _active:
        c.bytes[kind] += sent
        c.calls[kind] += 1
        c.by_group[group_name][kind] += sent
        if c.record:
            record.events.append(CommEvent(kind, sent, issued, tag=tag, start=start, done=not_before or float("nan"),
                                           group=group_name))
            c.events.append(record.events[-1])
    if record.events and device is not None and device.type == "cuda":
        record.timing = cuda_timing.begin(group, device)
    return record


def _stamp_completion(work, events, not_before: float) -> None:
    """Record when the backend finished the collective (on its own thread), not when we happened to wait."""
    def stamp(_):
        now = time.perf_counter()
        for e in events:
            e.done = max(now, not_before)
    try:
        work.get_future().add_done_callback(stamp)
    except (RuntimeError, AttributeError):  # a backend without futures: the wait stamps it instead
        pass
