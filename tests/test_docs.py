"""The docs site builds with no warnings, and what its pages include and show really exists.

The strict build is the real check: pymdownx.snippets runs with check_paths, so a missing file or a
renamed section marker fails it. The checks below only make the failure messages point at the page.
"""

import html as html_module
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "chapters").glob("*.md"))
INCLUDE = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$', re.MULTILINE)  # a block include on its own line
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")


def includes(page: Path) -> list[str]:
    return INCLUDE.findall(page.read_text(encoding="utf-8"))


def test_there_are_pages():
    assert (REPO / "mkdocs.yml").is_file()
    assert {p.name for p in PAGES} >= {"index.md", "01_ddp.md", "02_memory.md"}


def test_site_builds_strictly(site_build):
    out = site_build("public")  # built once per test run (tests/conftest.py), shared with test_site_solutions.py
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr[-3000:]
    for page in ("index.html", "01_ddp/index.html", "02_memory/index.html"):
        html = out.page(page)
        assert "8&lt;--" not in html and "8<--" not in html, f"{page}: an include was not expanded"
    # the included source really is on the page (as text: highlighting splits it into spans)
    ddp_page = out.page("01_ddp/index.html")
    assert "def _on_grad_ready(self, p: nn.Parameter)" in html_module.unescape(re.sub(r"<[^>]+>", "", ddp_page))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_include_points_at_a_file_and_section(page):
    for target in includes(page):
        path, _, section = target.partition(":")
        source = REPO / path
        assert source.is_file(), f"{page.name} includes {path}, which does not exist"
        if section and not re.fullmatch(r"[\d:,-]+", section):  # a named section, not line numbers
            text = source.read_text(encoding="utf-8")
            for kind in ("start", "end"):
                assert f"--8<-- [{kind}:{section}]" in text, f"{page.name}: {path} has no [{kind}:{section}] marker"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_image_exists(page):
    for src in IMAGE.findall(page.read_text(encoding="utf-8")):
        assert not src.startswith(("http://", "https://")), f"{page.name}: {src} would be fetched from the network"
        assert (page.parent / src).is_file(), f"{page.name} shows {src}, which does not exist"


def make_recipe(target: str) -> str:
    """A Makefile target's recipe, then the recipes of the targets it depends on (`figures: diagrams`)."""
    rule = re.search(rf"^{re.escape(target)}:([^#\n]*).*\n((?:\t.*\n)*)", (REPO / "Makefile").read_text(), re.MULTILINE)
    return rule.group(2) + "".join(make_recipe(dep) for dep in rule.group(1).split()) if rule else ""


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_generated_table_and_figure_names_its_command(page):
    """Each included output and each figure is made by `make figures`, and the page names the command."""
    text = page.read_text(encoding="utf-8")
    figures_recipe = make_recipe("figures")
    assert figures_recipe, "the Makefile has no `figures` target"
    made = [f"chapters/{src}" for src in IMAGE.findall(text)] + \
           [t for t in includes(page) if t.startswith("chapters/generated/")]
    for path in made:
        assert path in figures_recipe, f"{page.name} shows {path}, which `make figures` does not make"
        outside_includes = INCLUDE.sub("", text)
        assert path in outside_includes, f"{page.name} shows {path} without naming the command that made it"


# The widest listing line the content column shows without scrolling at 1280 px: 688 px of column, less the
# code block's padding, at 13.6 px monospace (0.6 em a character). tests/test_site_browser.py checks the same
# on the rendered pages (where a listing inside a list or an admonition is narrower still); this check says
# which lines, before any build.
LISTING_COLUMNS = 80
FENCE = re.compile(r"^(\s*)(```+|~~~+)")  # a fence's opening or closing line


def listing_lines(page: Path) -> list[tuple[str, str]]:
    """(where, line) for every line a page's listings show: each fenced block's own lines, and the source each
    include brings in, a named section dedented as pymdownx.snippets (dedent_subsections) shows it."""
    out, fence = [], None  # fence: the open block's indent and marker
    for line in page.read_text(encoding="utf-8").splitlines():
        mark = FENCE.match(line)
        if fence is None:
            fence = mark.groups() if mark else None
            continue
        if mark and mark.groups() == fence and not line[mark.end():].strip():
            fence = None
            continue
        target = INCLUDE.fullmatch(line)
        if not target:
            out.append((page.name, line[len(fence[0]):]))
            continue
        path, _, section = target.group(1).partition(":")
        if path.startswith("chapters/generated/"):
            continue  # a command's output, printed as it printed it
        text = (REPO / path).read_text(encoding="utf-8").splitlines()
        if section:
            start = next(i for i, s in enumerate(text) if f"--8<-- [start:{section}]" in s)
            end = next(i for i, s in enumerate(text) if f"--8<-- [end:{section}]" in s)
            text = textwrap.dedent("\n".join(text[start + 1:end])).splitlines()
        out += [(f"{path}:{section}" if section else path, s) for s in text if "--8<--" not in s]
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_listing_fits_the_column(page):
    long = [f"{where}: {len(line)} columns: {line.strip()[:60]}" for where, line in listing_lines(page)
            if len(line) > LISTING_COLUMNS]
    assert not long, f"{page.name}: {len(long)} listing lines wider than {LISTING_COLUMNS} columns:\n" + "\n".join(long)


# -- the commands the pages give ---------------------------------------------------------------------------------
CLI_INLINE = re.compile(r"`(python -m minifsdp [^`]*)`")  # an inline command, possibly wrapped over lines
CLI_FENCE = re.compile(r"^( *)(```|~~~)[^\n]*\n(.*?)^\1\2 *$", re.MULTILINE | re.DOTALL)
SHELL_STOPS = {">", ">>", "|", "&&", ";", "2>&1"}  # what follows is the shell's, not the command's


def cli_commands(text: str) -> list[str]:
    """Every `python -m minifsdp SUBCOMMAND ...` a page gives: the lines of its code blocks (continuations
    joined) and its inline code; `python -m minifsdp.reports...` modules are not the CLI's."""
    found = []
    for block in CLI_FENCE.finditer(text):
        body = re.sub(r"\\\n\s*", " ", block.group(3))
        found += [" ".join(line.split()) for line in body.splitlines()
                  if line.strip().startswith("python -m minifsdp ")]
    found += [" ".join(m.group(1).split()) for m in CLI_INLINE.finditer(CLI_FENCE.sub("", text))]
    return found


def cli_errors(command: str) -> str | None:
    """argparse's complaint about `command`, or None when the command line accepts it."""
    import contextlib
    import io
    import shlex

    from minifsdp.__main__ import build_parser

    words = shlex.split(command, comments=True)[3:]
    cut = [i for i, w in enumerate(words) if w in SHELL_STOPS]
    words = words[:cut[0]] if cut else words
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(words)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return None


def test_a_command_the_cli_refuses_is_found():
    text = "Run `python -m minifsdp student\n  --chapters 6,7`, then\n\n```bash\npython -m minifsdp grade a \\\n" \
           "    --weeks 6 > out.txt\npython -m minifsdp.reports.grading --markdown x.md\n```\n"
    commands = cli_commands(text)
    assert commands == ["python -m minifsdp grade a --weeks 6 > out.txt",
                        "python -m minifsdp student --chapters 6,7"]
    assert all(cli_errors(c) for c in commands)  # an option the CLI lacks; OUT_DIR missing
    assert cli_errors("python -m minifsdp grade a --chapters 6 > out.txt") is None


def test_every_command_the_pages_give_is_the_cli_s():
    """The guide once gave `student handout --chapters 6,7` in an order and a form the CLI did not have: every
    `python -m minifsdp ...` on a page or in the README must parse with the command line as it is."""
    sources = PAGES + sorted((REPO / "chapters").glob("*/*.md")) + [REPO / "README.md"]
    checked, wrong = 0, []
    for source in sources:
        for command in cli_commands(source.read_text(encoding="utf-8")):
            checked += 1
            if (error := cli_errors(command)) is not None:
                wrong.append(f"{source.relative_to(REPO)}: {command}\n    {error}")
    assert checked > 50, f"only {checked} commands found: is the pattern still right?"
    assert not wrong, "commands the CLI refuses:\n" + "\n".join(wrong)
