"""Chapter 5: the FlatParameter -- flatten, pad, shard; unshard into views; reshard frees the memory."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp import MemoryMeter, comm, launch
from minifsdp.fsdp.flat_param import FlatParameter

WORLD_SIZES = (1, 2, 3, 4)


def odd_module():
    torch.manual_seed(0)  # the same on every rank, so every rank can check the full values
    m = nn.Sequential(nn.Linear(7, 15), nn.Linear(16, 17))  # 7x15+15 and 16x17+17: nothing divides by 2..4
    m.tied = m[0].weight  # a second place for the same parameter
    return m


def flat_cases():
    r = dist.get_rank()
    m = odd_module()
    originals = {f"{i}.{name}": getattr(m[i], name).detach().clone() for i in (0, 1) for name in ("weight", "bias")}
    places = [(m[0], "weight"), (m[0], "bias"), (m[1], "weight"), (m[1], "bias"), (m, "tied")]
    flat = FlatParameter(places)
    out = {"shard": flat.param.detach().clone(), "numel": flat.numel, "shard_numel": flat.shard_numel,
           "sharded_weight_numel": m[0].weight.numel()}
    meter = MemoryMeter()
    with meter:
        with comm.counting() as sent:
            flat.unshard()
        out["unsharded_live"] = meter.live()["other"]
        out["views_equal"] = all(torch.equal(getattr(mod, name), originals[f"{i}.{name}"])
                                 for i, mod in enumerate(m) for name in ("weight", "bias"))
        out["is_view"] = m[0].weight.untyped_storage().data_ptr() == flat.param.untyped_storage().data_ptr()
        out["tie_kept"] = m.tied.data_ptr() == m[0].weight.data_ptr()  # both places show one view
        out["all_gather_bytes"] = sent.bytes["all_gather"]
        # a gradient through the views lands in the flat parameter, then is reduce-scattered to a shard
        meter.reset_peak()
        (m[1](torch.tanh(m[0](torch.ones(2, 7))).repeat(1, 2)[:, :16]).sum() * (r + 1)).backward()
        out["backward_peak"] = meter.peak
        full_grad = flat.param.grad
        flat.param.grad = None
        out["full_grad"] = full_grad.clone()  # reduce_scatter_grad scales its argument in place
        handle, grad_shard = flat.reduce_scatter_grad(full_grad)
        handle.wait()
        out["grad_shard"] = grad_shard
        before = meter.live()["other"]
        flat.reshard()
        out["freed"] = before - meter.live()["other"]
    out["peak"] = meter.peak
    return out


@pytest.fixture(scope="module")
def ranks():
    return {n: launch(flat_cases, world_size=n, device="cpu") for n in WORLD_SIZES}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_flatten_pad_and_shard(ranks, n):
    m = odd_module()
    params = [p.detach().reshape(-1) for p in (m[0].weight, m[0].bias, m[1].weight, m[1].bias)]
    res = ranks[n]
    assert res[0]["numel"] == sum(p.numel() for p in params) == 7 * 15 + 15 + 16 * 17 + 17
    # each parameter starts on a 64-byte boundary (16 fp32 elements): 0, 112, 128, 400; the end, 417, is
    # padded to a multiple of both 16 and N (16 for N = 1, 2, 4; 48 for N = 3): 432 in every case here
    offsets, padded_numel = [0, 112, 128, 400], 432
    assert res[0]["shard_numel"] * n == padded_numel
    padded = torch.cat([res[r]["shard"] for r in range(n)])
    expected = torch.zeros(padded_numel)  # the gaps and the tail are zeros
    for p, offset in zip(params, offsets):
        expected[offset: offset + p.numel()] = p
    assert torch.equal(padded, expected)
    assert res[0]["sharded_weight_numel"] == 0  # while sharded, the original holds nothing


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_unshard_gives_views_into_one_buffer_and_reshard_frees_it(ranks, n):
    for res in ranks[n]:
        assert res["views_equal"] and res["is_view"] and res["tie_kept"]
        padded_bytes = res["shard_numel"] * n * 4
        assert res["unsharded_live"] == padded_bytes  # one buffer, no copies out of it
        assert res["freed"] == padded_bytes  # reshard frees exactly the unsharded buffer
        assert res["all_gather_bytes"] == padded_bytes * (n - 1) / n


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter_gives_each_rank_its_shard_of_the_average(ranks, n):
    # rank r scaled its loss by r + 1: the average gradient is the plain one times mean(1..N)
    full_grads = [ranks[n][r]["full_grad"] for r in range(n)]
    average = sum(full_grads) / n
    shard = ranks[n][0]["shard_numel"]
    for r in range(n):
        torch.testing.assert_close(ranks[n][r]["grad_shard"], average[r * shard: (r + 1) * shard],
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_flat_gradient_is_built_in_one_buffer(ranks, n):
    # in backward: the full buffer, the pieces of the gradient of the one split (the gaps' as zeros) and
    # their concatenation, the flat gradient -- three buffers, and a few activations of 2 rows (5,192
    # bytes at the peak). Were the views cut one slice each, each slice's backward would make a zero-filled
    # gradient of the whole flat size, added one after another (7,400 bytes, more with more parameters).
    for res in ranks[n]:
        padded_bytes = res["shard_numel"] * n * 4
        assert res["backward_peak"] <= 3 * padded_bytes + 1024
