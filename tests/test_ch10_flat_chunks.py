"""Chapter 10: a flat shard as boxes of the original parameters (minifsdp/checkpoint/flat_chunks.py).

No tolerance here: the boxes are exact integer bookkeeping, and the values they carry are copied, not
computed. A box list is right when, read in order, its boxes cover exactly the elements [start, end) of the
row-major tensor, each box a contiguous run of them, and when no more boxes are used than the partial
row / whole rows / partial row cut needs (2 per dimension below the first, plus one).
"""

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
from test_ch10_fsdp_state_dicts import Collectives  # the c10d-op spy: every collective, through comm or not

from minifsdp import comm
from minifsdp.checkpoint.flat_chunks import boxes, flat_start, sharded_piece


def covered(shape, found):
    """The flat indices each box covers, in the box's own row-major order."""
    index = torch.arange(math.prod(shape)).view(shape)
    out = []
    for offsets, sizes in found:
        region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else index
        out.append(region.reshape(-1).tolist())
    return out


SHAPES = [(4, 5), (7,), (2, 3, 4), (3, 1, 5, 2), (1, 9), (6, 1), ()]


@pytest.mark.exercise("10.1")
@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_cover_every_range_exactly_and_in_order(shape):
    numel = math.prod(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        found = boxes(shape, start, end)
        runs = covered(shape, found)
        assert [i for run in runs for i in run] == list(range(start, end)), (shape, start, end, found)
        for (offsets, _), run in zip(found, runs):  # contiguous, and flat_start says where it begins
            assert run == list(range(run[0], run[0] + len(run))) and flat_start(shape, offsets) == run[0]


@pytest.mark.mechanism
@pytest.mark.exercise("10.1")
@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_are_the_fewest_the_cut_needs(shape):
    """Partial row, whole rows, partial row, one dimension down each time: at most 2 boxes per dimension below the
    first, plus one -- not a box per row or per element, which would cover the same elements."""
    numel = math.prod(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        assert len(boxes(shape, start, end)) <= 2 * max(len(shape) - 1, 0) + 1, (shape, start, end)


@pytest.mark.mechanism
@pytest.mark.exercise("10.1")
def test_the_example_in_the_docstring():
    assert boxes((4, 5), 7, 18) == [((1, 2), (1, 3)), ((2, 0), (1, 5)), ((3, 0), (1, 3))]
    assert boxes((4, 5), 5, 15) == [((1, 0), (2, 5))]  # whole rows only: one box
    assert boxes((4, 5), 3, 3) == []


@pytest.mark.exercise("10.1")
def test_random_large_shapes():
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randrange(numel)
        end = rng.randint(start + 1, numel)
        assert [i for run in covered(shape, boxes(shape, start, end)) for i in run] == list(range(start, end))


def pieces_of_a_flat_buffer(shapes):
    """Each rank's ShardedTensor pieces of tensors laid end to end in a flat buffer, padded to N shards."""
    n, r = dist.get_world_size(), dist.get_rank()
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    shard = -(-sum(math.prod(s) for s in shapes) // n)
    local = torch.arange(r * shard, (r + 1) * shard, dtype=torch.float32)  # element i holds i
    out = []
    for offset, shape in zip(offsets, shapes):
        with comm.counting() as counter, Collectives() as spy:
            piece = sharded_piece(local, r * shard, shard, offset, shape)
        sent = (dict(counter.calls), spy.ops)  # through comm, or around it
        if shape == ():
            out.append((None if piece is None else [((), piece.item())], sent))
            continue
        everyone = [(tuple(m.shard_offsets), tuple(m.shard_sizes), m.placement.rank())
                    for m in piece.metadata().shards_metadata]
        mine = [(tuple(s.metadata.shard_offsets), s.tensor.reshape(-1).tolist()) for s in piece.local_shards()]
        views = [(s.tensor.untyped_storage().data_ptr() == local.untyped_storage().data_ptr(),
                  s.tensor.data_ptr() - local.data_ptr(), flat_start(shape, s.metadata.shard_offsets))
                 for s in piece.local_shards()]
        out.append(((everyone, mine, views), sent))
    return out




SHAPES_IN_A_BUFFER = [(4, 5), (3,), (2, 3, 4), ()]


def each_rank_here(work, world_size, *args):
    """work(*args) as each rank of world_size in turn, in this process, under a process group whose collectives
    move nothing (torch's "fake" backend): enough for a work that needs no peer -- which the tests below check,
    since a collective still shows in both spies -- and no processes to start."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the backend

    out = []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            out.append(work(*args))
        finally:
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def launched():
    """Each rank's pieces of SHAPES_IN_A_BUFFER laid end to end, at 2 and 3 ranks."""
    return {n: each_rank_here(pieces_of_a_flat_buffer, n, SHAPES_IN_A_BUFFER) for n in (2, 3)}


@pytest.mark.exercise("10.1", "10.2")
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_pieces_tile_each_tensor(launched, n):
    shapes = SHAPES_IN_A_BUFFER
    ranks = [[piece for piece, _ in res] for res in launched[n]]
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    for t, (shape, offset) in enumerate(zip(shapes, offsets)):
        if shape == ():  # one element, one rank: a plain tensor there
            holders = [r for r in range(n) if ranks[r][t] is not None]
            assert len(holders) == 1 and ranks[holders[0]][t][0][1] == offset
            continue
        everyone = ranks[0][t][0]
        assert all(ranks[r][t][0] == everyone for r in range(n))  # every rank describes the same boxes
        seen = torch.zeros(math.prod(shape), dtype=torch.int64)
        for r in range(n):
            for box_offsets, values in ranks[r][t][1]:
                begin = flat_start(shape, box_offsets)
                assert values == [float(offset + begin + i) for i in range(len(values))]
                seen[begin: begin + len(values)] += 1
        assert seen.eq(1).all()  # together, the ranks' boxes hold every element exactly once


@pytest.mark.mechanism
@pytest.mark.exercise("10.2")
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_pieces_are_views_into_the_shard_made_without_a_collective(launched, n):
    """Each box this rank holds is a view into its flat shard, where the layout puts it (DCP writes from it and
    loads into it in place: a copy would load into nothing); and every rank's boxes are worked out, not asked
    for: no collective, through comm or around it."""
    offsets = [sum(math.prod(s) for s in SHAPES_IN_A_BUFFER[:i]) for i in range(len(SHAPES_IN_A_BUFFER))]
    shard = -(-sum(math.prod(s) for s in SHAPES_IN_A_BUFFER) // n)
    for r, res in enumerate(launched[n]):
        for (piece, sent), shape, offset in zip(res, SHAPES_IN_A_BUFFER, offsets):
            assert sent == ({}, []), (shape, sent)
            if shape == ():
                continue
            _, _, views = piece
            for same_storage, at, begin in views:
                assert same_storage and at == 4 * (offset + begin - r * shard), (shape, at, begin)
