"""Chapter 5: the FlatParameter -- flatten, pad, shard; unshard into views; reshard frees the memory."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp import MemoryMeter, comm, launch
from minifsdp.fsdp.flat_param import FlatParameter, ShardState
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)


def odd_module():
    torch.manual_seed(0)  # the same on every rank, so every rank can check the full values
    m = nn.Sequential(nn.Linear(7, 15), nn.Linear(16, 17))  # 7x15+15 and 16x17+17: nothing divides by 2..4
    m.tied = m[0].weight  # a second place for the same parameter
    return m


def places_of(m):
    return [(m[0], "weight"), (m[0], "bias"), (m[1], "weight"), (m[1], "bias"), (m, "tied")]


def let_go(meter, held: int, seconds: float = 10.0) -> bool:
    """Wait until the live "other" bytes are back to `held`. gloo's reduce-scatter works in a buffer of
    its own, which its worker thread drops a moment after waking the rank that waits, now and then
    after that rank has moved on: a reading begun before then would count the buffer as freed by
    whatever came next."""
    deadline = time.monotonic() + seconds
    while meter.live()["other"] > held:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def flat_cases():
    r = dist.get_rank()
    # built under a meter: what a rank keeps of the unit is its shard, and nothing else
    with MemoryMeter() as meter:
        built = FlatParameter(places_of(odd_module()))
    built_live = meter.live()["total"]
    del built
    m = odd_module()
    originals = {f"{i}.{name}": getattr(m[i], name).detach().clone() for i in (0, 1) for name in ("weight", "bias")}
    flat = FlatParameter(places_of(m))
    out = {"shard": flat.param.detach().clone(), "numel": flat.numel, "shard_numel": flat.shard_numel,
           "offsets": [int(o) for o in flat.offsets], "sharded_weight_numel": m[0].weight.numel(),
           "built_live": built_live}
    meter = MemoryMeter()
    with meter:
        with comm.counting() as sent:
            flat.unshard()
        out["unsharded_live"] = meter.live()["other"]
        out["views_equal"] = all(torch.equal(getattr(mod, name), originals[f"{i}.{name}"])
                                 for i, mod in enumerate(m) for name in ("weight", "bias"))
        out["is_view"] = m[0].weight.untyped_storage().data_ptr() == flat.param.untyped_storage().data_ptr()
        out["tie_kept"] = m.tied.data_ptr() == m[0].weight.data_ptr()  # both places show one view
        out["unshard_sent"], out["unshard_calls"] = dict(sent.bytes), dict(sent.calls)
        # a gradient through the views lands in the flat parameter, then is reduce-scattered to a shard
        meter.reset_peak()
        (m[1](torch.tanh(m[0](torch.ones(2, 7))).repeat(1, 2)[:, :16]).sum() * (r + 1)).backward()
        out["backward_peak"] = meter.peak
        full_grad = flat.param.grad
        flat.param.grad = None
        out["full_grad"] = full_grad.clone()  # reduce_scatter_grad scales its argument in place
        held = meter.live()["other"]
        with comm.counting(record=True) as sent:
            handle, grad_shard = flat.reduce_scatter_grad(full_grad)
            out["reduce_waited"] = [w.tag for w in sent.waits]  # before the caller's own wait
            handle.wait()
        out["reduce_sent"], out["reduce_calls"] = dict(sent.bytes), dict(sent.calls)
        if grad_shard.untyped_storage().data_ptr() != full_grad.untyped_storage().data_ptr():
            held += grad_shard.untyped_storage().nbytes()  # a shard of its own (exercise 5.2 allows it)
        out["gloo_let_go"] = let_go(meter, held)
        out["grad_shard"] = grad_shard
        kept_view = m[1].bias  # a view of the full buffer, as autograd saves one in forward
        before = meter.live()["other"]
        flat.reshard()
        out["freed"] = before - meter.live()["other"]
        # a prefetch (chapter 7): unshard(async_op=True) only starts the all-gather; nothing is waited for
        # until wait_for_unshard(), and the all-gather lands in the buffer itself, with no second one beside it
        meter.reset_peak()
        before = meter.live()["total"]
        with comm.counting(record=True) as sent:
            flat.unshard(async_op=True)
            out["prefetch"] = (flat.state, [w.tag for w in sent.waits])
            flat.wait_for_unshard()
        out["prefetch_peak"] = meter.peak - before
        out["prefetch_views_equal"] = torch.equal(m[1].bias, originals["1.bias"])
        try:  # the view kept across reshard and unshard sees the values again (on the storage it points at)
            out["kept_view_equal"] = torch.equal(kept_view, originals["1.bias"])
        except RuntimeError as e:  # a storage that never got its memory back
            out["kept_view_equal"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        flat.reshard()
    out["peak"] = meter.peak
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(flat_cases, world_size=n, device="cpu"), WORLD_SIZES)


ALIGN = 16  # elements: 64 bytes of fp32


@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_flatten_pad_and_shard(ranks, n):
    # The properties of any good layout, not one layout: each parameter on a 64-byte boundary, in order, with
    # fewer than 16 elements of gap before it; N equal shards that cover it all, fewer than 16N elements after
    # the last parameter, zeros wherever no parameter is. (This chapter's layout puts the four parameters at 0,
    # 112, 128 and 400 and pads the end, 417, to 432, a multiple of 16 and of N; padding to a multiple of N
    # only, 418 at N = 2, passes too.)
    m = odd_module()
    params = [p.detach().reshape(-1) for p in (m[0].weight, m[0].bias, m[1].weight, m[1].bias)]
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    res = ranks[n]
    assert res[0]["numel"] == sum(p.numel() for p in params) == 7 * 15 + 15 + 16 * 17 + 17
    offsets, shard_numel = res[0]["offsets"], res[0]["shard_numel"]
    assert len(offsets) == len(params), (
        f"offsets has {len(offsets)} entries, expected one per distinct parameter, {len(params)} (exercise 5.1): "
        f"the tied weight is stored once, at one offset")
    for r in range(n):
        got = res[r]["shard"].numel()
        assert got == shard_numel, (
            f"at N = {n}, rank {r}'s shard holds {got:,} elements, rank 0's shard_numel is {shard_numel:,} "
            f"(exercise 5.1): every rank's shard must be the same size, or no all-gather can rebuild the unit")
    padded = torch.cat([res[r]["shard"] for r in range(n)])
    end = 0
    for name, p, offset in zip(names, params, offsets):
        assert offset % ALIGN == 0, (
            f"{name} starts at element {offset:,}, byte {4 * offset:,}: not on a 64-byte boundary (exercise "
            f"5.1). CPU kernels round differently for data at other addresses, and the views would not compute "
            f"the bits the original parameters did")
        assert end <= offset < end + ALIGN, (
            f"{name} starts at element {offset:,}, and what comes before it ends at {end:,} (exercise 5.1): "
            + ("it overlaps the parameter before it" if offset < end else
               f"a gap of {offset - end:,} elements, where fewer than {ALIGN} reach the next 64-byte boundary; "
               f"every rank pays for the padding"))
        end = offset + p.numel()
    assert end <= padded.numel() < end + n * ALIGN, (
        f"at N = {n} the {n} shards hold {padded.numel():,} elements for a layout that ends at {end:,} "
        f"(exercise 5.1): expected at least {end:,} and fewer than {end + n * ALIGN:,} (padding to a multiple "
        f"of N, or of N and 16, is enough)")
    expected = torch.zeros(padded.numel())  # the gaps and the tail are zeros
    for p, offset in zip(params, offsets):
        expected[offset: offset + p.numel()] = p
    wrong = (padded != expected).nonzero().flatten().tolist()
    assert not wrong, (
        f"at N = {n} the shards, concatenated, differ from the parameters laid out at offsets {offsets} with "
        f"zeros elsewhere at {len(wrong):,} elements, the first at element {wrong[0]:,} (exercise 5.1): is rank "
        f"r's shard elements [r * shard_numel, (r + 1) * shard_numel) of the layout, and the padding zeros?")
    assert res[0]["sharded_weight_numel"] == 0, (
        f"while sharded an original parameter still holds {res[0]['sharded_weight_numel']:,} elements "
        f"(exercise 5.1)")


@pytest.mark.mechanism
@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_a_rank_keeps_only_its_shard(ranks, n):
    # measured by the meter over the construction: the padded flat copy is gone, the originals hold
    # nothing, and the shard has a storage of its own, the shard's size (not a view into a full-size copy)
    for res in ranks[n]:
        kept, shard = res["built_live"], res["shard_numel"] * 4
        assert kept == shard, (
            f"after building the FlatParameter a rank kept {kept:,} B, expected its {shard:,} B shard "
            f"(exercise 5.1): is `shard` a slice of a full-size tensor? A slice keeps its whole storage alive. Or "
            f"do the original parameters still hold their data?")


@pytest.mark.exercise("5.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_unshard_gives_views_into_one_buffer_and_reshard_frees_it(ranks, n):
    for r, res in enumerate(ranks[n]):
        assert res["views_equal"] and res["prefetch_views_equal"], (
            f"rank {r}: after unshard() a place does not show its original values (exercise 5.3): does the "
            f"all-gather write every rank's shard, in rank order, into the full buffer?")
        assert res["is_view"] and res["tie_kept"], (
            f"rank {r}: after unshard() a place is not a view into the flat parameter's buffer, or the two places "
            f"of the tied weight show different elements (exercise 5.3)")
        assert res["kept_view_equal"] is True, (
            f"rank {r}: a view of the parameters taken before reshard() does not show their values after the "
            f"next unshard() ({res['kept_view_equal']}) (exercise 5.3): autograd keeps such views from forward "
            f"to backward. Is the memory given back to the same storage the views point at, rather than to a "
            f"new tensor?")
        padded_bytes = res["shard_numel"] * n * 4
        assert res["unsharded_live"] == padded_bytes, (
            f"rank {r}: unshard() left {res['unsharded_live']:,} B alive, expected the one {padded_bytes:,} B "
            f"full buffer (exercise 5.3): is a copy, or a second buffer, kept beside it?")
        assert res["gloo_let_go"], "the reduce-scatter left more memory behind than the shard it returned"
        assert res["freed"] == padded_bytes, (
            f"rank {r}: reshard() freed {res['freed']:,} B, expected the {padded_bytes:,} B full buffer "
            f"(exercise 5.3): does the all-gather land in the buffer reshard frees?")


@pytest.mark.mechanism
@pytest.mark.exercise("5.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_unshard_is_one_async_all_gather_into_the_buffer(ranks, n):
    for res in ranks[n]:
        padded_bytes = res["shard_numel"] * n * 4
        # one all-gather of the padded buffer, counted by comm: (N-1)/N of it sent, nothing else
        assert res["unshard_calls"] == {"all_gather": 1}, (
            f"unshard issued {res['unshard_calls']}, expected one all_gather (exercise 5.3): gather the whole "
            f"padded buffer in one collective, through minifsdp's comm, not one per parameter")
        assert res["unshard_sent"] == {"all_gather": padded_bytes * (n - 1) / n}, (
            f"unshard sent {res['unshard_sent']} B, expected (N-1)/N of the {padded_bytes:,} B padded buffer "
            f"(exercise 5.3): is the input this rank's shard, and the output the full buffer?")
        # started, not waited for: the prefetch returns with the all-gather in flight
        state, waited = res["prefetch"]
        assert state is ShardState.UNSHARDING and waited == [], (
            f"unshard(async_op=True) returned in state {state.name}, having waited for {waited} (exercise 5.3): "
            f"unshard only starts the all-gather and keeps its handle; wait_for_unshard is where it is waited "
            f"for, so that the caller can overlap it with other work")
        # and the all-gather writes into the full buffer itself: the peak grows by that buffer only
        assert res["prefetch_peak"] == padded_bytes, (
            f"the unshard grew memory by {res['prefetch_peak']:,} B, expected the one {padded_bytes:,} B full "
            f"buffer (exercise 5.3): all-gather into that buffer itself, not into a list of tensors or a "
            f"second buffer copied after")


@pytest.mark.exercise("5.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter_gives_each_rank_its_shard_of_the_average(ranks, n):
    # rank r scaled its loss by r + 1: the average gradient is the plain one times mean(1..N)
    full_grads = [ranks[n][r]["full_grad"] for r in range(n)]
    average = sum(full_grads) / n
    shard = ranks[n][0]["shard_numel"]
    for r in range(n):
        torch.testing.assert_close(
            ranks[n][r]["grad_shard"], average[r * shard: (r + 1) * shard], rtol=1e-6, atol=1e-6,
            msg=lambda detail, r=r: (
                f"at N = {n}, rank {r}'s grad_shard is not its slice of the average of every rank's flat gradient "
                f"(exercise 5.2): the sum instead of the mean, or another rank's slice?\n{detail}"))


@pytest.mark.mechanism
@pytest.mark.exercise("5.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_average_is_one_reduce_scatter(ranks, n):
    # one reduce-scatter of the padded flat gradient, counted by comm: not an all-reduce (twice the bytes)
    # with this rank's slice kept, nor a collective called on torch.distributed directly; and only started
    for res in ranks[n]:
        padded_bytes = res["shard_numel"] * n * 4
        assert res["reduce_calls"] == {"reduce_scatter": 1}, (
            f"the gradient's average issued {res['reduce_calls']}, expected one reduce_scatter (exercise "
            f"5.2): an all_reduce with this rank's slice kept gives the same numbers and moves twice the bytes")
        assert res["reduce_sent"] == {"reduce_scatter": padded_bytes * (n - 1) / n}, (
            f"the reduce-scatter sent {res['reduce_sent']} B, expected (N-1)/N of the {padded_bytes:,} B flat "
            f"gradient (exercise 5.2): is its input the whole padded flat gradient?")
        assert res["reduce_waited"] == [], (
            f"reduce_scatter_grad waited for {res['reduce_waited']} before returning (exercise 5.2): it only "
            f"starts the collective and returns its handle; the caller decides when to wait, so that the "
            f"gradient travels while backward computes the units before this one")


@pytest.mark.exercise("5.3")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_flat_gradient_is_built_in_one_buffer(ranks, n):
    # in backward: the full buffer, the pieces of the gradient of the one split (the gaps' as zeros) and
    # their concatenation, the flat gradient -- three buffers, and a few activations of 2 rows (5,192
    # bytes at the peak). Were the views cut one slice each, each slice's backward would make a zero-filled
    # gradient of the whole flat size, added one after another (7,400 bytes, more with more parameters).
    for res in ranks[n]:
        padded_bytes = res["shard_numel"] * n * 4
        assert res["backward_peak"] <= 3 * padded_bytes + 1024, (
            f"backward's peak was {res['backward_peak']:,} B, above three {padded_bytes:,} B flat buffers and "
            f"1,024 B of activations (exercise 5.3): are the views cut by one split of the full buffer?")
