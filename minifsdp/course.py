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

From Python: `find_exercises`, `strip_solutions`, `write_student_copy`, `chapter_test_files`,
`run_chapter_tests` and `grade`.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import tokenize
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

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
_CHAPTER_TEST = re.compile(r"test_ch(\d+)_\w*\.py")
_MISSING = re.compile(r"NotImplementedError: Exercise \d+\.\d+: .*")


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


# -- grading ------------------------------------------------------------------------------------------------

def chapter_test_files(root: str | Path = ".") -> dict[int, list[Path]]:
    """{chapter: [tests/test_chNN_*.py, ...]} for the project at `root`, by chapter number."""
    by_chapter: dict[int, list[Path]] = {}
    for path in sorted((Path(root) / "tests").glob("test_ch*.py")):
        match = _CHAPTER_TEST.fullmatch(path.name)
        if match:
            by_chapter.setdefault(int(match[1]), []).append(path)
    return dict(sorted(by_chapter.items()))


class Problem(NamedTuple):
    test: str        # a pytest node id, e.g. tests/test_ch01_ddp.py::test_parity[3]
    message: str     # the first line of what went wrong
    details: str     # the whole report: traceback, and a failed rank's own traceback


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    problems: list[Problem] = field(default_factory=list)
    output: str = ""  # what pytest printed

    @property
    def total(self) -> int:
        # A skipped test (say, one that needs GPUs on a laptop) neither earns nor costs a point.
        return self.passed + self.failed + self.errors


def _node_id(project: Path, classname: str, name: str) -> str:
    """junit's dotted classname back into the node id one can paste after `pytest`."""
    parts = classname.split(".") if classname else []
    for i in range(len(parts), 0, -1):
        if project.joinpath(*parts[:i]).with_suffix(".py").is_file():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return "::".join([*parts, name]) if parts else name


def _read_junit(xml: Path, project: Path) -> Counts:
    counts = Counts()
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcomes = {child.tag: child for child in case}
        bad = outcomes.get("failure", outcomes.get("error"))
        if bad is not None:
            if "failure" in outcomes:
                counts.failed += 1
            else:
                counts.errors += 1
            message = (bad.get("message") or "").strip().splitlines()
            node = _node_id(project, case.get("classname", ""), case.get("name", ""))
            counts.problems.append(Problem(node, message[0] if message else bad.tag,
                                           "\n".join(filter(None, [bad.get("message"), bad.text]))))
        elif "skipped" in outcomes:
            counts.skipped += 1
        else:
            counts.passed += 1
    return counts


def _stop(proc: subprocess.Popen) -> None:
    """Stop pytest and the rank processes it started (they share its new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError):  # no process groups (Windows), or already gone
        proc.kill()


def run_chapter_tests(path: str | Path, chapter: int, extra_args: Sequence[str] = (),
                      timeout: float | None = None) -> tuple[int, Counts]:
    """Run one chapter's tests of the project at `path` in a fresh pytest; return (exit code, counts).

    The tests import the package under `path`, never an installed copy: that is what makes a student
    copy's score the student's. `timeout` (seconds) bounds the whole run.
    """
    project = Path(path).resolve()
    files = chapter_test_files(project).get(chapter)
    if not files:
        raise ValueError(f"chapter {chapter} has no tests in {project / 'tests'} (test_ch{chapter:02d}_*.py)")

    # `python -m pytest` puts the working directory first on sys.path, and PYTHONPATH reaches the rank
    # processes the tests spawn; together they beat an installed (even editable) minifsdp.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(project), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix=f"{PACKAGE}-grade-") as tmp:
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *(str(f.relative_to(project)) for f in files), *extra_args]
        proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            _stop(proc)
            output, _ = proc.communicate()
            output += f"\n[{PACKAGE}] stopped after {timeout:g} s"
            returncode = proc.returncode or -signal.SIGKILL
        except BaseException:  # e.g. Ctrl-C while grading: leave no test processes behind
            _stop(proc)
            proc.wait()
            raise
        counts = _read_junit(xml, project) if xml.is_file() else Counts()
    counts.output = output

    # pytest failed without blaming a test (no tests collected, a broken conftest, a timeout): that
    # must still cost the chapter, not read as a clean pass.
    if returncode != 0 and counts.failed + counts.errors == 0:
        tail = output.strip().splitlines()[-1:] or [f"pytest exited with code {returncode}"]
        counts.errors += 1
        counts.problems.append(Problem(f"chapter {chapter}", f"pytest exited with code {returncode}: {tail[0]}",
                                       output))
    return returncode, counts


def _percent(passed: int, total: int) -> str:
    return f"{100 * passed / total:.0f}%" if total else "-"


def _cause(problem: Problem) -> str:
    """One line on why a test does not pass; a missing exercise says which one, wherever it was raised."""
    missing = _MISSING.findall(problem.details)  # the last is the innermost: the traceback's own line
    return missing[-1] if missing else problem.message


def _print_causes(chapter: int, problems: list[Problem], most: int = 5) -> None:
    # One module-scoped fixture that fails takes every test using it down with the same message:
    # show each cause once, with how many tests it costs.
    by_cause: dict[str, list[str]] = {}
    for problem in problems:
        by_cause.setdefault(_cause(problem), []).append(problem.test)
    for cause, tests in list(by_cause.items())[:most]:
        also = f" and {len(tests) - 1} more" if len(tests) > 1 else ""
        print(f"  chapter {chapter}: {tests[0]}{also}\n      {cause[:200]}")
    if len(by_cause) > most:
        print(f"  chapter {chapter}: ... and {len(by_cause) - most} other causes")


def grade(path: str | Path = ".") -> int:
    """Run each chapter's tests of the project (or student copy) at `path`; print a score table.

    Returns 0 when every test passed, 1 otherwise: usable as a command's exit status.
    """
    project = Path(path).resolve()
    chapters = chapter_test_files(project) if project.is_dir() else {}
    if not chapters:
        print(f"Nothing to grade: no chapter tests (tests/test_chNN_*.py) in {project}")
        return 1

    print(f"Grading {project}\n")
    print(f"{'chapter':>7}  {'passed':>9}  {'score':>5}")
    all_passed, passed, total, not_passing = True, 0, 0, {}
    for chapter in chapters:
        returncode, counts = run_chapter_tests(project, chapter)
        notes = [f"{n} {word}" for n, word in [(counts.failed, "failed"),
                                               (counts.errors, "error" if counts.errors == 1 else "errors"),
                                               (counts.skipped, "skipped")] if n]
        print(f"{chapter:>7}  {f'{counts.passed}/{counts.total}':>9}  {_percent(counts.passed, counts.total):>5}"
              f"  {', '.join(notes)}".rstrip(), flush=True)  # one row at a time: a chapter can take a while
        all_passed &= returncode == 0 and counts.failed + counts.errors == 0
        passed, total = passed + counts.passed, total + counts.total
        if counts.problems:
            not_passing[chapter] = counts.problems
    print(f"{'total':>7}  {f'{passed}/{total}':>9}  {_percent(passed, total):>5}")

    if not_passing:
        print("\nNot passing yet:")
        for chapter, problems in not_passing.items():
            _print_causes(chapter, problems)
        first = next(iter(not_passing))
        print(f"\nThe full report of a chapter, e.g. chapter {first}:\n"
              f"  cd {project} && python -m pytest -x tests/test_ch{first:02d}_*.py")
    return 0 if all_passed else 1
