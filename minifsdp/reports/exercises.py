"""The course's exercises, one row each: what the instructor's guide (chapters/course.md) tabulates.

    python -m minifsdp.reports.exercises --markdown chapters/generated/exercises.md

Read from the package source itself (course/student.py's find_exercises): the id, the chapter, the file and
function that hold the solution, how many lines a student writes (the reference's, between the markers),
what it teaches (the marker's title), and the test cases that grade it -- collected as the grader collects
them, so the guide's counts are the grader's.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from minifsdp.course.student import Exercise, find_exercises
from minifsdp.reports.format import md_table, md_tabs, write_report

REPO = Path(__file__).resolve().parents[2]


def enclosing_function(exercise: Exercise) -> str:
    """`Class.method` or `function` holding the exercise's BEGIN marker."""
    tree = ast.parse(exercise.path.read_text(encoding="utf-8"))
    best, depth = "", -1

    def visit(node, names):
        nonlocal best, depth
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = names + [child.name]
                if child.lineno <= exercise.begin <= child.end_lineno and len(inner) > depth:
                    if not isinstance(child, ast.ClassDef):
                        best, depth = ".".join(inner), len(inner)
                visit(child, inner)

    visit(tree, [])
    return best or "(module level)"


def solution_lines(exercise: Exercise) -> int:
    """Lines of code between the markers, blank lines and comment-only lines not counted."""
    lines = exercise.path.read_text(encoding="utf-8").splitlines()[exercise.begin:exercise.end - 1]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def graded_by(collected) -> dict[str, dict[str, int]]:
    """exercise -> {"tests": n, "mechanism": m}: the test cases that carry its mark, as the grader counts
    them (each parametrized case once). A case that a machine skips (none of them does today) would count
    here and not in that machine's grade: the table does not depend on where it is made.
    `collected`: the reference's tests as the grader collects them (course.grade.collect_reference)."""
    counts: dict[str, dict[str, int]] = {}
    for tests in collected.tests.values():
        for test in tests:
            for ex in test.exercises:
                c = counts.setdefault(ex, {"tests": 0, "mechanism": 0})
                c["tests"] += 1
                c["mechanism"] += test.mechanism
    return counts


def collect(root: Path = REPO):
    """The project's chapter tests, collected as the grader collects them."""
    from minifsdp.course.grade import collect_reference
    from minifsdp.course.runner import plugin_dir

    with plugin_dir() as plugins:
        return collect_reference(root, None, plugins)


def table(root: Path = REPO, collected=None) -> str:
    exercises = find_exercises(root)
    counts = graded_by(collected if collected is not None else collect(root))
    rows = []
    for ex in exercises:
        c = counts.get(ex.id, {"tests": 0, "mechanism": 0})
        where = f"`{ex.path.relative_to(root).as_posix()}`<br>`{enclosing_function(ex)}`"
        rows.append((ex.chapter, [f"**{ex.id}**", where, solution_lines(ex), ex.title,
                                  f"{c['tests']} ({c['mechanism']})"]))
    header = ["id", "where", "lines", "what it teaches", "graded cases (mechanism)"]
    parts = [(f"Chapters {lo}–{hi}", md_table(header, [r for ch, r in rows if lo <= ch <= hi]))
             for lo, hi in ((1, 4), (5, 8), (9, 13))]
    total = sum(solution_lines(ex) for ex in exercises)
    return (md_tabs(parts) + f"\n\n{len(exercises)} exercises in {len({ex.chapter for ex in exercises})} "
            f"chapters, {total} lines of solution in all. \"graded cases\" counts the test cases marked with the "
            f"exercise, each parametrized case once, as `python -m minifsdp grade` scores them; \"mechanism\", "
            f"those of them that check how it is done.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    write_report(table(), args.markdown)


if __name__ == "__main__":
    main()
