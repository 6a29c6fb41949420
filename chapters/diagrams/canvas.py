"""The diagrams' canvas: sizes, colours, text measured before it is drawn, and the SVG it writes.

make_diagrams.py (its docstring says why these sizes and colours) and each chapter's module of diagrams
beside it (chNN_*.py) draw on it: `from canvas import *`.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

WIDTH = 680
MIN_FONT = 13.4  # 10 pt on the screen is 13.33 px: the smallest text, with a margin for rounding
SANS_FONT = "-apple-system, BlinkMacSystemFont, Helvetica, Arial, sans-serif"  # material's, with font: false
MONO_FONT = "SFMono-Regular, Consolas, Menlo, monospace"

# -- colours (see the module docstring) ---------------------------------------------------------------------------
WHITE, SLATE = "#ffffff", "#1e2129"   # material's backgrounds: default, and slate (hsl(225, 15%, 14%))
INK = "#15171c"                       # text inside filled boxes
MUTED = "#7b7f87"                     # text and lines on the page's background
BLUE, ORANGE, GREEN, PURPLE = "#86aee0", "#eeaa66", "#8fc98a", "#b89ddf"
RED, GRAY, YELLOW, TEAL = "#ec9a9a", "#b4bac4", "#e0c865", "#7cc7c2"
FILLS = (BLUE, ORANGE, GREEN, PURPLE, RED, GRAY, YELLOW, TEAL)
RANKS = (BLUE, ORANGE, GREEN, PURPLE)

# -- measuring text ------------------------------------------------------------------------------------------------
# Advance widths of DejaVu Sans and DejaVu Sans Bold, in hundredths of an em: ASCII 32..126, then EXTRA.
_SANS = [32, 40, 46, 84, 64, 95, 78, 27, 39, 39, 50, 84, 32, 36, 32, 34, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64,
         34, 34, 84, 84, 84, 53, 100, 68, 69, 70, 77, 63, 58, 77, 75, 29, 29, 66, 56, 86, 75, 79, 60, 79, 69, 63, 61,
         73, 68, 99, 69, 61, 69, 39, 34, 39, 84, 50, 50, 61, 63, 55, 63, 62, 35, 63, 63, 28, 28, 58, 28, 97, 63, 61,
         63, 63, 41, 52, 39, 63, 59, 82, 59, 59, 52, 64, 34, 64, 84,
         84, 84, 84, 84, 84, 84, 79, 32, 100, 63, 40, 68, 84, 84, 50, 100]
_BOLD = [35, 46, 52, 84, 70, 100, 87, 31, 46, 46, 52, 84, 38, 42, 38, 37, 70, 70, 70, 70, 70, 70, 70, 70, 70, 70,
         40, 40, 84, 84, 84, 58, 100, 77, 76, 73, 83, 68, 68, 82, 84, 37, 37, 77, 64, 100, 84, 85, 73, 85, 77, 72, 68,
         81, 77, 110, 77, 72, 73, 46, 37, 46, 84, 50, 50, 67, 72, 59, 72, 68, 44, 72, 71, 34, 34, 67, 34, 104, 71, 69,
         72, 72, 49, 60, 48, 71, 65, 92, 65, 65, 58, 71, 37, 71, 84,
         84, 84, 84, 84, 84, 84, 85, 38, 100, 68, 46, 77, 84, 84, 50, 100]
_EXTRA = "→←↑↓×−Ψ·…ΣₙΔ≥≤–—"


def text_width(s: str, size: float, mono: bool = False, bold: bool = False) -> float:
    """The width of `s` at font size `size`, in the widest likely font (unknown characters count one em)."""
    if mono:
        return len(s) * 0.61 * size
    table = _BOLD if bold else _SANS
    hundredths = 0
    for ch in s:
        if 32 <= ord(ch) < 127:
            hundredths += table[ord(ch) - 32]
        elif ch in _EXTRA:
            hundredths += table[95 + _EXTRA.index(ch)]
        else:
            hundredths += 100
    return hundredths / 100 * size


def luminance(colour: str) -> float:
    channels = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG's contrast ratio of two colours, 1 to 21."""
    low, high = sorted((luminance(a), luminance(b)))
    return (high + 0.05) / (low + 0.05)


def num(v: float) -> str:
    """A coordinate as short, stable text."""
    v = round(v, 1)
    return str(int(v)) if v == int(v) else str(v)


# -- the drawing helpers ------------------------------------------------------------------------------------------
class Canvas:
    """One SVG picture, WIDTH wide. Every helper checks that what it draws stays inside the picture."""

    def __init__(self, name: str, height: int, title: str, desc: str):
        self.name, self.height, self.title, self.desc = name, height, title, desc
        self.body: list[str] = []
        self.arrowheads: list[str] = []   # the colours arrows have been drawn in: one marker each

    def _inside(self, what: str, x0: float, y0: float, x1: float, y1: float) -> None:
        if x0 < -0.01 or y0 < -0.01 or x1 > WIDTH + 0.01 or y1 > self.height + 0.01:
            raise ValueError(f"{self.name}: {what} reaches outside the picture "
                             f"({x0:.0f}, {y0:.0f}) .. ({x1:.0f}, {y1:.0f}), picture {WIDTH} x {self.height}")

    def rect(self, x, y, w, h, fill="none", stroke=MUTED, width=1.0, dash=False, rx=2) -> None:
        self._inside("a box", x, y, x + w, y + h)
        extra = ' stroke-dasharray="4 3"' if dash else ""
        self.body.append(f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" rx="{num(rx)}" '
                         f'fill="{fill}" stroke="{stroke}" stroke-width="{num(width)}"{extra}/>')

    def text(self, x, y, s, size=14, anchor="start", colour=MUTED, mono=False, bold=False) -> float:
        """Text with its baseline at y; returns its width."""
        if size < MIN_FONT:
            raise ValueError(f"{self.name}: {s!r} at {size} is smaller than {MIN_FONT}")
        w = text_width(s, size, mono, bold)
        left = x - {"start": 0, "middle": w / 2, "end": w}[anchor]
        self._inside(f"the text {s!r}", left, y - 0.8 * size, left + w, y + 0.25 * size)
        attrs = f'x="{num(x)}" y="{num(y)}" font-size="{num(size)}" fill="{colour}"'
        if anchor != "start":
            attrs += f' text-anchor="{anchor}"'
        if mono:
            attrs += f' font-family="{MONO_FONT}"'
        if bold:
            attrs += ' font-weight="bold"'
        self.body.append(f"<text {attrs}>{escape(s)}</text>")
        return w

    def box(self, x, y, w, h, lines, fill, size=14, mono=False, bold=False, stroke=MUTED, width=1.0,
            dash=False, colour=INK, rx=2) -> None:
        """A filled box with lines of text centred in it. A line is a str, or (str, {options for text()})."""
        self.rect(x, y, w, h, fill=fill, stroke=stroke, width=width, dash=dash, rx=rx)
        lines = [line if isinstance(line, tuple) else (line, {}) for line in ([lines] if isinstance(lines, str)
                                                                               else lines) if line]
        specs = [(s, {"size": size, "mono": mono, "bold": bold, **opts}) for s, opts in lines]
        total = sum(1.2 * o["size"] for _, o in specs)
        if total > h + 0.01:
            raise ValueError(f"{self.name}: {len(specs)} lines do not fit a box {h} high")
        baseline = y + (h - total) / 2
        for s, o in specs:
            baseline += 1.2 * o["size"]
            if text_width(s, o["size"], o["mono"], o["bold"]) > w - 4:
                raise ValueError(f"{self.name}: {s!r} does not fit a box {w:.0f} wide")
            self.text(x + w / 2, baseline - 0.3 * o["size"], s, anchor="middle", colour=colour, **o)

    def line(self, x1, y1, x2, y2, colour=MUTED, width=1.5, dash=False, arrow=False) -> None:
        self.path(f"M{num(x1)},{num(y1)} L{num(x2)},{num(y2)}", colour=colour, width=width, dash=dash,
                  arrow=arrow, points=[(x1, y1), (x2, y2)])

    def path(self, d, points, colour=MUTED, width=1.5, dash=False, arrow=False, fill="none") -> None:
        """A path; `points` are its corners, checked to be inside the picture."""
        for px, py in points:
            self._inside("a line", px, py, px, py)
        extra = ' stroke-dasharray="4 3"' if dash else ""
        if arrow:
            if colour not in self.arrowheads:
                self.arrowheads.append(colour)
            extra += f' marker-end="url(#{self.name}-arrow-{colour[1:]})"'
        self.body.append(f'<path d="{d}" fill="{fill}" stroke="{colour}" stroke-width="{num(width)}"'
                         f' stroke-linejoin="round"{extra}/>')

    def svg(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{self.height}" '
                f'viewBox="0 0 {WIDTH} {self.height}" role="img" '
                f'aria-labelledby="{self.name}-title {self.name}-desc" font-family="{SANS_FONT}">')
        defs = "".join(f'<marker id="{self.name}-arrow-{c[1:]}" viewBox="0 0 10 10" refX="9" refY="5" '
                       f'markerWidth="9" markerHeight="9" markerUnits="userSpaceOnUse" orient="auto">'
                       f'<path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>' for c in self.arrowheads)
        return "\n".join([head,
                          f'<title id="{self.name}-title">{escape(self.title)}</title>',
                          f'<desc id="{self.name}-desc">{escape(self.desc)}</desc>',
                          f"<defs>{defs}</defs>" if defs else "<defs/>",
                          *self.body, "</svg>", ""])


def swatch(c: Canvas, x, y, fill, label, dash=False, size=MIN_FONT) -> float:
    """A legend entry: a small box and its label; returns the x after it."""
    c.rect(x, y - 11, 16, 14, fill=fill, dash=dash)
    return x + 22 + c.text(x + 22, y, label, size=size)


def bracket(c: Canvas, x, y0, y1, label_lines, size=MIN_FONT) -> None:
    """A bracket down the right of rows y0..y1, with its label to its right."""
    c.path(f"M{num(x)},{num(y0)} h6 V{num(y1)} h-6", points=[(x, y0), (x + 6, y1)])
    mid = (y0 + y1) / 2 - (len(label_lines) - 1) * 8
    for i, s in enumerate(label_lines):
        c.text(x + 12, mid + 5 + 16 * i, s, size=size)


# -- chapter 1 ----------------------------------------------------------------------------------------------------
