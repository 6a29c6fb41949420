"""What grading costs, measured: the instructor's guide (chapters/course.md) quotes this report.

    python -m minifsdp.reports.grading --markdown chapters/generated/grading.md

Three gradings of this project, each as `python -m minifsdp grade` does it (collect the reference's tests,
assemble the graded copy, run each chapter in a fresh pytest with its time limit):
- an untouched student copy (every exercise removed), all chapters: what it scores is what a student who
  hands in nothing gets, and its exercise tests should all fail;
- a solved copy (the reference's own solutions), all chapters: the time of one full submission;
- the solved copy, chapter 6 alone (`--chapters 6`): the time of a one-chapter assignment.
Wall-clock seconds on the machine it runs on, which the report names; the chapters run one after another.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from minifsdp.course.grade import collect_reference, grade_submission
from minifsdp.course.runner import plugin_dir
from minifsdp.course.student import write_student_copy
from minifsdp.reports.format import md_folded, md_table, write_report

REPO = Path(__file__).resolve().parents[2]
ONE_CHAPTER = 6


def _graded(submission: Path, chapters, plugins: Path) -> tuple[dict, float]:
    started = time.monotonic()
    ref = collect_reference(REPO, chapters, plugins)
    result = grade_submission(submission, ref, plugins)
    return result, time.monotonic() - started


def _exercise_totals(result: dict) -> tuple[int, int, int, int]:
    ex = result["exercises"]
    return (sum(e["score"] for e in ex), sum(e["max"] for e in ex),
            sum(e["mechanism"]["score"] for e in ex), sum(e["mechanism"]["max"] for e in ex))


def _machine() -> str:
    import torch

    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def measure() -> str:
    with plugin_dir() as plugins, tempfile.TemporaryDirectory(prefix="minifsdp-grading-") as tmp:
        student = Path(tmp) / "student"
        write_student_copy(REPO, student, quiet=True)
        runs = [("untouched student copy, every chapter", *_graded(student, None, plugins)),
                ("solved copy, every chapter", *_graded(REPO, None, plugins)),
                (f"solved copy, chapter {ONE_CHAPTER} (`--chapters {ONE_CHAPTER}`)",
                 *_graded(REPO, [ONE_CHAPTER], plugins))]
    rows = []
    for name, result, seconds in runs:
        total = result["total"]
        ex_score, ex_max, mech_score, mech_max = _exercise_totals(result)
        rows.append([name, f"{seconds:.0f} s", f"{total['score']} / {total['max']}",
                     f"{ex_score} / {ex_max}", f"{mech_score} / {mech_max}"])
    header = ["graded", "wall time", "tests passed", "exercise tests", "of them, mechanism"]
    per_chapter = md_table(["chapter", "tests", "seconds (solved)", "passed untouched"],
                           [[c["chapter"], c["max"], c["seconds"], f"{u['score']} / {u['max']}"]
                            for c, u in zip(runs[1][1]["chapters"], runs[0][1]["chapters"])])
    untouched, solved = runs[0][1], runs[1][1]
    passed_untouched = sorted({t for e in untouched["exercises"] for t in e["tests"] if t not in e["failed"]})
    failed_solved = [f"`{t['id']}`: {t['cause']}" for c in solved["chapters"] for t in c["failed"]]
    notes = [f"Exercise tests an untouched copy passes: {', '.join(f'`{t}`' for t in passed_untouched) or 'none'}.",
             f"Tests the solved copy failed: {'; '.join(failed_solved) or 'none'}."]
    return (md_table(header, rows) + f"\n\nMeasured on {_machine()}.\n\n" +
            md_folded("Each chapter: its tests, its time in the solved run, and what an untouched copy passes",
                      per_chapter + "\n\n" + "\n\n".join(notes)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", help="also write the report to this file")
    args = parser.parse_args(argv)
    write_report(measure(), args.markdown)


if __name__ == "__main__":
    main()
