"""Course mode: every chapter is also an assignment.

An exercise is a block of solution code in the package source, between two marker comments written at
the same indentation as the code they enclose:

    # BEGIN EXERCISE 1.2: flatten the bucket's gradients, average them with an async all-reduce
    ...the solution...
    # END EXERCISE

The id is "chapter.k". A *student copy* of the project replaces each block, markers included, by one line

    raise NotImplementedError("Exercise 1.2: flatten the bucket's gradients, average them with an async all-reduce")

so the package still imports, and that chapter's tests (tests/test_chNN_*.py) fail until the student
writes the code back. The grader runs each chapter's tests against a project, or a student copy of it,
and prints a score per chapter:

    python -m minifsdp student my_copy              # every exercise removed (--only 1.2: just that one)
    python -m minifsdp grade my_copy

From Python: `find_exercises`, `strip_solutions`, `write_student_copy`; grading lives in grade.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

PACKAGE = "minifsdp"

# Directories that are never part of a student copy: version control, caches, and things that are built
# (the docs site, wheels, egg-info). The student gets the sources and regenerates the rest.
_SKIP_DIRS = {".git", "__pycache__", "site", "build", "dist", ".pytest_cache", ".ipynb_checkpoints",
              ".benchmarks", ".hypothesis", ".mypy_cache", ".ruff_cache", ".venv"}
_SKIP_SUFFIXES = (".egg-info", ".pyc", ".pyo")

# A marker is any comment starting like one; anything after that must then be well formed, so a typo
# is an error instead of a solution silently shipped to students.
_MARKER = re.compile(r"#\s*(BEGIN|END)\s+EXERCISE\b(.*)", re.DOTALL)
_BEGIN_REST = re.compile(r"\s+(\d+)\.(\d+)\s*:\s*(\S.*?)\s*")


@dataclass(frozen=True)
class Exercise:
    id: str          # "1.2"
    title: str
    path: Path       # the source file that holds the solution
    begin: int       # line of the BEGIN marker (1-based)
    end: int         # line of the END marker
    chapter: int

    def __str__(self) -> str:
        return f"Exercise {self.id}: {self.title}"


class _Block(NamedTuple):
    exercise: Exercise
    indent: str      # the markers' indentation, which the replacement line takes


# -- finding and removing solutions -------------------------------------------------------------------------

def _parse(text: str, path: str | Path = "<string>") -> list[_Block]:
    """Every exercise block in one file's text, with its markers checked."""
    def where(line: int) -> str:
        return f"{path}, line {line}"

    # Only real comments count: a docstring that shows the convention (this module's does) is not a block.
    try:
        comments = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError) as e:
        raise ValueError(f"{path}: cannot read the exercise markers, the file is not valid Python: {e}") from e

    blocks: list[_Block] = []
    seen: dict[str, int] = {}
    open_: tuple[int, str, int, str, str] | None = None  # (line, indent, chapter, id, title)
    for tok in comments:
        match = _MARKER.match(tok.string)
        if not match:
            continue
        line, col = tok.start
        indent = tok.line[:col]
        kind, rest = match.groups()
        if indent.strip():
            raise ValueError(f"{where(line)}: an exercise marker must be on a line of its own")
        if kind == "BEGIN":
            if open_ is not None:
                raise ValueError(f"{where(line)}: BEGIN EXERCISE inside exercise {open_[3]} (begun on line "
                                 f"{open_[0]}); exercises cannot be nested")
            args = _BEGIN_REST.fullmatch(rest)
            if not args:
                raise ValueError(f"{where(line)}: expected '# BEGIN EXERCISE <chapter>.<k>: <title>', "
                                 f"got {tok.string!r}")
            chapter, k, title = int(args[1]), int(args[2]), args[3]
            ex_id = f"{chapter}.{k}"
            if ex_id in seen:
                raise ValueError(f"{where(line)}: exercise {ex_id} is already defined on line {seen[ex_id]}")
            seen[ex_id] = line
            open_ = (line, indent, chapter, ex_id, title)
        else:
            if open_ is None:
                raise ValueError(f"{where(line)}: END EXERCISE without a BEGIN EXERCISE before it")
            begin, begin_indent, chapter, ex_id, title = open_
            if rest.strip() not in ("", ex_id):
                raise ValueError(f"{where(line)}: END EXERCISE {rest.strip()} closes exercise {ex_id} "
                                 f"(begun on line {begin})")
            if indent != begin_indent:
                raise ValueError(f"{where(line)}: END EXERCISE is not at the indentation of its BEGIN "
                                 f"(line {begin}); both must be at the indentation of the code inside")
            blocks.append(_Block(Exercise(ex_id, title, Path(path), begin, line, chapter), begin_indent))
            open_ = None
    if open_ is not None:
        raise ValueError(f"{where(open_[0])}: BEGIN EXERCISE {open_[3]} has no END EXERCISE")
    return blocks


def _placeholder(exercise: Exercise) -> str:
    # A JSON string is also a valid Python string literal: quotes and backslashes in a title are escaped.
    return f"raise NotImplementedError({json.dumps(str(exercise), ensure_ascii=False)})"


def _strip(text: str, only: str | None, path: str | Path) -> tuple[str, list[tuple[Exercise, int]]]:
    """The stripped text, and each removed exercise with the line its placeholder lands on."""
    lines = text.splitlines(keepends=True)
    removed: list[tuple[Exercise, int]] = []
    shift = 0  # how many lines the blocks removed so far have taken away
    for block in _parse(text, path):
        ex = block.exercise
        if only is not None and ex.id != only:
            continue
        first, last = ex.begin - 1 - shift, ex.end - 1 - shift
        newline = lines[first][len(lines[first].rstrip("\r\n")):] or "\n"
        lines[first:last + 1] = [block.indent + _placeholder(ex) + newline]
        removed.append((ex, first + 1))
        shift += ex.end - ex.begin
    return "".join(lines), removed


def strip_solutions(text: str, only: str | None = None, path: str | Path = "<string>") -> str:
    """`text` with every exercise block (or just exercise `only`, e.g. "1.2") replaced by a raise.

    Malformed markers raise ValueError naming `path` and the line.
    """
    return _strip(text, only, path)[0]


def _package_sources(root: Path) -> list[Path]:
    package = root / PACKAGE
    if not package.is_dir():
        raise FileNotFoundError(f"no {PACKAGE}/ package in {root}: point at the project's top directory")
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def find_exercises(root: str | Path = ".") -> list[Exercise]:
    """Every exercise in the package under `root`, ordered by id. Bad or duplicated markers raise ValueError."""
    found: dict[str, Exercise] = {}
    for path in _package_sources(Path(root)):
        for block in _parse(path.read_text(encoding="utf-8"), path):
            ex = block.exercise
            if ex.id in found:
                first = found[ex.id]
                raise ValueError(f"{path}, line {ex.begin}: exercise {ex.id} is already defined in "
                                 f"{first.path}, line {first.begin}")
            found[ex.id] = ex
    return sorted(found.values(), key=_id_order)


def _id_order(exercise: Exercise) -> tuple[int, int]:
    chapter, k = exercise.id.split(".")
    return int(chapter), int(k)  # so that 1.10 comes after 1.9


# -- the student copy ---------------------------------------------------------------------------------------

def _copy_tree(src: Path, out: Path) -> None:
    """Copy the project's files; links stay links, so a link to a big dataset is not duplicated."""
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        target = out / here.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        keep = []
        for name in sorted(dirnames):
            if name in _SKIP_DIRS or name.endswith(_SKIP_SUFFIXES) or (here / name).resolve() == out:
                continue
            if (here / name).is_symlink():
                os.symlink(os.readlink(here / name), target / name)
                continue
            keep.append(name)
        dirnames[:] = keep
        for name in filenames:
            if name.endswith(_SKIP_SUFFIXES):
                continue
            if (here / name).is_symlink():
                os.symlink(os.readlink(here / name), target / name)
            else:
                shutil.copy2(here / name, target / name)


def write_student_copy(src_root: str | Path = ".", out_dir: str | Path = "student",
                       only: str | None = None) -> list[Exercise]:
    """Copy the project at `src_root` to `out_dir` with the exercise solutions removed; return those removed.

    only: remove just this exercise (e.g. "1.2"), leaving the others solved.
    Refuses an `out_dir` that exists and is not empty: it may hold a student's work.
    """
    src, out = Path(src_root).resolve(), Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; a student copy is only ever written to "
                              f"a new or empty directory, so nobody's work is overwritten. Choose another "
                              f"directory, or remove this one yourself.")

    exercises = find_exercises(src)
    if only is not None and only not in {e.id for e in exercises}:
        known = ", ".join(e.id for e in exercises) or "none"
        raise ValueError(f"no exercise {only!r} in {src / PACKAGE} (exercises: {known})")

    # Strip everything in memory first: a bad marker must stop us before a half-made copy exists.
    stripped: dict[Path, str] = {}
    removed: list[tuple[Exercise, int]] = []
    for path in _package_sources(src):
        rel = path.relative_to(src)
        text, gone = _strip(path.read_text(encoding="utf-8"), only, rel)
        if gone:
            try:
                compile(text, str(rel), "exec", dont_inherit=True)
            except SyntaxError as e:
                raise ValueError(f"{rel}: removing {', '.join(ex.id for ex, _ in gone)} leaves invalid Python "
                                 f"({e.msg}, line {e.lineno}); is a block's code less indented than its "
                                 f"markers?") from e
            stripped[rel] = text
            removed += gone

    removed.sort(key=lambda gone: _id_order(gone[0]))
    _copy_tree(src, out)
    for rel, text in stripped.items():
        (out / rel).write_text(text, encoding="utf-8")

    print(f"Student copy of {src} written to {out}")
    print(f"{len(removed)} exercise(s) removed; each now raises NotImplementedError until it is written:")
    for ex, line in removed:
        print(f"  {ex.id:>5}  {ex.path}:{line}  {ex.title}")
    print(f"Grade the work, chapter by chapter, with:\n  python -m {PACKAGE} grade {out}")
    gone = {ex.id for ex, _ in removed}
    return [ex for ex in exercises if ex.id in gone]
