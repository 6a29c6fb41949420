"""Chapter 4's diagrams show what the package does (chapters/diagrams/ch04_sdp.py).

- sdp_buckets: the example's owners are OSS's greedy partition of its sizes, and its buckets are the ones
  ShardedDataParallel._bucket_groups packs for those owners and that cap, in launch order.
- sdp_bucket_size: reduce_buffer_size=0 is a bucket per gradient in ShardedDataParallel, and the picture's
  model says what the page says: a reduce per gradient ends first where calls are cheap, buckets where they
  are dear.
"""

import types

import pytest

torch = pytest.importorskip("torch")

from minifsdp.zero.fairscale_compat import bucket_cap_mb_from  # noqa: E402
from minifsdp.zero.oss import partition_parameters  # noqa: E402
from minifsdp.zero.sdp import ShardedDataParallel  # noqa: E402

from diagram_modules import diagram_module  # noqa: E402

ch04 = diagram_module("ch04_sdp")


def _layers():
    """The example's layers as fp32 parameters, in registration order (L1 first), one element a unit."""
    names = sorted(ch04.BUCKETS_SIZES)
    return {torch.nn.Parameter(torch.zeros(ch04.BUCKETS_SIZES[n])): n for n in names}


def _groups(params: dict, owners: dict, cap_bytes: float):
    stub = types.SimpleNamespace(_owners=lambda: owners, _cap=cap_bytes)
    return ShardedDataParallel._bucket_groups(stub, list(params))


def test_owners_are_oss_s_partition():
    params = _layers()
    parts = partition_parameters([{"params": list(params)}], ch04.BUCKETS_N)
    owner = {params[p]: r for r, groups in enumerate(parts) for g in groups for p in g["params"]}
    assert owner == ch04.BUCKETS_OWNERS


def test_buckets_are_sdp_s():
    params = _layers()
    owners = {p: ch04.BUCKETS_OWNERS[name] for p, name in params.items()}
    groups = _groups(params, owners, ch04.BUCKETS_CAP * 4)
    assert [(owners[g[0]], tuple(params[p] for p in g)) for g in groups] == ch04.BUCKETS
    assert all(len({owners[p] for p in g}) == 1 for g in groups)  # one owner a bucket


def test_reduce_buffer_size_0_is_a_bucket_per_gradient():
    params = _layers()
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    cap_mb = bucket_cap_mb_from(0, None, module)
    groups = _groups(params, {p: 0 for p in params}, cap_mb * 2 ** 20)
    assert [len(g) for g in groups] == [1] * len(params)


def test_bucket_size_model_says_what_the_page_says():
    (cheap, dear) = ch04.SIZE_FIXED.values()
    one, two = ch04.SIZE_BUCKETS.values()
    assert (one, two) == (1, 2) and cheap < dear
    end = lambda fixed, per: ch04.bucket_size_timeline(fixed, per)[-1][2]  # noqa: E731
    assert end(cheap, one) < end(cheap, two)
    assert end(dear, two) < end(dear, one)


def test_sdp_timeline_sends_each_bucket_when_its_last_gradient_is_ready():
    spans, reduces = ch04.sdp_bucket_timeline()
    done = {layer: end for layer, _, end in spans}
    for (i, owner, start, _), (bucket_owner, layers) in zip(reduces, ch04.BUCKETS):
        assert owner == bucket_owner and start >= max(done[layer] for layer in layers)
    assert reduces[0][2] < max(done.values())  # the first goes out while backward goes on
