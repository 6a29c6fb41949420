"""One look for every chart the reports draw: sized for the docs' content column, legible in both of the
site's colour schemes, and saved as reproducible SVG.

    from minifsdp.reports import style

    @style.charts                      # the whole function runs under the style's rcParams
    def plot_something(data, path):
        fig, ax = style.figure(height=3.0)
        ...
        style.save(fig, path)          # .svg (text stays text) or .png; checks width and font sizes

Size. A figure is WIDTH_IN (7 in) wide: 504 pt, which a browser draws 672 CSS px wide, about 1:1 in the
content column of the site (650-690 px on a desktop). No text is smaller than MIN_FONT_PT (10 pt), so on
the page no label is drawn smaller than 10 pt (13 px). `save` refuses a figure that breaks either rule.
Small multiples are stacked vertically, never side by side in a strip that the page would shrink.

Dark mode. The pages show a figure with `<img>`, which does not follow material's palette toggle, so a
chart is drawn to read on both backgrounds, white and slate (#1e2129), as the diagrams of
chapters/diagrams/make_diagrams.py are, with the same colours: a transparent background; text, axes,
ticks and grid in one mid grey, MUTED (about 4:1 against both); areas filled with the diagrams' mid-tone
FILLS, and text inside them near-black, INK. Lines and markers use LINES, the same hues a step darker,
at least 2.2:1 on white and 4.8:1 on slate. The colours mean what they mean in the diagrams: parameters
blue, gradients orange, optimizer state green; all-gather blue, reduce-scatter orange, all-reduce purple;
forward blue, backward orange.

Files. SVG is the default (`svg.fonttype: none`, so the labels are text a reader can select and search;
a fixed `svg.hashsalt` and no date, so drawing the same data twice writes the same bytes). A PNG, for a
chart with too many marks for SVG, is saved at PNG_DPI (natural width 1,344 px, drawn at half size: sharp
on a high-density screen) and records that dpi and its smallest font size in its metadata (MIN_FONT_KEY,
DPI_KEY), which tests/test_figures.py reads to check legibility.
"""

from __future__ import annotations

import functools
import os

WIDTH_IN = 7.0              # 504 pt: 672 CSS px, the docs' content column
MIN_FONT_PT = 10.0          # the smallest text a chart may have
PNG_DPI = 192               # 7 in -> 1,344 px, drawn at about half size in the column
MIN_FONT_KEY, DPI_KEY = "minifsdp min font pt", "minifsdp dpi"   # PNG text chunks

# -- the diagrams' colours (chapters/diagrams/make_diagrams.py) -------------------------------------------------
MUTED = "#7b7f87"   # text, axes, ticks, grid: on the page's background, white or slate
INK = "#15171c"     # text and lines on top of a FILLS colour
HALO = "#eef0f3"    # a light edge that lets an INK mark stand out on the slate background too
FILLS = {"blue": "#86aee0", "orange": "#eeaa66", "green": "#8fc98a", "purple": "#b89ddf",
         "red": "#ec9a9a", "grey": "#b4bac4", "yellow": "#e0c865", "teal": "#7cc7c2"}
LINES = {"blue": "#5b8fd6", "orange": "#e08a3c", "green": "#5fae5a", "purple": "#9b7fd1",
         "red": "#d96b6b", "grey": "#9aa0aa", "yellow": "#c9a92e", "teal": "#3fa9a3"}

# what a colour means, in every chart
CATEGORY = {"params": FILLS["blue"], "grads": FILLS["orange"], "optim": FILLS["green"], "other": FILLS["grey"]}
COLLECTIVE = {"all_gather": FILLS["blue"], "reduce_scatter": FILLS["orange"], "all_reduce": FILLS["purple"],
              "broadcast": FILLS["teal"], "reduce": FILLS["red"], "object": FILLS["grey"]}

SANS = ["DejaVu Sans",  # first: bundled with matplotlib, so the layout is the same on every machine
        "-apple-system", "BlinkMacSystemFont", "Helvetica", "Arial", "sans-serif"]  # then the diagrams' fonts

RC = {
    "figure.figsize": (WIDTH_IN, 4.0),
    "figure.facecolor": "none", "axes.facecolor": "none",
    "savefig.facecolor": "none", "savefig.edgecolor": "none", "savefig.transparent": True,
    "figure.constrained_layout.use": True,
    "font.family": "sans-serif", "font.sans-serif": SANS, "font.size": 10,
    "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 10, "ytick.labelsize": 10,
    "legend.fontsize": 10, "legend.title_fontsize": 10, "figure.titlesize": 11,
    "text.color": MUTED, "axes.labelcolor": MUTED, "axes.titlecolor": MUTED, "axes.edgecolor": MUTED,
    "xtick.color": MUTED, "ytick.color": MUTED, "grid.color": MUTED, "grid.alpha": 0.35,
    "hatch.color": MUTED, "hatch.linewidth": 0.8,
    "axes.spines.top": False, "axes.spines.right": False,
    "legend.frameon": False, "lines.linewidth": 1.8,
    "svg.fonttype": "none", "svg.hashsalt": "minifsdp",
}


def charts(fn):
    """Decorator: run a plotting function under the style (RC), whatever the caller's rcParams; on the Agg
    backend, unless a notebook's own (module://...) is in use."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        import matplotlib

        if not matplotlib.get_backend().startswith("module://"):
            matplotlib.use("Agg")
        from cycler import cycler

        with matplotlib.rc_context({**RC, "axes.prop_cycle": cycler(color=list(LINES.values()))}):
            return fn(*args, **kwargs)
    return wrapped


def notebook() -> None:
    """Draw every later figure of this notebook in the style's colours: transparent backgrounds, MUTED text and
    axes, LINES for the colour cycle, so the PNGs stored with a notebook read on the site's white and slate
    pages alike. Call it after `%matplotlib inline`, which sets rcParams of its own. Sizes and layout stay
    the notebook's: its figures are not charts for the docs' column, and `save`'s checks do not apply."""
    import matplotlib
    from cycler import cycler

    keep = ("figure.figsize", "figure.constrained_layout.use", "svg.fonttype", "svg.hashsalt")
    matplotlib.rcParams.update({k: v for k, v in RC.items() if k not in keep})
    matplotlib.rcParams["axes.prop_cycle"] = cycler(color=list(LINES.values()))


def figure(height: float, nrows: int = 1, ncols: int = 1, **kwargs):
    """A figure WIDTH_IN wide and `height` inches tall, with its axes (plt.subplots' arguments)."""
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(WIDTH_IN, height), **kwargs)


def pale(colour: str, amount: float = 0.5) -> str:
    """`colour` mixed with white: opaque, so it reads as paler on both backgrounds (alpha would darken it on slate)."""
    from matplotlib.colors import to_hex, to_rgb

    return to_hex([c + (1 - c) * amount for c in to_rgb(colour)])


def halo(width: float = 3.0):
    """Path effects that draw a light edge under an INK line or text, so it reads on white, slate and fills."""
    from matplotlib import patheffects

    return [patheffects.withStroke(linewidth=width, foreground=HALO)]


def texts(fig) -> list:
    """The text a reader sees: every visible, non-empty Text artist of the figure (titles, labels, ticks, legend)."""
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def check(fig) -> float:
    """The figure's smallest font size, in points; ValueError if it is wider than WIDTH_IN or has text
    under MIN_FONT_PT."""
    width = fig.get_figwidth()
    if width > WIDTH_IN + 1e-6:
        raise ValueError(f"a figure {width:g} in wide is shrunk by the page, and its text with it: "
                         f"at most {WIDTH_IN:g}")
    found = texts(fig)
    small = sorted({(t.get_fontsize(), t.get_text()) for t in found if t.get_fontsize() < MIN_FONT_PT - 1e-6})
    if small:
        raise ValueError(f"text under {MIN_FONT_PT:g} pt: " + "; ".join(f"{s:g} pt {txt!r}" for s, txt in small[:5]))
    return min((t.get_fontsize() for t in found), default=MIN_FONT_PT)


def save(fig, path: str) -> None:
    """Check the figure (`check`) and write it: SVG (text as text, reproducible) or PNG (dpi and smallest font
    recorded); by the path's suffix. Closes the figure."""
    import matplotlib.pyplot as plt

    try:
        fig.canvas.draw()  # tick labels get their text when drawn: lay out and draw once before looking
        smallest = check(fig)
        ext = os.path.splitext(path)[1].lower()
        if ext == ".svg":
            fig.savefig(path, format="svg", metadata={"Date": None})
        elif ext == ".png":
            fig.savefig(path, format="png", dpi=PNG_DPI,
                        metadata={MIN_FONT_KEY: f"{smallest:g}", DPI_KEY: f"{PNG_DPI:g}"})
        else:
            raise ValueError(f"{path}: a chart is saved as .svg (or .png)")
    finally:
        plt.close(fig)
