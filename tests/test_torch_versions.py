"""The torch versions minifsdp runs on, and the code that makes it so.

pyproject.toml declares the oldest torch the package runs on. That is a claim about every torch API the
package calls, so it is kept next to a table of the ones that arrived late (API_SINCE: the release each
first shipped in), and tested against it: the declared minimum is the newest of those the package needs,
and an API newer than that is called only behind a fallback to an older spelling (comm.py). The fallback
is run here on this machine's torch by taking the new names away, and must give the same results and
count the same bytes. On a GPU the timeline reads CUDA events; their conversion to seconds is tested with
stand-in events.
"""

import collections
import contextlib
import inspect
import os
import re
import warnings
from importlib import import_module

import pytest
import torch
import torch.distributed as dist

from minifsdp import launch
from minifsdp.distributed import comm
from minifsdp.distributed.comm import CommCounter, CommEvent, Wait
from minifsdp.measure.timeline import _Clock, _spans, hidden_fraction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUIRED, FALLBACK = "called directly", "behind a fallback"
# (where, name, first release, how the package calls it); a name ending in "=" is a keyword argument
API_SINCE = [
    ("torch.Tensor", "register_post_accumulate_grad_hook", "2.1", REQUIRED),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", "2.1", REQUIRED),
    ("torch.distributed.device_mesh", "init_device_mesh", "2.2", REQUIRED),
    ("torch.distributed.device_mesh.DeviceMesh", "from_group", "2.4", REQUIRED),
    ("torch.distributed.fsdp", "fully_shard", "2.6", REQUIRED),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", "2.6", REQUIRED),
    ("torch.distributed.fsdp", "OffloadPolicy", "2.6", REQUIRED),
    ("torch.distributed.fsdp", "CPUOffloadPolicy", "2.6", REQUIRED),
    ("torch.distributed.broadcast", "group_src=", "2.6", REQUIRED),
    ("torch.distributed.reduce", "group_dst=", "2.6", REQUIRED),
    ("torch.distributed", "all_gather_into_tensor", "1.13", REQUIRED),
    ("torch.distributed", "reduce_scatter_tensor", "1.13", REQUIRED),
    ("torch.distributed", "all_gather_single", "2.13", FALLBACK),
    ("torch.distributed", "reduce_scatter_single", "2.13", FALLBACK),
]
# what each fallback falls back to
OLDER_SPELLING = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _declared_minimum() -> str:
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        return re.search(r'"torch>=([0-9.]+)"', f.read()).group(1)


def _resolve(where: str):
    parts = where.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
        try:
            obj = import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(where)


def _package_source() -> dict[str, str]:
    root = os.path.join(REPO, "minifsdp")
    return {os.path.relpath(os.path.join(d, f), REPO): open(os.path.join(d, f)).read()
            for d, _, files in os.walk(root) for f in files if f.endswith(".py")}


@pytest.mark.parametrize("where, name, since, use", API_SINCE, ids=[f"{w}.{n}" for w, n, _, _ in API_SINCE])
def test_each_api_in_the_table_is_here_and_used(where, name, since, use):
    obj = _resolve(where)
    if name.endswith("="):
        assert name[:-1] in inspect.signature(obj).parameters
    else:
        assert hasattr(obj, name)
    using = [path for path, text in _package_source().items() if name in text]
    assert using, f"{name} is no longer used: drop it from the table"
    if use == FALLBACK:  # looked up in one place, where its older spelling stands in for it
        assert using == ["minifsdp/distributed/comm.py"], using


def test_the_declared_minimum_is_the_newest_api_the_package_needs():
    minimum = _declared_minimum()
    required = [since for _, _, since, use in API_SINCE if use == REQUIRED]
    assert minimum == max(required, key=_version)
    for _, name, since, use in API_SINCE:
        if use == FALLBACK:  # else the fallback would never run on a supported torch: call it directly
            assert _version(since) > _version(minimum), name
            older = next(s for _, n, s, _ in API_SINCE if n == OLDER_SPELLING[name])
            assert _version(older) <= _version(minimum), name


# -- the fallback, forced ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _torch_before_2_13():
    """torch.distributed as the declared minimum has it: no *_single names. The older spellings it has
    instead are wrapped, to see that they are what ran (they warn of their deprecation on newer torch)."""
    calls = collections.Counter()
    new = {name: getattr(dist, name) for name in OLDER_SPELLING}
    old = {name: getattr(dist, name) for name in OLDER_SPELLING.values()}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return old[name](*args, **kwargs)
        return call

    for name in new:
        delattr(dist, name)
    for name in old:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in {**new, **old}.items():
            setattr(dist, name, fn)


def _collectives(group):
    """All-gather (blocking and async), reduce-scatter, broadcast and reduce over `group`: what each rank
    ends with, and the bytes counted."""
    me, n = comm.rank(group), comm.world_size(group)
    shard = torch.arange(3.0) + 10 * me
    gathered, gathered_async = torch.empty(3 * n), torch.empty(3 * n)
    scattered = torch.empty(2)
    bcast, reduced = torch.full((4,), float(me)), torch.full((4,), float(me + 1))
    with comm.counting() as counter:
        comm.all_gather(gathered, shard, group=group)
        comm.all_gather(gathered_async, shard, async_op=True, group=group).wait()
        comm.reduce_scatter(scattered, torch.arange(2.0 * n) * (me + 1), group=group)
        comm.broadcast(bcast, src=n - 1, group=group)
        comm.reduce(reduced, dst=n - 1, group=group)
    return {"all_gather": gathered.tolist(), "all_gather_async": gathered_async.tolist(),
            "reduce_scatter": scattered.tolist(), "broadcast": bcast.tolist(),
            "reduce": reduced.tolist() if me == n - 1 else None,  # defined on dst only
            "bytes": dict(counter.bytes), "by_group": {g: dict(k) for g, k in counter.by_group.items()}}


def _work():
    world = dist.get_world_size()
    sub_ranks = list(range(world))[-2:]  # {0, 1} of 2, {1, 2} of 3: group rank 0 is global rank 1 there
    sub = dist.new_group(sub_ranks)
    groups = {"world": None} | ({"sub": sub} if dist.get_rank() in sub_ranks else {})
    new = {name: _collectives(g) for name, g in groups.items()}
    with _torch_before_2_13() as calls:
        old = {name: _collectives(g) for name, g in groups.items()}
    return {"new": new, "old": old, "old_calls": dict(calls)}


@pytest.fixture(scope="module")
def fallback_runs():
    return {n: launch(_work, world_size=n) for n in (2, 3)}


@pytest.mark.parametrize("n", [2, 3])
def test_without_the_2_13_names_the_collectives_give_the_same_results_and_bytes(fallback_runs, n):
    for rank, res in enumerate(fallback_runs[n]):
        assert res["old"] == res["new"], f"rank {rank}"
        # per group: 2 all-gathers and 1 reduce-scatter went through the older spellings
        assert res["old_calls"] == {"all_gather_into_tensor": 2 * len(res["new"]),
                                    "reduce_scatter_tensor": len(res["new"])}


@pytest.mark.parametrize("n", [2, 3])
def test_the_collectives_are_right_on_the_world_and_on_a_subgroup(fallback_runs, n):
    for rank, res in enumerate(fallback_runs[n]):
        for name, got in res["new"].items():
            size = n if name == "world" else 2
            me = rank if name == "world" else rank - (n - 2)
            assert got["all_gather"] == got["all_gather_async"] == [
                float(10 * r + i) for r in range(size) for i in range(3)]
            total = size * (size + 1) / 2  # the sum of (rank + 1) over the group
            assert got["reduce_scatter"] == [float((2 * me + i) * total) for i in range(2)]
            assert got["broadcast"] == [float(size - 1)] * 4  # src is a rank of the group
            assert got["reduce"] in (None, [total] * 4) and (got["reduce"] is None) == (me != size - 1)
            assert list(got["by_group"]) == ["world" if name == "world" else "ranks " + ",".join(
                map(str, range(n - 2, n)))]


def test_copy_to_the_host_cannot_cast_what_has_not_landed():
    with pytest.raises(ValueError, match="cannot cast"):
        comm.copy_to(torch.ones(2), torch.device("cpu"), "device_to_host", dtype=torch.float64, non_blocking=True)


# -- a GPU timeline's clock, with stand-in CUDA events ----------------------------------------------------------

class FakeEvent:
    """What the clock asks of a CUDA event: elapsed_time(later) in milliseconds."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.ms - self.ms


def test_the_clock_reads_host_times_as_before():
    clock = _Clock(100.0)
    assert clock.seconds(100.25) == 0.25
    counter = CommCounter(record=True)
    counter.events.append(CommEvent("all_gather", 8.0, issued=100.5, start=100.5, done=100.75, tag="unshard a"))
    counter.waits.append(Wait(100.625, 100.75, "unshard a"))
    spans = _spans(clock, [("forward a", 100.5, 101.0)], counter)
    assert [tuple(s) for s in spans] == [
        ("compute", "forward a", 0.5, 0.625), ("all_gather", "unshard a", 0.5, 0.75),
        ("wait", "unshard a", 0.625, 0.75), ("compute", "forward a", 0.75, 1.0)]


def test_the_clock_reads_cuda_events_not_the_hosts_enqueue_times():
    """NCCL says a collective is done when it is queued: the host's times collapse to the issue. The events
    say it was on the wire from 10 ms to 40 ms; compute reached its wait at 25 ms and stalled to 40 ms."""
    origin = FakeEvent(5.0)
    clock = _Clock(100.0, origin)
    counter = CommCounter(record=True)
    counter.events.append(CommEvent("all_gather", 8.0, issued=100.001, start=100.001, done=100.001,
                                    tag="unshard b", cuda=(FakeEvent(15.0), FakeEvent(45.0))))
    counter.waits.append(Wait(100.002, 100.002, "unshard b", cuda=(FakeEvent(30.0), FakeEvent(45.0))))
    # a second wait, reached at 52 ms: done by then, so no time lost
    counter.waits.append(Wait(100.003, 100.003, "unshard b", cuda=(FakeEvent(52.0), FakeEvent(45.0))))
    spans = _spans(clock, [("forward b", origin, FakeEvent(55.0))], counter)
    got = [(s.lane, s.name, round(s.start, 9), round(s.end, 9)) for s in spans]
    assert got == [("compute", "forward b", 0.0, 0.025), ("all_gather", "unshard b", 0.01, 0.04),
                   ("wait", "unshard b", 0.025, 0.04), ("compute", "forward b", 0.04, 0.05)]
    assert hidden_fraction(spans) == pytest.approx(0.5)  # 15 of the 30 ms on the wire were waited through
