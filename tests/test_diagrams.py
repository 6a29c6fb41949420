"""The chapters' conceptual diagrams (chapters/diagrams/make_diagrams.py, `make diagrams`).

- The committed SVGs are exactly what the script draws now, one per diagram and no others: no stale picture.
  The script runs with `python -I -S`, so it needs nothing but the standard library.
- Each is well-formed XML, 680 wide with a matching viewBox, and accessible: role="img", a <title> and a
  <desc> that aria-labelledby names.
- Each is legible at 100% and in both of material's colour schemes: no text under MIN_FONT (10 pt on the screen), none outside the
  picture (measured as the script measures it, in the widest likely font), only the script's palette, dark
  text only on filled boxes, and the palette's contrasts hold against white and against slate.
- What a diagram shows of the code (OSS's partition, the FlatParameter's layout, a flat shard's boxes, the
  1F1B order) is what the package computes, and the names it uses exist in the package.
"""

import colorsys
import importlib.util
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "chapters" / "diagrams" / "make_diagrams.py"
COMMITTED = REPO / "chapters" / "figures" / "diagrams"
NS = "{http://www.w3.org/2000/svg}"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_diagrams", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


md = _load_script()
NAMES = sorted(md.DIAGRAMS)


def _svg(name: str) -> ET.Element:
    return ET.parse(COMMITTED / f"{name}.svg").getroot()


# -- committed as drawn -------------------------------------------------------------------------------------------
def test_the_committed_diagrams_are_what_the_script_draws(tmp_path):
    paths = [tmp_path / f"{name}.svg" for name in NAMES]
    out = subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), *map(str, paths)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    committed = sorted(p.stem for p in COMMITTED.glob("*.svg"))
    assert committed == NAMES, f"chapters/figures/diagrams/ holds {committed}, the script draws {NAMES}: " \
                               "run `make diagrams` (and delete what it no longer draws)"
    for name, path in zip(NAMES, paths):
        assert path.read_text(encoding="utf-8") == (COMMITTED / f"{name}.svg").read_text(encoding="utf-8"), \
            f"chapters/figures/diagrams/{name}.svg is stale: run `make diagrams`"


def test_every_diagram_is_shown_by_a_chapter():
    pages = "".join(p.read_text(encoding="utf-8") for p in (REPO / "chapters").glob("*.md"))
    for name in NAMES:
        assert f"](figures/diagrams/{name}.svg)" in pages, f"no chapter shows {name}.svg"


def test_an_unknown_diagram_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a diagram"):
        md.main([str(tmp_path / "no_such_diagram.svg")])


# -- well-formed and accessible -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_well_formed_sized_and_accessible(name):
    root = _svg(name)
    assert root.tag == f"{NS}svg"
    height = int(root.get("height"))
    assert root.get("viewBox") == f"0 0 680 {height}" and root.get("width") == "680", \
        "drawn for the content column: 680 wide, shown at 1:1 on a desktop"
    assert 100 <= height <= 600
    assert root.get("role") == "img"
    title, desc = root[0], root[1]
    assert title.tag == f"{NS}title" and desc.tag == f"{NS}desc"
    assert len(title.text.strip()) > 20 and len(desc.text.strip()) > 150, "say what the picture shows"
    assert root.get("aria-labelledby").split() == [title.get("id"), desc.get("id")]
    text = (COMMITTED / f"{name}.svg").read_text(encoding="utf-8")
    for forbidden in ("<script", "<image", "href=\"http", "currentColor", "@import", "<foreignObject"):
        assert forbidden not in text, f"{name}.svg contains {forbidden}"


# -- legible, in both colour schemes ------------------------------------------------------------------------------
def _boxes(root):
    """The filled rectangles, as (x0, y0, x1, y1)."""
    return [(float(r.get("x")), float(r.get("y")), float(r.get("x")) + float(r.get("width")),
             float(r.get("y")) + float(r.get("height")))
            for r in root.iter(f"{NS}rect") if r.get("fill") not in ("none", None)]


@pytest.mark.parametrize("name", NAMES)
def test_text_is_large_enough_inside_the_picture_and_readable_where_it_sits(name):
    root = _svg(name)
    height, filled = int(root.get("height")), _boxes(root)
    texts = list(root.iter(f"{NS}text"))
    assert texts
    for t in texts:
        size = float(t.get("font-size"))
        assert size >= md.MIN_FONT >= 40 / 3, f"{name}: {t.text!r} at {size}"
        width = md.text_width(t.text, size, mono=t.get("font-family") is not None, bold=t.get("font-weight") == "bold")
        x, y = float(t.get("x")), float(t.get("y"))
        left = x - {"start": 0, "middle": width / 2, "end": width}[t.get("text-anchor", "start")]
        top, bottom = y - 0.8 * size, y + 0.25 * size
        assert 0 <= left and left + width <= 680 and 0 <= top and bottom <= height, f"{name}: {t.text!r} sticks out"
        assert t.get("fill") in (md.INK, md.MUTED), f"{name}: {t.text!r} in {t.get('fill')}"
        if t.get("fill") == md.INK:  # near-black text only on a filled box: on slate it would not read
            assert any(x0 <= left and left + width <= x1 and y0 <= top and bottom <= y1 + 1
                       for x0, y0, x1, y1 in filled), f"{name}: {t.text!r} is dark text outside a filled box"


@pytest.mark.parametrize("name", NAMES)
def test_only_the_palette(name):
    palette = {md.INK, md.MUTED, *md.FILLS, "none"}
    for element in _svg(name).iter():
        for attribute in ("fill", "stroke"):
            value = element.get(attribute)
            assert value is None or value in palette, f"{name}: {element.tag} {attribute}={value}"


def test_the_palette_reads_on_white_and_on_slate():
    r, g, b = colorsys.hls_to_rgb(225 / 360, 0.14, 0.15)  # material's slate: hsla(225, 15%, 14%)
    assert md.SLATE == "#{:02x}{:02x}{:02x}".format(*(round(v * 255) for v in (r, g, b)))
    for background in (md.WHITE, md.SLATE):
        assert md.contrast(md.MUTED, background) >= 4.0, "grey text and lines on the page, in either scheme"
    for fill in md.FILLS:
        assert md.contrast(md.INK, fill) >= 7, f"dark text on {fill}"
        assert md.contrast(fill, md.SLATE) >= 6, f"{fill} stands out on slate"
        assert md.contrast(fill, md.WHITE) >= 1.5, f"{fill} stands out on white (with its grey outline)"


# -- what the diagrams show is what the code computes -------------------------------------------------------------
def _exercise(call, exercise):
    try:
        return call()
    except NotImplementedError:
        pytest.skip(f"exercise {exercise} is not written yet")


def test_oss_partition_is_partition_parameters():
    pytest.importorskip("torch")
    from minifsdp.models import TinyGPT
    from minifsdp.zero.oss import partition_parameters

    model = TinyGPT()
    names = {p: n for n, p in model.named_parameters()}
    parts = _exercise(lambda: partition_parameters([{"params": list(model.parameters())}], md.PARTITION_N), "3.1")
    owner = {p: r for r, groups in enumerate(parts) for group in groups for p in group["params"]}
    placed = sorted(model.parameters(), key=lambda p: p.numel(), reverse=True)  # the order the page describes
    k = len(md.PARTITION_MATRICES)
    assert [(names[p], p.numel(), owner[p]) for p in placed[:k]] == md.PARTITION_MATRICES
    assert all(p.dim() == 2 for p in placed[:k]) and all(p.dim() == 1 for p in placed[k:])
    assert len(placed) - k == md.PARTITION_VECTORS
    assert [sum(p.numel() for group in groups for p in group["params"]) for groups in parts] == md.PARTITION_TOTALS


def test_flat_parameter_layout_is_flat_layout():
    pytest.importorskip("torch")
    from minifsdp.fsdp.flat_param import ALIGN_BYTES
    from minifsdp.zero.flat import flat_layout

    numels = [math.prod(shape) for _, shape in md.FLAT_PARAMS]
    assert flat_layout(numels, md.FLAT_N, ALIGN_BYTES // 4) == (md.FLAT_OFFSETS, md.FLAT_PADDED)


def test_checkpoint_boxes_are_flat_chunks_boxes():
    pytest.importorskip("torch")
    from minifsdp.checkpoint.flat_chunks import flat_start
    from minifsdp.reports.checkpoints import reshard_boxes

    shapes = [shape for _, shape in md.RESHARD_SHAPES]
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    for n in (md.RESHARD_SAVED, md.RESHARD_LOADED):
        expected = _exercise(lambda: reshard_boxes(shapes, n), "10.1")
        drawn = md.RESHARD_BOXES[n]
        for i, (name, shape) in enumerate(md.RESHARD_SHAPES):
            mine = [(rank, off, size) for rank, tensor, off, size, _, _ in drawn if tensor == name]
            assert mine == [(q, tuple(o), tuple(s)) for q, o, s in expected[i]], (n, name)
        for rank, tensor, off, size, start, end in drawn:
            i = [name for name, _ in md.RESHARD_SHAPES].index(tensor)
            assert start == offsets[i] + flat_start(shapes[i], off) and end == start + math.prod(size)


def test_pipeline_order_and_times_are_the_schedules():
    pytest.importorskip("torch")
    from minifsdp.measure.pipeline_timeline import simulate
    from minifsdp.parallel.pipeline_orders import one_f_one_b_order

    p, m = md.PIPELINE_P, md.PIPELINE_M
    orders = _exercise(lambda: [one_f_one_b_order(r, p, m) for r in range(p)], "12.2")
    assert [" ".join(f"{a.kind}{a.microbatch}" for a in order) for order in orders] == md.PIPELINE_1F1B
    ideal = simulate(orders, 1, 2)
    assert [[(s.name.split()[0], s.start, s.end) for s in row] for row in ideal] == md.pipeline_spans(md.PIPELINE_1F1B)


def test_backward_prefetch_model_follows_the_page():
    """Chapter 7's table: where unit i-1's all-gather sits on the channel, and how many full buffers."""
    for mode, ahead in ((None, False), ("BACKWARD_POST", True), ("BACKWARD_PRE", True)):
        _, channel = md._backward_timeline(mode)
        order = [(kind, unit) for kind, unit, _, _ in channel]
        assert (order.index(("AG", 2)) < order.index(("RS", 3))) == ahead, mode
    waits = [sum(e - s for kind, _, s, e in md._backward_timeline(mode)[0] if kind == "wait")
             for mode in (None, "BACKWARD_POST", "BACKWARD_PRE")]
    assert waits[0] > waits[1] > waits[2]


NAMES_USED = {  # file: names the diagrams take from it
    "minifsdp/distributed/comm.py": ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "host_to_device",
                                     "device_to_host"],
    "minifsdp/ddp/ddp.py": ["_on_grad_ready", "_launch", "_finish"],
    "minifsdp/fsdp/flat_param.py": ["unshard", "reshard", "_full", "shard_numel", "grad_for_optimizer"],
    "minifsdp/fsdp/precision.py": ["_cast_shard", "param_dtype", "reduce_dtype"],
    "minifsdp/fsdp/prefetch.py": ["BACKWARD_PRE", "BACKWARD_POST"],
    "minifsdp/mixed_precision.py": ["MixedPrecision", "CPUOffload", "offload_params"],
    "minifsdp/fsdp/checkpointing.py": ["checkpoint_module"],
    "minifsdp/distributed/mesh.py": ["init_mesh"],
    "minifsdp/parallel/tensor_parallel.py": ["ColumnParallelLinear", "RowParallelLinear"],
}


@pytest.mark.parametrize("path", sorted(NAMES_USED))
def test_the_names_the_diagrams_use_are_the_code_s(path):
    source = (REPO / path).read_text(encoding="utf-8")
    drawn = "".join((COMMITTED / f"{name}.svg").read_text(encoding="utf-8") for name in NAMES)
    for name in NAMES_USED[path]:
        assert re.search(rf"\b{re.escape(name)}\b", source), f"{path} has no {name}"
        assert name in drawn, f"no diagram uses {name} any more: drop it from this list"


# -- chapter 5's newer pictures (chapters/diagrams/ch05_states.py) ------------------------------------------------
def _module_of(diagram: str):
    return sys.modules[md.DIAGRAMS[diagram].__module__]


def test_chapter_5_unit_states_and_block_are_the_package_s():
    pytest.importorskip("torch")
    from minifsdp.fsdp.flat_param import ALIGN_BYTES, ShardState
    from minifsdp.models import TinyGPT
    from minifsdp.zero.flat import flat_layout

    ch05 = _module_of("flat_param_states")
    numels = [math.prod(shape) for _, shape in ch05.UNIT_PARAMS]
    assert flat_layout(numels, ch05.UNIT_N, ALIGN_BYTES // ch05.UNIT_BYTES) == (ch05.UNIT_OFFSETS, ch05.UNIT_PADDED)
    assert ch05.UNIT_PARAMS == md.FLAT_PARAMS and ch05.UNIT_N == md.FLAT_N, "the unit of flat_parameter.svg"
    assert ch05.STATES == [(s.name, s.value) for s in ShardState]
    block = TinyGPT().blocks[0]
    assert ch05.BLOCK == [(name, p.numel()) for name, p in block.named_parameters()]


@pytest.mark.parametrize("path,names", [
    ("minifsdp/fsdp/flat_param.py", ["unshard", "wait_for_unshard", "reshard", "reduce_scatter_grad",
                                     "grad_for_optimizer", "_alloc_storage", "_full", "all_gather"]),
])
def test_the_names_the_chapter_5_diagrams_use_are_the_code_s(path, names):
    source = (REPO / path).read_text(encoding="utf-8")
    drawn = "".join((COMMITTED / f"{name}.svg").read_text(encoding="utf-8")
                    for name in NAMES if md.DIAGRAMS[name].__module__ == "ch05_states")
    for name in names:
        assert re.search(rf"\b{re.escape(name)}\b", source), f"{path} has no {name}"
        assert name in drawn, f"no chapter 5 diagram uses {name} any more: drop it from this list"


# -- chapter 10's newer pictures (chapters/diagrams/ch10_checkpoints.py) ------------------------------------------
def test_chapter_10_layouts_and_boxes_are_the_package_s():
    pytest.importorskip("torch")
    import torch

    from minifsdp.checkpoint.flat_chunks import boxes
    from minifsdp.fsdp.flat_param import ALIGN_BYTES
    from minifsdp.zero.flat import flat_layout
    from minifsdp.zero.oss import partition_parameters

    ch10 = _module_of("checkpoint_layouts")
    names = list(ch10.SHAPES)
    numels = [math.prod(ch10.SHAPES[name]) for name in names]
    offsets, padded = flat_layout(numels, ch10.N, ALIGN_BYTES // 4)
    assert (dict(zip(names, offsets)), padded) == (ch10.OFFSETS, ch10.PADDED)
    # who holds which element of w: FSDP's (and a flat bucket's) chunk r is [r * shard, (r + 1) * shard)
    shard = padded // ch10.N
    w = names.index("w")
    for q in range(ch10.N):
        lo, hi = max(offsets[w], q * shard), min(offsets[w] + numels[w], (q + 1) * shard)
        drawn = [k for k in range(numels[w]) if ch10._flat_owner("w", k) == q]
        assert drawn == list(range(lo - offsets[w], hi - offsets[w])), q
    params = [torch.nn.Parameter(torch.zeros(ch10.SHAPES[name])) for name in names]
    parts = _exercise(lambda: partition_parameters([{"params": params}], ch10.N), "3.1")
    owner = {id(p): r for r, groups in enumerate(parts) for group in groups for p in group["params"]}
    assert {name: owner[id(p)] for name, p in zip(names, params)} == ch10.OSS_OWNER
    start, end = ch10.RANGE
    got = _exercise(lambda: boxes(ch10.RANGE_SHAPE, start, end), "10.1")
    assert [(tuple(o), tuple(s)) for o, s in got] == ch10.RANGE_BOXES
