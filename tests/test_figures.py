"""Every figure a page shows can be read in the docs' content column, in both colour schemes, from the file alone.

The rule. The site's content column is COLUMN_PX (690 CSS px) wide on a desktop, and material draws an image at
its natural width, or shrunk to the column (`max-width: 100%`), never wider. So a figure's smallest text on
the screen is

    drawn px = smallest text at natural size (CSS px) x min(1, COLUMN_PX / natural width (CSS px))

and it must be at least MIN_DRAWN_PX, 13 CSS px: the diagrams' smallest text (chapters/diagrams/
make_diagrams.py), and 10 pt (13.3 px) as a chart draws it at 1:1, less rounding. The sizes come from the file:

- SVG: natural width is the root's `width` (pt x 4/3, px or no unit x 1); the smallest text is the smallest
  font-size in the file, in user units, times width / viewBox width.
- PNG: natural width is its width in pixels (a browser draws one pixel per CSS px, whatever the dpi); the
  smallest text is `min font pt` x `dpi` / 72 pixels, both read from the PNG's text chunks, which
  minifsdp/reports/style.py's save() writes (a PNG without them fails: its text size cannot be told).

Also: no figure is more than MAX_NATURAL_PX (1,400 px) wide, so none is a strip the page would shrink to a
sliver, nor a PNG so large it only costs bandwidth. And the charts (figures/*.svg, made by `make figures` in the
style of minifsdp/reports/style.py) keep their text as text (svg.fonttype none), carry no date (so drawing the
same data twice writes the same file), have a transparent background, and colour their text from the style's
palette, which reads on white and on material's slate: the dark-mode check.

Nothing is drawn here: the test reads the committed files, in well under a second.
"""

from __future__ import annotations

import importlib.util
import re
import struct
import zlib
from pathlib import Path
from xml.etree import ElementTree

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_style():
    """minifsdp/reports/style.py on its own (it imports nothing from the package): no torch to import."""
    spec = importlib.util.spec_from_file_location("_figure_style", REPO / "minifsdp" / "reports" / "style.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


style = _load_style()
CHAPTERS = REPO / "chapters"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
COLUMN_PX = 690.0
MIN_DRAWN_PX = 13.0
MAX_NATURAL_PX = 1400.0
CSS_PX = {"pt": 4 / 3, "px": 1.0, "": 1.0, "in": 96.0}
SVG_NS = "{http://www.w3.org/2000/svg}"


def shown_figures() -> dict[Path, list[str]]:
    """Every image file a chapter page shows, with the pages that show it."""
    out: dict[Path, list[str]] = {}
    for page in sorted(CHAPTERS.glob("*.md")):
        for src in IMAGE.findall(page.read_text(encoding="utf-8")):
            if not src.startswith(("http://", "https://", "data:")):
                out.setdefault((page.parent / src).resolve(), []).append(page.name)
    return out


FIGURES = shown_figures()


def _length(value: str) -> float:
    m = re.fullmatch(r"\s*([\d.]+)\s*(pt|px|in|)\s*", value)
    assert m, f"an SVG length this test cannot read: {value!r}"
    return float(m.group(1)) * CSS_PX[m.group(2)]


def svg_sizes(text: str) -> tuple[float, float]:
    """(natural width, smallest text at natural size), both in CSS px."""
    root = ElementTree.fromstring(text)
    view = [float(v) for v in re.split(r"[\s,]+", root.get("viewBox", "").strip())] if root.get("viewBox") else None
    width = _length(root.get("width")) if root.get("width") else view[2]
    per_unit = width / view[2] if view else 1.0
    sizes = [float(v) * CSS_PX[u] for v, u in re.findall(r"font-size\s*[:=]\s*[\"']?\s*([\d.]+)\s*(pt|px|)", text)]
    sizes += [float(v) * CSS_PX[u] for v, u in re.findall(r"\bfont\s*:\s*(?:[a-z-]+\s+)*([\d.]+)(px|pt)", text)]
    if not sizes and root.find(f".//{SVG_NS}text") is not None:
        sizes = [16.0]  # text with no size set: the browser's default
    return width, (min(sizes) * per_unit if sizes else float("inf"))


def png_chunks(data: bytes) -> tuple[int, dict[str, str]]:
    """(width in pixels, the text chunks: tEXt, and zTXt / iTXt uncompressed) of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, texts, i = 0, {}, 8
    while i + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        if kind == b"IHDR":
            width = struct.unpack(">I", body[:4])[0]
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            texts[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")  # language
            _, _, value = rest.partition(b"\0")  # translated keyword
            texts[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode("utf-8")
        elif kind == b"IEND":
            break
        i += 12 + n
    return width, texts


def drawn_text_px(path: Path) -> tuple[float, float]:
    """(natural width, smallest text as drawn in the column), both in CSS px."""
    data = path.read_bytes()
    if path.suffix == ".svg":
        width, smallest = svg_sizes(data.decode("utf-8"))
    else:
        width, texts = png_chunks(data)
        missing = {style.MIN_FONT_KEY, style.DPI_KEY} - set(texts)
        assert not missing, f"{path.name} does not record {sorted(missing)}: save it with minifsdp.reports.style.save"
        smallest = float(texts[style.MIN_FONT_KEY]) * float(texts[style.DPI_KEY]) / 72
    return width, smallest * min(1.0, COLUMN_PX / width)


def test_the_pages_show_figures():
    assert len(FIGURES) >= 20 and any(p.suffix == ".svg" and p.parent.name == "figures" for p in FIGURES)


@pytest.mark.parametrize("path", sorted(FIGURES), ids=[p.name for p in sorted(FIGURES)])
def test_figure_is_legible_in_the_column(path):
    pages = ", ".join(FIGURES[path])
    assert path.is_file(), f"{pages} show {path.relative_to(REPO)}, which does not exist"
    assert path.suffix in (".svg", ".png"), f"{path.name} ({pages}): a figure is SVG, or PNG where SVG would be huge"
    width, drawn = drawn_text_px(path)
    assert width <= MAX_NATURAL_PX, f"{path.name} ({pages}) is {width:.0f} px wide, over {MAX_NATURAL_PX:.0f}"
    assert drawn >= MIN_DRAWN_PX - 1e-6, \
        f"{path.name} ({pages}): its smallest text is drawn {drawn:.1f} px in a {COLUMN_PX:.0f} px column, " \
        f"under {MIN_DRAWN_PX:g}"


CHARTS = sorted(p for p in FIGURES if p.parent == CHAPTERS / "figures" and p.suffix == ".svg")


@pytest.mark.parametrize("path", CHARTS, ids=[p.name for p in CHARTS])
def test_chart_reads_in_both_colour_schemes_and_is_reproducible(path):
    text = path.read_text(encoding="utf-8")
    assert "<text" in text and "DejaVuSans-" not in text, f"{path.name}: its text is drawn as paths, not text"
    assert "<dc:date>" not in text, f"{path.name} records a date: saved twice, it would differ"
    root = ElementTree.fromstring(text)
    background = next(g for g in root.iter(f"{SVG_NS}g") if g.get("id") == "patch_1")
    assert "fill: none" in next(background.iter(f"{SVG_NS}path")).get("style", ""), \
        f"{path.name} has an opaque background: a white box on the dark scheme"
    palette = {c.lower() for c in (style.MUTED, style.INK, *style.LINES.values(), *style.FILLS.values())}
    for t in root.iter(f"{SVG_NS}text"):
        fill = re.search(r"fill:\s*(#[0-9a-fA-F]{6})", t.get("style", ""))
        assert fill and fill.group(1).lower() in palette, \
            f"{path.name}: text {''.join(t.itertext())!r} is coloured {fill and fill.group(1)}, not from the palette"


def test_the_rule_on_made_up_files(tmp_path):
    """The arithmetic, on files whose answers are known."""
    chart = tmp_path / "c.svg"  # a 7 in chart with 10 pt text: 672 px wide, text 13.3 px, drawn 1:1
    chart.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="504pt" height="100pt" viewBox="0 0 504 100">'
                     '<text style="font-size: 10px">a</text></svg>')
    assert drawn_text_px(chart) == pytest.approx((672, 40 / 3))
    wide = tmp_path / "w.svg"  # 1380 px wide: shrunk by half, 16 px text drawn 8 px
    wide.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="1380" height="10">'
                    '<text font-size="16">a</text></svg>')
    assert drawn_text_px(wide) == pytest.approx((1380, 8))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2))
    ax.set_title("t", fontsize=12)
    ax.tick_params(labelsize=10)
    png = tmp_path / "f.png"
    style.save(fig, str(png))  # 1,344 px at 192 dpi: 10 pt is 26.7 px, drawn at 690/1344 of that
    assert drawn_text_px(png) == pytest.approx((1344, 10 * 192 / 72 * 690 / 1344))
    fig, ax = plt.subplots(figsize=(7, 2))
    ax.set_title("too small", fontsize=8)
    with pytest.raises(ValueError, match="under 10 pt"):
        style.save(fig, str(tmp_path / "g.svg"))


def test_the_tours_figure_fills_a_bar_for_every_category_it_names():
    """The tour's figure (chapters/figures/tour_memory.svg, `make figures`), the site's first chart, shows the
    ZeRO stages at N = 4: parameters, gradients and optimizer state each fill some bar (a bar of zero width is
    still drawn, so its width is what counts), and no legend entry names a category no bar shows."""
    root = ElementTree.fromstring((CHAPTERS / "figures" / "tour_memory.svg").read_text(encoding="utf-8"))
    shown = {"".join(t.itertext()).strip() for t in root.iter(f"{SVG_NS}text")}
    assert any("N = 4" in t for t in shown), "the tour's figure is not measured at N = 4"
    labels = {"parameters": "params", "gradients": "grads", "optimizer state": "optim",
              "activations, temporaries, buffers": "other"}  # minifsdp/reports/format.py's CATEGORY_LABELS
    named = {cat for label, cat in labels.items() if label in shown}
    assert {"params", "grads", "optim"} <= named, f"the legend names {sorted(named)}"
    for cat in named:
        widths = []
        for path in root.iter(f"{SVG_NS}path"):
            if f"fill: {style.CATEGORY[cat]}" in path.get("style", ""):
                xs = [float(x) for x in re.findall(r"([-\d.]+) [-\d.]+", path.get("d", ""))]
                widths.append(max(xs) - min(xs))
        drawn = [w for w in widths if w > 0.5]
        assert len(drawn) >= 2, f"{cat}: named in the legend, but no bar shows it ({len(widths)} paths, widths {widths})"
