"""Course mode: every chapter is also an assignment.

An exercise is a block of solution code in the package source, between two marker comments written at
the same indentation as the code they enclose:

    # BEGIN EXERCISE 1.2: flatten the bucket's gradients, average them with an async all-reduce
    ...the solution...
    # END EXERCISE

The id is "chapter.k". A *student copy* of the project keeps the two markers and replaces what is
between them by one line

    raise NotImplementedError("Exercise 1.2: flatten the bucket's gradients, average them with an async all-reduce")

so the package still imports, and that chapter's tests (tests/test_chNN_*.py) fail until the student
writes the code back -- between the markers, which is where the grader (grade.py) takes it from:

    python -m minifsdp student ../my_copy           # every exercise removed (--only 1.2, --chapters 6,7)
    python -m minifsdp grade ../my_copy

A student copy holds what git would commit (tracked and untracked files, nothing ignored) when the
project is a git work tree, and otherwise the project's files less caches and build outputs; never the
instructor's directory (`instructor/`: the answers to the chapters' "why" questions, and the wrong solutions
that show what the mechanism tests catch).

From Python: `find_exercises`, `strip_solutions`, `write_student_copy`, `project_files`.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

PACKAGE = "minifsdp"

# Directories that are never part of a student copy: version control, caches, and things that are built
# (the docs site, wheels, egg-info). The student gets the sources and regenerates the rest.
_SKIP_DIRS = {".git", "__pycache__", "site", "build", "dist", ".pytest_cache", ".ipynb_checkpoints",
              ".benchmarks", ".hypothesis", ".mypy_cache", ".ruff_cache", ".venv", "node_modules"}
_SKIP_SUFFIXES = (".egg-info", ".pyc", ".pyo")

# Top-level directories for the instructor's eyes only: what answers the exercises in words or in code.
INSTRUCTOR_ONLY = ("instructor",)

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

    if "EXERCISE" not in text:  # most files: no marker can be there, and tokenizing is the slow part
        return []

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


def placeholder_lines(exercise: Exercise, indent: str = "", newline: str = "") -> list[str]:
    """What a student copy has between an exercise's markers: a raise of NotImplementedError naming the
    exercise, over two lines (each ended by `newline`), so that with its title it still fits the docs'
    80-column listings."""
    # A JSON string is also a valid Python string literal: quotes and backslashes in a title are escaped.
    return [f"{indent}raise NotImplementedError({newline}",
            f"{indent}    {json.dumps(str(exercise), ensure_ascii=False)}){newline}"]


def placeholder_line(exercise: Exercise, indent: str, newline: str = "\n") -> str:
    """placeholder_lines as one text."""
    return "".join(placeholder_lines(exercise, indent, newline))


def _newline(line: str) -> str:
    return line[len(line.rstrip("\r\n")):] or "\n"


def _strip(text: str, chosen: Callable[[Exercise], bool],
           path: str | Path) -> tuple[str, list[tuple[Exercise, int]]]:
    """The stripped text, and each removed exercise with the line its placeholder lands on."""
    lines = text.splitlines(keepends=True)
    removed: list[tuple[Exercise, int]] = []
    shift = 0  # how many lines the blocks replaced so far have taken away
    for block in _parse_once(text, str(path)):
        ex = block.exercise
        if not chosen(ex):
            continue
        # The markers stay: the student writes between them, and the grader reads what is there.
        begin, end = ex.begin - 1 - shift, ex.end - 1 - shift  # 0-based lines of the two markers
        placeholder = placeholder_lines(ex, block.indent, _newline(lines[begin]))
        lines[begin + 1:end] = placeholder
        removed.append((ex, begin + 2))
        shift += end - begin - 1 - len(placeholder)
    return "".join(lines), removed


def _chooser(only: str | None, chapters: Iterable[int] | None) -> Callable[[Exercise], bool]:
    wanted = None if chapters is None else set(chapters)
    return lambda ex: (only is None or ex.id == only) and (wanted is None or ex.chapter in wanted)


def strip_solutions(text: str, only: str | None = None, path: str | Path = "<string>",
                    chapters: Iterable[int] | None = None) -> str:
    """`text` with the code inside every exercise block replaced by a raise; the markers stay.

    only: just this exercise (e.g. "1.2"); chapters: just the exercises of these chapters.
    Malformed markers raise ValueError naming `path` and the line.
    """
    return _strip(text, _chooser(only, chapters), path)[0]


def _package_sources(root: Path) -> list[Path]:
    package = root / PACKAGE
    if not package.is_dir():
        raise FileNotFoundError(f"no {PACKAGE}/ package in {root}: point at the project's top directory")
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=64)
def _parse_once(text: str, path: str) -> tuple[_Block, ...]:
    # A student copy reads every exercise twice (find, then strip), the removal check once per exercise:
    # tokenizing is what that costs, so a file's text is tokenized once.
    return tuple(_parse(text, path))


def find_exercises(root: str | Path = ".") -> list[Exercise]:
    """Every exercise in the package under `root`, ordered by id. Bad or duplicated markers raise ValueError."""
    found: dict[str, Exercise] = {}
    for path in _package_sources(Path(root)):
        for block in _parse_once(path.read_text(encoding="utf-8"), str(path)):
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

def _git_files(root: Path) -> list[Path] | None:
    """What git would commit under `root` (tracked, or untracked and not ignored); None if not a work tree."""
    try:
        inside = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"],
                                capture_output=True, text=True, timeout=60)
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):  # no git at all: the walk below stands in
        return None
    names = sorted({name for name in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if name})
    return [Path(name) for name in names]


def walk_files(root: Path, skip: Path | None = None) -> list[Path]:
    """The project's files (relative paths) less caches, build outputs and version control; links are not
    followed, so a link to a big dataset is listed once, as a link."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        keep = []
        for name in sorted(dirnames):
            if name in _SKIP_DIRS or name.endswith(_SKIP_SUFFIXES) or (skip and (here / name).resolve() == skip) \
                    or (here / name / "pyvenv.cfg").is_file():  # a virtual environment, whatever its name
                continue
            if (here / name).is_symlink():
                found.append((here / name).relative_to(root))
            else:
                keep.append(name)
        dirnames[:] = keep
        found += [(here / name).relative_to(root) for name in filenames if not name.endswith(_SKIP_SUFFIXES)]
    return sorted(found)


def project_files(root: str | Path, skip: str | Path | None = None) -> list[Path]:
    """The files (relative paths) that make up the project at `root`: what git lists when it is a git work
    tree, else the walk's. `skip`: a directory left out (a student copy being written inside the project)."""
    root = Path(root).resolve()
    skip = Path(skip).resolve() if skip is not None else None
    listed = _git_files(root)
    if not listed:
        return walk_files(root, skip)
    inside = skip.relative_to(root) if skip is not None and skip.is_relative_to(root) else None
    return [rel for rel in listed if os.path.lexists(root / rel)  # a deleted but still tracked file: gone
            and not (inside is not None and rel.is_relative_to(inside))]


def copy_files(src: Path, out: Path, files: Iterable[Path]) -> None:
    """Copy these files of `src` to `out`; links stay links."""
    for rel in files:
        source, target = src / rel, out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif source.is_dir():  # a git submodule: its own files
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)


def write_student_copy(src_root: str | Path = ".", out_dir: str | Path = "student", only: str | None = None,
                       chapters: Iterable[int] | None = None, quiet: bool = False,
                       pass_line: float | None = None) -> list[Exercise]:
    """Copy the project at `src_root` to `out_dir` with the exercise solutions removed; return those removed.

    only: remove just this exercise (e.g. "1.2"); chapters: just these chapters' exercises. The others
    stay solved. Refuses an `out_dir` that exists and is not empty: it may hold a student's work.
    quiet: print nothing (else: what was removed, and where). pass_line: the most an exercise that skips its
    mechanism scores (points.py), recorded in the copy's assignment; None leaves the grader's default.
    """
    src, out = Path(src_root).resolve(), Path(out_dir).resolve()
    if pass_line is not None:
        pass_line = check_pass_line(pass_line)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; a student copy is only ever written to "
                              f"a new or empty directory, so nobody's work is overwritten. Choose another "
                              f"directory, or remove this one yourself.")

    exercises = find_exercises(src)
    known = ", ".join(e.id for e in exercises) or "none"
    if only is not None and only not in {e.id for e in exercises}:
        raise ValueError(f"no exercise {only!r} in {src / PACKAGE} (exercises: {known})")
    if chapters is not None:
        chapters = sorted(set(chapters))
        empty = [c for c in chapters if not any(e.chapter == c for e in exercises)]
        if empty:
            raise ValueError(f"chapter(s) {', '.join(map(str, empty))} have no exercise in {src / PACKAGE} "
                             f"(exercises: {known})")

    # Strip everything in memory first: a bad marker must stop us before a half-made copy exists.
    files = [rel for rel in project_files(src, skip=out) if rel.parts[0] not in INSTRUCTOR_ONLY]
    stripped: dict[Path, str] = {}
    removed: list[tuple[Exercise, int]] = []
    for path in _package_sources(src):
        rel = path.relative_to(src)
        text, gone = _strip(path.read_text(encoding="utf-8"), _chooser(only, chapters), path)
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
    out.mkdir(parents=True, exist_ok=True)
    copy_files(src, out, files)
    for rel, text in stripped.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).unlink(missing_ok=True)  # a link is copied as a link: never write through it
        (out / rel).write_text(text, encoding="utf-8")

    gone_ids = {ex.id for ex, _ in removed}
    write_assignment(out, src, [ex for ex in exercises if ex.id in gone_ids], pass_line)
    if not quiet:
        print(f"Student copy of {src} written to {out}")
        print(f"{len(removed)} exercise(s) removed; each now raises NotImplementedError until it is written "
              f"between its markers:")
        for ex, line in removed:
            print(f"  {ex.id:>5}  {ex.path.relative_to(src)}:{line}  {ex.title}")
        print(f"Grade the work, chapter by chapter, with:\n  python -m {PACKAGE} grade {out}\n"
              f"(it grades the chapters handed out, against {src}'s tests: {ASSIGNMENT_FILE} in the copy says so)")
    return [ex for ex in exercises if ex.id in gone_ids]


# -- what a copy was handed out for ----------------------------------------------------------------------------

ASSIGNMENT_FILE = "assignment.json"


def check_pass_line(value) -> float:
    """The pass line an instructor gave, as points of 100 (assignment.py's [Note: the pass line])."""
    try:
        line = float(value)
    except (TypeError, ValueError):
        line = float("nan")
    if not 0 <= line <= 100:
        raise ValueError(f"the pass line is a number of points from 0 to 100 (an exercise is worth 100), "
                         f"not {value!r}")
    return line


def write_assignment(out: Path, course: Path, handed_out: list[Exercise], pass_line: float | None = None) -> None:
    """The copy remembers its assignment: the exercises removed, their chapters, and the course project it was
    made from, whose tests grade it (never the copy's own, which a student can edit); and the pass line, if the
    instructor set one."""
    record = {"course": str(course), "exercises": [ex.id for ex in handed_out],
              "chapters": sorted({ex.chapter for ex in handed_out})}
    if pass_line is not None:
        record["pass_line"] = pass_line
    (out / ASSIGNMENT_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_assignment(root: str | Path) -> dict | None:
    """A student copy's assignment (write_assignment), or None where `root` holds none."""
    path = Path(root) / ASSIGNMENT_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        read = {"course": str(record["course"]), "exercises": [str(e) for e in record["exercises"]],
                "chapters": [int(c) for c in record["chapters"]]}
        if "pass_line" in record:
            read["pass_line"] = float(record["pass_line"])
        return read
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an assignment this package wrote ({e}); pass --reference and "
                         f"--chapters to grade the copy") from e
