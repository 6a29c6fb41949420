"""Grading: run each chapter's tests against a project (or a student copy of it), print a score.

    python -m minifsdp grade my_copy

A chapter's tests are the files tests/test_chNN_*.py. They run in a fresh pytest process whose imports
resolve to the package *under the graded path* -- a student copy is graded on the student's code, not on
whatever minifsdp happens to be installed. Results are read from pytest's JUnit XML report.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

PACKAGE = "minifsdp"
_CHAPTER_TEST = re.compile(r"test_ch(\d+)_\w*\.py")
_MISSING = re.compile(r"NotImplementedError: Exercise \d+\.\d+: .*")

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
                      timeout: float | None = None, first: str | None = None) -> tuple[int, Counts]:
    """Run one chapter's tests of the project at `path` in a fresh pytest; return (exit code, counts).

    The tests import the package under `path`, never an installed copy: that is what makes a student
    copy's score the student's. `timeout` (seconds) bounds the whole run. `first`: run the test files
    whose name contains it before the others (with -x, the likeliest failure then comes soonest).
    """
    project = Path(path).resolve()
    files = chapter_test_files(project).get(chapter)
    if not files:
        raise ValueError(f"chapter {chapter} has no tests in {project / 'tests'} (test_ch{chapter:02d}_*.py)")
    if first:
        files = sorted(files, key=lambda f: first not in f.name)  # stable: otherwise the usual order

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
