"""What a submission is graded for: the assignment a student copy was handed out with, and what an exercise is worth.

A student copy records its assignment (student.py's assignment.json): the course project whose tests grade it,
the chapters handed out, and the pass line, if the instructor set one. An exercise scores 0 to 100 points: the
share of its tests that passed as they ran with its code alone, and no more than the pass line where it skips
the lesson (see [Note: the pass line]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from minifsdp.course.student import ASSIGNMENT_FILE, PACKAGE, check_pass_line, read_assignment

DEFAULT_PASS_LINE = 60.0  # points of 100: a solution that skips its exercise's mechanism scores at most this

# [Note: the pass line]
# The tests that check values outnumber those that check how (the mechanism tests: collectives issued and
# their bytes, the order of issues and waits, the memory a rank keeps). A 6.1 that waits for its
# reduce-scatter at once, so that nothing overlaps, gets every value right and fails one test of 79: 99% of
# the tests, for a solution that skipped the chapter's idea. So an exercise with a failing mechanism test scores
# at most the pass line, whatever its share of tests: it passes (the numbers are right) and no more. The
# instructor sets the line (`student --pass-line`, recorded in the copy's assignment.json, or `grade
# --pass-line`); 100 makes the tests alone the grade, 0 makes the mechanism all or nothing.


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


def pass_line_for(submission: str | Path, pass_line) -> float:
    """The pass line given, else the one the student copy's assignment records, else DEFAULT_PASS_LINE."""
    if pass_line is None:
        pass_line = (read_assignment(submission) or {}).get("pass_line")
    return check_pass_line(DEFAULT_PASS_LINE if pass_line is None else pass_line)


def exercise_points(row: dict, pass_line: float) -> tuple[float, bool]:
    """(points of 100, whether the pass line capped them) for one exercise row of grade_submission."""
    if not row["max"]:
        return 0.0, False
    share = 100 * row["score"] / row["max"]
    mechanism = row["mechanism"]
    lesson_skipped = mechanism["score"] < mechanism["max"]
    return round(min(share, pass_line) if lesson_skipped else share, 1), lesson_skipped and share > pass_line


def add_points(result: dict, pass_line: float) -> dict:
    """Give each exercise row its points, and each chapter and the whole the sum over their exercises."""
    for ex in result["exercises"]:
        ex["points"], ex["capped"] = exercise_points(ex, pass_line)
    scored = [ex for ex in result["exercises"] if ex["max"]]
    for chapter in result["chapters"]:
        mine = [ex for ex in scored if ex["chapter"] == chapter["chapter"]]
        chapter["points"] = {"score": round(sum(ex["points"] for ex in mine), 1), "max": 100 * len(mine)}
    result["points"] = {"score": round(sum(ex["points"] for ex in scored), 1), "max": 100 * len(scored),
                        "pass_line": pass_line}
    return result
