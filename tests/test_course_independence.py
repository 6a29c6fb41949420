"""Chapter independence for every exercise and every chapter, checked on the graded trees: no pytest runs.

The requirement: for every exercise, removing it fails its own chapter's tests (test_course.py's
test_removal_of_each_exercise_fails_its_tests runs those) and, under --chapters, no other chapter's.
A chapter's tests see nothing but the copy that `grade` assembles and runs them in. So the second half
holds for every (exercise, chapter) pair at once if, for every chapter k, the copy assembled from a
submission with *every* exercise removed, graded with --chapters k, is exactly the reference with only
chapter k's exercises removed: then no exercise of another chapter, removed or not, reaches chapter k's
tests. This file checks that, byte for byte, for each chapter with tests (and for --chapters 6,7, the
guide's example), over the files a chapter's pytest run reads: the package, tests/ and the top-level
configuration. The rest of the graded copy is the reference's, copied before any exercise is placed and
whatever the chapters: checked once, over every file, for a grade of all chapters. Then the student
side: `student --chapters k` removes chapter k's exercises and nothing else.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from minifsdp.course.assemble import assemble, scan_regions
from minifsdp.course.grade import chapter_test_files
from minifsdp.course.student import (find_exercises, placeholder_line, project_files, strip_solutions,
                                     write_student_copy)

REPO = Path(__file__).resolve().parents[1]
EXERCISES = find_exercises(REPO)
CHAPTERS = sorted(set(chapter_test_files(REPO)) | {ex.chapter for ex in EXERCISES})
SELECTIONS = [(k,) for k in CHAPTERS] + [(6, 7)]
SOURCES = sorted({ex.path.relative_to(REPO) for ex in EXERCISES})  # package files that hold exercises


@functools.lru_cache(maxsize=None)
def _regions(text: str, rel: Path) -> dict[str, str]:
    """Exercise id -> the text between its markers."""
    found, problems = scan_regions(text, rel)
    assert problems == [], problems
    return {r.id: "".join(r.body) for r in found}


@functools.lru_cache(maxsize=None)
def _outside(text: str, rel: Path) -> str:
    """The text with every exercise's lines (between its markers) left out."""
    inside = {i for r in scan_regions(text, rel)[0] for i in range(r.line + 1, r.line + len(r.body) + 1)}
    return "".join(line for i, line in enumerate(text.splitlines(keepends=True), 1) if i not in inside)


def _placeholder(ex_id: str, text: str, rel: Path) -> str:
    """What a removed exercise leaves between its markers, at their indentation (as the reference's file has it)."""
    ex = next(e for e in EXERCISES if e.id == ex_id)
    begin = text.splitlines(keepends=True)[ex.begin - 1]
    indent = begin[:len(begin) - len(begin.lstrip(" \t"))]
    return placeholder_line(ex, indent)


@pytest.fixture(scope="module")
def reference_files():
    return project_files(REPO)


@pytest.fixture(scope="module")
def what_tests_read(reference_files):
    """The package, tests/ and the top-level files (pyproject.toml, conftest.py...): what pytest reads."""
    return [rel for rel in reference_files if len(rel.parts) == 1 or rel.parts[0] in ("minifsdp", "tests")]


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """A student copy with every exercise removed: the worst case for every other chapter."""
    copy = tmp_path_factory.mktemp("untouched") / "copy"
    removed = write_student_copy(REPO, copy, quiet=True)
    assert {ex.id for ex in removed} == {ex.id for ex in EXERCISES}
    return copy


def test_every_exercise_and_chapter_is_in_the_check():
    assert EXERCISES, "no exercises found"
    assert {ex.chapter for ex in EXERCISES} <= set(CHAPTERS)
    assert set(chapter_test_files(REPO)) <= set(CHAPTERS)


def _check_graded_copy(chapters, untouched, reference_files, dest):
    assembly = assemble(REPO, untouched, dest, chapters=chapters, ref_files=reference_files)
    chapters = CHAPTERS if chapters is None else chapters
    graded = sorted(ex.id for ex in EXERCISES if ex.chapter in chapters)
    assert sorted(assembly.graded) == graded
    assert assembly.missing == {} and assembly.edits == [] and assembly.warnings == []

    # Every file of the graded copy: byte for byte the reference's, except the graded exercises' regions.
    graded_files = {ex.path.relative_to(REPO) for ex in EXERCISES if ex.chapter in chapters}
    got_files = sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file() or p.is_symlink())
    assert got_files == sorted(reference_files)
    different = []
    for rel in reference_files:
        if (REPO / rel).is_symlink():  # copied as a link (chapters/notebooks -> ../notebooks)
            if not (dest / rel).is_symlink() or os.readlink(dest / rel) != os.readlink(REPO / rel):
                different.append(str(rel))
            continue
        ref_bytes = (REPO / rel).read_bytes()
        want = ref_bytes
        if rel in graded_files:
            want = strip_solutions(ref_bytes.decode("utf-8"), path=rel, chapters=chapters).encode("utf-8")
        if (dest / rel).read_bytes() != want:
            different.append(str(rel))
    assert different == [], (f"graded with --chapters {','.join(map(str, chapters))}, a submission with every "
                             f"exercise removed changes these files beyond the graded exercises: {different}")

    # Spelled out per exercise: the graded ones are the submission's placeholder, every other one the
    # reference's solution -- so removing it cannot fail these chapters' tests.
    for rel in SOURCES:
        ref_text = (REPO / rel).read_text(encoding="utf-8")
        want, got = _regions(ref_text, rel), _regions((dest / rel).read_text(encoding="utf-8"), rel)
        assert set(got) == set(want), rel
        for ex_id in want:
            if ex_id in graded:
                assert got[ex_id] == _placeholder(ex_id, ref_text, rel), ex_id
            else:
                assert got[ex_id] == want[ex_id], (f"exercise {ex_id} is not the reference's solution in the copy "
                                                   f"graded for chapter(s) {chapters}")


@pytest.mark.parametrize("chapters", SELECTIONS, ids=["ch" + "_".join(map(str, s)) for s in SELECTIONS])
def test_the_graded_copy_is_the_reference_less_only_the_graded_chapters_exercises(chapters, untouched,
                                                                                  what_tests_read, tmp_path):
    _check_graded_copy(chapters, untouched, what_tests_read, tmp_path / "graded")


def test_every_file_of_the_graded_copy_is_the_references_but_the_exercises(untouched, reference_files, tmp_path):
    _check_graded_copy(None, untouched, reference_files, tmp_path / "graded")


def test_a_solved_submission_assembles_to_the_reference_itself(reference_files, tmp_path):
    dest = tmp_path / "graded"
    assembly = assemble(REPO, REPO, dest, chapters=None, ref_files=reference_files)
    assert assembly.missing == {} and assembly.warnings == []
    assert [str(rel) for rel in reference_files if not (REPO / rel).is_symlink()
            and (dest / rel).read_bytes() != (REPO / rel).read_bytes()] == []


@pytest.mark.parametrize("chapters", SELECTIONS, ids=["ch" + "_".join(map(str, s)) for s in SELECTIONS])
def test_student_chapters_removes_those_chapters_exercises_and_nothing_else(chapters):
    for rel in SOURCES:
        ref_text = (REPO / rel).read_text(encoding="utf-8")
        stripped = strip_solutions(ref_text, path=rel, chapters=chapters)
        want, got = _regions(ref_text, rel), _regions(stripped, rel)
        assert set(got) == set(want), rel
        for ex_id in want:
            chapter = int(ex_id.split(".")[0])
            expected = _placeholder(ex_id, ref_text, rel) if chapter in chapters else want[ex_id]
            assert got[ex_id] == expected, (ex_id, chapters)
        # and outside the regions, nothing moved
        assert _outside(stripped, rel) == _outside(ref_text, rel), rel
