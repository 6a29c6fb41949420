"""What a grade looks like: the table a person reads, Gradescope's results.json, and the class's summary.csv.

All of them are made from the result of grade.grade_submission (the --json document), so they cannot
disagree with it.
"""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

_MOST_CAUSES = 5  # per chapter, in the table


def _percent(score: int, most: int) -> str:
    return f"{100 * score / most:.0f}%" if most else "-"


def print_header(submission: Path, ref) -> None:
    print(f"Grading {submission}\n  on the tests of {ref.root} (chapters {', '.join(map(str, ref.tests))}); "
          f"only the code between the exercise markers is the submission's\n", flush=True)


def print_chapter_row(chapter: dict) -> None:
    """While grading: one line as each chapter ends (a chapter can take minutes). Its failures are not final:
    each exercise's failing tests run again with that exercise alone from the submission (grade.py)."""
    again = "; the failures run again with each exercise alone" if chapter["failed"] else ""
    print(f"  chapter {chapter['chapter']}: {chapter['score']}/{chapter['max']} tests passed with all its "
          f"exercises in place, in {chapter['seconds']:.0f} s{again}", flush=True)


def _points(points: dict | None) -> str:
    return f"{points['score']:g}/{points['max']}" if points and points["max"] else "-"


def _row(label: str, score: int, most: int, points: str, notes: str = "") -> str:
    return f"  {label:<34} {f'{score}/{most}':>9} {_percent(score, most):>6} {points:>9}  {notes}".rstrip()


def _exercise_notes(ex: dict) -> str:
    notes = []
    if not ex["from_submission"]:
        notes.append(f"the placeholder was graded: {ex['note']}")
    if ex["mechanism"]["max"]:
        notes.append(f"mechanism {ex['mechanism']['score']}/{ex['mechanism']['max']}")
    if ex.get("capped"):
        notes.append("a mechanism test failed: held to the pass line")
    if not ex["max"]:
        notes.append("no tests marked with it")
    return "; ".join(notes)


def _chapter_notes(chapter: dict) -> str:
    notes = [f"{len(chapter['failed'])} failed"] if chapter["failed"] else []
    if chapter["skipped"]:
        notes.append(f"{len(chapter['skipped'])} skipped")
    if chapter["status"] != "ran":
        notes.append(chapter["status"])
    return ", ".join(notes)


def _print_causes(chapter: dict) -> None:
    # One module-scoped fixture that fails takes every test using it down with the same message:
    # show each cause once, with how many tests it costs.
    by_cause: dict[str, list[str]] = {}
    for test in chapter["failed"]:
        by_cause.setdefault(test["cause"], []).append(test["id"])
    for cause, tests in list(by_cause.items())[:_MOST_CAUSES]:
        also = f" and {len(tests) - 1} more" if len(tests) > 1 else ""
        # whole (the plugin keeps 300 characters of it), wrapped: a check's message names the likely mistake
        print(f"  chapter {chapter['chapter']}: {tests[0]}{also}\n"
              + textwrap.fill(cause, 110, initial_indent=" " * 6, subsequent_indent=" " * 6))
    if len(by_cause) > _MOST_CAUSES:
        print(f"  chapter {chapter['chapter']}: ... and {len(by_cause) - _MOST_CAUSES} other causes")


def print_report(result: dict) -> None:
    print()
    print(f"  {'chapter / exercise':<34} {'tests':>9} {'':>6} {'points':>9}")
    for chapter in result["chapters"]:
        print(_row(f"chapter {chapter['chapter']}", chapter["score"], chapter["max"], _points(chapter.get("points")),
                   _chapter_notes(chapter)))
        for ex in result["exercises"]:
            if ex["chapter"] == chapter["chapter"]:
                label = f"  {ex['id']} {ex['title']}"
                label = label if len(label) <= 34 else label[:33] + "…"
                points = f"{ex['points']:g}/100" if "points" in ex and ex["max"] else "-"
                print(_row(label, ex["score"], ex["max"], points, _exercise_notes(ex)))
    total = result["total"]
    print(_row("total", total["score"], total["max"], _points(result.get("points"))))
    if result.get("points"):
        print(f"\n  An exercise is worth 100 points: the share of its tests passed, but at most "
              f"{result['points']['pass_line']:g} where one of its mechanism tests fails.")

    if result["edits_outside_exercises"]:
        print("\nEdits outside the exercise regions (ignored: the reference's version of these was graded):")
        for edit in result["edits_outside_exercises"]:
            print(f"  {edit['kind']:<8} {edit['path']}  ({edit['what']})")
    if result["warnings"]:
        print("\nWarnings:")
        for warning in result["warnings"]:
            print(f"  {warning}")
    failing = [c for c in result["chapters"] if c["failed"]]
    if failing:
        print("\nNot passing yet:")
        for chapter in failing:
            _print_causes(chapter)
        first = failing[0]["chapter"]
        print(f"\nThe full report of a chapter, e.g. chapter {first}, in the submission:\n"
              f"  cd {result['submission']} && python -m pytest -x tests/test_ch{first:02d}_*.py")


# -- Gradescope ----------------------------------------------------------------------------------------------

def _entry(name: str, score: int, most: int, output: str, number: str | None = None) -> dict:
    entry = {"name": name, "score": score, "max_score": most, "status": "passed" if score == most else "failed",
             "output": output, "visibility": "visible"}
    if number is not None:
        entry["number"] = number
    return entry


def gradescope_results(result: dict) -> dict:
    """Gradescope's autograder results.json: one test entry per exercise, worth its points (of 100), and one
    per chapter, worth nothing, for the tests that grade no single exercise. The top-level score is the
    exercises' points, what Gradescope records."""
    causes = {t["id"]: t["cause"] for c in result["chapters"] for t in c["failed"]}
    tagged = {t for ex in result["exercises"] for t in ex["tests"]}
    line = result["points"]["pass_line"]
    tests = []
    for chapter in result["chapters"]:
        for ex in result["exercises"]:
            if ex["chapter"] != chapter["chapter"] or not ex["max"]:
                continue
            lines = [] if ex["from_submission"] else [
                f"Your code for it was not found, so the placeholder was graded: {ex['note']}"]
            lines.append(f"Tests passed: {ex['score']}/{ex['max']}")
            if ex["mechanism"]["max"]:
                lines.append(f"Mechanism tests: {ex['mechanism']['score']}/{ex['mechanism']['max']} passed")
            if ex["capped"]:
                lines.append(f"A mechanism test failed: the points are held to the pass line, {line:g} of 100")
            lines += [f"FAILED {t}\n    {causes.get(t, '')}" for t in ex["failed"]]
            tests.append(_entry(f"Exercise {ex['id']}: {ex['title']}", ex["points"], 100, "\n".join(lines), ex["id"]))
        others = [t for t in chapter["passed"] if t not in tagged]
        failed = [t for t in chapter["failed"] if t["id"] not in tagged]
        if others or failed:
            lines = [] if chapter["status"] == "ran" else [f"Chapter {chapter['chapter']}: {chapter['status']}"]
            lines.append(f"Tests passed: {len(others)}/{len(others) + len(failed)} (worth no points: they check "
                         f"the chapter's given code)")
            lines += [f"FAILED {t['id']}\n    {t['cause']}" for t in failed]
            entry = _entry(f"Chapter {chapter['chapter']}: tests of no single exercise", 0, 0, "\n".join(lines))
            entry["status"] = "passed" if not failed else "failed"
            tests.append(entry)

    summary = [f"{c['score']}/{c['max']} tests passed in chapter {c['chapter']}" for c in result["chapters"]]
    summary.append(f"An exercise is worth 100 points: the share of its tests passed, but at most {line:g} where one "
                   f"of its mechanism tests fails.")
    if result["edits_outside_exercises"]:
        summary.append("Edits outside the exercise regions, not graded (the course's version was used):")
        summary += [f"  {e['kind']} {e['path']}" for e in result["edits_outside_exercises"]]
    summary += result["warnings"]
    return {"score": result["points"]["score"], "execution_time": round(result["seconds"]),
            "output": "\n".join(summary), "tests": tests,
            "extra_data": {"max_score": result["points"]["max"], "tests_passed": result["total"]["score"],
                           "tests": result["total"]["max"], "chapters": result["chapters_graded"]}}


# -- the class -----------------------------------------------------------------------------------------------

def summary_row(name: str, ref, result: dict | None, error: str | None) -> dict:
    """One submission's row of summary.csv; a submission the grader could not grade scores zeros."""
    row: dict = {"submission": name}
    chapters = {c["chapter"]: c for c in result["chapters"]} if result else {}
    for chapter in ref.tests:
        row[f"chapter_{chapter}"] = chapters[chapter]["score"] if chapter in chapters else 0
        row[f"chapter_{chapter}_max"] = chapters[chapter]["max"] if chapter in chapters else ref.maximum(chapter)
    exercises = {e["id"]: e for e in result["exercises"]} if result else {}
    for ex in ref.exercises:
        if ex.chapter in ref.tests:
            mine = exercises.get(ex.id)
            most = sum(ex.id in t.exercises and t.skip is None for ts in ref.tests.values() for t in ts)
            row[f"exercise_{ex.id}"] = mine["score"] if mine else 0
            row[f"exercise_{ex.id}_max"] = mine["max"] if mine else most
            row[f"exercise_{ex.id}_points"] = mine["points"] if mine else 0
    row["total"] = result["total"]["score"] if result else 0
    row["total_max"] = result["total"]["max"] if result else sum(map(ref.maximum, ref.tests))
    row["points"] = result["points"]["score"] if result else 0
    row["edits_outside_exercises"] = len(result["edits_outside_exercises"]) if result else 0
    row["error"] = error or ""
    return row


def write_summary(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0]) if rows else ["submission", "total", "total_max", "edits_outside_exercises", "error"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
