"""Grading: score a submission chapter by chapter, and exercise by exercise, on the reference's tests.

    python -m minifsdp grade my_copy [--reference REF] [--chapters 6,7] [--json F] [--gradescope F] [--junit DIR]
    python -m minifsdp grade-all submissions/ [--chapters 6,7] [--out grades]

The submission supplies only the code between its exercise markers (assemble.py builds the copy that is
graded); the tests, conftest.py, pytest configuration and the rest of the package are the reference's.
The reference is, unless told otherwise, the project that holds the running package.

A chapter's tests are the files tests/test_chNN_*.py. Each chapter runs in a fresh pytest process in
that copy, with a time limit, and its imports resolve to the copy alone: never to the submission's
directory or an installed minifsdp (runner.py). The outcomes come from the grader's own plugin (plugin.py),
loaded from a directory that holds only it. The maximum comes from collecting the reference's tests, so a
chapter that crashes, hangs or cannot even be collected scores 0 of its real maximum instead of
vanishing. A test that is skipped (one that needs GPUs, on a laptop) neither earns nor costs a point.

An exercise's tests are those marked @pytest.mark.exercise("<id>"); those also marked
@pytest.mark.mechanism check how it is done (collectives issued, memory freed), and are counted apart
too. A test with no exercise mark counts for its chapter only. Output: a table (report.py), and on
request JSON, Gradescope's results.json and pytest's JUnit XML.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from minifsdp.course.assemble import assemble
from minifsdp.course.runner import PytestRun, plugin_dir, run_pytest
from minifsdp.course.student import (ASSIGNMENT_FILE, PACKAGE, Exercise, copy_files, find_exercises, project_files,
                                     read_assignment)

DEFAULT_TIMEOUT = 900.0  # seconds per chapter: the longest chapter takes a few minutes on two cores
_CHAPTER_TEST = re.compile(r"test_ch(\d+)_\w*\.py")


def chapter_test_files(root: str | Path = ".") -> dict[int, list[Path]]:
    """{chapter: [tests/test_chNN_*.py, ...]} for the project at `root`, by chapter number."""
    by_chapter: dict[int, list[Path]] = {}
    for path in sorted((Path(root) / "tests").glob("test_ch*.py")):
        match = _CHAPTER_TEST.fullmatch(path.name)
        if match:
            by_chapter.setdefault(int(match[1]), []).append(path)
    return dict(sorted(by_chapter.items()))


def chapter_of(node_id: str) -> int | None:
    match = _CHAPTER_TEST.fullmatch(node_id.split("::")[0].rsplit("/", 1)[-1])
    return int(match[1]) if match else None


def default_reference() -> Path:
    """The project that holds the running package, if it has its tests (an installed wheel does not)."""
    import minifsdp

    root = Path(minifsdp.__file__).resolve().parents[1]
    if not (root / "tests").is_dir():
        raise FileNotFoundError(f"the running {PACKAGE} ({root / PACKAGE}) is not inside a project with its "
                                f"tests/; pass --reference with the course project (the one with the solutions)")
    return root


def assignment_defaults(submission: str | Path, reference: str | Path | None,
                        chapters: Iterable[int] | str | None) -> tuple[str | Path | None, Iterable[int] | str | None]:
    """--reference and --chapters for a student copy, where not given: what its assignment says (the course
    project it was made from, the chapters handed out). A copy is never its own reference: its tests and
    conftest.py are the student's to edit."""
    record = read_assignment(submission)
    if record is None:
        return reference, chapters
    if reference is None:
        course = Path(record["course"])
        if not (course / PACKAGE).is_dir() or not (course / "tests").is_dir():
            raise FileNotFoundError(
                f"{Path(submission).resolve()} is a student copy of the course project at {course} (its "
                f"{ASSIGNMENT_FILE} says so), which is not on this machine: grade it against the course's tests "
                f"with --reference PATH")
        reference = course
    if Path(reference).resolve() == Path(submission).resolve():
        raise ValueError(f"{Path(submission).resolve()} is a student copy and cannot be its own reference: its "
                         f"tests would grade it. Pass --reference PATH, the course project")
    if chapters is None and record["chapters"]:
        chapters = record["chapters"]
    return reference, chapters


# -- what the reference asks ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Test:
    id: str                      # a node id, e.g. tests/test_ch01_ddp.py::test_parity[3]
    chapter: int
    exercises: tuple[str, ...]   # from its exercise marks
    mechanism: bool
    skip: str | None             # why a skip mark skips it before it runs


@dataclass
class Reference:
    root: Path
    files: list[Path]                     # what a copy of it holds
    exercises: list[Exercise]
    chapter_files: dict[int, list[str]]   # chapter -> its test files, relative
    tests: dict[int, list[Test]]          # chapter -> its collected tests
    warnings: list[str] = field(default_factory=list)

    def maximum(self, chapter: int) -> int:
        return sum(t.skip is None for t in self.tests.get(chapter, []))

    def restricted(self, chapters: Iterable[int]) -> "Reference":
        """The same reference, grading only these chapters (without collecting again)."""
        chapters = [c for c in self.tests if c in set(chapters)]
        return Reference(self.root, self.files, self.exercises, {c: self.chapter_files[c] for c in chapters},
                         {c: self.tests[c] for c in chapters}, list(self.warnings))


def parse_chapters(chapters: Iterable[int] | str | None) -> list[int] | None:
    if chapters is None or isinstance(chapters, (list, tuple, set)) and not chapters:
        return None
    if isinstance(chapters, str):
        try:
            return sorted({int(c) for c in chapters.replace(" ", "").split(",") if c})
        except ValueError:
            raise ValueError(f"--chapters takes chapter numbers separated by commas (e.g. 6,7), not {chapters!r}")
    return sorted(set(chapters))


def collect_reference(reference: str | Path | None, chapters: Iterable[int] | str | None, plugins: Path,
                      timeout: float = DEFAULT_TIMEOUT) -> Reference:
    """The reference's chapter tests and their marks, collected once (pytest --collect-only) in a copy of it."""
    root = Path(reference).resolve() if reference is not None else default_reference()
    if not (root / PACKAGE).is_dir():
        raise FileNotFoundError(f"no {PACKAGE}/ package in the reference {root}")
    files = project_files(root)
    by_chapter: dict[int, list[str]] = {}
    for rel in files:
        if len(rel.parts) == 2 and rel.parts[0] == "tests" and _CHAPTER_TEST.fullmatch(rel.name):
            by_chapter.setdefault(chapter_of(rel.name), []).append(rel.as_posix())
    wanted = parse_chapters(chapters)
    if wanted is not None:
        unknown = [c for c in wanted if c not in by_chapter]
        if unknown:
            raise ValueError(f"chapter(s) {', '.join(map(str, unknown))} have no tests in {root / 'tests'} "
                             f"(chapters with tests: {', '.join(map(str, sorted(by_chapter))) or 'none'})")
        by_chapter = {c: by_chapter[c] for c in wanted}
    by_chapter = dict(sorted(by_chapter.items()))
    if not by_chapter:
        raise ValueError(f"nothing to grade: no chapter tests (tests/test_chNN_*.py) in {root}")

    ref = Reference(root, files, find_exercises(root), by_chapter, {c: [] for c in by_chapter})
    with tempfile.TemporaryDirectory(prefix=f"{PACKAGE}-reference-") as tmp:
        copy_files(root, Path(tmp), files)  # exactly what each graded copy will hold
        run = run_pytest(tmp, ["--collect-only", *(f for fs in by_chapter.values() for f in fs)], plugins, timeout)
    if run.report is None:
        raise RuntimeError(f"could not collect the reference's tests in {root}:\n{run.output[-3000:]}")
    for test in run.report["collected"]:
        chapter = chapter_of(test["id"])
        if chapter in ref.tests:
            ref.tests[chapter].append(Test(test["id"], chapter, tuple(test["exercises"]), test["mechanism"],
                                           test["skip"]))
    for error in run.report["collect_errors"]:
        ref.warnings.append(f"the reference's {error['id']} cannot be collected ({error['cause']}); its tests "
                            f"are not graded")
    known = {ex.id for ex in ref.exercises}
    stray = sorted({e for ts in ref.tests.values() for t in ts for e in t.exercises} - known)
    if stray:
        ref.warnings.append(f"tests are marked with exercise(s) {', '.join(stray)}, which the reference's package "
                            f"does not have")
    return ref


# -- scoring -------------------------------------------------------------------------------------------------

def _score_chapter(ref: Reference, chapter: int, run: PytestRun) -> dict:
    if run.timed_out:
        status = f"stopped after {run.seconds:.0f} s (time limit)"
    elif run.report is None:
        tail = [line for line in run.output.strip().splitlines() if line.strip()][-1:]
        status = f"pytest ended (exit code {run.returncode}) without a report: {tail[0] if tail else ''}".rstrip(": ")
    else:
        status = "ran"
    results = run.report["results"] if run.report else {}
    broken = {e["id"]: e["cause"] for e in (run.report or {}).get("collect_errors", [])}
    passed, failed, skipped = [], [], []
    for test in ref.tests[chapter]:
        result = results.get(test.id)
        if test.skip is not None:
            skipped.append({"id": test.id, "cause": test.skip})
        elif status != "ran":
            failed.append({"id": test.id, "cause": status})
        elif result is None:
            file = test.id.split("::")[0]
            cause = f"not collected: {broken[file]}" if file in broken else "did not run"
            failed.append({"id": test.id, "cause": cause})
        elif result["outcome"] == "passed":
            passed.append(test.id)
        elif result["outcome"] == "skipped":
            skipped.append({"id": test.id, "cause": result["cause"] or "skipped"})
        else:
            failed.append({"id": test.id, "cause": result["cause"] or result["outcome"]})
    return {"chapter": chapter, "score": len(passed), "max": len(passed) + len(failed), "status": status,
            "seconds": round(run.seconds, 1), "passed": passed, "failed": failed, "skipped": skipped,
            "test_seconds": {t: round(results[t]["seconds"], 3) for t in passed + [f["id"] for f in failed]
                             if t in results}}


def _score_exercises(ref: Reference, graded: list[Exercise], chapters: dict[int, dict],
                     missing: dict[str, str]) -> list[dict]:
    outcome: dict[str, bool | None] = {}  # test id -> passed (None: skipped)
    seconds: dict[str, float] = {}        # test id -> its set-up, call and tear-down, as pytest timed them
    for chapter in chapters.values():
        seconds.update(chapter["test_seconds"])
        outcome.update({t: True for t in chapter["passed"]})
        outcome.update({t["id"]: False for t in chapter["failed"]})
        outcome.update({t["id"]: None for t in chapter["skipped"]})
    rows = []
    for ex in graded:
        tests = [t for c in chapters for t in ref.tests[c] if ex.id in t.exercises and outcome.get(t.id) is not None]
        mechanism = [t for t in tests if t.mechanism]
        rows.append({"id": ex.id, "chapter": ex.chapter, "title": ex.title,
                     "from_submission": ex.id not in missing, "note": missing.get(ex.id),
                     "score": sum(outcome[t.id] for t in tests), "max": len(tests),
                     "mechanism": {"score": sum(outcome[t.id] for t in mechanism), "max": len(mechanism)},
                     "tests": [t.id for t in tests], "passed": [t.id for t in tests if outcome[t.id]],
                     "failed": [t.id for t in tests if not outcome[t.id]],
                     # a test marked with two exercises counts in both; a module fixture's set-up, in the test
                     # that first asked for it
                     "seconds": round(sum(seconds.get(t.id, 0.0) for t in tests), 1)})
    return rows


def grade_submission(submission: str | Path, ref: Reference, plugins: Path, timeout: float = DEFAULT_TIMEOUT,
                     junit_dir: str | Path | None = None, progress=None) -> dict:
    """Grade one submission on the reference's tests; the result is what --json writes."""
    submission = Path(submission).resolve()
    if not submission.is_dir():
        raise FileNotFoundError(f"no submission at {submission}")
    started = time.monotonic()
    chapters: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix=f"{PACKAGE}-graded-") as tmp:
        copy = Path(tmp) / "project"
        # A submission kept inside the reference's directory is not part of the reference.
        inside = submission != ref.root and submission.is_relative_to(ref.root)
        ref_files = [f for f in ref.files if not (inside and (ref.root / f).is_relative_to(submission))]
        assembly = assemble(ref.root, submission, copy, chapters=list(ref.tests), ref_files=ref_files)
        for chapter, files in ref.chapter_files.items():
            args = list(files)
            if junit_dir is not None:
                Path(junit_dir).mkdir(parents=True, exist_ok=True)
                args.append(f"--junitxml={Path(junit_dir).resolve() / f'chapter_{chapter:02d}.xml'}")
            run = run_pytest(copy, args, plugins, timeout, keep_out=[submission])
            chapters[chapter] = _score_chapter(ref, chapter, run)
            if progress is not None:
                progress(chapters[chapter])
    graded = [ex for ex in ref.exercises if ex.id in set(assembly.graded)]
    exercises = _score_exercises(ref, graded, chapters, assembly.missing)
    warnings = list(ref.warnings) + assembly.warnings
    warnings += [f"chapter {ex.chapter}'s exercise {ex.id} has no tests marked exercise(\"{ex.id}\"); only its "
                 f"chapter's score shows it" for ex, row in zip(graded, exercises) if row["max"] == 0]
    return {
        "submission": str(submission), "reference": str(ref.root), "chapters_graded": list(chapters),
        "chapters": list(chapters.values()), "exercises": exercises,
        "total": {"score": sum(c["score"] for c in chapters.values()),
                  "max": sum(c["max"] for c in chapters.values())},
        "edits_outside_exercises": [{"path": e.path, "kind": e.kind, "what": e.what} for e in assembly.edits],
        "warnings": warnings, "seconds": round(time.monotonic() - started, 1),
    }


# -- the commands --------------------------------------------------------------------------------------------

def _write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def grade(submission: str | Path = ".", reference: str | Path | None = None,
          chapters: Iterable[int] | str | None = None, timeout: float = DEFAULT_TIMEOUT,
          json_path: str | Path | None = None, gradescope: str | Path | None = None,
          junit_dir: str | Path | None = None) -> int:
    """Grade one submission, print the table, write what was asked for; 0 if every test passed, else 1."""
    from minifsdp.course.report import gradescope_results, print_chapter_row, print_report, print_header

    reference, chapters = assignment_defaults(submission, reference, chapters)
    with plugin_dir() as plugins:
        ref = collect_reference(reference, chapters, plugins, timeout)
        print_header(Path(submission).resolve(), ref)
        result = grade_submission(submission, ref, plugins, timeout, junit_dir, progress=print_chapter_row)
    print_report(result)
    if json_path:
        _write_json(json_path, result)
    if gradescope:
        _write_json(gradescope, gradescope_results(result))
    total = result["total"]
    return 0 if total["score"] == total["max"] and all(e["from_submission"] for e in result["exercises"]) else 1


def grade_all(directory: str | Path, reference: str | Path | None = None,
              chapters: Iterable[int] | str | None = None, out: str | Path = "grades",
              timeout: float = DEFAULT_TIMEOUT) -> int:
    """Grade each immediate subdirectory of `directory` as one submission; write OUT/<name>.json and
    OUT/summary.csv. One submission that breaks the grader gets a row of zeros, never stops the class."""
    from minifsdp.course.report import summary_row, write_summary

    directory, out = Path(directory).resolve(), Path(out).resolve()
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory of submissions at {directory}")
    submissions = sorted(d for d in directory.iterdir() if d.is_dir() and not d.name.startswith(".") and d != out)
    if not submissions:
        raise FileNotFoundError(f"no submissions (subdirectories) in {directory}")
    rows = []
    with plugin_dir() as plugins:
        ref = collect_reference(reference, chapters, plugins, timeout)
        print(f"Grading {len(submissions)} submissions in {directory} against {ref.root} "
              f"(chapters {', '.join(map(str, ref.tests))})")
        for sub in submissions:
            try:
                result = grade_submission(sub, ref, plugins, timeout)
                error = None
            except Exception as e:  # noqa: BLE001 -- any failure is this submission's row, not the class's end
                result, error = None, f"{type(e).__name__}: {e}"
            _write_json(out / f"{sub.name}.json", result or {"submission": str(sub), "error": error})
            rows.append(summary_row(sub.name, ref, result, error))
            row = rows[-1]
            edits = row["edits_outside_exercises"]
            print(f"  {sub.name:<30} {row['total']:>5}/{row['total_max']:<5}"
                  + (f"  {edits} edit(s) outside the exercises" if edits else "")
                  + (f"  ERROR {error}" if error else ""), flush=True)
    write_summary(out / "summary.csv", rows)
    print(f"Results: {out / 'summary.csv'} and one JSON file per submission in {out}")
    return 0
