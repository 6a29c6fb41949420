"""How every report prints: byte sizes, the Markdown files the docs include, the memory bar chart.

Each report prints its table and, given a path, writes the same text there (chapters/generated/...): the
pages include those files, so every figure on the site is what a named command printed.
"""

from __future__ import annotations

CATEGORY_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868", "other": "#c7c7c7"}
CATEGORY_LABELS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
                   "other": "activations, temporaries, buffers"}


def write_report(text: str, markdown: str | None) -> None:
    """Print a report, and write it to `markdown` too when a path is given (the docs include that file)."""
    print(text)
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


def plot_memory(named_breakdowns: list[tuple[str, dict, float]], path: str, title: str,
                peaks: list[float] | None = None, ylabel: str = "MB per rank (rank 0, at peak)") -> None:
    """Stacked bars of memory by category, one per label, with the analytic model states marked (and,
    if given, each bar's peak as a dot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # at most 12 inches wide: a wider figure is shrunk to the page's width, and its text with it
    fig, ax = plt.subplots(figsize=(min(12.0, 1.6 + 1.0 * len(named_breakdowns)), 4.5))
    for i, (label, cats, model_states) in enumerate(named_breakdowns):
        bottom = 0.0
        for cat, color in CATEGORY_COLORS.items():
            ax.bar(i, cats[cat] / 1e6, bottom=bottom, color=color, label=CATEGORY_LABELS[cat] if i == 0 else None)
            bottom += cats[cat] / 1e6
        ax.plot([i - 0.4, i + 0.4], [model_states / 1e6] * 2, "k--", lw=1.5,
                label="analytic model states" if i == 0 else None)
        if peaks:
            ax.plot(i, peaks[i] / 1e6, "ko", ms=5, label="peak during the step" if i == 0 else None)
    ax.set_xticks(range(len(named_breakdowns)), [b[0] for b in named_breakdowns])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
