"""The copy that is graded: the reference project, with the submission's code between the exercise markers.

A submission is graded on what the student was asked to write and on nothing else. Its tests,
conftest.py files, ini files and the package code around the exercises are the student's to read, not
to change: a conftest hook can mark every test passed, a deleted test file takes its chapter's tests
with it, an edited helper can return the expected answer. So the graded copy is built from the
reference project (the one with the solutions, or the course's own copy), and only the text between
each graded exercise's two markers comes from the submission -- found by its id anywhere in the
submission's package, so a block that moved still counts.

The submission's files are only ever read as text: nothing in its directory is imported or run, and
git is never run in it (a repository's own config can make git run a command). Whatever the student
changed outside the exercises is listed, so an instructor can look, and changes nothing in the score.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

from minifsdp.course.student import (PACKAGE, Exercise, _parse, copy_files, find_exercises, placeholder_lines,
                                     project_files, walk_files)

# Files that decide which tests run and how: changed, they are reported, never used.
CONFIG_NAMES = {"conftest.py", "pyproject.toml", "setup.cfg", "pytest.ini", "tox.ini", "sitecustomize.py",
                "usercustomize.py"}
_LARGEST = 10 * 2**20  # bytes; a bigger file in a submission is not read (it is not an exercise)

_MARKER_LINE = re.compile(r"[ \t]*#\s*(BEGIN|END)\s+EXERCISE\b(.*)", re.DOTALL)
_BEGIN_ID = re.compile(r"\s+(\d+\.\d+)\s*:.*", re.DOTALL)


class Region(NamedTuple):
    id: str             # "6.1"
    path: Path          # relative to the submission's root
    line: int           # of its BEGIN marker
    indent: str
    body: list[str]     # the lines between the markers


@dataclass(frozen=True)
class Edit:
    path: str           # relative to the project's root
    kind: str           # "changed", "missing" or "added"
    what: str           # "package code outside the exercises" or "test or config file"

    def __str__(self) -> str:
        return f"{self.kind:<8} {self.path}  ({self.what})"


@dataclass
class Assembly:
    root: Path
    exercises: list[Exercise]                                   # the reference's, all of them
    graded: list[str]                                           # ids whose code is the submission's
    missing: dict[str, str] = field(default_factory=dict)       # graded id -> why the placeholder is there
    edits: list[Edit] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# -- reading a submission ------------------------------------------------------------------------------------

def _comment_lines(text: str) -> set[int] | None:
    """Lines that hold a real comment; None when the text does not tokenize (then every line may)."""
    try:
        return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return None


def scan_regions(text: str, path: Path) -> tuple[list[Region], list[tuple[str | None, str]]]:
    """The well-formed exercise regions of one submission file, and (id or None, note) on each malformed one.

    Unlike the reference's markers, which must be perfect, a student's may be broken: one broken pair
    costs only its own exercise. A file that is not valid Python (the student's code may not be) is read
    line by line.
    """
    if "EXERCISE" not in text:  # most files: no marker can be there, and tokenizing is the slow part
        return [], []
    comments = _comment_lines(text)
    lines = text.splitlines(keepends=True)
    regions: list[Region] = []
    notes: list[tuple[str | None, str]] = []
    open_: tuple[str, int, str] | None = None  # (id, line, indent)
    for number, line in enumerate(lines, 1):
        match = _MARKER_LINE.fullmatch(line.rstrip("\r\n"))
        if not match or (comments is not None and number not in comments):
            continue
        indent = line[:len(line) - len(line.lstrip(" \t"))]
        kind, rest = match.groups()
        if kind == "BEGIN":
            if open_ is not None:
                notes.append((open_[0], f"BEGIN on {path}, line {open_[1]} has no END before line {number}"))
            args = _BEGIN_ID.fullmatch(rest)
            open_ = (args[1], number, indent) if args else None
            if not args:
                notes.append((None, f"{path}, line {number}: unreadable BEGIN EXERCISE marker {line.strip()!r}"))
        elif open_ is not None:
            ex_id, begin, begin_indent = open_
            if rest.strip() not in ("", ex_id):
                notes.append((ex_id, f"END on {path}, line {number} names exercise {rest.strip()}"))
            else:
                regions.append(Region(ex_id, path, begin, begin_indent, lines[begin:number - 1]))
            open_ = None
    if open_ is not None:
        notes.append((open_[0], f"BEGIN on {path}, line {open_[1]} has no END"))
    return regions, notes


def _read(path: Path) -> str | None:
    """A submission file's text, or None if it is a link, too big or unreadable."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _LARGEST:
            return None
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _submission_files(root: Path) -> list[Path]:
    return [rel for rel in walk_files(root) if not (root / rel).is_symlink()]


def _package_py(files: Iterable[Path]) -> list[Path]:
    return [rel for rel in files if rel.parts[0] == PACKAGE and rel.suffix == ".py"]


# -- comparing the code around the exercises -----------------------------------------------------------------

def _blank(text: str, spans: Iterable[tuple[int, int]]) -> str:
    """The text with every exercise's lines (between its markers) taken out, line endings normalized."""
    lines = text.replace("\r\n", "\n").splitlines(keepends=True)
    for begin, end in sorted(spans, reverse=True):  # 1-based marker lines
        del lines[begin:end - 1]
    return "".join(lines)


def _reference_spans(text: str, path: Path) -> list[tuple[int, int]]:
    return [(b.exercise.begin, b.exercise.end) for b in _parse(text, path)]


def _is_config(rel: Path) -> bool:
    return rel.parts[0] == "tests" or rel.name in CONFIG_NAMES


def find_edits(reference: Path, submission: Path, ref_files: list[Path], sub_files: list[Path]) -> list[Edit]:
    """Package code changed outside the exercises, and test or config files changed, missing or added."""
    ref_set, sub_set = set(ref_files), set(sub_files)
    edits = []
    for rel in sorted(ref_set | sub_set):
        if rel.parts[0] == PACKAGE:
            what = "package code outside the exercises"
        elif _is_config(rel):
            what = "test or config file"
        else:
            continue
        if rel not in sub_set:
            edits.append(Edit(str(rel), "missing", what))
            continue
        if rel not in ref_set:
            edits.append(Edit(str(rel), "added", what))
            continue
        mine = _read(submission / rel)
        try:
            theirs = (reference / rel).read_bytes()
        except OSError:
            continue
        if mine is None:
            edits.append(Edit(str(rel), "changed", what))
        elif rel.parts[0] == PACKAGE and rel.suffix == ".py":
            ref_text = theirs.decode("utf-8", errors="replace")
            regions, _ = scan_regions(mine, rel)
            if _blank(mine, [(r.line, r.line + len(r.body) + 1) for r in regions]) != \
                    _blank(ref_text, _reference_spans(ref_text, rel)):
                edits.append(Edit(str(rel), "changed", what))
        elif mine.replace("\r\n", "\n") != theirs.decode("utf-8", errors="replace").replace("\r\n", "\n"):
            edits.append(Edit(str(rel), "changed", what))
    return edits


# -- building the graded copy --------------------------------------------------------------------------------

def _reindent(body: list[str], old: str, new: str) -> list[str]:
    """The student's lines moved from their markers' indentation to the reference's."""
    if old == new:
        return body
    return [new + line[len(old):] if line.startswith(old) and line.strip() else line for line in body]


def _outdented(region: Region) -> int | None:
    """The first line of the region's code that is indented less than its markers, or None. Such a line
    would close the block the markers sit in, and what follows it would run outside the exercise: as
    module-level code on import, or as a new definition of anything in the file."""
    for k, line in enumerate(region.body):
        if line.strip() and not line.startswith(region.indent):
            return region.line + 1 + k
    return None


def _choose(ex: Exercise, found: list[Region], rel: Path) -> tuple[Region | None, str]:
    same_file = [r for r in found if r.path == rel]
    chosen = found[0] if len(found) == 1 else (same_file[0] if len(same_file) == 1 else None)
    if chosen is not None:
        line = _outdented(chosen)
        if line is None:
            return chosen, ""
        return None, (f"its code on {chosen.path}, line {line} is indented less than its markers: "
                      f"code there would run outside the exercise")
    if found:
        places = ", ".join(f"{r.path}:{r.line}" for r in found)
        return None, f"its markers appear {len(found)} times ({places})"
    return None, "its markers were not found in the submission's package"


class Assembler:
    """The graded copy of one submission, rebuilt in place for each grading pass: the reference project is
    copied once, the submission read once, and `place` writes the exercise-holding files again with the
    submission's code for the exercises asked, the reference's solution for every other one."""

    def __init__(self, reference: str | Path, submission: str | Path, dest: str | Path,
                 ref_files: list[Path] | None = None):
        self.reference, self.submission = Path(reference).resolve(), Path(submission).resolve()
        self.dest = Path(dest)
        self.exercises = find_exercises(self.reference)
        ref_files = project_files(self.reference) if ref_files is None else ref_files
        self.warnings: list[str] = []
        sub_files = _submission_files(self.submission)
        if (self.submission / PACKAGE).is_symlink():
            self.warnings.append(f"the submission's {PACKAGE}/ is a link; it was not read")
        self.regions: dict[str, list[Region]] = {}
        self.notes: dict[str, list[str]] = {}
        for rel in _package_py(sub_files):
            text = _read(self.submission / rel)
            if text is None:
                continue
            found, problems = scan_regions(text, rel)
            for region in found:
                self.regions.setdefault(region.id, []).append(region)
            for ex_id, problem in problems:
                if ex_id is None:
                    self.warnings.append(problem)
                else:
                    self.notes.setdefault(ex_id, []).append(problem)
        copy_files(self.reference, self.dest, ref_files)
        self.edits = (find_edits(self.reference, self.submission, ref_files, sub_files)
                      if self.submission != self.reference else [])

    def place(self, ids: Iterable[str]) -> Assembly:
        """Write every exercise-holding file of the copy: the submission's code for `ids`, the reference's
        solution for the others. Returns what went in (its warnings: this placement's and the reading's)."""
        wanted = set(ids)
        graded = [ex for ex in self.exercises if ex.id in wanted]
        assembly = Assembly(self.dest, self.exercises, [ex.id for ex in graded], warnings=list(self.warnings),
                            edits=list(self.edits))
        by_file: dict[Path, list[Exercise]] = {}
        for ex in self.exercises:
            by_file.setdefault(ex.path.relative_to(self.reference), [])
        for ex in graded:
            by_file[ex.path.relative_to(self.reference)].append(ex)
        for rel, in_file in by_file.items():
            text = (self.reference / rel).read_text(encoding="utf-8")
            if in_file:
                text = self._with_submissions(text, rel, in_file, assembly)
            (self.dest / rel).unlink()  # a link in the reference is copied as a link: never write through it
            (self.dest / rel).write_text(text, encoding="utf-8")
            try:
                compile(text, str(rel), "exec", dont_inherit=True)
            except SyntaxError as e:
                assembly.warnings.append(f"{rel} is not valid Python with the submission's code in it "
                                         f"({e.msg}, line {e.lineno}; exercise(s) "
                                         f"{', '.join(ex.id for ex in in_file)}): its tests cannot import it")
        return assembly

    def _with_submissions(self, text: str, rel: Path, in_file: list[Exercise], assembly: Assembly) -> str:
        lines = text.splitlines(keepends=True)
        blocks = {b.exercise.id: b for b in _parse(text, rel)}
        for ex in sorted(in_file, key=lambda e: e.begin, reverse=True):  # bottom up: line numbers hold
            block = blocks[ex.id]
            region, why = _choose(ex, self.regions.get(ex.id, []), rel)
            newline = lines[ex.begin - 1][len(lines[ex.begin - 1].rstrip("\r\n")):] or "\n"
            if region is None:
                assembly.missing[ex.id] = "; ".join(self.notes.get(ex.id, [])) or why
                body = placeholder_lines(ex, block.indent, newline)
            else:
                body = _reindent(region.body, region.indent, block.indent)
            lines[ex.begin:ex.end - 1] = body
        return "".join(lines)

    def same_as_reference(self, ex: Exercise) -> bool:
        """The submission's code for this exercise is the reference's solution, as the copy would hold it."""
        region, _ = _choose(ex, self.regions.get(ex.id, []), ex.path.relative_to(self.reference))
        if region is None:
            return False
        text = ex.path.read_text(encoding="utf-8")
        block = next(b for b in _parse(text, ex.path.relative_to(self.reference)) if b.exercise.id == ex.id)
        solution = text.splitlines(keepends=True)[ex.begin:ex.end - 1]
        return _reindent(region.body, region.indent, block.indent) == solution


def assemble(reference: str | Path, submission: str | Path, dest: str | Path,
             chapters: Iterable[int] | None = None, ref_files: list[Path] | None = None) -> Assembly:
    """Write the graded copy to `dest` (an empty or new directory) and say what went into it.

    chapters: the exercises graded (None: all); every other exercise keeps the reference's solution, so
    a chapter can be graded without the ones before it. ref_files: the reference's file list, if known.
    """
    assembler = Assembler(reference, submission, dest, ref_files)
    wanted = None if chapters is None else set(chapters)
    return assembler.place(ex.id for ex in assembler.exercises if wanted is None or ex.chapter in wanted)
