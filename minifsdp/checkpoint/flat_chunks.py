"""Chapter 10's idea: a flat shard, saved as pieces of the original parameters, with no communication.

Chapter 5 laid a unit's parameters end to end in one flat buffer and gave rank r the r-th 1/N of it, so a
rank's shard starts and ends wherever the arithmetic says: in the middle of a row of one weight, through
the whole of the next, into a third. PyTorch's distributed checkpoint (DCP) stores each tensor under its
name as a list of *chunks*, boxes (offsets, sizes) of the full tensor, which any other layout can later
read any part of. So a flat shard needs no gather to be saved: cut this rank's range of each parameter
into the few boxes it covers, and hand DCP views into the shard.

A range of a row-major tensor is at most a partial row, some whole rows, and a partial row; and a
partial row is, one dimension down, the same problem again:

    shape (4, 5), elements [7, 18):   . . . . .        row 1, columns 2..4   offsets (1, 2) sizes (1, 3)
                                      . . # # #        rows 2..2, whole      offsets (2, 0) sizes (1, 5)
                                      # # # # #        row 3, columns 0..2   offsets (3, 0) sizes (1, 3)
                                      # # # . .

Each box is a contiguous run of the flat buffer, so its view into the shard is a plain reshape: DCP
writes from it on save and copies into it on load, in place. The same holds for the optimizer state,
which has the shard's layout (AdamW's exp_avg of a flat shard is a flat shard).

A DTensor cannot say this: its Shard(0) cuts every parameter into N near-equal row blocks, which the
flat layout does not. torch's ShardedTensor can (a list of boxes per tensor, placed on ranks), and it is
what PyTorch FSDP1's SHARDED_STATE_DICT gives by default.
"""

from __future__ import annotations

import math

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from minifsdp.distributed import comm


# --8<-- [start:boxes]
def boxes(shape, start: int,
          end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements [start, end) of a row-major tensor of `shape`, as boxes
    (offsets, sizes), in order."""
    # BEGIN EXERCISE 10.1: range as boxes: partial row, whole rows, partial row
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if len(shape) == 1 else [((), ())]
    row = math.prod(shape[1:])  # elements per index of dim 0
    first, last = -(-start // row), end // row  # the whole rows: [first, last)
    # inside one row: a box one index thick, cut one dimension down
    if first > last:
        i = start // row
        return [((i,) + o, (1,) + s)
                for o, s in boxes(shape[1:], start - i * row, end - i * row)]
    out = []
    if start < first * row:  # the partial row it starts in
        out += [((first - 1,) + o, (1,) + s)
                for o, s in boxes(shape[1:], start - (first - 1) * row, row)]
    if first < last:
        out.append(((first,) + (0,) * (len(shape) - 1),
                    (last - first,) + tuple(shape[1:])))
    if last * row < end:  # the partial row it ends in
        out += [((last,) + o, (1,) + s)
                for o, s in boxes(shape[1:], 0, end - last * row)]
    return out
    # END EXERCISE
# --8<-- [end:boxes]


def flat_start(shape, offsets) -> int:
    """Where a box begins, counted in elements of the row-major tensor."""
    stride, at = 1, 0
    for size, offset in zip(reversed(shape), reversed(offsets)):
        at += offset * stride
        stride *= size
    return at


# --8<-- [start:pieces]
def sharded_piece(local: torch.Tensor, shard_start: int, shard_numel: int,
                  offset: int, shape,
                  group=None) -> ShardedTensor | torch.Tensor | None:
    """One original tensor (`shape`, at `offset` in a flat buffer cut into
    equal shards of `shard_numel`, rank r holding
    [r * shard_numel, (r + 1) * shard_numel) as `local`) as this rank's
    ShardedTensor: its boxes are views into `local`, and every rank's boxes
    are described, with no communication, since each rank can work out every
    other's range. A 0-dim tensor is one element, on one rank: a plain tensor
    there (None elsewhere)."""
    numel = math.prod(shape)
    if len(shape) == 0:
        here = shard_start <= offset < shard_start + shard_numel
        return local[offset - shard_start].view(()) if here else None
    # --8<-- [start:every_rank]
    metadata, mine = [], []
    n = comm.world_size(group)
    ranks = comm.group_ranks(group)
    for q in range(n):
        # BEGIN EXERCISE 10.2: rank q's boxes; for this rank, views into `local`
        # rank q's range
        lo, hi = (max(offset, q * shard_numel),
                  min(offset + numel, (q + 1) * shard_numel))
        for box_offsets, sizes in boxes(shape, lo - offset, hi - offset):
            metadata.append(ShardMetadata(list(box_offsets), list(sizes),
                                          f"rank:{ranks[q]}/{local.device}"))
            # a box is a contiguous run of the flat shard: a view
            if q * shard_numel == shard_start:
                begin = offset + flat_start(shape, box_offsets) - shard_start
                view = local[begin: begin + math.prod(sizes)].view(sizes)
                mine.append(Shard(view, metadata[-1]))
        # END EXERCISE
    # --8<-- [end:every_rank]
    properties = TensorProperties(dtype=local.dtype, requires_grad=False)
    global_metadata = ShardedTensorMetadata(metadata, torch.Size(shape),
                                            properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        mine, global_metadata, process_group=group)
# --8<-- [end:pieces]


def flat_piece(local: torch.Tensor, shard_start: int, shard_numel: int, offset: int, shape, group=None,
               sharded: bool = True):
    """sharded_piece(), or, when every rank holds the whole flat buffer (FSDP's NO_SHARD), a plain view."""
    if not sharded:
        return local[offset: offset + math.prod(shape)].view(shape)
    return sharded_piece(local, shard_start, shard_numel, offset, shape, group)
