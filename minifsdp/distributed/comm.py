"""The one place minifsdp talks: every collective in the package goes through this module.

Going through one door lets us count what crosses it. For each collective we add the *logical* bytes one
rank sends in a bandwidth-optimal ring implementation, so the figures are the same on gloo, NCCL or a
fake process group, and can be checked against the formulas of the ZeRO paper (SPEC, "Measurement"):

    all_reduce      of S bytes          2 * S * (N-1)/N     (= reduce_scatter + all_gather)
    reduce_scatter  of S bytes in       S * (N-1)/N
    all_gather      of S bytes out      S * (N-1)/N
    broadcast/reduce of S bytes         S * (N-1)/N         (a pipelined ring: N-1 hops of S, over N ranks)

    with comm.counting() as counter:
        train_step()
    counter.bytes["all_reduce"], counter.total()

Every collective takes `group=`, a process group (default: every rank). Chapters 11 and 12 run several
at once -- data parallel inside a tensor-parallel group, replicas of shards -- and the counter keeps each
group's bytes apart (`counter.by_group["dp"]`), under the group's name (see `name_group`, and mesh.py,
which names each dimension's group after the dimension). Ranks passed to a collective (`src`, `dst`) are
ranks *within* the group, as the algorithms think of them: owner 1 of a group of ranks {2, 3} is rank 3.

The counting itself lives in recording.py (re-exported here: `comm.counting`, `comm.CommCounter`), which
can also record each collective's issue and completion times, and the time this rank spent blocked
waiting for one, for timelines (chapter 7); on a GPU with CUDA events (cuda_timing.py). For teaching,
`comm.throttled(...)` (recording.py too) makes the network slow enough to see on a laptop. A collective
that fails raises an error that says where every rank was (failures.py).

Versions: the declared minimum torch (pyproject.toml) has every call made here except the single-tensor
collectives' newest names, which are looked up where they are made (see `_all_gather_single`).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from minifsdp import events
from minifsdp.distributed import failures, recording
# The counters and the simulated link live in recording.py; callers reach them here, through the one door
# (comm.counting(), comm.throttled(...)).
from minifsdp.distributed.recording import CommCounter, CommEvent, Wait, counting, throttled  # noqa: F401

ReduceOp = dist.ReduceOp


class NoProcessGroupError(RuntimeError):
    pass


def require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise NoProcessGroupError(
            "minifsdp needs a process group, and none is initialized in this process. Start ranks with "
            "minifsdp.launch(fn, world_size=N) (or run under torchrun and call minifsdp.launch there), "
            "or call torch.distributed.init_process_group(...) yourself first.")


def world_size(group=None) -> int:
    """How many ranks `group` has (default: all of them)."""
    require_process_group()
    return dist.get_world_size(group)


def rank(group=None) -> int:
    """This rank's position in `group` (0 .. world_size(group) - 1)."""
    require_process_group()
    return dist.get_rank(group)


_group_names: dict = {}  # process group -> the name its bytes are counted under


def name_group(group, name: str) -> None:
    """Count `group`'s traffic under `name` (a mesh dimension's name, say) instead of its list of ranks."""
    _group_names[group] = name


def group_ranks(group=None) -> list[int]:
    """The global ranks of `group`, in group order."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def group_name(group=None) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    if group not in _group_names:
        _group_names[group] = "ranks " + ",".join(map(str, group_ranks(group)))
    return _group_names[group]


# --8<-- [start:ring_bytes]
def ring_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for a collective over `nbytes` (the full, unsharded
    size) on a ring of n ranks."""
    if kind == "all_reduce":
        return 2 * nbytes * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "broadcast", "reduce"):
        return nbytes * (n - 1) / n
    raise ValueError(f"unknown collective {kind!r}")
# --8<-- [end:ring_bytes]


# The Handle lives here, beside the collectives that return it, because its wait() is the backend's wait
# and, should that fail, the error that says where this rank was (failures.py). What a wait means to the
# counters -- how long this rank was blocked, the throttled link's delivery -- is the record's business
# (recording.py), which wraps the backend's wait.
class Handle:
    """What an async collective returns: wait() blocks until it is done (and records how long it blocked)."""

    def __init__(self, work, record: recording.Record, where: str = ""):
        self._work, self._record = work, record
        self._where = where  # "all_gather 'unshard blocks.1', collective #12 of group 'world'"

    def wait(self) -> None:
        with self._record.waiting(pending=self._work is not None):
            if self._work is not None:
                try:
                    self._work.wait()
                except RuntimeError as e:  # a timeout, or a peer gone: say which collective this rank was in
                    raise failures.collective_error(self._where, rank(), world_size(), e) from e
                self._work = None

    def is_completed(self) -> bool:
        done = self._work is None or self._work.is_completed()
        return done and self._record.delivered()


# --8<-- [start:issue]
def _issue(kind: str, nbytes: int, call, async_op: bool, tag: str, group,
           device=None):
    """Count, call, and (for a blocking call) wait: the path every
    collective shares."""
    n, name = world_size(group), group_name(group)
    if kind in ("object", "send", "recv"):
        sent = {"object": nbytes * (n - 1), "send": nbytes, "recv": 0}[kind]
    else:
        sent = ring_bytes(kind, nbytes, n)
    record = recording.begin(kind, sent, tag, name, group, device)
    work = call(async_op=True)
    record.issued(work)
    handle = Handle(work, record, where=failures.where(kind, tag, name))
    if async_op:
        return handle
    handle.wait()
    return None
# --8<-- [end:issue]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch 2.13 renamed the single-tensor collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single) and deprecated the old names; the declared minimum has only
# those. Looked up at each call, so every version takes the same path through this module.
def _all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, tag: str = "", group=None):
    """Every rank ends with the reduction (sum by default) of every rank's `tensor`, in place."""
    return _issue("all_reduce", _nbytes(tensor),
                  lambda async_op: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op, tag,
                  group, tensor.device)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False,
                   tag: str = "", group=None):
    """Rank r gets chunk r of the reduction of every rank's `input` (len(input) = N * len(output))."""
    return _issue("reduce_scatter", _nbytes(input),
                  lambda async_op: _reduce_scatter_single()(output, input, op=op, group=group, async_op=async_op),
                  async_op, tag, group, input.device)


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = "", group=None):
    """`output` becomes every rank's `input`, concatenated in rank order (len(output) = N * len(input))."""
    return _issue("all_gather", _nbytes(output),
                  lambda async_op: _all_gather_single()(output, input, group=group, async_op=async_op),
                  async_op, tag, group, output.device)


def broadcast(tensor: torch.Tensor, src: int = 0, async_op: bool = False, tag: str = "", group=None):
    """Every rank's `tensor` becomes that of rank `src` (of the group)."""
    return _issue("broadcast", _nbytes(tensor),
                  lambda async_op: dist.broadcast(tensor, group=group, group_src=src, async_op=async_op),
                  async_op, tag, group, tensor.device)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, async_op: bool = False, tag: str = "", group=None):
    """Rank `dst`'s (of the group) `tensor` becomes the reduction of every rank's; the others' are undefined."""
    return _issue("reduce", _nbytes(tensor),
                  lambda async_op: dist.reduce(tensor, group=group, group_dst=dst, op=op, async_op=async_op),
                  async_op, tag, group, tensor.device)


def _global(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send(tensor: torch.Tensor, dst: int, async_op: bool = False, tag: str = "", group=None):
    """Point to point: `tensor` goes to rank `dst` (of the group), which must post the matching recv. Counted
    as `tensor`'s bytes sent by this rank (a pipeline stage passing activations on, chapter 12)."""
    return _issue("send", _nbytes(tensor),
                  lambda async_op: dist.isend(tensor, dst=_global(group, dst), group=group), async_op, tag, group,
                  tensor.device)


def recv(tensor: torch.Tensor, src: int, async_op: bool = False, tag: str = "", group=None):
    """Point to point: `tensor` is filled with what rank `src` (of the group) sends. Counted as a call, with no
    bytes: the sender counts them."""
    return _issue("recv", _nbytes(tensor),
                  lambda async_op: dist.irecv(tensor, src=_global(group, src), group=group), async_op, tag, group,
                  tensor.device)


def release(tensor: torch.Tensor) -> None:
    """Free the memory of a collective's buffer that is no longer needed (after its wait()), now.
    Dropping our last reference is not enough: the backend may hold one for a moment after wait() returns
    (gloo does, about one time in four), so the memory would go at a moment nobody chose, and a peak
    would change from run to run. Emptying the storage frees it at once, whoever still holds it. Only for
    a buffer nothing else views; on a GPU, only once the collective's stream is done with it (after wait)."""
    tensor.untyped_storage().resize_(0)
    events.emit(events.STORAGE_RESIZED, tensor.untyped_storage())  # no op reports a resize (the meter listens)


# --8<-- [start:copy_to]
def copy_to(tensor: torch.Tensor, device: torch.device, direction: str,
            dtype: torch.dtype | None = None,
            non_blocking: bool = False) -> torch.Tensor:
    """A copy between host and device memory (CPU offload, chapter 8): not a
    collective, but traffic all the same, so it is counted here too -- in
    `counter.copies[direction]`, apart from the network's bytes.
    direction: "host_to_device" or "device_to_host". On a CPU-only machine
    both ends are the CPU: the copy still happens (one code path), it just
    costs a memcpy instead of a trip over PCIe.

    non_blocking (device to host): only queue the copy on the current stream,
    into pinned host memory, and return. The CPU must not read the result
    before that stream has got past it (wait on an event recorded there), so
    no `dtype` then: a cast on the host would read it at once."""
    if non_blocking and dtype is not None:
        raise ValueError("copy_to(non_blocking=True) cannot cast: the host "
                         "would read the copy before it lands")
    # from pinned host memory to the device, asynchronous is always safe (the
    # device's later work queues behind it); to the host only when the caller
    # says it will wait before reading
    asynchronous = (tensor.is_pinned() if direction == "host_to_device"
                    else non_blocking and tensor.is_cuda)
    out = tensor.to(device, non_blocking=asynchronous, copy=True)
    recording.count_copy(direction, _nbytes(tensor))
    return out if dtype is None else out.to(dtype)
# --8<-- [end:copy_to]


def all_gather_object(obj, group=None) -> list:
    """Every rank's (picklable) `obj`, in rank order. For small metadata, counted under 'object'."""
    out = [None] * world_size(group)

    def call(async_op):  # all_gather_object has no async form: it is done when it returns
        dist.all_gather_object(out, obj, group=group)

    _issue("object", len(pickle.dumps(obj)), call, async_op=False, tag="", group=group)
    return out


def barrier(group=None) -> None:
    require_process_group()
    dist.barrier(group=group)


# --8<-- [start:sync_from_rank0]
def sync_from_rank0(named_tensors, group=None) -> None:
    """Every rank's tensors become rank 0's (of the group): how every data-parallel wrapper makes its
    replicas start from the same weights and buffers. The names, shapes and dtypes are checked first, so a
    rank that built another model gets an error naming the tensor instead of a hang or silent garbage.
    Meta tensors (deferred init, chapter 9) hold nothing yet: they are checked, not sent."""
    named = list(named_tensors)
    assert_same_across_ranks(named, group=group)
    broadcast_tensors([t for _, t in named if not t.is_meta], src=0, group=group)


def broadcast_tensors(tensors, src: int = 0, group=None) -> None:
    with torch.no_grad():
        for t in tensors:
            broadcast(t, src=src, group=group)
# --8<-- [end:sync_from_rank0]


def assert_same_across_ranks(named_tensors, what: str = "parameter", group=None) -> None:
    """Raise on every rank, naming the first tensor whose shape or dtype differs between ranks.

    Sharding code that silently trusts the shapes would hang in a collective of mismatched sizes, or
    worse, mix up slices; checking once at construction turns that into an error that names the tensor.
    """
    mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in named_tensors]
    me = rank(group)
    for other, theirs in enumerate(all_gather_object(mine, group=group)):
        if theirs == mine:
            continue
        for i in range(max(len(mine), len(theirs))):
            a = mine[i] if i < len(mine) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                name = (a or b)[0]
                raise ValueError(f"{what} {name!r} differs across ranks: {a[1:] if a else 'missing'} on rank "
                                 f"{me}, {b[1:] if b else 'missing'} on rank {other}. Every rank must build the "
                                 f"same model (same code, same config).")
