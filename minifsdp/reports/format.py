"""How every report prints: byte sizes, the Markdown files the docs include, the memory bar chart (drawn in
the charts' common style, minifsdp/reports/style.py).

Each report prints its table and, given a path, writes the same text there (chapters/generated/...): the
pages include those files, so every figure on the site is what a named command printed. A report whose
Markdown carries the site's markup (a folded block) renders the same data twice: for the site (MARKDOWN)
and for a terminal (TERMINAL: plain tables, no markup).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from minifsdp.reports import style

CATEGORY_LABELS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
                   "other": "activations, temporaries, buffers"}


def write_report(text: str, markdown: str | None, printed: str | None = None) -> None:
    """Print a report, and write it to `markdown` too when a path is given (the docs include that file).
    printed: what the terminal gets instead of `text`, where `text` carries the site's markup."""
    print(text if printed is None else printed)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_size(b: float | None) -> str:
    """Bytes as chapter 13's simulator prints them: up to TB (70B and 175B models), an em dash for none."""
    if b is None:
        return "—"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


# The site's content column is 688 px wide at 1280 px, and the theme gives every header cell at least
# 5rem (100 px): a table of more than six columns scrolls sideways, hiding its last columns. The reports
# keep each table to MAX_COLUMNS, put what the chapter compares side by side, early, and split long
# tables into tabs (one per world size, say).
MAX_COLUMNS = 6


def md_table(header: list[str], rows: list[list], caption: str | None = None) -> str:
    """A Markdown table (readable as plain text too), under a bold caption when one is given."""
    if len(header) > MAX_COLUMNS:
        import warnings

        warnings.warn(f"{len(header)} columns scroll sideways in the docs' column (it holds {MAX_COLUMNS}): {header}",
                      stacklevel=2)
    lines = ([f"**{caption}**", ""] if caption else []) + ["| " + " | ".join(header) + " |",
                                                             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join(("    " + line) if line else "" for line in text.split("\n"))


def md_tabs(panels: list[tuple[str, str]]) -> str:
    """Content tabs (pymdownx.tabbed): one `=== "label"` per panel, its Markdown indented under it."""
    return "\n\n".join(f'=== "{label}"\n\n{_indent(body)}' for label, body in panels)


def md_folded(title: str, body: str) -> str:
    """A folded block (pymdownx.details), closed until the reader opens it."""
    return f'??? note "{title}"\n\n{_indent(body)}'


def text_table(header: list[str], rows: list[list], caption: str | None = None) -> str:
    """md_table's table for a terminal: each column as wide as its widest cell, a rule of dashes under the
    header, the caption on a line of its own above it."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    lines = ([caption] if caption else []) + [line(cells[0]), line(["-" * w for w in widths])]
    return "\n".join(lines + [line(row) for row in cells[1:]])


def text_section(title: str, body: str) -> str:
    """md_folded's block for a terminal: nothing to fold, so the title as a heading line over the body."""
    return f"{title}\n{'=' * len(title)}\n\n{body}"


class Renderer(NamedTuple):
    """How a report writes its tables and its folded parts."""
    table: Callable[..., str]          # (header, rows, caption=None) -> the table
    folded: Callable[[str, str], str]  # (title, body) -> the part a reader opens


MARKDOWN = Renderer(md_table, md_folded)  # for the site: what `--markdown PATH` writes
TERMINAL = Renderer(text_table, text_section)


@style.charts
def plot_memory(named_breakdowns: list[tuple[str, dict, float | None]], path: str, title: str,
                peaks: list[float] | None = None, xlabel: str = "MB per rank (rank 0, at peak)",
                panels: list[str] | None = None, categories: tuple[str, ...] = tuple(style.CATEGORY)) -> None:
    """Stacked horizontal bars of memory by category, one per label (first at the top), each with the analytic
    model states marked by a dashed line (none where they are None) and, if given, its peak as a dot.

    panels: a panel title per bar; consecutive bars with the same title share a panel, and the panels are
    stacked one above the other on one scale (small multiples, e.g. one per world size).
    categories: the categories stacked (and named in the legend), of style.CATEGORY; by default all four."""
    groups: list[tuple[str | None, list[int]]] = []
    for i, name in enumerate(panels or [None] * len(named_breakdowns)):
        if groups and groups[-1][0] == name:
            groups[-1][1].append(i)
        else:
            groups.append((name, [i]))
    row = 0.3  # inches per bar
    height = 1.45 + sum(row * len(idx) + (0.3 if name else 0.0) for name, idx in groups)
    fig, axes = style.figure(height, len(groups), 1, sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [len(idx) + (1.0 if name else 0.0) for name, idx in groups]})
    for ax, (name, idx) in zip(axes[:, 0], groups):
        for y, i in enumerate(idx):
            label, cats, model_states = named_breakdowns[i]
            left = 0.0
            for cat, colour in ((c, style.CATEGORY[c]) for c in categories):
                ax.barh(y, cats[cat] / 1e6, left=left, height=0.7, color=colour,
                        label=CATEGORY_LABELS[cat] if i == 0 else None)
                left += cats[cat] / 1e6
            if model_states is not None:  # (None: no closed form for this bar)
                ax.plot([model_states / 1e6] * 2, [y - 0.45, y + 0.45], color=style.INK, lw=1.5, ls=(0, (2.5, 1.5)),
                        path_effects=style.halo(), label="analytic model states")
            if peaks:
                ax.plot(peaks[i] / 1e6, y, "o", color=style.INK, mec=style.HALO, mew=1.0, ms=6,
                        label="peak during the step" if i == 0 else None)
        ax.set_yticks(range(len(idx)), [named_breakdowns[i][0] for i in idx])
        ax.set_ylim(len(idx) - 0.5, -0.5)
        ax.tick_params(axis="y", length=0)
        ax.grid(True, axis="x")
        ax.set_axisbelow(True)
        if name:
            ax.set_title(name, loc="left", fontsize=10)
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle(title)
    legend = {}  # every entry once, whichever panel has it
    for ax in axes[:, 0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    handles, labels = list(legend.values()), list(legend)
    order = [labels.index(t) for t in [*CATEGORY_LABELS.values(), "analytic model states", "peak during the step"]
             if t in labels]
    fig.legend([handles[k] for k in order], [labels[k] for k in order], loc="outside lower center", ncol=2)
    style.save(fig, path)
