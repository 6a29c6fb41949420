"""Chapter 7: prefetching and the rate limiter change when collectives are issued, never a value.

Parity is bit-exact against the same FSDP without prefetching (tolerance 0.0): every collective and every
addition is the same, only issued earlier. The issue order is read from the comm counter and the
timeline, not from timings. Overlap is checked on a throttled link, measured as chapter 7's table is.

Parity runs three steps (the optimizers' state in use from the second; zero_grad alternates set_to_none, so
the third backward lands on zeroed gradients). It does not train with the rate limiter off: on the CPU the
limiter never has a free to wait for (AllGatherLimiter), so that run is the limited one again, bit for bit.
What turning it off does is measured where it could show, in the prefetch memory below. Each prefetching
variant trains with one optimizer, SGD with momentum or AdamW in turn, against the no-prefetch run with the
same one: a prefetch moves collectives within forward and backward, and the optimizer, which runs after
both on the shards, sees only their values -- compared bit for bit. Both optimizers still meet every kind
of prefetch (forward, BACKWARD_PRE and BACKWARD_POST) and NRAF.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp import RankFailedError, comm, events, launch
from minifsdp.fsdp import BACKWARD_POST, BACKWARD_PRE, AllGatherLimiter, BackwardPrefetch, ModuleWrapPolicy
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.measure.timeline import Span, Timeline, hidden_fraction, lane_time, plot_timeline, write_chrome_trace
from minifsdp.models import Block, GPTConfig
from minifsdp.reports.overlap import (MODES, build, expected_full_units, full_buffers, measure_prefetch_memory,
                                      record_timelines, step)
from minifsdp.train import OPTIMIZERS, batch, loss_of
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
TINY = GPTConfig()  # 2 blocks: a root and two units
SMALL = GPTConfig(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=48)
VARIANTS = {mode: dict(MODES[mode]) for mode in MODES}
VARIANTS["BACKWARD_POST, NRAF"] = dict(MODES["BACKWARD_POST"], reshard_after_forward=False)
VARIANTS["forward_prefetch + BACKWARD_PRE, NRAF"] = dict(MODES["forward_prefetch + BACKWARD_PRE"],
                                                        reshard_after_forward=False)
# (variant, optimizer) trained: the reference with both, each prefetching variant with one (see above)
PARITY_RUNS = [("no prefetch", "sgd"), ("no prefetch", "adamw"), ("forward_prefetch", "sgd"),
               ("BACKWARD_POST", "adamw"), ("BACKWARD_PRE", "sgd"), ("forward_prefetch + BACKWARD_PRE", "adamw"),
               ("BACKWARD_POST, NRAF", "sgd"), ("forward_prefetch + BACKWARD_PRE, NRAF", "adamw")]


# -- pieces, without ranks (first, so that they fail fast when an exercise is missing) --------------------
@pytest.mark.exercise("7.3")
def test_hidden_fraction_on_made_up_spans():
    comm_only = [Span("all_gather", "a", 0.0, 10.0), Span("reduce_scatter", "b", 5.0, 15.0)]
    assert hidden_fraction(comm_only) == 1.0  # nobody waited
    assert hidden_fraction(comm_only + [Span("wait", "a", 0.0, 15.0)]) == 0.0
    assert hidden_fraction(comm_only + [Span("wait", "a", 5.0, 8.0), Span("wait", "b", 12.0, 20.0)]) == pytest.approx(0.6)
    assert hidden_fraction([Span("compute", "forward x", 0.0, 1.0)]) == 1.0


@pytest.mark.mechanism
@pytest.mark.exercise("7.3")
def test_hidden_fraction_counts_each_moment_once():
    """Unions, not sums: two waits over the same moment block the rank once (on a GPU, waits of two streams
    can overlap), two collectives in flight at once are one stretch of busy wire, and a wait outside every
    collective hides nothing and exposes nothing."""
    comm_spans = [Span("all_gather", "a", 0.0, 10.0), Span("all_gather", "b", 2.0, 10.0)]
    waits = [Span("wait", "a", 2.0, 6.0), Span("wait", "b", 4.0, 8.0), Span("wait", "c", 12.0, 14.0)]
    assert hidden_fraction(comm_spans + waits) == pytest.approx(1 - 6 / 10)  # exposed: [2, 8]


def test_rate_limiter_waits_for_the_oldest_free():
    class Event:
        def __init__(self):
            self.synced = False

        def synchronize(self):
            self.synced = True

    limiter = AllGatherLimiter(limit=2)
    events = [Event(), Event(), Event()]
    limiter.pending.extend(events[:2])
    limiter.before_all_gather()          # two frees outstanding: wait for the oldest
    assert [e.synced for e in events] == [True, False, False]
    limiter.pending.append(events[2])
    limiter.before_all_gather()
    assert [e.synced for e in events] == [True, True, False]
    limiter.freed(torch.zeros(1))        # a CPU buffer is freed when reshard returns: nothing to wait for
    assert len(limiter.pending) == 1


def test_bad_input_is_named():
    with pytest.raises(RankFailedError, match="ValueError: backward_prefetch must be"):
        launch(_bad_prefetch, world_size=1, device="cpu")
    with pytest.raises(ValueError, match="bandwidth"):
        with comm.throttled(bandwidth=0):
            pass


def train_variant(variant, optimizer, steps=3):
    n, r = dist.get_world_size(), dist.get_rank()
    model = FSDP(_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), **VARIANTS[variant])
    opt = OPTIMIZERS[optimizer](model.parameters())
    for i in range(steps):
        loss_of("gpt", model, batch("gpt", i, 12, r, n, "cpu", SMALL)).backward()
        opt.step()
        opt.zero_grad(set_to_none=i % 2 == 0)
    return model.full_state_dict()


def _gpt():
    from minifsdp.models import TinyGPT
    return TinyGPT(SMALL, seed=dist.get_rank())  # each rank its own weights: FSDP must broadcast rank 0's


def issue_order(mode):
    """The third step of a mode: its timeline's spans, and the order itself, as the recorder saw it: each
    collective ("all_gather", unit) and each unit's compute beginning and ending ("begin", "forward blocks.0"),
    one after the other -- no clock involved."""
    model, opt = build(SMALL, mode)
    for i in range(2):
        step(model, opt, SMALL, i, global_batch=12)
    order = []
    with Timeline() as tl:
        def mark(what):  # a compute event: after the collectives issued so far
            return lambda name: order.append((what, name, len(tl.counter.events)))
        listeners = {events.COMPUTE_BEGIN: mark("begin"), events.COMPUTE_END: mark("end")}
        for kind, fn in listeners.items():
            events.subscribe(kind, fn)
        try:
            step(model, opt, SMALL, 2, global_batch=12)
        finally:
            for kind, fn in listeners.items():
                events.unsubscribe(kind, fn)
    collectives = [(e.kind, e.tag.split(" ", 1)[1]) for e in tl.counter.events]
    sequence, done = [], 0
    for what, name, issued_before in order:
        sequence += collectives[done:issued_before] + [(what, name)]
        done = issued_before
    return tl.spans(), sequence + collectives[done:]


class Reordered(nn.Module):
    """Three units; on odd steps the last two run in the other order -- not a static graph."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, odd):
        h = self.a(torch.tanh(self.inp(x)))
        h = self.c(self.b(h)) if not odd else self.b(self.c(h))
        return h.pow(2).mean()


def dynamic_order(prefetch):
    kw = MODES["forward_prefetch + BACKWARD_PRE"] if prefetch else MODES["no prefetch"]
    model = FSDP(Reordered(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kw)
    opt = OPTIMIZERS["sgd"](model.parameters())
    leftovers = []
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(5):
        loss = model(torch.randn(4, 6, generator=g), odd=i % 2 == 1)
        leftovers.append(sum(f.is_unsharded for u in model.units()[1:] for f in u.flat_params))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict(), leftovers


def chapter_cases():
    n = dist.get_world_size()
    out = {"parity": {(v, o): train_variant(v, o) for v, o in PARITY_RUNS},
           "order": {mode: issue_order(mode) for mode in MODES},
           "dynamic": {p: dynamic_order(p) for p in (False, True)}}
    if n in (2, 4):
        out["memory"] = measure_prefetch_memory(config=SMALL)
    if n == 2:
        out["throttled"] = throttled_overlap()
    return out


def throttled_overlap():
    """Without and with prefetching, measured as chapter 7's table is (reports/overlap.py's record_timelines:
    its model, its throttled link, the step of median time of three): each mode's spans."""
    modes = ("no prefetch", "forward_prefetch + BACKWARD_PRE")
    return {mode: res["spans"] for mode, res in record_timelines(modes).items()}


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(chapter_cases, world_size=n, device="cpu"), WORLD_SIZES)


# -- values: prefetching never changes one -----------------------------------------------------------------
@pytest.mark.exercise("7.1", "7.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("variant, opt", [(v, o) for v, o in PARITY_RUNS if v != "no prefetch"])
def test_prefetch_keeps_bit_exact_parity(ranks, n, variant, opt):
    for r in range(n):
        ours, reference = ranks[n][r]["parity"][(variant, opt)], ranks[n][r]["parity"][("no prefetch", opt)]
        assert max(float((ours[k] - reference[k]).abs().max()) for k in ours) == 0.0


@pytest.mark.exercise("7.1", "7.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_changing_order_is_still_right_and_leaves_nothing_unsharded(ranks, n):
    """A prefetch the graph does not use is freed at the end of forward, and values stay exact."""
    for r in range(n):
        (plain, left_plain), (prefetched, left_prefetched) = ranks[n][r]["dynamic"][False], ranks[n][r]["dynamic"][True]
        assert max(float((plain[k] - prefetched[k]).abs().max()) for k in plain) == 0.0
        assert left_plain == left_prefetched == [0] * 5


# -- order: read from the recorder, not from a clock ---------------------------------------------------------------
def _at(sequence, what, name):
    """Where the first `what` ("all_gather", "reduce_scatter", "begin", "end") of `name` is in the sequence."""
    return sequence.index((what, name))


def _backward(sequence):
    """The sequence after forward: the root's forward compute ends last (it encloses the blocks')."""
    return sequence[_at(sequence, "end", "forward (root)") + 1:]


@pytest.mark.mechanism
@pytest.mark.exercise("7.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_backward_issue_order_matches_the_mode(ranks, n):
    """Block i-1's all-gather in block i's backward: without prefetch, issued behind block i's reduce-scatter;
    with BACKWARD_PRE before block i's compute begins, with BACKWARD_POST after it ends -- both ahead of the
    reduce-scatter."""
    for r in range(n):
        for mode in MODES:
            back = _backward(ranks[n][r]["order"][mode][1])
            prefetch = MODES[mode]["backward_prefetch"]
            for i in range(SMALL.n_layer - 1, 0, -1):
                ag_next = _at(back, "all_gather", f"blocks.{i - 1}")
                rs_here = _at(back, "reduce_scatter", f"blocks.{i}")
                begin, end = _at(back, "begin", f"backward blocks.{i}"), _at(back, "end", f"backward blocks.{i}")
                if prefetch is None:   # issued when its own backward starts: behind our reduce-scatter
                    assert rs_here < ag_next, (mode, i)
                else:                  # ahead of our reduce-scatter ...
                    assert ag_next < rs_here, (mode, i)
                if prefetch == BACKWARD_PRE:   # ... and before our compute
                    assert ag_next < begin, (mode, i)
                if prefetch == BACKWARD_POST:  # ... but after it
                    assert end < ag_next, (mode, i)


@pytest.mark.mechanism
@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_forward_prefetch_issues_the_next_all_gather_before_computing(ranks, n):
    """With forward_prefetch, block i+1's all-gather is issued before block i's forward compute begins (and
    after block i's own: ours first, it is the one we wait for); without, only once it has ended."""
    for r in range(n):
        for mode in MODES:
            sequence = ranks[n][r]["order"][mode][1]
            for i in range(SMALL.n_layer - 1):
                ag_here = _at(sequence, "all_gather", f"blocks.{i}")
                ag_next = _at(sequence, "all_gather", f"blocks.{i + 1}")
                begin, end = _at(sequence, "begin", f"forward blocks.{i}"), _at(sequence, "end", f"forward blocks.{i}")
                if MODES[mode]["forward_prefetch"]:
                    assert ag_here < ag_next < begin, (mode, i)
                else:
                    assert end < ag_next, (mode, i)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_timeline_has_every_units_compute_in_both_phases(ranks, n):
    spans, _ = ranks[n][0]["order"]["no prefetch"]
    names = {s.name for s in spans if s.lane == "compute"}
    units = ["(root)"] + [f"blocks.{i}" for i in range(SMALL.n_layer)]
    assert names == {f"{phase} {u}" for phase in ("forward", "backward") for u in units}
    assert all(s.end >= s.start >= 0 for s in spans)


# -- memory: the extra full buffer, measured = analytic ---------------------------------------------------------
@pytest.mark.mechanism
@pytest.mark.exercise("7.1", "7.2")
@pytest.mark.parametrize("n", [2, 4])
def test_prefetch_memory_is_one_more_full_buffer(ranks, n):
    res = ranks[n][0]["memory"]
    for (mode, limit), m in res.items():
        blocks = [u for u in m["units"] if u != "(root)"]
        for phase in ("forward", "backward"):
            alive = ["(root)"] + blocks[:expected_full_units(mode, phase)]
            assert m[phase]["params"] == full_buffers(m["units"], n, alive), (mode, limit, phase)
    # the rate limiter never waits on the CPU, so it changes nothing here
    both = "forward_prefetch + BACKWARD_PRE"
    assert res[(both, True)]["backward"] == res[(both, False)]["backward"]
    # prefetching in backward raises the step's peak by up to one block's full parameters
    none, pre = res[("no prefetch", True)], res[("BACKWARD_PRE", True)]
    block = 4 * res[("no prefetch", True)]["units"]["blocks.0"]
    assert 0 <= pre["backward"]["total"] - none["backward"]["total"] <= block


# -- overlap: on a throttled link ------------------------------------------------------------------------------
@pytest.mark.mechanism
@pytest.mark.exercise("7.1", "7.2", "7.3")
def test_prefetching_hides_communication_on_a_slow_link(ranks, tmp_path):
    off, on = (ranks[2][0]["throttled"][m] for m in ("no prefetch", "forward_prefetch + BACKWARD_PRE"))
    # Measured on 2 cores, six runs: waits of 97-131 ms without prefetching and 41-63 ms with it; hidden
    # 5-15% and 44-65%. A loaded machine wakes the ranks' threads late and moves both, so only the direction
    # is asserted (the issue order is tested above). (A single step of a smaller model, on a link of 5 ms a
    # collective, left a margin of a few points, which load could close.)
    assert lane_time(on, "wait") < lane_time(off, "wait")
    assert hidden_fraction(on) > hidden_fraction(off)
    timelines = [r["throttled"]["forward_prefetch + BACKWARD_PRE"] for r in ranks[2]]
    write_chrome_trace(timelines, tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1}
    assert sum(e["ph"] == "X" for e in trace) == sum(len(t) for t in timelines)
    plot_timeline(timelines, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 0


def _bad_prefetch():
    FSDP(nn.Linear(2, 2), backward_prefetch="BACKWARD_PRE")


def test_backward_prefetch_names_match_torch():
    from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch

    assert {m.name for m in BackwardPrefetch} == {m.name for m in TorchBackwardPrefetch}


def test_a_throttled_wait_ends_when_the_link_delivers_not_later():
    """The link's delay runs from the collective's issue: a wait whose backend work itself took 0.2 s, on a
    link that delivers 0.3 s after the issue, returns at 0.3 s -- not at 0.2 + 0.3 s."""
    import time as clock

    from minifsdp.distributed.comm import Handle
    from minifsdp.distributed.recording import Record

    class SlowWork:
        def wait(self):
            clock.sleep(0.2)

    start = clock.perf_counter()
    Handle(SlowWork(), Record(tag="throttled", not_before=start + 0.3)).wait()
    assert 0.3 <= clock.perf_counter() - start < 0.45
