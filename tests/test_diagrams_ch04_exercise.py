"""What exercise 4.3's contract figure (sdp_owner_buckets_contract, chapters/diagrams/ch04_sdp.py) shows is what
ShardedDataParallel does: twelve 1 KiB parameters at N = 2 under a 4 KiB cap, OSS's owners, and for each of the
figure's two designs -- the package's `_bucket_groups` (the open buckets share one cap) and a whole cap for each
owner's bucket (instructor/bypasses' wrong solution for 4.3), put in place inside the rank for that run only --
the buckets it makes and, in one real backward, at each gradient's arrival, the buckets sent and the bytes of
each rank's gradients computed and not yet sent, as `contract_waiting` draws them.
"""

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from minifsdp import launch  # noqa: E402
from minifsdp.zero.oss import OSS  # noqa: E402
from minifsdp.zero.sdp import ShardedDataParallel  # noqa: E402

from diagram_modules import diagram_module  # noqa: E402
from instructor_bypasses import instructor_bypasses  # noqa: E402

ch04 = diagram_module("ch04_sdp")
RIGHT, WRONG = ch04.CONTRACT_DESIGNS


class Chain(nn.Module):
    """w1..w12, each a vector of 1 KiB of fp32 the input is multiplied by in turn: backward meets w12 first."""

    def __init__(self):
        super().__init__()
        self.names = [f"w{i}" for i in range(1, 13)]
        for name in self.names:
            self.register_parameter(name, nn.Parameter(torch.ones(ch04.CONTRACT_BYTES // 4)))

    def forward(self, x):
        for name in self.names:
            x = x * getattr(self, name)
        return x.sum()


def _bypass_source() -> str:
    """instructor/bypasses' wrong solution for 4.3, the code between the exercise's markers (a student copy has
    no instructor/: the wrong design is then not run)."""
    bypasses = instructor_bypasses()
    if bypasses is None:
        pytest.skip("instructor/bypasses/ is not in this copy")
    return bypasses.load()[0]["4.3"]


def _bucket_groups_from(source: str):
    """A `_bucket_groups` whose body is `source`, the region between the 4.3 markers."""
    def _bucket_groups(self, params):
        scope = {"self": self, "params": params, "owner": self._owners()}
        exec(source, scope)
        return scope["groups"]
    return _bucket_groups


def _one_backward():
    net = Chain()
    opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1)
    owner = {p: k for k in range(dist.get_world_size()) for p in opt.owned_params(k)}
    names = {p: name for name, p in net.named_parameters()}
    model = ShardedDataParallel(net, opt, bucket_cap_mb=ch04.CONTRACT_CAP / 2 ** 20)
    rows, arrivals = [], []

    def after_the_wrappers_hook(p):  # registered after the wrapper's: it has sent what p's arrival let go
        sent_before = rows[-1][0] if rows else 0
        waiting = [0, 0]
        for bucket in model._buckets[model._next:]:
            for q in bucket.params:
                if q.grad is not None:
                    waiting[owner[q]] += q.grad.numel() * q.grad.element_size()
        rows.append((model._next, (tuple(range(sent_before, model._next)), tuple(waiting))))
        arrivals.append(names[p])

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(after_the_wrappers_hook)
    model(torch.ones(2, ch04.CONTRACT_BYTES // 4)).backward()
    return {"owners": {names[p]: k for p, k in owner.items()}, "arrivals": tuple(arrivals),
            "buckets": [tuple(names[p] for p in b.params) for b in model._buckets], "rows": [r for _, r in rows]}


def _both_designs(wrong_source: str):
    out = {RIGHT: _one_backward()}
    own = ShardedDataParallel._bucket_groups
    ShardedDataParallel._bucket_groups = _bucket_groups_from(wrong_source)
    try:
        out[WRONG] = _one_backward()
    finally:
        ShardedDataParallel._bucket_groups = own
    return out


@pytest.fixture(scope="module")
def runs():
    ranks = launch(_both_designs, world_size=2, device="cpu", args=(_bypass_source(),))
    assert ranks[0] == ranks[1], "every rank makes the same buckets and sends them at the same arrivals"
    return ranks[0]


def test_the_gradients_arrive_as_drawn_and_oss_deals_them_out_in_turn(runs):
    for run in runs.values():
        assert run["arrivals"] == ch04.CONTRACT_GRADIENTS
        assert run["owners"] == ch04.CONTRACT_OWNERS


@pytest.mark.parametrize("design", [RIGHT, WRONG])
def test_each_design_makes_the_drawn_buckets_and_sends_them_at_the_drawn_arrivals(runs, design):
    assert runs[design]["buckets"] == ch04.CONTRACT_DESIGNS[design]
    assert runs[design]["rows"] == ch04.contract_waiting(ch04.CONTRACT_DESIGNS[design])


def test_one_cap_among_the_buckets_stays_under_the_line_and_a_cap_each_does_not(runs):
    limit = ch04.CONTRACT_CAP + ch04.CONTRACT_BYTES
    peak = {d: max(sum(waiting) for _, waiting in run["rows"]) for d, run in runs.items()}
    assert peak[RIGHT] <= limit < peak[WRONG]
    for design, buckets in ch04.CONTRACT_DESIGNS.items():  # both are right-valued: one owner a bucket, each once
        assert sorted(g for b in buckets for g in b) == sorted(ch04.CONTRACT_GRADIENTS), design
        assert all(len({ch04.CONTRACT_OWNERS[g] for g in b}) == 1 for b in buckets), design
