"""The site does not give the exercises away: listings show the placeholder, solutions sit folded below them.

chapters/hooks/solutions.py rewrites every listing that includes an exercise: the code between the markers
becomes the line a student copy has there, and the solution follows the listing in a closed <details>
block. MINIFSDP_SITE=student leaves the solutions out altogether, and a student copy (whose source holds
only the placeholders) builds with nothing to fold. The two flavours of the real site are built once per
test run (tests/conftest.py's site_build, shared with test_docs.py); the student copy gets a one-page site
of its own, which is enough to show the hook copes with the placeholder form.
"""

from __future__ import annotations

import html as html_module
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from functools import cache
from html.parser import HTMLParser
from io import StringIO
from pathlib import Path

import pytest

from minifsdp.course.student import find_exercises, strip_solutions, write_student_copy
from test_site_links import skip_without_site_tools

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "chapters").glob("*.md"))
INCLUDE = re.compile(r'^[ \t]*--8<--\s+"([^"]+)"[ \t]*$', re.MULTILINE)
SECTION = re.compile(r"--8<-- \[(start|end):([\w-]+)\]")
SHORTEST = 20  # characters: shorter solution lines ("offset = 0") are common elsewhere, so prove nothing

EXERCISES = find_exercises(REPO)


# -- what the pages include ---------------------------------------------------------------------------------

def _sections(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (line of its start marker, line of its end marker), 1-based."""
    found: dict[str, list[int]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for kind, name in SECTION.findall(line):
            found.setdefault(name, [0, 0])[0 if kind == "start" else 1] = number
    return {name: (start, end) for name, (start, end) in found.items()}


def _covered(target: str) -> tuple[str, int, int] | None:
    """The file an include names and the lines it brings in (None when it is not package source)."""
    path, _, section = target.partition(":")
    if not path.startswith("minifsdp/") or not (REPO / path).is_file():
        return None
    if not section:
        return path, 1, 10**9
    if re.fullmatch(r"\d+(:\d+)?", section):
        first, _, last = section.partition(":")
        return path, int(first), int(last or 10**9)
    start, end = _sections(REPO / path).get(section, (0, 0))
    return path, start, end


@cache
def listings() -> dict[str, list[tuple[str, str]]]:
    """Exercise id -> [(page's html path in the site, the include)] for every page whose listing shows it."""
    shown: dict[str, list[tuple[str, str]]] = {}
    for page in PAGES:
        html = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
            covered = _covered(target)
            if covered is None:
                continue
            path, first, last = covered
            for ex in EXERCISES:
                inside = ex.path.relative_to(REPO).as_posix() == path and first < ex.begin and ex.end < last
                if inside and (html, target) not in shown.setdefault(ex.id, []):
                    shown[ex.id].append((html, target))
    return shown


@cache
def solution_lines(ex) -> tuple[str, ...]:
    """The solution's lines that tell it apart: long enough, and found nowhere in a student copy's text."""
    text = ex.path.read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in text[ex.begin:ex.end - 1]
                 if len(line.strip()) >= SHORTEST and line.strip() not in _student_text())


@cache
def _student_text() -> str:
    """What a student copy holds besides the solutions: the package source with every solution taken out,
    the pages and the notebooks (which may well call what an exercise calls: that gives nothing away)."""
    parts = [strip_solutions(p.read_text(encoding="utf-8"), path=p)
             for p in sorted((REPO / "minifsdp").rglob("*.py")) if "__pycache__" not in p.parts]
    parts += [p.read_text(encoding="utf-8") for p in PAGES]
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
        parts += ["".join(cell.get("source", [])) for cell in cells]
    return "\n".join(parts)


def has_placeholder(ex, text: str) -> bool:
    """The student copy's raise for `ex` is in `text` (over two lines: student.placeholder_lines)."""
    message = re.escape(json.dumps(str(ex), ensure_ascii=False))
    return re.search(rf"NotImplementedError\(\s*{message}\)", text) is not None


# -- what a built page shows --------------------------------------------------------------------------------

@dataclass
class Details:
    open: bool
    summary: str = ""
    text: str = ""


@dataclass
class PageText:
    outside: str = ""                 # all the text outside <details> elements
    details: list[Details] = field(default_factory=list)
    listings: list[str] = field(default_factory=list)  # the text of each <pre> outside <details>


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page, self.open, self.in_summary, self.in_pre = PageText(), [], False, 0

    def handle_starttag(self, tag, attrs):
        if tag == "pre" and not self.open:
            self.in_pre += 1
            if self.in_pre == 1:
                self.page.listings.append("")
        elif tag == "details":
            self.open.append(Details(open=any(name == "open" for name, _ in attrs)))
        elif tag == "summary" and self.open:
            self.in_summary = True

    def handle_endtag(self, tag):
        if tag == "pre" and self.in_pre:
            self.in_pre -= 1
        elif tag == "details" and self.open:
            self.page.details.append(self.open.pop())
        elif tag == "summary":
            self.in_summary = False

    def handle_data(self, data):
        if not self.open:
            self.page.outside += data
            if self.in_pre:
                self.page.listings[-1] += data
            return
        for details in self.open:  # nested ones count for every level
            details.text += data
        if self.in_summary:
            self.open[-1].summary += data


@cache
def read(html: str) -> PageText:
    reader = _Reader()
    reader.feed(html)
    reader.close()
    return reader.page


_UNSHOWN = re.compile(r"<(script|style)\b.*?</\1>", re.DOTALL)
_TAG = re.compile(r"<[^>]+>")


def unfolded_text(html: str) -> str:
    """The text a page shows outside <details> blocks; faster than read() on the big notebook pages."""
    if "<details" in html:
        return read(html).outside
    return html_module.unescape(_TAG.sub("", _UNSHOWN.sub("", html)))


# -- the tests ----------------------------------------------------------------------------------------------

def test_the_pages_show_exercises():
    assert listings(), "no page includes an exercise's code; the checks below would prove nothing"
    for ex in EXERCISES:
        if ex.id in listings():
            assert solution_lines(ex), f"exercise {ex.id}: no line of its solution is distinctive enough to look for"


@pytest.fixture(scope="module")
def public(site_build):
    out = site_build("public")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def student(site_build):
    out = site_build("student")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("ex", EXERCISES, ids=[ex.id for ex in EXERCISES])
def test_public_site_folds_the_solution(public, ex):
    pages = listings().get(ex.id)
    if not pages:
        pytest.skip(f"no page includes the code of exercise {ex.id}")
    wanted = solution_lines(ex)
    for html, target in pages:
        page = read(public.page(html))
        assert has_placeholder(ex, page.outside), f"{html} (--8<-- {target}): the listing has no placeholder for {ex.id}"
        leaked = [line for line in wanted if line in page.outside]
        assert not leaked, f"{html} (--8<-- {target}): exercise {ex.id}'s solution shows outside <details>: {leaked}"
        titled = [d for d in page.details if f"Solution: Exercise {ex.id} " in d.summary + " "]
        assert titled, f"{html}: no <details> titled 'Solution: Exercise {ex.id}' under the listing"
        assert all(not d.open for d in titled), f"{html}: exercise {ex.id}'s solution is open; it must start folded"
        missing = [line for line in wanted if line not in titled[0].text]
        assert not missing, f"{html}: the folded solution of {ex.id} lacks {missing}"
        rel = ex.path.relative_to(REPO).as_posix()
        assert rel in titled[0].text, f"{html}: the folded solution of {ex.id} does not name {rel}"
        numbers = [n for n in range(ex.begin + 1, ex.end) if not re.search(rf"(?<!\d){n}(?!\d)", titled[0].text)]
        assert not numbers, f"{html}: {ex.id}'s solution is not numbered as in {rel} (lines {numbers} missing)"


def _site_texts(build, search_index: bool) -> dict[str, str]:
    """What every page of a built site shows outside <details> blocks (and the search index's text)."""
    texts = {p.relative_to(build.site).as_posix(): unfolded_text(p.read_text(encoding="utf-8"))
             for p in sorted(build.site.rglob("*.html"))}
    index = build.site / "search" / "search_index.json"
    if search_index and index.is_file():
        docs = json.loads(index.read_text(encoding="utf-8")).get("docs", [])
        texts["search/search_index.json"] = "\n".join(unfolded_text(doc.get("text", "")) for doc in docs)
    return texts


def _leaks(texts: dict[str, str]) -> list[str]:
    return [f"{name}: exercise {ex.id}: {line}" for ex in EXERCISES for line in solution_lines(ex)
            for name, text in texts.items() if line in text]


def test_public_site_shows_no_solution_unfolded(public):
    """No page (the notebooks' included) shows a solution outside a <details> block. (The search index
    holds the folded solutions too: a reader searching for them may find them.)"""
    leaks = _leaks(_site_texts(public, search_index=False))
    assert not leaks, "public site: solutions shown unfolded:\n" + "\n".join(leaks[:20])


def test_student_site_shows_no_solution(student):
    leaks = _leaks(_site_texts(student, search_index=True))
    assert not leaks, "student site: solutions shown:\n" + "\n".join(leaks[:20])
    for ex in EXERCISES:
        for html, target in listings().get(ex.id, []):
            page = read(student.page(html))
            assert has_placeholder(ex, page.outside), f"student site, {html} (--8<-- {target}): no placeholder"
            assert not [d for d in page.details if "Solution: Exercise" in d.summary], \
                f"student site, {html}: a solution block was left in"


def test_public_and_student_listings_match(public, student):
    """The student site's listings are the public one's, less the folded blocks."""
    for html in sorted({html for pages in listings().values() for html, _ in pages}):
        assert read(public.page(html)).listings == read(student.page(html)).listings, html


def test_a_student_copy_builds_with_nothing_to_fold(tmp_path):
    """In a student copy the source already holds the placeholders: the hook folds nothing and fails on nothing."""
    skip_without_site_tools()
    copy = tmp_path / "copy"
    with redirect_stdout(StringIO()):
        write_student_copy(REPO, copy)
    # One page with every listing of the real pages that shows an exercise, built with the copy's own hook.
    docs = copy / "one_page"
    docs.mkdir()
    targets = sorted({target for pages in listings().values() for _, target in pages})
    (docs / "index.md").write_text("# Listings\n\n" + "\n".join(
        f'```python title="{t.partition(":")[0]}"\n--8<-- "{t}"\n```\n' for t in targets), encoding="utf-8")
    (copy / "one_page.yml").write_text(
        "site_name: listings\ndocs_dir: one_page\n"
        "hooks:\n  - chapters/hooks/solutions.py\ntheme:\n  name: material\n  font: false\n"
        "plugins: []\nmarkdown_extensions:\n  - admonition\n  - pymdownx.details\n  - pymdownx.superfences\n"
        "  - pymdownx.highlight\n  - pymdownx.snippets:\n      base_path: ['.']\n      check_paths: true\n"
        "      dedent_subsections: true\n", encoding="utf-8")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MINIFSDP_SITE": "public"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "one_page.yml",
               "--site-dir", str(tmp_path / "site")]
    out = subprocess.run(command, check=False, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    page = read((tmp_path / "site" / "index.html").read_text(encoding="utf-8"))
    assert not page.details, "a solution block in a student copy's site, where there is no solution"
    for ex in EXERCISES:
        if ex.id in listings():
            assert has_placeholder(ex, page.outside), f"the student copy's listing has no placeholder for {ex.id}"
            shown = [line for line in solution_lines(ex) if line in page.outside]
            assert not shown, f"the student copy's site shows exercise {ex.id}'s solution: {shown}"


# -- the hook on its own, on listings no page has -------------------------------------------------------------

@pytest.fixture
def hook(_hook_module):
    _hook_module._SITE.flavour = "public"
    return _hook_module


@pytest.fixture(scope="module")
def _hook_module():
    """chapters/hooks/solutions.py, loaded afresh, set up as a build of this project would set it up."""
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("solutions_hook_under_test", REPO / "chapters/hooks/solutions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as mkdocs loads a hook (its dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
        module._SITE.exercises = module.load_solutions(REPO)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _listing(ex, body: list[str], info: str = ' title="x.py"') -> list[str]:
    return ["Text.", "", "```python" + info, "def f(self):", *body, "```", "", "More text."]


def _source_block(ex) -> list[str]:
    return ex.path.read_text(encoding="utf-8").splitlines()[ex.begin - 1:ex.end]


def test_hook_folds_a_listing_and_adds_the_solution(hook):
    ex = EXERCISES[0]
    page = hook.fold_page(_listing(ex, _source_block(ex)))
    text = "\n".join(page)
    assert has_placeholder(ex, text)
    summary = f'??? success "Solution: Exercise {ex.id} — {ex.title}"'
    assert summary in page, text
    before, after = text.split(summary)
    assert not [line for line in solution_lines(ex) if line in before], "the solution is still in the listing"
    assert all(line in after for line in solution_lines(ex))
    assert f'linenums="{ex.begin + 1}"' in after and ex.path.relative_to(REPO).as_posix() in after
    assert page[-1] == "More text."


def test_hook_leaves_solutions_out_of_the_student_flavour(hook):
    ex = EXERCISES[0]
    hook._SITE.flavour = "student"
    text = "\n".join(hook.fold_page(_listing(ex, _source_block(ex))))
    assert has_placeholder(ex, text) and "??? success" not in text
    assert not [line for line in solution_lines(ex) if line in text]


@pytest.mark.parametrize("form", ["markers kept", "markers replaced"])
def test_hook_leaves_a_student_copys_listing_alone(hook, form):
    """Both forms a student copy's block has had: the markers around the raise line, or the raise line alone."""
    ex = EXERCISES[0]
    block = strip_solutions("\n".join(_source_block(ex)) + "\n", only=ex.id).splitlines()
    if form == "markers replaced":
        block = [line for line in block if "EXERCISE" not in line]
    assert has_placeholder(ex, "\n".join(block))
    lines = _listing(ex, block)
    assert hook.fold_page(lines) == lines


def test_hook_leaves_a_listing_written_by_hand_alone(hook, caplog):
    """The course page shows the convention with a real id and made-up code: not a solution, not folded."""
    ex = EXERCISES[0]
    lines = _listing(ex, [f"# BEGIN EXERCISE {ex.id}: {ex.title}", "...the solution...", "# END EXERCISE"], info="")
    with caplog.at_level(logging.WARNING):
        assert hook.fold_page(lines) == lines
    assert not caplog.records


def test_hook_warns_where_it_cannot_fold_correctly(hook, caplog):
    """A stale copy in a listing titled with the exercise's file, half an exercise, renumbered lines: each
    is a warning, which fails a --strict build."""
    ex = EXERCISES[0]
    rel = ex.path.relative_to(REPO).as_posix()
    block = _source_block(ex)
    cases = {"not the file's": _listing(ex, [block[0], "    pass", block[-1]], info=f' title="{rel}"'),
             "without its END": _listing(ex, block[:-1]),
             "linenums": _listing(ex, block, info=' linenums="1"')}
    for words, lines in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            hook.fold_page(lines)
        assert any(words in record.getMessage() for record in caplog.records), words
