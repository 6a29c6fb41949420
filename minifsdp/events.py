"""What the runtime announces, for whoever measures it: algorithms emit events, measurement observes them.

The algorithms (ddp/, zero/, fsdp/, ...) never import the meter or the timeline. They call `emit(...)` at
the moments a measurement needs to see, and the meter (measure/meter.py) or the timeline
(measure/timeline.py) subscribes while it is recording. With nobody listening, an event costs a lookup.

    STORAGE_RESIZED  storage          a tensor storage changed size in place (FSDP frees and re-allocates
                                      its unsharded parameters this way, and no op reports it)
    COMPUTE_BEGIN    name             a unit starts computing ("forward blocks.0") ...
    COMPUTE_END      name             ... and stops
Collectives need no event: they all pass through distributed/comm.py, which counts and records them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

STORAGE_RESIZED, COMPUTE_BEGIN, COMPUTE_END = "storage_resized", "compute_begin", "compute_end"

_subscribers: dict[str, list[Callable]] = defaultdict(list)


def emit(kind: str, *args) -> None:
    for fn in _subscribers.get(kind, ()):
        fn(*args)


def subscribe(kind: str, fn: Callable) -> None:
    _subscribers[kind].append(fn)


def unsubscribe(kind: str, fn: Callable) -> None:
    _subscribers[kind].remove(fn)
