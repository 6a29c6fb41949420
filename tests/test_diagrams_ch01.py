"""Chapter 1's diagrams show what the package does (chapters/diagrams/ch01_ddp.py).

- four_collectives: what each rank ends with after comm's all_reduce, reduce_scatter, all_gather and
  broadcast, run on three ranks.
- ddp_naive_vs_overlap: DDP's buckets in the picture are the ones DistributedDataParallel packs for the same
  gradient sizes and cap, and the picture's timelines say what the page says (NaiveDDP sends one call per
  gradient after backward; the buckets go out during backward, and the step starts earlier).
- ddp_bucket_order: DDP issues the buckets strictly in order, replayed through _launch_ready_buckets.
- ddp_no_sync: a backward whose forward ran inside no_sync() all-reduces nothing, the next one every bucket.
- ddp_bucket_policy: the toy model's gradients in the order backward produces them, and the buckets _pack
  makes of them under the picture's cap.
"""

import types

import pytest

torch = pytest.importorskip("torch")

from minifsdp import comm, launch  # noqa: E402
from minifsdp.ddp.ddp import DistributedDataParallel, _pack  # noqa: E402
from minifsdp.models import ToyModel  # noqa: E402

from diagram_modules import diagram_module  # noqa: E402

ch01 = diagram_module("ch01_ddp")


def _collectives():
    r, n = comm.rank(), comm.world_size()
    mine = torch.tensor(ch01.COLLECTIVE_INPUTS[r], dtype=torch.float32)
    k = mine.numel()
    out = {}
    total = mine.clone()
    comm.all_reduce(total)
    out["all_reduce"] = total
    chunk = torch.empty(1)
    comm.reduce_scatter(chunk, mine.clone())
    out["reduce_scatter"] = chunk
    gathered = torch.empty(n * k)
    comm.all_gather(gathered, mine.clone())
    out["all_gather"] = gathered
    sent = mine.clone()
    comm.broadcast(sent, src=0)
    out["broadcast"] = sent
    return {name: [int(v) for v in t.tolist()] for name, t in out.items()}


def test_four_collectives_are_comms_results():
    ranks = launch(_collectives, world_size=len(ch01.COLLECTIVE_INPUTS), device="cpu")
    drawn = ch01.collective_results()
    for name, rows in drawn.items():
        assert [result[name] for result in ranks] == rows, name


def test_ddp_buckets_are_the_ones_ddp_packs():
    """Each layer's weight and bias, sized by the bytes the picture sends; DDP's cap of two layers."""
    scale = 2  # elements per unit of time: 1.5 and 0.5 units are whole tensors
    layers, params = {}, []
    for layer in sorted(ch01.DDP_LAYERS):  # registration order: layer 1 first
        for name, send in ch01.DDP_SEND.items():
            p = torch.nn.Parameter(torch.zeros(int(send * scale)))
            layers[p] = layer
            params.append(p)
    stub = types.SimpleNamespace(_cap=ch01.DDP_CAP * scale * 4)  # fp32: 4 bytes an element
    groups = DistributedDataParallel._bucket_groups(stub, params)
    assert [tuple(dict.fromkeys(layers[p] for p in reversed(g))) for g in groups] == ch01.DDP_BUCKETS


def test_the_timelines_say_what_the_page_says():
    naive_compute, naive_channel = ch01.ddp_timeline("naive")
    compute, channel = ch01.ddp_timeline("buckets")
    backward_end = max(end for kind, _, _, end in compute if kind == "backward")
    calls = lambda spans: [s for s in spans if s[0] == "fixed"]  # noqa: E731
    assert len(calls(naive_channel)) == len(ch01.DDP_LAYERS) * len(ch01.DDP_SEND)  # one per gradient
    assert min(start for _, _, start, _ in naive_channel) == backward_end         # after backward
    assert len(calls(channel)) == len(ch01.DDP_BUCKETS)
    assert min(start for _, _, start, _ in channel) < backward_end                # during backward
    step = lambda spans: next(start for kind, _, start, _ in spans if kind == "step")  # noqa: E731
    assert step(compute) < step(naive_compute)
    # the same bytes either way
    moved = lambda spans: sum(end - start for kind, _, start, end in spans if kind == "bytes")  # noqa: E731
    assert moved(channel) == moved(naive_channel)


def test_buckets_are_issued_as_ddp_launches_them():
    """ddp_bucket_order's strict order is _launch_ready_buckets's, replayed on each rank's filling order."""
    for rank, filled in ch01.ORDER_FILLED.items():
        issued = []
        stub = types.SimpleNamespace(_next=0, _launch=lambda b: issued.append(b.index),
                                     _buckets=[types.SimpleNamespace(index=i, params=[None], ready=0)
                                               for i in range(len(filled))])
        for b in filled:
            stub._buckets[b].ready += 1
            DistributedDataParallel._launch_ready_buckets(stub)
        assert issued == ch01.issue_order(filled, strict=True) == sorted(filled), rank
        assert ch01.issue_order(filled, strict=False) == list(filled)
    assert ch01.ORDER_FILLED[0] != ch01.ORDER_FILLED[1]  # the picture's point: the ranks fill differently


def _all_reduces_per_backward():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    one_layer = sum(p.numel() * p.element_size() for p in net[1].parameters())
    model = DistributedDataParallel(net, bucket_cap_mb=one_layer / 2 ** 20)  # a bucket per layer
    x = torch.randn(4, 8)
    counts = []
    for inside in (True, False):
        with comm.counting() as counter:
            if inside:
                with model.no_sync():
                    loss = model(x).sum()
            else:
                loss = model(x).sum()
            loss.backward()
        counts.append(counter.calls.get("all_reduce", 0))
    return counts, len(model._buckets)


def test_no_sync_sends_nothing_then_every_bucket():
    counts, buckets = launch(_all_reduces_per_backward, world_size=2, device="cpu")[0]
    assert buckets == ch01.NO_SYNC_ALL_REDUCES[1]
    assert tuple(counts) == ch01.NO_SYNC_ALL_REDUCES


def test_the_bucket_policy_is_the_toy_models_gradients_packed_by_pack():
    model = ToyModel()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    arrival = trainable[::-1]  # the last layer first (the tied weight after both uses): backward's order
    seen = []
    for name, p in trainable:
        p.register_post_accumulate_grad_hook(lambda _, name=name: seen.append(name))
    model(torch.randn(4, 7)).sum().backward()
    assert seen == [name for name, _ in arrival]
    assert [(name, p.numel() * p.element_size()) for name, p in arrival] == list(ch01.POLICY_GRADIENTS)
    index = {id(p): i for i, (_, p) in enumerate(arrival)}
    buckets = _pack([p for _, p in arrival], ch01.POLICY_CAP)
    assert [tuple(index[id(p)] for p in b) for b in buckets] == list(ch01.POLICY_BUCKETS)
