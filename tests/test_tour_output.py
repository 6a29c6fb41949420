"""The tour's two renderings of one result: the site's Markdown (what `make figures` writes into
chapters/generated/tour_ws2.md), and plain tables for a terminal. Nothing is trained: a fixed result is
rendered, so the test runs in well under a second."""

import itertools

from minifsdp.reports.format import TERMINAL, write_report
from minifsdp.reports.tour import format_tour


def row(rank, diff, peak, states, analytic, other, sent, theory, ms):
    return {"rank": rank, "max_diff": diff, "peak": peak, "alloc_retries": None, "states": states,
            "states_analytic": analytic, "other_at_peak": other, "bytes_per_step": sent,
            "bytes_theory": theory, "step_ms": ms}


# what strategy_rows returns, for two ranks; torch's own strategies are not counted; one rank's difference
# is not 0, so the summary must show the largest over the ranks
TABLES = {
    "torch_ddp": [row(0, 0.0, 8_000_512, 3_352_576, 3_352_576, 5_480_000, 0, 838_144, 230.71),
                  row(1, 0.0, 8_000_512, 3_352_576, 3_352_576, 5_480_000, 0, 838_144, 193.94)],
    "ddp": [row(0, 0.0, 7_170_000, 3_352_576, 3_352_576, 4_660_000, 838_144, 838_144, 113.4),
            row(1, 0.0, 7_170_000, 3_352_576, 3_352_576, 4_660_000, 838_144, 838_144, 149.2)],
    "fsdp": [row(0, 0.0, 6_140_000, 1_676_288, 1_676_288, 4_650_000, 1_240_000, 1_257_216, 39.2),
             row(1, 1.5e-8, 6_140_000, 1_676_288, 1_676_288, 4_650_000, 1_240_000, 1_257_216, 39.4)],
    "torch_fsdp2": [row(0, 0.0, 6_340_000, 1_676_288, 1_676_288, 5_090_000, 0, 1_257_216, 415.5),
                    row(1, 0.0, 6_340_000, 1_676_288, 1_676_288, 5_090_000, 0, 1_257_216, 328.0)],
}

# The site's markup for TABLES, byte for byte as the tour has always written it (chapters/generated/tour_ws2.md)
MARKDOWN = """\
| strategy | max abs diff vs torch DDP | model states (measured) | model states (analytic) | bytes sent / step | theory |
|---|---|---|---|---|---|
| torch_ddp (the oracle) | 0 | 3.35 MB | 3.35 MB | not counted | 838.14 kB |
| ddp | 0 | 3.35 MB | 3.35 MB | 838.14 kB | 838.14 kB |
| fsdp | 1.5e-08 | 1.68 MB | 1.68 MB | 1.24 MB | 1.26 MB |
| torch_fsdp2 | 0 | 1.68 MB | 1.68 MB | not counted | 1.26 MB |

torch_ddp and torch_fsdp2 are PyTorch's own: their collectives do not pass through minifsdp's counter.

??? note "All columns, every rank: peak memory, activations, step time"

    **Memory**

    | strategy | rank | peak memory | model states (measured) | model states (analytic) | activations + other at peak |
    |---|---|---|---|---|---|
    | torch_ddp | 0 | 8.00 MB | 3.35 MB | 3.35 MB | 5.48 MB |
    | torch_ddp | 1 | 8.00 MB | 3.35 MB | 3.35 MB | 5.48 MB |
    | ddp | 0 | 7.17 MB | 3.35 MB | 3.35 MB | 4.66 MB |
    | ddp | 1 | 7.17 MB | 3.35 MB | 3.35 MB | 4.66 MB |
    | fsdp | 0 | 6.14 MB | 1.68 MB | 1.68 MB | 4.65 MB |
    | fsdp | 1 | 6.14 MB | 1.68 MB | 1.68 MB | 4.65 MB |
    | torch_fsdp2 | 0 | 6.34 MB | 1.68 MB | 1.68 MB | 5.09 MB |
    | torch_fsdp2 | 1 | 6.34 MB | 1.68 MB | 1.68 MB | 5.09 MB |

    **Parity, traffic and time**

    | strategy | rank | max abs diff vs torch DDP | bytes sent / step | theory | step time |
    |---|---|---|---|---|---|
    | torch_ddp | 0 | 0 | not counted | 838.14 kB | 230.7 ms |
    | torch_ddp | 1 | 0 | not counted | 838.14 kB | 193.9 ms |
    | ddp | 0 | 0 | 838.14 kB | 838.14 kB | 113.4 ms |
    | ddp | 1 | 0 | 838.14 kB | 838.14 kB | 149.2 ms |
    | fsdp | 0 | 0 | 1.24 MB | 1.26 MB | 39.2 ms |
    | fsdp | 1 | 1.5e-08 | 1.24 MB | 1.26 MB | 39.4 ms |
    | torch_fsdp2 | 0 | 0 | not counted | 1.26 MB | 415.5 ms |
    | torch_fsdp2 | 1 | 0 | not counted | 1.26 MB | 328.0 ms |"""


def test_the_markdown_is_the_sites():
    assert format_tour(TABLES) == MARKDOWN


def markdown_tables(text):
    """Each Markdown table in `text`: (header, rows), as lists of cells."""
    tables, current = [], None
    for line in (line.strip() for line in text.splitlines()):
        if line.startswith("|---"):
            continue
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if current is None:
            current = (cells, [])
            tables.append(current)
        else:
            current[1].append(cells)
    return tables


def terminal_tables(text):
    """Each plain table in `text`: (header, rows), each line cut where its rule of dashes starts a column
    (so a cell out of its column comes out wrong)."""
    lines, tables = text.splitlines(), []
    for i, rule in enumerate(lines):
        if rule and set(rule) <= {"-", " "}:
            starts = [j for j, ch in enumerate(rule) if ch == "-" and (j == 0 or rule[j - 1] == " ")]
            block = [lines[i - 1]] + list(itertools.takewhile(bool, lines[i + 1:]))
            cut = [[line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])] for line in block]
            tables.append((cut[0], cut[1:]))
    return tables


def test_the_terminal_gets_the_same_tables_without_markup():
    text = format_tour(TABLES, TERMINAL)
    assert "???" not in text and "|---|" not in text and "**" not in text
    assert not [line for line in text.splitlines() if line.startswith("    ")]  # no admonition's indent
    # every column and every rank's row, cell for cell as on the site, each in its column
    tables = terminal_tables(text)
    assert tables == markdown_tables(MARKDOWN)
    assert [len(rows) for _, rows in tables] == [len(TABLES), 2 * len(TABLES), 2 * len(TABLES)]
    assert [len(header) for header, _ in tables] == [6, 6, 6]
    lines = text.splitlines()
    title = "All columns, every rank: peak memory, activations, step time"  # the folded part's heading, plain
    assert lines[lines.index(title) + 1] == "=" * len(title)
    for caption, header in (("Memory", "peak memory"), ("Parity, traffic and time", "step time")):
        assert header in lines[lines.index(caption) + 1]  # each caption right above its table


def test_the_terminal_and_the_file_each_get_theirs(tmp_path, capsys):
    path = tmp_path / "tour.md"
    terminal = f"header\n\n{format_tour(TABLES, TERMINAL)}"
    write_report(f"header\n\n{format_tour(TABLES)}", str(path), printed=terminal)
    assert path.read_text() == f"header\n\n{MARKDOWN}\n"
    assert capsys.readouterr().out == terminal + "\n"
