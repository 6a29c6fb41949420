"""Chapter 10's newer pictures: what each strategy holds of one weight, a range as boxes, FSDP1's three state
dicts, and the steps of an atomic save.

The numbers are those of chapter 5's unit, w (4 x 5) and b (5) at N = 4: laid out flat on 16-element boundaries
and padded to 48, rank r holds elements [12r, 12r + 12). tests/test_diagrams.py checks them against the
package: the layout against minifsdp.zero.flat.flat_layout, OSS's owner of w against partition_parameters, the
boxes against minifsdp.checkpoint.flat_chunks.boxes.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

N = 4
SHAPES = {"w": (4, 5), "b": (5,)}
OFFSETS, PADDED = {"w": 0, "b": 32}, 48          # flat_layout([20, 5], 4, 16)
SHARD = PADDED // N                              # 12 elements a rank
OSS_OWNER = {"w": 0, "b": 1}                     # partition_parameters: the largest first, to the emptiest rank
# boxes((4, 5), 7, 18): a range of a row-major tensor as (offsets, sizes), as flat_chunks.py's docstring draws it
RANGE_SHAPE, RANGE = (4, 5), (7, 18)
RANGE_BOXES = [((1, 2), (1, 3)), ((2, 0), (1, 5)), ((3, 0), (1, 3))]


def _numel(shape) -> int:
    return shape[0] * shape[1] if len(shape) == 2 else shape[0]


def _flat_owner(name: str, k: int) -> int | None:
    """The rank whose flat shard holds element k of parameter `name`."""
    e = OFFSETS[name] + k
    return e // SHARD if e < PADDED else None


def _grid(c: Canvas, x, y, shape, fill_of, cell=8.0) -> None:
    """A row-major grid of a tensor's elements; fill_of(k) gives element k's fill, or None for an empty cell."""
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    for i in range(rows):
        for j in range(cols):
            fill = fill_of(i * cols + j)
            c.rect(x + j * cell, y + i * cell, cell, cell, fill=fill or "none", stroke=MUTED, width=0.6 if fill
                   is None else 0.8, rx=0)


def checkpoint_layouts() -> Canvas:
    shape = SHAPES["w"]
    numel = _numel(shape)
    rows_of = shape[0] // N                     # fully_shard: Shard(0) gives rank r rows [r, r + 1)
    whole = (lambda r: (lambda k: RANKS[r]))
    owner = (lambda r: (lambda k: RANKS[r] if OSS_OWNER["w"] == r else None))
    flat = (lambda r: (lambda k: RANKS[r] if _flat_owner("w", k) == r else None))
    dim0 = (lambda r: (lambda k: RANKS[r] if k // shape[1] // rows_of == r else None))
    strategies = [("DDP", whole, whole), ("OSS, SDP", whole, owner), ("FlatOSS, flat SDP", whole, flat),
                  ("FSDP", flat, flat), ("fully_shard", dim0, dim0)]
    c = Canvas("checkpoint_layouts", 328, "One weight, held five ways: what each rank holds of w and of its "
               "optimizer state",
               f"A table of small grids of the weight w ({shape[0]} by {shape[1]}) of chapter 5's unit at N = {N}: "
               "one row per strategy, four grids for the parameter (ranks 0 to 3) and four for its optimizer "
               "state, each element filled in the colour of the rank if that rank holds it. DDP: every rank holds "
               "all of both. OSS and SDP: every rank holds the parameter, and its owner, rank "
               f"{OSS_OWNER['w']}, all of the state. FlatOSS and flat SDP: every rank holds the parameter; the "
               f"state is flat, rank 0 holds elements 0 to {SHARD - 1} and rank 1 the rest. FSDP: the parameter "
               "and the state are both flat shards, cut the same way. fully_shard: Shard(0), rank r holds row r of "
               "both. A checkpoint names them all model.w and optim.state.w.exp_avg, with the boxes each rank "
               "holds.")
    x0, cell, step = 150, 8.0, 58
    gw = shape[1] * cell
    groups = [("the parameter: model.w", x0), ("its optimizer state: optim.state.w.*", x0 + 4 * step + 20)]
    for title, gx in groups:
        c.text(gx, 18, title, size=MIN_FONT, bold=True)
        for r in range(N):
            c.text(gx + r * step + gw / 2, 40, f"rank {r}", anchor="middle", size=MIN_FONT)
    y = 52
    for name, params, state in strategies:
        c.text(10, y + 22, name, size=MIN_FONT, bold=True, mono=name == "fully_shard")
        for r in range(N):
            _grid(c, x0 + r * step, y, shape, params(r), cell)
            _grid(c, groups[1][1] + r * step, y, shape, state(r), cell)
        y += 48
    y += 8
    c.text(10, y, f"Under every layout, a checkpoint stores the {numel} elements of w once, as model.w, in the boxes",
           size=MIN_FONT)
    c.text(10, y + 18, "the ranks hold; a loader under another layout reads the boxes it holds now.", size=MIN_FONT)
    return c


def checkpoint_boxes() -> Canvas:
    rows, cols = RANGE_SHAPE
    start, end = RANGE
    kinds = ["the partial row it starts in", "the whole rows", "the partial row it ends in"]
    c = Canvas("checkpoint_boxes", 262, "A range of a flat buffer as boxes of the tensor: partial row, whole rows, "
               "partial row",
               f"Top: the {rows * cols} elements of a {rows} by {cols} tensor in row-major order, a flat run, with "
               f"the range [{start}, {end}) that one rank holds highlighted. Below: the same elements in the "
               f"tensor's shape. The range is three boxes: row 1, columns 2 to 4 (offsets (1, 2), sizes (1, 3)); "
               "row 2 whole (offsets (2, 0), sizes (1, 5)); row 3, columns 0 to 2 (offsets (3, 0), sizes (1, 3)). "
               "A partial row is the same problem one dimension down. Each box is a contiguous run of the flat "
               "shard, so its view is a slice and a reshape, with no copy.")
    cell = 26
    x0 = 10
    c.text(10, 18, f"elements [{start}, {end}) of a tensor of shape {RANGE_SHAPE}, flat:", size=MIN_FONT, bold=True)
    for k in range(rows * cols):
        inside = start <= k < end
        c.box(x0 + k * 32, 28, cell, 24, str(k), BLUE if inside else GRAY, size=MIN_FONT)
    c.text(10, 82, "the same elements in the tensor's shape, and the boxes that cover the range:", size=MIN_FONT,
           bold=True)
    gx, gy = 20, 96
    for i in range(rows):
        for j in range(cols):
            k = i * cols + j
            c.box(gx + j * (cell + 4), gy + i * (cell + 4), cell, cell, str(k),
                  BLUE if start <= k < end else GRAY, size=MIN_FONT)
    lx = gx + cols * (cell + 4) + 36
    for n, ((r0, c0), (nr, nc)) in enumerate(RANGE_BOXES):
        bx, by = gx + c0 * (cell + 4) - 3, gy + r0 * (cell + 4) - 3
        c.rect(bx, by, nc * (cell + 4) - 4 + 6, nr * (cell + 4) - 4 + 6, width=2)
        yy = gy + r0 * (cell + 4) + 18
        c.line(gx + cols * (cell + 4) + 4, yy - 5, lx - 6, yy - 5, arrow=True)
        c.text(lx, yy, f"offsets ({r0}, {c0}), sizes ({nr}, {nc})", mono=True, size=MIN_FONT)
        c.text(lx + 290, yy, kinds[n], size=MIN_FONT)
    c.text(10, gy + rows * (cell + 4) + 28, "Each box is a contiguous run of the shard: its view is a slice and a "
           "reshape, no copy.", size=MIN_FONT)
    return c


def checkpoint_state_dicts() -> Canvas:
    c = Canvas("checkpoint_state_dicts", 350, "FSDP1's three state dicts, for chapter 5's unit at N = 4",
               f"Three columns, one per StateDictType, four rows, one per rank, for the unit of w (4 by 5) and b "
               f"(5) laid out flat and padded to {PADDED}, {SHARD} elements a rank. FULL_STATE_DICT: gathered unit "
               "by unit, every tensor whole under its own name; with rank0_only, rank 0 holds w and b and the "
               "others nothing; one all_gather per unit. SHARDED_STATE_DICT: each rank holds the boxes of w and b "
               "that its shard covers, under their own names, as views: no collective, loads at any N through "
               "DCP. LOCAL_STATE_DICT: each rank holds its flat shard itself, flat_param_0, padding included: no "
               "collective, but it loads only into the same wrapping at the same N.")
    fill = {"w": BLUE, "b": GREEN}
    cols = [10, 240, 470]
    heads = [("FULL_STATE_DICT", "rank0_only=True"), ("SHARDED_STATE_DICT", "ShardedTensor boxes"),
             ("LOCAL_STATE_DICT", "the flat shard itself")]
    for x, (name, sub) in zip(cols, heads):
        c.box(x, 8, 200, 40, [(name, {"mono": True, "bold": True}), sub], GRAY, size=MIN_FONT)
    top, row_h, cell = 60, 50, 7.0
    for r in range(N):
        y = top + r * row_h
        for x in cols:
            c.text(x, y + 18, f"rank {r}", size=MIN_FONT)
        # FULL, rank0_only: rank 0 holds every tensor whole
        x = cols[0] + 56
        if r == 0:
            _grid(c, x, y, SHAPES["w"], lambda k: BLUE, cell)
            c.text(x + 42, y + 20, "w", mono=True, size=MIN_FONT)
            _grid(c, x + 64, y + 10, SHAPES["b"], lambda k: GREEN, cell)
            c.text(x + 106, y + 20, "b", mono=True, size=MIN_FONT)
        else:
            c.text(x, y + 18, "nothing", size=MIN_FONT)
        # SHARDED: the boxes of w and b this rank's shard covers
        x = cols[1] + 56
        _grid(c, x, y, SHAPES["w"], lambda k, r=r: BLUE if _flat_owner("w", k) == r else None, cell)
        c.text(x + 42, y + 20, "w", mono=True, size=MIN_FONT)
        _grid(c, x + 64, y + 10, SHAPES["b"], lambda k, r=r: GREEN if _flat_owner("b", k) == r else None, cell)
        c.text(x + 106, y + 20, "b", mono=True, size=MIN_FONT)
        # LOCAL: the flat shard, elements [12r, 12r + 12)
        x = cols[2] + 56
        for k in range(SHARD):
            e = r * SHARD + k
            name = next((p for p in SHAPES if OFFSETS[p] <= e < OFFSETS[p] + _numel(SHAPES[p])), None)
            c.rect(x + k * 11, y + 8, 11, 14, fill=fill[name] if name else GRAY, width=0.8, rx=0)
        c.text(x, y + 40, "flat_param_0", mono=True, size=MIN_FONT)
    y = top + N * row_h + 6
    notes = [["one all_gather per unit,", "into one file: torch.save"], ["no collective, no copy;", "loads at any N (DCP)"],
             ["no collective; loads only", "at the same N and wrapping"]]
    for x, lines in zip(cols, notes):
        for i, s in enumerate(lines):
            c.text(x, y + 14 + 18 * i, s, size=MIN_FONT)
    y += 66
    x = swatch(c, 10, y, BLUE, "w") + 16
    x = swatch(c, x, y, GREEN, "b") + 16
    x = swatch(c, x, y, GRAY, "padding and gaps") + 16
    swatch(c, x, y, "none", "held by another rank")
    return c


def checkpoint_atomic() -> Canvas:
    c = Canvas("checkpoint_atomic", 348, "An atomic save: written aside, renamed into place once every rank is done",
               "Five steps of checkpoint.save, top to bottom, beside what is on disk after each and what a crash "
               "there leaves. 1: every rank writes its own data file into <name>.partial, and the coordinator the "
               ".metadata; a crash leaves a .partial without .metadata and the old checkpoint untouched. 2: a "
               "barrier: every rank has finished. 3: rank 0 renames the old checkpoint to <name>.old. 4: it renames "
               "<name>.partial to <name>; a crash between 3 and 4 leaves <name>.old, which load finds, with a "
               "warning. 5: it deletes <name>.old.")
    steps = [("1", "every rank: dcp.save", "into <name>.partial/", ["<name>.partial: writing",
                                                                    "<name>: the old one"], "<name> untouched"),
             ("2", "barrier", "every rank is done", ["<name>.partial: complete", "<name>: the old one"],
              "<name> untouched"),
             ("3", "rank 0: rename", "<name> → <name>.old", ["<name>.partial: complete", "<name>.old"],
              "load takes <name>.old"),
             ("4", "rank 0: rename", "<name>.partial → <name>", ["<name>: the new one", "<name>.old"],
              "the new one loads"),
             ("5", "rank 0: delete", "<name>.old", ["<name>: the new one"], "the new one loads")]
    c.text(10, 18, "checkpoint.save", bold=True, mono=True, size=MIN_FONT)
    c.text(250, 18, "on disk after it", bold=True, size=MIN_FONT)
    c.text(478, 18, "a crash here leaves", bold=True, size=MIN_FONT)
    y = 30
    for n, what, detail, disk, crash in steps:
        c.box(10, y, 26, 44, n, GRAY, size=MIN_FONT, bold=True)
        c.text(46, y + 18, what, size=MIN_FONT, mono=what.startswith("every rank: dcp") or what == "barrier")
        c.text(46, y + 36, detail, size=MIN_FONT, mono="<name>" in detail)
        for i, s in enumerate(disk):
            new = "new" in s or "partial" in s
            c.box(250, y + 1 + i * 22, 200, 20, s, BLUE if new else GRAY, size=MIN_FONT)
        c.text(478, y + 18, crash, size=MIN_FONT)
        y += 56
    c.text(10, y + 14, "A load checks the .metadata first (unpickled with an allow-list), then every name and shape,",
           size=MIN_FONT)
    c.text(10, y + 32, "and refuses, naming every problem, before it writes a byte.", size=MIN_FONT)
    return c


DIAGRAMS = (checkpoint_layouts, checkpoint_boxes, checkpoint_state_dicts, checkpoint_atomic)
