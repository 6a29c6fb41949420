"""Chapter 10: a flat shard as boxes of the original parameters (minifsdp/checkpoint/flat_chunks.py).

No tolerance here: the boxes are exact integer bookkeeping, and the values they carry are copied, not
computed. Exercise 10.1 is graded by properties, not by one way of cutting: a box list is right when, read in
order, its boxes cover exactly the elements [start, end) of the row-major tensor, each box a contiguous run of
them, and when no cover of that range by such boxes is shorter (the partial row / whole rows / partial row cut,
one dimension down each time, is one design that reaches it; at most 2 boxes per dimension below the first,
plus one).
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


def box_is_contiguous(shape, start, stop) -> bool:
    """Are the elements [start, stop) of a row-major tensor of `shape` one box? They are when, for some
    dimension j, the run is whole index blocks of dimension j (multiples of the product of the sizes after j)
    and, below the first dimension, stays inside one index of dimension j - 1."""
    for j in range(len(shape)):
        block = math.prod(shape[j + 1:])
        outer = block * shape[j]
        if start % block == 0 and stop % block == 0 and (j == 0 or start // outer == (stop - 1) // outer):
            return True
    return len(shape) == 0


def fewest_boxes(shape) -> dict[tuple[int, int], int]:
    """(start, end) -> the fewest contiguous boxes that cover [start, end), over every cover, not one cut."""
    numel = math.prod(shape)
    out = {}
    for end in range(1, numel + 1):
        fewest = {end: 0}
        for start in range(end - 1, -1, -1):
            fewest[start] = 1 + min(fewest[stop] for stop in range(start + 1, end + 1)
                                    if box_is_contiguous(shape, start, stop))
            out[start, end] = fewest[start]
    return out


def well_formed(shape, found) -> bool:
    return isinstance(found, list) and all(
        isinstance(b, tuple) and len(b) == 2 and all(isinstance(t, tuple) and len(t) == len(shape) for t in b)
        and all(isinstance(v, int) for t in b for v in t) and all(s >= 1 for s in b[1]) for b in found)


def runs_of(found, shape) -> str:
    """The elements each box covers, in a line: `(1, 2) (1, 3) -> 7..9`."""
    return "; ".join(f"{tuple(o)} {tuple(s)} -> {r[0]}..{r[-1]}" if r else f"{tuple(o)} {tuple(s)} -> nothing"
                     for (o, s), r in zip(found, covered(shape, found)))


SHAPES = [(4, 5), (7,), (2, 3, 4), (3, 1, 5, 2), (1, 9), (6, 1), ()]


@pytest.mark.exercise("10.1")
@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_cover_every_range_exactly_and_in_order(shape):
    numel = math.prod(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        found = boxes(shape, start, end)
        assert well_formed(shape, found), (
            f"boxes({shape}, {start}, {end}) returned {found!r}, expected a list of (offsets, sizes), each a tuple "
            f"of {len(shape)} ints, one per dimension, every size at least 1 (exercise 10.1)")
        runs = covered(shape, found)
        got = [i for run in runs for i in run]
        assert got == list(range(start, end)), (
            f"shape {shape}, elements [{start}, {end}): the boxes cover {runs_of(found, shape)}, "
            f"{len(got):,} elements in all, expected each of the {end - start:,} elements of [{start}, {end}) once, "
            f"in order (exercise 10.1): does a partial row start at the right column, and are the boxes listed in "
            f"the order of the elements?")
        for (offsets, sizes), run in zip(found, runs):  # contiguous, and flat_start says where it begins
            assert run == list(range(run[0], run[0] + len(run))) and flat_start(shape, offsets) == run[0], (
                f"shape {shape}, elements [{start}, {end}): the box at offsets {offsets}, sizes {sizes} covers "
                f"{run[:8]}{'...' if len(run) > 8 else ''}, not one run of consecutive elements (exercise 10.1): "
                f"a box may span more than one index of a dimension only where every dimension after it is whole")


@pytest.mark.mechanism
@pytest.mark.exercise("10.1")
@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_are_the_fewest_the_cut_needs(shape):
    """No cover of the range by contiguous boxes is shorter (every cover is searched): not a box per row or per
    element, which covers the same elements with more chunks to write, list and match. At most 2 boxes per
    dimension below the first, plus one."""
    numel = math.prod(shape)
    fewest = fewest_boxes(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        found = boxes(shape, start, end)
        assert len(found) == fewest[start, end] <= 2 * max(len(shape) - 1, 0) + 1, (
            f"shape {shape}, elements [{start}, {end}): {len(found)} boxes ({runs_of(found, shape)}), where "
            f"{fewest[start, end]} {'box covers' if fewest[start, end] == 1 else 'boxes cover'} it (exercise 10.1): is a partial row cut into rows or runs of the "
            f"last dimension, rather than into the same three parts one dimension down (the rest of a row, whole "
            f"rows, the start of a row)?")


@pytest.mark.mechanism
@pytest.mark.exercise("10.1")
def test_the_example_in_the_docstring():
    """The fewest boxes of each of these ranges are one list only (a box cannot cross a row it does not cover
    whole), so any design that meets the two tests above gives these."""
    for start, end, want in [(7, 18, [((1, 2), (1, 3)), ((2, 0), (1, 5)), ((3, 0), (1, 3))]),
                             (5, 15, [((1, 0), (2, 5))]),  # whole rows only: one box
                             (3, 3, [])]:  # nothing
        found = boxes((4, 5), start, end)
        assert found == want, (
            f"shape (4, 5), elements [{start}, {end}): boxes {found!r}, expected {want!r} (exercise 10.1): "
            f"the rest of row 1, the whole rows, the start of the last row; whole rows in one box; an empty range "
            f"as no box")


@pytest.mark.exercise("10.1")
def test_random_large_shapes():
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randrange(numel)
        end = rng.randint(start + 1, numel)
        found = boxes(shape, start, end)
        got = [i for run in covered(shape, found) for i in run]
        assert got == list(range(start, end)) and len(found) <= 2 * (len(shape) - 1) + 1, (
            f"shape {shape}, elements [{start}, {end}): {len(found)} boxes covering {len(got):,} elements, expected "
            f"[{start}, {end}) once, in order, in at most {2 * (len(shape) - 1) + 1} boxes (exercise 10.1)")


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
            assert len(holders) == 1 and ranks[holders[0]][t][0][1] == offset, (
                f"N = {n}: the 0-dim tensor at element {offset:,} of the flat buffer is held by ranks {holders}, "
                f"expected by the one rank whose shard holds that element (exercise 10.2)")
            continue
        everyone = ranks[0][t][0]
        for r in range(n):  # every rank describes the same boxes
            assert ranks[r][t][0] == everyone, (
                f"N = {n}, tensor {shape} at element {offset:,}: rank {r} describes the boxes {ranks[r][t][0]} "
                f"(offsets, sizes, rank), rank 0 {everyone} (exercise 10.2): every rank must describe every rank's "
                f"boxes, the same list on each, in the order of the ranks")
        seen = torch.zeros(math.prod(shape), dtype=torch.int64)
        for r in range(n):
            for box_offsets, values in ranks[r][t][1]:
                begin = flat_start(shape, box_offsets)
                assert values == [float(offset + begin + i) for i in range(len(values))], (
                    f"N = {n}, tensor {shape} at element {offset:,}: rank {r}'s box at {box_offsets} holds elements "
                    f"{values[:6]}... of the flat buffer, expected {offset + begin:,} onwards (exercise 10.2): is the "
                    f"box's place in the shard counted from the shard's first element, r x shard_numel?")
                seen[begin: begin + len(values)] += 1
        assert seen.eq(1).all(), (
            f"N = {n}, tensor {shape}: the ranks' own boxes hold some elements {int(seen.max())} times and "
            f"{int(seen.eq(0).sum()):,} elements not at all, expected every element once (exercise 10.2): is each "
            f"rank's range cut where the tensor and the shard overlap, and only there?")


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
            through_comm, c10d_ops = sent
            assert sent == ({}, []), (
                f"N = {n}, rank {r}: describing tensor {shape} issued {through_comm or 'nothing'} through comm and "
                f"the c10d ops {c10d_ops or 'none'}, expected no collective at all (exercise 10.2): every rank's "
                f"range of the flat buffer follows from the layout (equal shards of shard_numel), so no rank needs "
                f"to ask another for its boxes")
            if shape == ():
                continue
            _, _, views = piece
            for same_storage, at, begin in views:
                expected = 4 * (offset + begin - r * shard)
                assert same_storage, (
                    f"N = {n}, rank {r}: a box of tensor {shape} (its element {begin:,} first) lies in memory of its "
                    f"own, expected a view into the rank's flat shard (exercise 10.2): a copy is written on save, but "
                    f"a load copies the checkpoint into the copy, and the shard never sees it")
                assert at == expected, (
                    f"N = {n}, rank {r}: the box of tensor {shape} that begins at its element {begin:,} is a view "
                    f"{at:,} B into the shard, expected {expected:,} B (exercise 10.2): where does the tensor start "
                    f"in the shard, and where the box in the tensor?")
