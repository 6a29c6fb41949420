"""The exercises in the site's listings: the public site shows each solution, marked; the students' shows the gap.

The chapter pages include the real package source (pymdownx.snippets), and the source holds every
exercise's solution between its two marker comments (minifsdp/course/student.py). This hook finds those
blocks in every code listing and marks them, in one of the site's two flavours, chosen by the environment
variable MINIFSDP_SITE:

    python -m mkdocs build                          # public (the default): the code as it is, exercises marked
    MINIFSDP_SITE=student python -m mkdocs build    # student (make docs-student): placeholders, no solutions

- public: the listing shows the source as it is, the solution included. The solution's lines are
  highlighted (pymdownx.highlight's hl_lines, counted from the listing's first line whatever its linenums
  say; added to any hl_lines the listing sets), and a short line follows the listing:

      Highlighted: exercise 6.1 — reduce-scatter the flat gradient, queue it, reshard
      (lines 354–360 of minifsdp/fsdp/runtime.py)

  with the exercise linked to the course's table of exercises (course.md#the-exercises).
- student: between the two marker comments, what a student copy has there instead of the solution,
  `raise NotImplementedError("Exercise 6.1: ...")` (over two lines), highlighted the same way, with the
  same line after the listing. No solution is on the site, in a page or in the search index.

In a student copy (python -m minifsdp student) the source already has the placeholders: both flavours show
them, marked. Listings without an exercise are left as they are.

How: snippets expands the includes while Markdown is converted, after mkdocs's page events, so the hook
adds a Markdown preprocessor that runs right after it (snippets: priority 32; this one: 31.5; the fenced
blocks are parsed at 25). It sees each listing as the page will show it, finds the marker lines, and
compares the code between them with the source's solution (find_exercises says where each one is): only
an exact copy of a solution (or a student copy's placeholder) is marked, so a listing written by hand to
show the convention is left alone. Reported as a warning, which fails a --strict build: a marker without
its partner in a listing (a section that cuts an exercise in two: the part shown would be neither marked
nor, in the students' site, taken out), a listing titled with an exercise's file whose code differs from
the file's, and, in the student flavour, a listing with linenums that holds a solution (the placeholder
is shorter than the solution, so the numbers after it would be wrong).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.exceptions import PluginError

FLAG = "MINIFSDP_SITE"
FLAVOURS = ("public", "student")
COURSE_MODULE = Path("minifsdp") / "course" / "student.py"
COURSE_PAGE, COURSE_ANCHOR = "course.md", "the-exercises"  # the table of exercises, linked under each mark

log = logging.getLogger("mkdocs.hooks.solutions")  # under "mkdocs": a warning fails a --strict build

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_BEGIN = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN\s+EXERCISE\s+(?P<id>\d+\.\d+)\s*:")
_END = re.compile(r"^(?P<indent>[ \t]*)#\s*END\s+EXERCISE\b")
_TITLE = re.compile(r"""\btitle\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_LANG = re.compile(r"^\s*\{?\s*\.?(?P<lang>[\w+#.-]+)(?![\w+#.=-])")  # not an option's name (title=...)
_LINENUMS = re.compile(r"\blinenums\s*=")
_HL_LINES = re.compile(r"""\bhl_lines\s*=\s*(?:"([^"]*)"|'([^']*)')""")


@dataclass(frozen=True)
class Solution:
    id: str
    title: str
    path: str               # relative to the project root, as the listings' titles name it
    first_line: int         # the solution's first line in that file (the line after BEGIN)
    placeholder: tuple[str, ...]  # what a student copy has between the markers, without their indentation
    code: tuple[str, ...]   # the solution, indented relative to its markers; () where the source has none


@dataclass
class _Site:
    flavour: str = "public"
    root: Path = Path(".")
    exercises: dict[str, Solution] | None = None
    course_page: str | None = None


_SITE = _Site()


# -- the exercises, from the project's own course module ------------------------------------------------------

def _course_module(root: Path):
    """minifsdp/course/student.py of the project being built, loaded from its file: importing the package
    would import torch, and could pick up another copy of it than the one whose site this is."""
    path = root / COURSE_MODULE
    if not path.is_file():
        raise PluginError(f"solutions hook: {path} not found; the hook reads the exercises with its find_exercises")
    name = "_minifsdp_site_course_student"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _relative(lines: list[str], indent: str) -> tuple[str, ...]:
    """Lines with the markers' indentation taken off (blank lines become empty, trailing blanks go)."""
    out = []
    for line in lines:
        line = line.rstrip()
        out.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    return tuple(out)


def _is_placeholder(code: tuple[str, ...], ex_id: str) -> bool:
    """The student copy's raise (placeholder_lines: two lines; one in copies made before it wrapped)."""
    written = [line.strip() for line in code if line.strip()]
    return (1 <= len(written) <= 2 and written[0].startswith("raise NotImplementedError(")
            and f"Exercise {ex_id}:" in written[-1])


def load_solutions(root: Path) -> dict[str, Solution]:
    """Every exercise of the project at `root`, with its solution's code (empty where the source holds the
    placeholder instead, as in a student copy)."""
    course = _course_module(root)
    try:
        exercises = course.find_exercises(root)
    except ValueError as e:
        raise PluginError(f"solutions hook: {e}") from e
    solutions: dict[str, Solution] = {}
    for ex in exercises:
        path = Path(ex.path)
        lines = path.read_text(encoding="utf-8").splitlines()
        begin_line = lines[ex.begin - 1]
        indent = begin_line[:len(begin_line) - len(begin_line.lstrip())]
        code = _relative(lines[ex.begin:ex.end - 1], indent)
        while code and not code[-1]:
            code = code[:-1]
        if _is_placeholder(code, ex.id):
            code = ()
        make = getattr(course, "placeholder_lines", None)
        placeholder = tuple(make(ex)) if make else (f"raise NotImplementedError({json.dumps(str(ex))})",)
        rel = path.resolve().relative_to(root.resolve()).as_posix() if path.is_absolute() else path.as_posix()
        solutions[ex.id] = Solution(ex.id, ex.title, rel, ex.begin + 1, placeholder, code)
    return solutions


# -- the listings --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mark:
    """One exercise block a listing shows: its lines there (1-based, counted from the listing's first line,
    as hl_lines counts them), and whether they are the solution or a placeholder."""
    solution: Solution
    first: int
    last: int
    shows_solution: bool


def _closing(lines: list[str], start: int, fence: str) -> int | None:
    """Index of the line that closes a fence opened with `fence` just before `start`, or None."""
    closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
    for j in range(start, len(lines)):
        if closing.match(lines[j]):
            return j
    return None


def _ranges(numbers: list[int]) -> str:
    """hl_lines' form of a set of line numbers: "3-9 12"."""
    out, numbers = [], sorted(set(numbers))
    while numbers:
        first = last = numbers.pop(0)
        while numbers and numbers[0] == last + 1:
            last = numbers.pop(0)
        out.append(str(first) if first == last else f"{first}-{last}")
    return " ".join(out)


def _highlight(info: str, marks: list[Mark]) -> str:
    """The fence's info string with the marked lines added to its hl_lines."""
    lines = [n for m in marks for n in range(m.first, m.last + 1)]
    if not lines:
        return info
    existing = _HL_LINES.search(info)
    if existing:
        for part in (existing.group(1) or existing.group(2) or "").split():
            first, _, last = part.partition("-")
            if first.isdigit() and (not last or last.isdigit()):
                lines += range(int(first), int(last or first) + 1)
        return info[:existing.start()] + f'hl_lines="{_ranges(lines)}"' + info[existing.end():]
    option = f' hl_lines="{_ranges(lines)}"'
    stripped = info.rstrip()
    if stripped.endswith("}"):  # the attribute form: {.python title="..."}
        return stripped[:-1].rstrip() + option + " }"
    return stripped + option


def _label(mark: Mark, indent: str, link: str | None, listing_title: str | None) -> list[str]:
    """The line under a listing that names the exercise its highlighted lines are (and, where they are the
    solution, the file's lines they are: the file where the listing's title does not name it)."""
    sol = mark.solution
    title = sol.title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    name = f"[exercise {sol.id}]({link})" if link else f"exercise {sol.id}"
    if mark.shows_solution:
        last = sol.first_line + len(sol.code) - 1
        of = "" if listing_title == sol.path else f" of `{sol.path}`"
        where = f" (lines {sol.first_line}–{last}{of})"
    else:
        where = ": yours to write"
    return ["", f'{indent}<span class="exercise-mark">Highlighted: {name} — {title}{where}</span>', ""]


def mark_listing(body: list[str], info: str, page: str = "") -> tuple[list[str], list[Mark]]:
    """A listing's lines as the site's flavour shows them (in the student flavour each solution replaced by
    its placeholder), and each exercise block it shows."""
    solutions = _SITE.exercises or {}
    title_match = _TITLE.search(info)
    title = (title_match.group(1) or title_match.group(2)) if title_match else None
    out: list[str] = []
    marks: list[Mark] = []
    k = 0
    while k < len(body):
        line = body[k]
        begin = _BEGIN.match(line)
        sol = solutions.get(begin["id"]) if begin else None
        if sol is None:
            if _END.match(line) and not any(_BEGIN.match(prev) for prev in body[:k]):
                log.warning(f"{page}: a listing shows an END EXERCISE marker without its BEGIN: the section "
                            f"cuts an exercise in two, and the part shown is neither marked nor left out of "
                            f"the students' site")
            out.append(line)
            k += 1
            continue
        indent = begin["indent"]
        end = next((j for j in range(k + 1, len(body)) if _END.match(body[j]) or _BEGIN.match(body[j])), None)
        if end is None or not _END.match(body[end]):
            log.warning(f"{page}: a listing shows the BEGIN marker of exercise {sol.id} without its END: the "
                        f"section cuts the exercise in two, and the part shown is neither marked nor left out "
                        f"of the students' site")
            out.append(line)
            k += 1
            continue
        code = _relative(body[k + 1:end], indent)
        while code and not code[-1]:
            code = code[:-1]
        start = len(out) + 2  # the line after BEGIN, counted from 1
        if code and _is_placeholder(code, sol.id):  # a student copy: the placeholder is what there is to show
            out.extend(body[k:end + 1])
            marks.append(Mark(sol, start, start + end - k - 2, shows_solution=False))
        elif code and code == sol.code:
            if _SITE.flavour == "public":
                out.extend(body[k:end + 1])
                marks.append(Mark(sol, start, start + len(code) - 1, shows_solution=True))
            else:
                out += [line, *(indent + p for p in sol.placeholder), body[end]]
                marks.append(Mark(sol, start, start + len(sol.placeholder) - 1, shows_solution=False))
        else:  # written by hand (the course page shows the convention this way), or a stale copy
            if code and title == sol.path:
                log.warning(f"{page}: the listing of {sol.path} shows exercise {sol.id} with code that is not "
                            f"the file's, so it is not marked")
            out.extend(body[k:end + 1])
        k = end + 1
    replaced = [m.solution.id for m in marks if not m.shows_solution and m.solution.code]
    if replaced and _LINENUMS.search(info):
        log.warning(f"{page}: a listing with linenums holds exercise(s) {', '.join(replaced)}; the student site "
                    f"replaces each solution by its two-line placeholder, so the numbers after it would be "
                    f"wrong: drop linenums, or end the section before the exercise")
    return out, marks


def mark_page(lines: list[str], page: str = "") -> list[str]:
    """The page's Markdown (includes expanded) with every listing's exercises marked (and, in the student
    flavour, their solutions replaced by placeholders)."""
    if not _SITE.exercises:
        return lines
    link = _course_link(page)
    out: list[str] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or (opening["fence"][0] == "`" and "`" in opening["info"]):
            out.append(lines[i])
            i += 1
            continue
        close = _closing(lines, i + 1, opening["fence"])
        if close is None:  # an unclosed fence runs to the end of the page
            out.extend(lines[i:])
            break
        body, marks = mark_listing(lines[i + 1:close], opening["info"], page)
        info = _highlight(opening["info"], marks)
        out += [opening["indent"] + opening["fence"] + info, *body, lines[close]]
        title = _TITLE.search(opening["info"])
        for mark in marks:
            out += _label(mark, opening["indent"], link, title and (title.group(1) or title.group(2)))
        i = close + 1
    return out


def _course_link(page: str) -> str | None:
    """The course's table of exercises, relative to `page` (None where the site has no course page)."""
    if not _SITE.course_page:
        return None
    base = posixpath.dirname(page) or "."
    return posixpath.relpath(_SITE.course_page, base) + "#" + COURSE_ANCHOR


class _MarkExercises(Preprocessor):
    def __init__(self, md, page_name):
        super().__init__(md)
        self.page_name = page_name

    def run(self, lines: list[str]) -> list[str]:
        return mark_page(lines, self.page_name())


class MarkExercisesExtension(Extension):
    """Runs after pymdownx.snippets (32), before the fenced blocks are taken out (superfences: 31.05, 25)."""

    def __init__(self, page_name=lambda: ""):
        super().__init__()
        self.page_name = page_name

    def extendMarkdown(self, md):
        md.preprocessors.register(_MarkExercises(md, self.page_name), "minifsdp_mark_exercises", 31.5)


# -- the mkdocs events ---------------------------------------------------------------------------------------

_current_page = {"name": ""}


def on_config(config):
    flavour = os.environ.get(FLAG, "").strip().lower() or "public"
    if flavour not in FLAVOURS:
        raise PluginError(f"{FLAG}={os.environ[FLAG]!r}: the site flavour is one of {', '.join(FLAVOURS)}")
    _SITE.flavour = flavour
    _SITE.root = Path(config.config_file_path).resolve().parent
    _SITE.exercises = load_solutions(_SITE.root)
    _SITE.course_page = COURSE_PAGE if (Path(config["docs_dir"]) / COURSE_PAGE).is_file() else None
    if not any(isinstance(ext, MarkExercisesExtension) for ext in config.markdown_extensions):
        config.markdown_extensions.append(MarkExercisesExtension(lambda: _current_page["name"]))
    log.info(f"site flavour: {flavour} ({FLAG}); "
             f"{sum(1 for s in _SITE.exercises.values() if s.code)} exercise solution(s) "
             f"{'shown, highlighted' if flavour == 'public' else 'replaced by placeholders'} where a listing "
             f"shows them")
    return config


def on_page_markdown(markdown, page, **kwargs):
    _current_page["name"] = page.file.src_uri  # for the warnings and links: the preprocessor does not know its page
    return markdown
