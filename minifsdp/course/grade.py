"""Grading: score a submission chapter by chapter, and exercise by exercise, on the reference's tests.

    python -m minifsdp grade ../my_copy [--reference REF] [--chapters 6,7] [--json F] [--gradescope F] [--junit DIR]
    python -m minifsdp grade-all submissions/ [--chapters 6,7] [--out grades]

The submission supplies only the code between its exercise markers (assemble.py builds the copy that is
graded); the tests, conftest.py, pytest configuration and the rest of the package are the reference's.
The reference is, unless told otherwise, the project that holds the running package.

A chapter's tests are the files tests/test_chNN_*.py. Each chapter runs in a fresh pytest process in
that copy, holding that chapter's exercises from the submission and the reference's solution of every
other one, then each exercise's unsettled tests with that exercise alone from the submission (see [Note:
where a wrong solution costs points]), each with a time limit. Imports resolve to the copy alone: never
to the submission's directory or an installed minifsdp (runner.py). The outcomes come from the grader's own plugin (plugin.py),
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

from minifsdp.course.assemble import Assembler
from minifsdp.course.assignment import DEFAULT_PASS_LINE, add_points, assignment_defaults, pass_line_for
from minifsdp.course.runner import PytestRun, plugin_dir, run_pytest
from minifsdp.course.student import PACKAGE, Exercise, copy_files, find_exercises, project_files

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

def _status(run: PytestRun) -> str:
    if run.timed_out:
        return f"stopped after {run.seconds:.0f} s (time limit)"
    if run.report is None:
        tail = [line for line in run.output.strip().splitlines() if line.strip()][-1:]
        return f"pytest ended (exit code {run.returncode}) without a report: {tail[0] if tail else ''}".rstrip(": ")
    return "ran"


def _outcomes(tests: list[Test], run: PytestRun) -> dict[str, tuple[str, str, float]]:
    """test id -> (passed / failed / skipped, why, seconds) for these tests in one pytest run."""
    status = _status(run)
    results = run.report["results"] if run.report else {}
    broken = {e["id"]: e["cause"] for e in (run.report or {}).get("collect_errors", [])}
    out = {}
    for test in tests:
        result = results.get(test.id)
        seconds = result["seconds"] if result else 0.0
        if test.skip is not None:
            out[test.id] = ("skipped", test.skip, 0.0)
        elif status != "ran":
            out[test.id] = ("failed", status, seconds)
        elif result is None:
            file = test.id.split("::")[0]
            out[test.id] = ("failed", f"not collected: {broken[file]}" if file in broken else "did not run", 0.0)
        elif result["outcome"] in ("passed", "skipped"):
            out[test.id] = (result["outcome"], result["cause"] or result["outcome"], seconds)
        else:
            out[test.id] = ("failed", result["cause"] or result["outcome"], seconds)
    return out


def _score_chapter(ref: Reference, chapter: int, run: PytestRun, outcome: dict[str, tuple[str, str, float]]) -> dict:
    passed = [t.id for t in ref.tests[chapter] if outcome[t.id][0] == "passed"]
    failed = [{"id": t.id, "cause": outcome[t.id][1]} for t in ref.tests[chapter] if outcome[t.id][0] == "failed"]
    skipped = [{"id": t.id, "cause": outcome[t.id][1]} for t in ref.tests[chapter] if outcome[t.id][0] == "skipped"]
    return {"chapter": chapter, "score": len(passed), "max": len(passed) + len(failed), "status": _status(run),
            "seconds": round(run.seconds, 1), "passed": passed, "failed": failed, "skipped": skipped,
            "test_seconds": {t: round(outcome[t][2], 3) for t in passed + [f["id"] for f in failed]}}


def _score_exercises(ref: Reference, graded: list[Exercise], own: dict[tuple[str, str], tuple[str, str, float]],
                     missing: dict[str, str]) -> list[dict]:
    """Each exercise scored on its tests as they ran with its code alone from the submission (own[(id, test)])."""
    rows = []
    for ex in graded:
        tests = [t for c in ref.tests for t in ref.tests[c]
                 if ex.id in t.exercises and own[(ex.id, t.id)][0] != "skipped"]
        ok = {t.id: own[(ex.id, t.id)][0] == "passed" for t in tests}
        mechanism = [t for t in tests if t.mechanism]
        rows.append({"id": ex.id, "chapter": ex.chapter, "title": ex.title,
                     "from_submission": ex.id not in missing, "note": missing.get(ex.id),
                     "score": sum(ok[t.id] for t in tests), "max": len(tests),
                     "mechanism": {"score": sum(ok[t.id] for t in mechanism), "max": len(mechanism)},
                     "tests": [t.id for t in tests], "passed": [t.id for t in tests if ok[t.id]],
                     "failed": [t.id for t in tests if not ok[t.id]],
                     "seconds": round(sum(own[(ex.id, t.id)][2] for t in tests), 1)})
    return rows


# [Note: where a wrong solution costs points]
# A chapter's tests call the code of several exercises, some of earlier chapters: a 5.2 that all-reduces
# instead of reduce-scattering makes chapter 6's tests fail too, though 6.1 and 6.2 may be right. So no test
# is scored in a copy holding every exercise of the submission. A chapter's tests run in a copy with that
# chapter's exercises from the submission and every other exercise the reference's solution; then each
# exercise's marked tests that this did not settle -- those that failed, and those of another chapter, which
# ran with the reference's code for it (unless its code is the reference's and they passed) -- run again in a
# copy with that one exercise from the submission. An exercise scores its
# tests as they ran with its own code alone; a chapter scores a marked test only if it passed for every
# exercise it is marked with, and a test of no exercise as it ran with the chapter's code. A wrong X then
# costs points in X's tests and in X's chapter's tests of no exercise, never in Y's.

def _own_runs(ref: Reference, asm: Assembler, graded: list[Exercise], chapter_outcome: dict, run, timeout: float,
              keep_out: list[Path]) -> dict[tuple[str, str], tuple[str, str, float]]:
    """(exercise, test) -> the test's outcome with that exercise alone from the submission."""
    own = {}
    for ex in graded:
        tests = [t for c in ref.tests for t in ref.tests[c] if ex.id in t.exercises]
        settled = {t.id for t in tests if t.chapter == ex.chapter and chapter_outcome[t.id][0] != "failed"}
        if asm.same_as_reference(ex):  # the reference's own code: its passes in other chapters' copies count
            settled |= {t.id for t in tests if t.chapter != ex.chapter and chapter_outcome[t.id][0] != "failed"}
        for t in tests:
            if t.id in settled:
                own[(ex.id, t.id)] = chapter_outcome[t.id]
        rerun = [t for t in tests if t.id not in settled]
        if rerun:
            asm.place([ex.id])
            outcome = _outcomes(rerun, run(asm.dest, [t.id for t in rerun], timeout, keep_out))
            own.update({(ex.id, t.id): outcome[t.id] for t in rerun})
    return own


def _for_the_chapter(test: str, marks: tuple[str, ...], chapter_outcome: dict, own: dict) -> tuple[str, str, float]:
    """A test's outcome in its chapter's score: as it ran with each exercise it is marked with alone from the
    submission (failed if it failed for any of them), or with the chapter's code where it is marked with no
    exercise graded."""
    outs = [own[(e, test)] for e in marks if (e, test) in own]
    if not outs:
        return chapter_outcome[test]
    return next((o for o in outs if o[0] == "failed"), None) or next((o for o in outs if o[0] == "passed"), outs[0])


def grade_submission(submission: str | Path, ref: Reference, plugins: Path, timeout: float = DEFAULT_TIMEOUT,
                     junit_dir: str | Path | None = None, progress=None,
                     pass_line: float = DEFAULT_PASS_LINE) -> dict:
    """Grade one submission on the reference's tests; the result is what --json writes. The points of each
    exercise (points.py) are capped at `pass_line` where a mechanism test failed."""
    submission = Path(submission).resolve()
    if not submission.is_dir():
        raise FileNotFoundError(f"no submission at {submission}")
    started = time.monotonic()
    runs: dict[int, PytestRun] = {}
    chapter_outcome: dict[str, tuple[str, str, float]] = {}

    def run(copy, args, limit, keep_out):
        return run_pytest(copy, args, plugins, limit, keep_out=keep_out)

    with tempfile.TemporaryDirectory(prefix=f"{PACKAGE}-graded-") as tmp:
        # A submission kept inside the reference's directory is not part of the reference.
        inside = submission != ref.root and submission.is_relative_to(ref.root)
        ref_files = [f for f in ref.files if not (inside and (ref.root / f).is_relative_to(submission))]
        asm = Assembler(ref.root, submission, Path(tmp) / "project", ref_files)
        assembly = asm.place(ex.id for ex in asm.exercises if ex.chapter in ref.tests)  # what is graded
        for chapter, files in ref.chapter_files.items():
            args = list(files)
            if junit_dir is not None:
                Path(junit_dir).mkdir(parents=True, exist_ok=True)
                args.append(f"--junitxml={Path(junit_dir).resolve() / f'chapter_{chapter:02d}.xml'}")
            placed = asm.place(ex.id for ex in asm.exercises if ex.chapter == chapter)
            assembly.warnings += [w for w in placed.warnings if w not in assembly.warnings]
            runs[chapter] = run(asm.dest, args, timeout, [submission])
            chapter_outcome.update(_outcomes(ref.tests[chapter], runs[chapter]))
            if progress is not None:
                progress(_score_chapter(ref, chapter, runs[chapter], chapter_outcome))
        graded = [ex for ex in ref.exercises if ex.id in set(assembly.graded)]
        own = _own_runs(ref, asm, graded, chapter_outcome, run, timeout, [submission])
    final = {t: _for_the_chapter(t, marks, chapter_outcome, own) for c in ref.tests for t, marks in
             ((t.id, t.exercises) for t in ref.tests[c])}
    chapters = {c: _score_chapter(ref, c, runs[c], final) for c in ref.chapter_files}
    exercises = _score_exercises(ref, graded, own, assembly.missing)
    warnings = list(ref.warnings) + assembly.warnings
    warnings += [f"chapter {ex.chapter}'s exercise {ex.id} has no tests marked exercise(\"{ex.id}\"); only its "
                 f"chapter's score shows it" for ex, row in zip(graded, exercises) if row["max"] == 0]
    return add_points({
        "submission": str(submission), "reference": str(ref.root), "chapters_graded": list(chapters),
        "chapters": list(chapters.values()), "exercises": exercises,
        "total": {"score": sum(c["score"] for c in chapters.values()),
                  "max": sum(c["max"] for c in chapters.values())},
        "edits_outside_exercises": [{"path": e.path, "kind": e.kind, "what": e.what} for e in assembly.edits],
        "warnings": warnings, "seconds": round(time.monotonic() - started, 1),
    }, pass_line)


# -- the commands --------------------------------------------------------------------------------------------

def _write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def grade(submission: str | Path = ".", reference: str | Path | None = None,
          chapters: Iterable[int] | str | None = None, timeout: float = DEFAULT_TIMEOUT,
          json_path: str | Path | None = None, gradescope: str | Path | None = None,
          junit_dir: str | Path | None = None, pass_line: float | None = None) -> int:
    """Grade one submission, print the table, write what was asked for; 0 if every test passed, else 1."""
    from minifsdp.course.report import gradescope_results, print_chapter_row, print_report, print_header

    reference, chapters = assignment_defaults(submission, reference, chapters)
    pass_line = pass_line_for(submission, pass_line)
    with plugin_dir() as plugins:
        ref = collect_reference(reference, chapters, plugins, timeout)
        print_header(Path(submission).resolve(), ref)
        result = grade_submission(submission, ref, plugins, timeout, junit_dir, print_chapter_row, pass_line)
    print_report(result)
    if json_path:
        _write_json(json_path, result)
    if gradescope:
        _write_json(gradescope, gradescope_results(result))
    total = result["total"]
    return 0 if total["score"] == total["max"] and all(e["from_submission"] for e in result["exercises"]) else 1


def grade_all(directory: str | Path, reference: str | Path | None = None,
              chapters: Iterable[int] | str | None = None, out: str | Path = "grades",
              timeout: float = DEFAULT_TIMEOUT, pass_line: float | None = None) -> int:
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
                result = grade_submission(sub, ref, plugins, timeout, pass_line=pass_line_for(sub, pass_line))
                error = None
            except Exception as e:  # noqa: BLE001 -- any failure is this submission's row, not the class's end
                result, error = None, f"{type(e).__name__}: {e}"
            _write_json(out / f"{sub.name}.json", result or {"submission": str(sub), "error": error})
            rows.append(summary_row(sub.name, ref, result, error))
            row = rows[-1]
            edits = row["edits_outside_exercises"]
            print(f"  {sub.name:<30} {row['total']:>5}/{row['total_max']:<5} tests, {row['points']:>7g} points"
                  + (f"  {edits} edit(s) outside the exercises" if edits else "")
                  + (f"  ERROR {error}" if error else ""), flush=True)
    write_summary(out / "summary.csv", rows)
    print(f"Results: {out / 'summary.csv'} and one JSON file per submission in {out}")
    return 0
