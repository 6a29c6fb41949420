"""Timing collectives on a GPU (comm.py uses it while a timeline records).

NCCL returns from a collective, and completes its future, as soon as its kernels are queued, so the host
clock says nothing about when the bytes moved. Instead a stream of each group's own, which only waits and
records, brackets every collective with CUDA events; the timeline reads them once it ends.
"""

from __future__ import annotations

import torch

# --8<-- [start:cuda_timing]
_timing_streams: dict = {}  # (process group, device) -> the stream that follows that group's collectives


def stamp(stream=None):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def begin(group, device):
    """Before the collective is issued: a stream of the group's own, which only waits and records, joins
    the issuing stream here. Having waited for the collectives issued before in this group, its start event
    marks when the link is free and the input is ready -- when NCCL, which runs one group's collectives one
    after another, can start this one."""
    key = (group, device)
    if key not in _timing_streams:
        _timing_streams[key] = torch.cuda.Stream(device)
    stream = _timing_streams[key]
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream, stamp(stream)


def end(timing, work):
    """After the collective is issued: the timing stream waits for it -- a wait that blocks that stream only
    (not the CPU, not the streams doing the work) -- and records its end. Returns (start, end)."""
    stream, start = timing
    with torch.cuda.stream(stream):
        if work is not None:
            try:
                # NCCL's future holds an event on its stream: waiting on it blocks the current stream only.
                # Not work.wait(), which would also release the tensors NCCL is still using to the allocator,
                # as if the caller had waited
                work.get_future().wait()
            except (RuntimeError, AttributeError):  # a backend without futures
                work.wait()
        return start, stamp(stream)
# --8<-- [end:cuda_timing]
