"""Chapter 7: the side streams a GPU runs FSDP's collectives on.

On a GPU the CPU only queues kernels, and runs ahead of them. A collective queued on the compute stream
would wait behind every kernel queued before it; on a stream of its own it can run beside them -- the
"implicit prefetch" of chapter 7. FlatParameter (chapter 5) and fully_shard's parameter groups (chapter 11)
issue their all-gathers and reduce-scatters inside `side_stream(...)`; on the CPU it does nothing, since
there compute is synchronous and a collective is simply asynchronous.
"""

from __future__ import annotations

import contextlib

import torch


# --8<-- [start:streams]
_side_streams: dict = {}


# --8<-- [start:side_stream]
@contextlib.contextmanager
def side_stream(kind: str, tensor: torch.Tensor, after_compute: bool):
    """On a GPU, run the block on a stream of its own (one for all-gathers, one
    for reduce-scatters); a later wait() on the compute stream joins them again.
    On the CPU there are no streams: the collective is simply asynchronous.

    after_compute: first wait for everything the compute stream has issued so
    far. A reduce-scatter must (its gradient is being computed there); an
    all-gather must not -- that wait would put the next unit's all-gather behind
    this unit's compute, and no prefetch could overlap (sync_all_gathers
    instead)."""
    if not tensor.is_cuda:
        yield
        return
    stream = _stream(kind, tensor.device)
    if after_compute:
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        yield
# --8<-- [end:side_stream]


def _stream(kind: str, device: torch.device):
    if (kind, device) not in _side_streams:
        _side_streams[(kind, device)] = torch.cuda.Stream(device)
    return _side_streams[(kind, device)]


def sync_all_gathers(device: torch.device) -> None:
    """The all-gather stream catches up with the compute stream, at every root
    forward and before every gather outside training (summon_full_params): the
    shards it sends were last written there (by the optimizer, or the user).
    Always -- the stream is made here if no all-gather has made it yet, so even
    the first all-gather cannot read a shard the compute stream is still
    writing."""
    if device.type == "cuda":
        _stream("all_gather", device).wait_stream(
            torch.cuda.current_stream(device))
# --8<-- [end:streams]


# --8<-- [start:record_stream]
def keep_until_compute_is_past(t: torch.Tensor) -> None:
    """Before freeing `t`, a buffer the compute stream may still be reading (the
    CPU runs ahead): the allocator must not hand its memory to the next
    all-gather before the compute stream gets past this point."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream())
# --8<-- [end:record_stream]
