"""The site on a phone: tables that read as cards, figures whose text stays legible.

A page is about 360 px wide on a phone. A table of five or six columns cannot fit there, and a chart scaled
down to it draws its labels at 5 px. This hook prepares both for css/narrow.css, which restyles them under
material's own phone breakpoint only; on a wider screen the page is drawn exactly as before.

Tables. Each data cell gets data-label, the plain text of its column's header (its TeX source where the
header holds a formula: KaTeX typesets in the browser, after the build), and a table of three columns or
more is marked data-cards. On a phone such a table becomes a stack of cards, one per row: the row's first
cell is the card's title, and every other cell shows its column's name before its value. A table without a
header row is left alone; so are the code listings' line-number tables (they carry a class). A table of
two columns stays a table: it reads as well, and fits. A card table's style sets --card-label, the width of
its column of labels: as wide as its longest label, within limits.

On a desktop, a table that names files in code (`minifsdp/ddp/ddp.py`) is marked data-paths: css/tables.css
keeps its code from breaking inside a word, so a path wraps after a slash, never as "minifsdp/ddp/d" over
"dp.py" (material lets code break anywhere, and a table then squeezes such a column to a few letters).

Figures. Each content image gets --min-legible, the narrowest width at which its smallest text is drawn at
MIN_TEXT_PX CSS px (and a little more): for an SVG, its smallest font-size against its viewBox's width; for
a PNG (the notebooks' plots, inlined as data: URIs), 10 pt (matplotlib's smallest default, or the size the
PNG records) at the dpi of its pHYs chunk. On a phone the image is kept at least that wide and its frame
pans sideways, rather than the whole figure shrinking to the column. This is how tests/test_site_browser.py
judges a figure's text, from the same inputs.
"""

from __future__ import annotations

import base64
import html
import math
import posixpath
import re
import struct
from pathlib import Path

MIN_TEXT_PX = 40 / 3  # the smallest text a figure may draw on the screen: 10 pt, in CSS px
MARGIN = 1.04        # a little above the limit: subpixel rounding must not put a label at 9.99 px
DEFAULT_MIN_FONT_PT = 10  # matplotlib's smallest default text; a PNG made by minifsdp/reports records its own
MIN_FONT_KEY, DPI_KEY = "minifsdp min font pt", "minifsdp dpi"
CARD_MIN_COLUMNS = 3
LABEL_MIN_CH, LABEL_MAX_CH = 16, 26  # a card's column of labels: a longer label wraps, within these bounds
CARD_CH = 36         # about what a card holds on one line on a 390 px screen, label and value


# -- tables ----------------------------------------------------------------------------------------------------

_TABLE_TAG = re.compile(r"<(/?)table\b([^>]*)>", re.IGNORECASE)
_PART = re.compile(r"<(/?)(thead|tbody|tfoot|tr|th|td)\b([^>]*)>", re.IGNORECASE)
_SPAN = re.compile(r"""\b(colspan|rowspan)\s*=\s*["']?(\d+)""", re.IGNORECASE)
_TAGS = re.compile(r"<[^>]*>")
_TEX = {r"\Psi": "Ψ", r"\psi": "ψ", r"\times": "×", r"\cdot": "·", r"\to": "→", r"\le": "≤", r"\ge": "≥",
        r"\alpha": "α", r"\beta": "β", r"\gamma": "γ", r"\Phi": "Φ", r"\phi": "φ", r"\sum": "Σ",
        r"\approx": "≈"}


def _plain(fragment: str) -> str:
    """A cell's text as a label: tags stripped, entities decoded, a formula's TeX made readable."""
    text = html.unescape(_TAGS.sub(" ", fragment))
    text = re.sub(r"\\[()\[\]]", "", text)  # arithmatex's \( \) and \[ \]
    for tex, char in _TEX.items():
        text = re.sub(re.escape(tex) + r"(?![A-Za-z])", char, text)
    text = re.sub(r"\\(?:mathrm|text|mathbf|operatorname)\b", "", text).replace("{", "").replace("}", "")
    text = text.replace("¶", "")  # a permalink's mark, should a header hold one
    return re.sub(r"\s+", " ", text).strip()


def _table_spans(page_html: str) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, end, the tables nested in it) of each outermost <table>...</table>."""
    spans, stack = [], []
    for m in _TABLE_TAG.finditer(page_html):
        if not m.group(1):
            stack.append(m.start())
        elif stack:
            start = stack.pop()
            spans.append((start, m.end(), len(stack)))
    return [(s, e, [(s2, e2) for s2, e2, d2 in spans if d2 > 0 and s < s2 < e])
            for s, e, depth in spans if depth == 0]


def _rows(page_html: str, start: int, end: int, nested: list[tuple[int, int]]):
    """The table's rows: (section, [cell]) where a cell is a dict with its tag, where its start tag closes,
    its spans and its text."""
    tokens = [m for m in _PART.finditer(page_html, start, end)
              if not any(s <= m.start() < e for s, e in nested)]
    rows, section, row, cell = [], "", None, None

    def close_cell(at: int):
        nonlocal cell
        if cell is not None:
            cell["text"] = _plain(page_html[cell["content"]:at])
            cell = None

    for k, m in enumerate(tokens):
        closing, tag = bool(m.group(1)), m.group(2).lower()
        if tag in ("th", "td"):
            close_cell(m.start())
            if not closing:
                spans = {a.lower(): int(v) for a, v in _SPAN.findall(m.group(3))}
                cell = {"tag": tag, "attrs": m.group(3), "insert": m.end() - 1, "content": m.end(),
                        "colspan": max(1, spans.get("colspan", 1)), "rowspan": max(1, spans.get("rowspan", 1))}
                if row is None:  # a cell outside any <tr>: not a table this hook understands
                    return []
                row.append(cell)
        elif tag == "tr":
            close_cell(m.start())
            if not closing:
                row = []
                rows.append((section, row))
            else:
                row = None
        else:
            close_cell(m.start())
            section = "" if closing else tag
    close_cell(end)
    return rows


def _place(rows: list[list[dict]]) -> list[list[tuple[int, dict]]]:
    """Each row's cells with the column each one starts in, rowspans and colspans taken into account."""
    taken: dict[int, int] = {}  # column -> rows it stays taken for, counting this one
    out = []
    for cells in rows:
        placed, col = [], 0
        for cell in cells:
            while taken.get(col, 0) > 0:
                col += 1
            placed.append((col, cell))
            for c in range(col, col + cell["colspan"]):
                taken[c] = max(taken.get(c, 0), cell["rowspan"])
            col += cell["colspan"]
        taken = {c: n - 1 for c, n in taken.items() if n > 1}
        out.append(placed)
    return out


def label_tables(page_html: str) -> str:
    """The page with data-label on every data cell of every table that has a header row, and data-cards on
    those of CARD_MIN_COLUMNS columns or more."""
    inserts: list[tuple[int, str]] = []
    for start, end, nested in _table_spans(page_html):
        open_tag = page_html[start:page_html.index(">", start) + 1]
        classes = re.search(r"""\bclass\s*=\s*["']([^"']*)""", open_tag)
        if classes and "dataframe" not in classes.group(1).split():
            continue  # a code listing's line numbers, or a table styled on purpose
        rows = _rows(page_html, start, end, nested)
        if not rows:
            continue
        head = [cells for section, cells in rows if section == "thead"]
        if not head:  # else the leading rows made of <th> alone
            for section, cells in rows:
                if cells and all(c["tag"] == "th" for c in cells) and section != "tbody":
                    head.append(cells)
                else:
                    break
        body = [cells for section, cells in rows[len(head):] if section != "thead"] if head else []
        if not head or not body:
            continue
        labels: dict[int, list[str]] = {}
        for placed in _place(head):
            for col, cell in placed:
                for c in range(col, col + cell["colspan"]):
                    if cell["text"] and cell["text"] not in labels.setdefault(c, []):
                        labels[c].append(cell["text"])
        columns = max(col + cell["colspan"] for placed in _place(head + body) for col, cell in placed)
        for placed in _place(body):
            for col, cell in placed:
                label = " / ".join(labels.get(col, []))
                if label and "data-label" not in cell["attrs"]:
                    inserts.append((cell["insert"], f' data-label="{html.escape(label, quote=True)}"'))
        if columns >= CARD_MIN_COLUMNS and "data-cards" not in open_tag:
            # the column of labels as wide as its longest label, within limits that leave the values room:
            # wider where the values are short (numbers), narrower where they are sentences
            longest = max((len(" / ".join(labels.get(c, []))) for c in range(1, columns)), default=0)
            texts = [cell["text"] for placed in _place(body) for col, cell in placed if col > 0]
            values = sorted(len(text) for text in texts)
            typical = values[len(values) // 2] if values else 0
            word = min(max((len(w) for text in texts for w in text.split()), default=0), 20)
            most = min(LABEL_MAX_CH, max(LABEL_MIN_CH, CARD_CH - max(typical, word + 2)))
            width = min(max(longest, 3), most) + 1
            style = "" if re.search(r"\bstyle\s*=", open_tag, re.IGNORECASE) else f' style="--card-label: {width}ch"'
            inserts.append((start + len("<table"), " data-cards" + style))
    for at, text in sorted(inserts, reverse=True):
        page_html = page_html[:at] + text + page_html[at:]
    return page_html


_CODE = re.compile(r"<code\b[^>]*>([^<]*)</code>", re.IGNORECASE)
_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+\.\w+$")  # a file named with its directory: minifsdp/ddp/ddp.py


def mark_path_tables(page_html: str) -> str:
    """The page with data-paths on each outermost table whose code names a file by its path."""
    inserts = []
    for start, end, _ in _table_spans(page_html):
        open_tag = page_html[start:page_html.index(">", start) + 1]
        if "data-paths" in open_tag or re.search(r"""\bclass\s*=""", open_tag):
            continue  # a code listing's line numbers, or a table styled on purpose
        if any(_PATH.match(html.unescape(code).strip()) for code in _CODE.findall(page_html, start, end)):
            inserts.append(start + len("<table"))
    for at in sorted(inserts, reverse=True):
        page_html = page_html[:at] + " data-paths" + page_html[at:]
    return page_html


# -- figures ---------------------------------------------------------------------------------------------------

_IMG = re.compile(r"<img\b[^>]*>", re.IGNORECASE)
_SRC = re.compile(r"""\bsrc\s*=\s*(["'])(.*?)\1""", re.IGNORECASE | re.DOTALL)


def svg_text(text: str) -> tuple[float | None, float | None]:
    """An SVG's smallest font size and its own width, both in its user units (None: no text / no size)."""
    to_units = {"px": 1.0, "pt": 4 / 3, "": 1.0}
    sizes = [float(v) * to_units[u] for v, u in re.findall(r"font-size\s*[:=]\s*[\"']?\s*([\d.]+)\s*(px|pt|)", text)]
    sizes += [float(v) * to_units[u] for v, u in re.findall(r"font\s*:\s*(?:[a-z-]+\s+)*([\d.]+)(px|pt)", text)]
    smallest = min(sizes) if sizes else (16.0 if "<text" in text else None)
    m = re.search(r"<svg\b[^>]*?\bviewBox\s*=\s*[\"'][-\d.]+[\s,]+[-\d.]+[\s,]+([\d.]+)", text)
    if m:
        return smallest, float(m.group(1))
    m = re.search(r"<svg\b[^>]*?\bwidth\s*=\s*[\"']([\d.]+)(px|pt|)[\"']", text)
    return smallest, (float(m.group(1)) * to_units[m.group(2)] if m else None)


def png_info(data: bytes) -> tuple[int | None, float | None, dict[str, str]]:
    """A PNG's width in pixels, its dpi (pHYs, where matplotlib writes the savefig dpi) and its text chunks."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None, None, {}
    width, dpi, texts, i = None, None, {}, 8
    while i + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        if kind == b"IHDR":
            width = struct.unpack(">I", body[:4])[0]
        elif kind == b"pHYs":
            x, _, unit = struct.unpack(">IIB", body[:9])
            dpi = x * 0.0254 if unit == 1 else None
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"IDAT":
            break
        i += 12 + n
    return width, dpi, texts


def min_legible_width(data: bytes, is_svg: bool) -> int | None:
    """The narrowest width, in CSS px, at which the image's smallest text is MIN_TEXT_PX; None where its
    text size cannot be told."""
    if is_svg:
        smallest, own_width = svg_text(data.decode("utf-8", "replace"))
        if not smallest or not own_width:
            return None
        width = MIN_TEXT_PX / smallest * own_width
    else:
        natural, dpi, texts = png_info(data)
        dpi = float(texts.get(DPI_KEY, dpi or 0)) or None
        if not natural or not dpi:
            return None
        points = float(texts.get(MIN_FONT_KEY, DEFAULT_MIN_FONT_PT))
        width = MIN_TEXT_PX / (points * dpi / 72) * natural
    return math.ceil(width * MARGIN)


def _image(src: str, page_url: str, docs_dir: Path) -> tuple[bytes | None, bool]:
    if src.startswith("data:"):
        header, _, payload = src.partition(",")
        kind = header[5:].split(";")[0]
        data = base64.b64decode(payload) if ";base64" in header else payload.encode()
        return data, "svg" in kind
    if re.match(r"^[a-z]+:|^//", src, re.IGNORECASE):
        return None, False
    path = src.split("#")[0].split("?")[0]
    base = page_url if page_url.endswith("/") or not page_url else posixpath.dirname(page_url) + "/"
    rel = posixpath.normpath(posixpath.join(base, path)) if not path.startswith("/") else path.lstrip("/")
    file = docs_dir / rel
    if rel.startswith("..") or not file.is_file():
        return None, False
    return file.read_bytes(), file.suffix.lower() == ".svg"


def size_figures(page_html: str, page_url: str, docs_dir: Path) -> str:
    """The page with style="--min-legible: Wpx" on each image whose smallest text can be told."""
    def one(m: re.Match) -> str:
        tag = m.group(0)
        src = _SRC.search(tag)
        if not src or "--min-legible" in tag:
            return tag
        data, is_svg = _image(html.unescape(src.group(2)), page_url, docs_dir)
        width = min_legible_width(data, is_svg) if data else None
        if width is None:
            return tag
        style = re.search(r"""\bstyle\s*=\s*(["'])(.*?)\1""", tag, re.IGNORECASE | re.DOTALL)
        if style:
            rule = style.group(2).rstrip().rstrip(";")
            merged = (f"{rule}; " if rule else "") + f"--min-legible: {width}px"
            return tag[:style.start(2)] + merged + tag[style.end(2):]
        return tag[:4] + f' style="--min-legible: {width}px"' + tag[4:]

    return _IMG.sub(one, page_html)


# -- the mkdocs event ------------------------------------------------------------------------------------------

def on_page_content(html_text, page, config, files, **kwargs):
    docs_dir = Path(config["docs_dir"])
    html_text = size_figures(html_text, page.url, docs_dir)
    return mark_path_tables(label_tables(html_text))
