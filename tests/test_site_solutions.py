"""The site shows each exercise as its flavour should: the public one the solution, marked; the students' the gap.

chapters/hooks/solutions.py finds every listing that includes an exercise. On the public site the listing
shows the source as it is, the solution's lines highlighted, and a line under the listing names the
exercise and links to the course's table. MINIFSDP_SITE=student puts the student copy's placeholder in
place of each solution (highlighted and named the same way), and no solution is anywhere on that site.
A student copy's source holds only the placeholders: its site shows them, marked. The two flavours of the
real site are built once per test run (tests/conftest.py's site_build, shared with test_docs.py and
test_site_browser.py); the student copy gets a one-page site of its own, which is enough to show the hook
copes with the placeholder form.
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
class Listing:
    text: str = ""          # all of its code
    highlighted: str = ""   # the code of its highlighted lines (pymdownx.highlight's <span class="hll">)
    folded: bool = False    # inside a <details> block


@dataclass
class Mark:
    text: str = ""
    links: list[str] = field(default_factory=list)


@dataclass
class PageText:
    outside: str = ""                 # all the text outside <details> elements
    details: list[Details] = field(default_factory=list)
    listings: list[Listing] = field(default_factory=list)  # each <pre>, folded or not
    marks: list[Mark] = field(default_factory=list)  # each <span class="exercise-mark">: the line under a listing


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page, self.open, self.in_summary, self.in_pre = PageText(), [], False, 0
        self.spans: list[str] = []  # the class of each <span> open inside a <pre> or a mark
        self.mark: Mark | None = None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "pre":
            self.in_pre += 1
            if self.in_pre == 1:
                self.page.listings.append(Listing(folded=bool(self.open)))
        elif tag == "details":
            self.open.append(Details(open=any(name == "open" for name, _ in attrs)))
        elif tag == "summary" and self.open:
            self.in_summary = True
        elif tag == "span" and (self.in_pre or self.mark is not None or "exercise-mark" in classes):
            if "exercise-mark" in classes and self.mark is None:
                self.mark = Mark()
                self.page.marks.append(self.mark)
            self.spans.append(" ".join(classes))
        elif tag == "a" and self.mark is not None:
            self.mark.links.append(dict(attrs).get("href") or "")

    def handle_endtag(self, tag):
        if tag == "pre" and self.in_pre:
            self.in_pre -= 1
        elif tag == "details" and self.open:
            self.page.details.append(self.open.pop())
        elif tag == "summary":
            self.in_summary = False
        elif tag == "span" and self.spans:
            if "exercise-mark" in self.spans.pop().split():
                self.mark = None

    def handle_data(self, data):
        if self.in_pre:
            listing = self.page.listings[-1]
            listing.text += data
            if any("hll" in c.split() for c in self.spans):
                listing.highlighted += data
        if self.mark is not None:
            self.mark.text += data
        if not self.open:
            self.page.outside += data
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
_PRE = re.compile(r"<pre\b.*?</pre>", re.DOTALL | re.IGNORECASE)
PLACEHOLDER = re.compile(r'NotImplementedError\(\s*"Exercise \d+\.\d+:')  # any exercise's, in a listing


def page_text(html: str) -> str:
    """All the text a page shows, folded or not; faster than read() on the big notebook pages."""
    return html_module.unescape(_TAG.sub("", _UNSHOWN.sub("", html)))


def listings_text(html: str) -> str:
    """The text of every <pre> of a page, folded or not."""
    return "\n".join(html_module.unescape(_TAG.sub("", pre)) for pre in _PRE.findall(html))


def _shown_by(ex) -> dict[str, list[str]]:
    """Page -> the includes on it that show exercise `ex`."""
    pages: dict[str, list[str]] = {}
    for html, target in listings().get(ex.id, []):
        pages.setdefault(html, []).append(target)
    return pages


@cache
def _solution(ex) -> tuple[str, ...]:
    """Every line of the exercise's solution, stripped."""
    return tuple(line.strip() for line in ex.path.read_text(encoding="utf-8").splitlines()[ex.begin:ex.end - 1])


def _times_shown(html: str, line: str) -> int:
    """How many times a page's listings hold a solution's line: once for each time it is in the solution of
    each exercise an include on the page shows (two exercises may share a line; one may hold it twice)."""
    return sum(len(targets) * _solution(ex).count(line)
               for ex in EXERCISES for page, targets in _shown_by(ex).items() if page == html)


def _marks_of(page: PageText, ex) -> list[Mark]:
    return [m for m in page.marks if re.search(rf"\bexercise {re.escape(ex.id)}\b", m.text)]


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
def test_public_site_shows_the_solution_marked(public, ex):
    """Each include that shows the exercise shows its solution once, every line of it highlighted, and names
    it under the listing, with the file's line numbers and a link to the course's table."""
    pages = _shown_by(ex)
    if not pages:
        pytest.skip(f"no page includes the code of exercise {ex.id}")
    rel = ex.path.relative_to(REPO).as_posix()
    for html, targets in pages.items():
        page = read(public.page(html))
        code = "\n".join(listing.text for listing in page.listings)
        assert not has_placeholder(ex, code), f"{html}: a listing shows the placeholder of {ex.id}"
        lines = [line.strip() for line in code.splitlines()]
        highlighted = [line.strip() for listing in page.listings for line in listing.highlighted.splitlines()]
        for line in solution_lines(ex):
            times = _times_shown(html, line)
            assert lines.count(line) == times, \
                f"{html} ({targets}): exercise {ex.id}'s line {line!r} is shown {lines.count(line)} times, not {times}"
            assert highlighted.count(line) == times, \
                f"{html} ({targets}): exercise {ex.id}'s line {line!r} is not highlighted"
        marks = _marks_of(page, ex)
        assert len(marks) == len(targets), \
            f"{html}: {len(marks)} lines name exercise {ex.id}, for {len(targets)} listings"
        for mark in marks:
            assert any(link.split("#")[-1] == "the-exercises" and "course" in link for link in mark.links), \
                f"{html}: the line under exercise {ex.id}'s listing does not link to the course's table: {mark.links}"
            assert f"lines {ex.begin + 1}–{ex.end - 1}" in mark.text, \
                f"{html}: the line under exercise {ex.id}'s listing does not give {rel}'s lines: {mark.text!r}"
        assert not [d for d in page.details if "Solution: Exercise" in d.summary], f"{html}: a folded solution block"


def _site_listings(build) -> dict[str, str]:
    """The text of every listing of every page of a built site, folded or not."""
    return {p.relative_to(build.site).as_posix(): listings_text(p.read_text(encoding="utf-8"))
            for p in sorted(build.site.rglob("*.html"))}


def test_public_site_shows_no_placeholder(public):
    """No listing of the public site, the notebooks' included, shows a student copy's raise."""
    shown = {name: PLACEHOLDER.findall(text) for name, text in _site_listings(public).items()}
    shown = {name: found for name, found in shown.items() if found}
    assert not shown, f"public site: listings show placeholders: {shown}"


def _site_texts(build, search_index: bool) -> dict[str, str]:
    """What every page of a built site shows, folded or not (and the search index's text)."""
    texts = {p.relative_to(build.site).as_posix(): page_text(p.read_text(encoding="utf-8"))
             for p in sorted(build.site.rglob("*.html"))}
    index = build.site / "search" / "search_index.json"
    if search_index and index.is_file():
        docs = json.loads(index.read_text(encoding="utf-8")).get("docs", [])
        texts["search/search_index.json"] = "\n".join(page_text(doc.get("text", "")) for doc in docs)
    return texts


def _leaks(texts: dict[str, str]) -> list[str]:
    return [f"{name}: exercise {ex.id}: {line}" for ex in EXERCISES for line in solution_lines(ex)
            for name, text in texts.items() if line in text]


def test_student_site_shows_only_placeholders(student):
    """No solution anywhere, the search index included; each listing that shows an exercise shows its
    placeholder, highlighted, and names the exercise under it."""
    leaks = _leaks(_site_texts(student, search_index=True))
    assert not leaks, "student site: solutions shown:\n" + "\n".join(leaks[:20])
    for ex in EXERCISES:
        for html, targets in _shown_by(ex).items():
            page = read(student.page(html))
            highlighted = "\n".join(listing.highlighted for listing in page.listings)
            assert len(re.findall(rf'NotImplementedError\(\s*{re.escape(json.dumps(str(ex), ensure_ascii=False))}\)',
                                  highlighted)) == len(targets), \
                f"student site, {html} ({targets}): {ex.id}'s placeholder is not shown, highlighted, once a listing"
            assert len(_marks_of(page, ex)) == len(targets), f"student site, {html}: exercise {ex.id} is not named"
            assert not [d for d in page.details if "Solution: Exercise" in d.summary], \
                f"student site, {html}: a solution block was left in"


_BLOCK = re.compile(r"^[ \t]*# BEGIN EXERCISE .*?^[ \t]*# END EXERCISE[ \t]*$", re.MULTILINE | re.DOTALL)


def test_public_and_student_listings_match(public, student):
    """The two flavours' listings differ only between an exercise's markers."""
    pages = sorted({html for pages in listings().values() for html, _ in pages})
    for html in pages:
        ours, theirs = read(public.page(html)).listings, read(student.page(html)).listings
        assert len(ours) == len(theirs), html
        for a, b in zip(ours, theirs):
            assert _BLOCK.sub("# the exercise", a.text) == _BLOCK.sub("# the exercise", b.text), html


def test_a_student_copy_builds_and_shows_its_placeholders(tmp_path):
    """In a student copy the source already holds the placeholders: the hook marks them and fails on nothing."""
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
    highlighted = "\n".join(listing.highlighted for listing in page.listings)
    for ex in EXERCISES:
        if ex.id in listings():
            assert has_placeholder(ex, highlighted), f"the student copy's site does not highlight {ex.id}'s placeholder"
            assert _marks_of(page, ex), f"the student copy's site does not name exercise {ex.id} under its listing"
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
        module._SITE.course_page = "course.md"
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _listing(ex, body: list[str], info: str = ' title="x.py"') -> list[str]:
    return ["Text.", "", "```python" + info, "def f(self):", *body, "```", "", "More text."]


def _source_block(ex) -> list[str]:
    return ex.path.read_text(encoding="utf-8").splitlines()[ex.begin - 1:ex.end]


def _hl_lines(fence: str) -> set[int]:
    """The line numbers a fence's hl_lines option names."""
    spec = re.search(r'hl_lines="([^"]*)"', fence)
    out = set()
    for part in (spec.group(1).split() if spec else []):
        first, _, last = part.partition("-")
        out |= set(range(int(first), int(last or first) + 1))
    return out


def test_hook_marks_the_solution_in_the_public_flavour(hook):
    ex = EXERCISES[0]
    lines = _listing(ex, _source_block(ex))
    page = hook.mark_page(lines, "06_fsdp.md")
    fence = page[2]
    assert fence.startswith('```python title="x.py"'), fence
    body = page[3:page.index("```")]
    assert body == lines[3:lines.index("```")], "the public listing is not the source as it is"
    solution = range(3, 3 + ex.end - ex.begin - 1)  # after "def f(self):" and the BEGIN marker
    assert _hl_lines(fence) == set(solution), (fence, ex.end - ex.begin - 1)
    assert [body[n - 1].strip() for n in solution] == [line.strip() for line in _source_block(ex)[1:-1]]
    text = "\n".join(page)
    assert not has_placeholder(ex, text)
    label = [line for line in page if "exercise-mark" in line]
    assert len(label) == 1 and f"[exercise {ex.id}](course.md#the-exercises)" in label[0], label
    assert f"lines {ex.begin + 1}–{ex.end - 1} of `{ex.path.relative_to(REPO).as_posix()}`" in label[0], label
    assert page[-1] == "More text."


def test_hook_puts_placeholders_in_the_student_flavour(hook):
    ex = EXERCISES[0]
    hook._SITE.flavour = "student"
    page = hook.mark_page(_listing(ex, _source_block(ex)), "06_fsdp.md")
    text = "\n".join(page)
    assert has_placeholder(ex, text) and "??? success" not in text
    assert not [line for line in solution_lines(ex) if line in text]
    assert _hl_lines(page[2]) == {3, 4}, page[2]  # the placeholder's two lines
    assert "NotImplementedError(" in page[3 + 2] and "exercise-mark" in text


def test_hook_adds_to_hl_lines_counted_from_the_listings_first_line(hook):
    """hl_lines counts from 1 whatever linenums says; the listing's own highlighted lines stay."""
    ex = EXERCISES[0]
    page = hook.mark_page(_listing(ex, _source_block(ex), info=' linenums="100" hl_lines="1"'))
    assert 'linenums="100"' in page[2]
    assert _hl_lines(page[2]) == {1, *range(3, 3 + ex.end - ex.begin - 1)}, page[2]


@pytest.mark.parametrize("flavour", ["public", "student"])
@pytest.mark.parametrize("form", ["markers kept", "markers replaced"])
def test_hook_shows_a_student_copys_listing_as_it_is(hook, form, flavour):
    """Both forms a student copy's block has had: the markers around the raise, marked; the raise alone, as it is."""
    hook._SITE.flavour = flavour
    ex = EXERCISES[0]
    block = strip_solutions("\n".join(_source_block(ex)) + "\n", only=ex.id).splitlines()
    if form == "markers replaced":
        block = [line for line in block if "EXERCISE" not in line]
    assert has_placeholder(ex, "\n".join(block))
    lines = _listing(ex, block)
    page = hook.mark_page(lines)
    if form == "markers replaced":
        assert page == lines
        return
    assert page[3:page.index("```")] == lines[3:lines.index("```")]
    assert _hl_lines(page[2]) == {3, 4}, page[2]
    assert any("exercise-mark" in line for line in page)


def test_hook_leaves_a_listing_written_by_hand_alone(hook, caplog):
    """The course page shows the convention with a real id and made-up code: neither a solution nor marked."""
    ex = EXERCISES[0]
    lines = _listing(ex, [f"# BEGIN EXERCISE {ex.id}: {ex.title}", "...the solution...", "# END EXERCISE"], info="")
    with caplog.at_level(logging.WARNING):
        assert hook.mark_page(lines) == lines
    assert not caplog.records


def test_hook_warns_where_it_cannot_mark_correctly(hook, caplog):
    """A stale copy in a listing titled with the exercise's file, half an exercise, and (in the student
    flavour, where the placeholder shortens the listing) linenums: each is a warning, which fails a --strict
    build. linenums in the public flavour, whose listing is the source as it is, is not."""
    ex = EXERCISES[0]
    rel = ex.path.relative_to(REPO).as_posix()
    block = _source_block(ex)
    cases = {("public", "not the file's"): _listing(ex, [block[0], "    pass", block[-1]], info=f' title="{rel}"'),
             ("public", "without its END"): _listing(ex, block[:-1]),
             ("public", "without its BEGIN"): _listing(ex, block[1:]),
             ("student", "linenums"): _listing(ex, block, info=' linenums="1"'),
             ("public", None): _listing(ex, block, info=' linenums="1"')}
    for (flavour, words), lines in cases.items():
        hook._SITE.flavour = flavour
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            hook.mark_page(lines)
        if words is None:
            assert not caplog.records, [r.getMessage() for r in caplog.records]
        else:
            assert any(words in record.getMessage() for record in caplog.records), (flavour, words)
