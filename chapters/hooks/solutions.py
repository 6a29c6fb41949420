"""The site's exercise solutions, folded: a listing shows what a student sees, the solution sits under it, closed.

The chapter pages include the real package source (pymdownx.snippets), and the source holds every
exercise's solution between its two marker comments (minifsdp/course/student.py). Shown as it is, each
listing would give the exercise away. So, in every code listing that holds an exercise block, this hook

- keeps the two marker comments and puts what a student copy has between them in place of the
  solution, `raise NotImplementedError("Exercise 1.2: ...")` (over two lines);
- adds, right after the listing, a collapsed block with the solution, its file and its line numbers:

      ??? success "Solution: Exercise 1.2 — average the bucket's gradients with an async all-reduce"

          ```python title="minifsdp/ddp/ddp.py" linenums="193"
          bucket.flat = self._flatten(bucket)
          ...
          ```

Listings without an exercise are left as they are.

The site comes in two flavours, chosen by the environment variable MINIFSDP_SITE:

    python -m mkdocs build                          # public (the default): placeholders, solutions folded
    MINIFSDP_SITE=student python -m mkdocs build    # student: placeholders, no solutions at all

In a student copy (python -m minifsdp student) the source already has the placeholders, so both
flavours show them and there is no solution to fold.

How: snippets expands the includes while Markdown is converted, after mkdocs's page events, so the hook
adds a Markdown preprocessor that runs right after it (snippets: priority 32; this one: 31.5; the fenced
blocks are parsed at 25). It sees each listing as the page will show it, finds the marker lines, and
compares the code between them with the source's solution (find_exercises says where each one is):
only an exact copy of a solution is folded, so a listing written by hand to show the convention is left
alone. A marker without its partner in a listing (a section that cuts an exercise in two), or a listing
titled with an exercise's file whose code differs from the file's, is reported as a warning, which
fails a --strict build.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
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

log = logging.getLogger("mkdocs.hooks.solutions")  # under "mkdocs": a warning fails a --strict build

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_BEGIN = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN\s+EXERCISE\s+(?P<id>\d+\.\d+)\s*:")
_END = re.compile(r"^(?P<indent>[ \t]*)#\s*END\s+EXERCISE\b")
_TITLE = re.compile(r"""\btitle\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_LANG = re.compile(r"^\s*\{?\s*\.?(?P<lang>[\w+#.-]+)(?![\w+#.=-])")  # not an option's name (title=...)
_RENUMBERED = re.compile(r"\b(linenums|hl_lines)\s*=")


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

def _closing(lines: list[str], start: int, fence: str) -> int | None:
    """Index of the line that closes a fence opened with `fence` just before `start`, or None."""
    closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
    for j in range(start, len(lines)):
        if closing.match(lines[j]):
            return j
    return None


def _solution_block(sol: Solution, indent: str, lang: str) -> list[str]:
    inner = indent + "    "
    longest = max([len(line) - len(line.lstrip("`")) for line in sol.code] + [2])
    fence = "`" * (longest + 1)
    title = f"Solution: Exercise {sol.id} — {sol.title}"
    return (["", f'{indent}??? success "{title}"', "",
             f'{inner}{fence}{lang} title="{sol.path}" linenums="{sol.first_line}"']
            + [inner + line if line else "" for line in sol.code]
            + [inner + fence, ""])


def fold_listing(body: list[str], info: str, page: str = "") -> tuple[list[str], list[Solution]]:
    """A listing's lines with each solution replaced by its placeholder, and the solutions taken out."""
    solutions = _SITE.exercises or {}
    title_match = _TITLE.search(info)
    title = (title_match.group(1) or title_match.group(2)) if title_match else None
    out: list[str] = []
    taken: list[Solution] = []
    k = 0
    while k < len(body):
        line = body[k]
        begin = _BEGIN.match(line)
        sol = solutions.get(begin["id"]) if begin else None
        if sol is None:
            if _END.match(line) and not any(_BEGIN.match(prev) for prev in body[:k]):
                log.warning(f"{page}: a listing shows an END EXERCISE marker without its BEGIN: the section "
                            f"cuts an exercise in two, and the part shown is not folded")
            out.append(line)
            k += 1
            continue
        indent = begin["indent"]
        end = next((j for j in range(k + 1, len(body)) if _END.match(body[j]) or _BEGIN.match(body[j])), None)
        if end is None or not _END.match(body[end]):
            log.warning(f"{page}: a listing shows the BEGIN marker of exercise {sol.id} without its END: the "
                        f"section cuts the exercise in two, and the part shown is not folded")
            out.append(line)
            k += 1
            continue
        code = _relative(body[k + 1:end], indent)
        while code and not code[-1]:
            code = code[:-1]
        if _is_placeholder(code, sol.id) or not code:  # a student copy (or an empty block): nothing to fold
            out.extend(body[k:end + 1])
        elif code == sol.code:
            out += [line, *(indent + p for p in sol.placeholder), body[end]]
            taken.append(sol)
        else:  # written by hand (the course page shows the convention this way), or a stale copy
            if title == sol.path:
                log.warning(f"{page}: the listing of {sol.path} shows exercise {sol.id} with code that is not "
                            f"the file's, so it is not folded")
            out.extend(body[k:end + 1])
        k = end + 1
    if taken and _RENUMBERED.search(info):
        log.warning(f"{page}: a listing with linenums or hl_lines holds exercise(s) "
                    f"{', '.join(s.id for s in taken)}; their solutions are replaced by two lines, so the numbers "
                    f"after it would be wrong: drop the option, or end the section before the exercise")
    return out, taken


def fold_page(lines: list[str], page: str = "") -> list[str]:
    """The page's Markdown (includes expanded) with every listing's exercises folded."""
    if not _SITE.exercises:
        return lines
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
        body, taken = fold_listing(lines[i + 1:close], opening["info"], page)
        out += [lines[i], *body, lines[close]]
        if _SITE.flavour == "public":
            lang = m["lang"] if (m := _LANG.match(opening["info"])) else "python"  # every exercise is Python
            for sol in taken:
                out += _solution_block(sol, opening["indent"], lang)
        i = close + 1
    return out


class _FoldSolutions(Preprocessor):
    def __init__(self, md, page_name):
        super().__init__(md)
        self.page_name = page_name

    def run(self, lines: list[str]) -> list[str]:
        return fold_page(lines, self.page_name())


class FoldSolutionsExtension(Extension):
    """Runs after pymdownx.snippets (32), before the fenced blocks are taken out (superfences: 31.05, 25)."""

    def __init__(self, page_name=lambda: ""):
        super().__init__()
        self.page_name = page_name

    def extendMarkdown(self, md):
        md.preprocessors.register(_FoldSolutions(md, self.page_name), "minifsdp_fold_solutions", 31.5)


# -- the mkdocs events ---------------------------------------------------------------------------------------

_current_page = {"name": ""}


def on_config(config):
    flavour = os.environ.get(FLAG, "").strip().lower() or "public"
    if flavour not in FLAVOURS:
        raise PluginError(f"{FLAG}={os.environ[FLAG]!r}: the site flavour is one of {', '.join(FLAVOURS)}")
    _SITE.flavour = flavour
    _SITE.root = Path(config.config_file_path).resolve().parent
    _SITE.exercises = load_solutions(_SITE.root)
    if not any(isinstance(ext, FoldSolutionsExtension) for ext in config.markdown_extensions):
        config.markdown_extensions.append(FoldSolutionsExtension(lambda: _current_page["name"]))
    log.info(f"site flavour: {flavour} ({FLAG}); "
             f"{sum(1 for s in _SITE.exercises.values() if s.code)} exercise solution(s) "
             f"{'folded' if flavour == 'public' else 'left out'} where a listing shows them")
    return config


def on_page_markdown(markdown, page, **kwargs):
    _current_page["name"] = page.file.src_uri  # for the warnings: the preprocessor does not know its page
    return markdown
