"""Course mode (minifsdp/course.py, minifsdp/grade.py): exercise markers, student copies, and the grader.

The test that matters most is the removal check at the end: for every exercise in the package, a
student copy with just that exercise removed must fail its chapter's tests. A chapter whose tests pass
without the solution grades nothing.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minifsdp.course import find_exercises, strip_solutions, write_student_copy
from minifsdp.course.grade import chapter_test_files, grade, run_chapter_tests

REPO = Path(__file__).resolve().parents[1]
REMOVAL_TIMEOUT = 300  # seconds for one chapter's tests with one exercise removed


SOURCE = textwrap.dedent('''\
    """A module with two exercises."""


    def double(x):
        # BEGIN EXERCISE 3.1: twice x
        y = x + x
        # END EXERCISE
        return y


    class Worker:
        def run(self, items):
            total = 0
            for item in items:
                if item:
                    # BEGIN EXERCISE 3.2: add up the "true" items, say \\"why\\"
                    total += item
                    # END EXERCISE
            return total
    ''')


def test_strip_replaces_each_block_by_a_raise_at_its_indentation():
    assert strip_solutions(SOURCE) == textwrap.dedent('''\
        """A module with two exercises."""


        def double(x):
            raise NotImplementedError("Exercise 3.1: twice x")
            return y


        class Worker:
            def run(self, items):
                total = 0
                for item in items:
                    if item:
                        raise NotImplementedError("Exercise 3.2: add up the \\"true\\" items, say \\\\\\"why\\\\\\"")
                return total
        ''')


def test_stripped_code_compiles_and_raises_with_the_exercise_title():
    stripped = strip_solutions(SOURCE)
    ast.parse(stripped)
    namespace: dict = {}
    exec(compile(stripped, "<student>", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^Exercise 3\.1: twice x$"):
        namespace["double"](2)
    with pytest.raises(NotImplementedError) as info:
        namespace["Worker"]().run([1])
    assert str(info.value) == 'Exercise 3.2: add up the "true" items, say \\"why\\"'


def test_only_strips_just_that_exercise():
    namespace: dict = {}
    exec(compile(strip_solutions(SOURCE, only="3.2"), "<student>", "exec"), namespace)
    assert namespace["double"](2) == 4
    with pytest.raises(NotImplementedError, match=r"Exercise 3\.2"):
        namespace["Worker"]().run([1])
    assert strip_solutions(SOURCE, only="9.9") == SOURCE


def test_text_without_markers_is_unchanged_and_markers_in_strings_do_not_count():
    text = 'DOC = """\n    # BEGIN EXERCISE 1.1: an example in a docstring\n    # END EXERCISE\n"""\nx = 1\n'
    assert strip_solutions(text) == text
    assert strip_solutions("") == ""


def test_line_endings_and_a_last_line_without_newline_are_kept():
    text = "def f():\r\n    # BEGIN EXERCISE 1.1: t\r\n    return 1\r\n    # END EXERCISE"
    assert strip_solutions(text) == 'def f():\r\n    raise NotImplementedError("Exercise 1.1: t")\r\n'


@pytest.mark.parametrize("text, line, complaint", [
    ("x = 1\n# BEGIN EXERCISE 1.1: t\nx = 2\n", 2, "no END"),
    ("x = 1\n# END EXERCISE\n", 2, "without a BEGIN"),
    ("# BEGIN EXERCISE 1.1: a\n# BEGIN EXERCISE 1.2: b\n# END EXERCISE\n# END EXERCISE\n", 2, "nested"),
    ("# BEGIN EXERCISE 1.1: a\n# END EXERCISE\n# BEGIN EXERCISE 1.1: b\n# END EXERCISE\n", 3, "already defined"),
    ("if x:\n    # BEGIN EXERCISE 1.1: a\n    y = 1\n# END EXERCISE\n", 4, "indentation"),
    ("# BEGIN EXERCISE 1.1: a\n# END EXERCISE 1.2\n", 2, "closes exercise 1.1"),
    ("# BEGIN EXERCISE 1: a\n# END EXERCISE\n", 1, "expected"),
    ("# BEGIN EXERCISE 1.1\n# END EXERCISE\n", 1, "expected"),
    ("x = 1  # BEGIN EXERCISE 1.1: a\n# END EXERCISE\n", 1, "own"),
])
def test_malformed_markers_are_errors_naming_file_and_line(text, line, complaint):
    with pytest.raises(ValueError, match=rf"^where\.py, line {line}: .*{complaint}"):
        strip_solutions(text, path="where.py")


def _project(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_find_exercises_lists_blocks_across_the_package(tmp_path):
    _project(tmp_path, {"minifsdp/__init__.py": "", "minifsdp/three.py": SOURCE,
                        "minifsdp/sub/ten.py": "def f():\n    # BEGIN EXERCISE 1.10: ten\n    pass\n"
                                               "    # END EXERCISE\n",
                        "minifsdp/sub/nine.py": "# BEGIN EXERCISE 1.9: nine\n# END EXERCISE\n",
                        "tests/test_ch01_x.py": "# BEGIN EXERCISE 1.1: not in the package\n# END EXERCISE\n"})
    found = find_exercises(tmp_path)
    assert [(e.id, e.chapter, e.title) for e in found] == [
        ("1.9", 1, "nine"), ("1.10", 1, "ten"), ("3.1", 3, "twice x"),
        ("3.2", 3, 'add up the "true" items, say \\"why\\"')]
    three = found[2]
    assert three.path == tmp_path / "minifsdp/three.py" and (three.begin, three.end) == (5, 7)


def test_find_exercises_rejects_an_id_used_in_two_files(tmp_path):
    _project(tmp_path, {"minifsdp/a.py": "# BEGIN EXERCISE 2.1: a\n# END EXERCISE\n",
                        "minifsdp/b.py": "x = 1\n# BEGIN EXERCISE 2.1: b\n# END EXERCISE\n"})
    with pytest.raises(ValueError, match=r"b\.py, line 2: exercise 2\.1 is already defined in .*a\.py, line 1"):
        find_exercises(tmp_path)


def test_find_exercises_needs_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="no minifsdp/ package"):
        find_exercises(tmp_path)


def test_the_real_package_has_well_formed_exercises():
    for ex in find_exercises(REPO):  # none at all in a student copy, whose package has its raises instead
        assert ex.id == f"{ex.chapter}.{ex.id.split('.')[1]}" and ex.title and ex.begin < ex.end


# -- the student copy ----------------------------------------------------------------------------------------

def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_student_copy_of_the_real_project_imports_and_has_no_solutions(tmp_path, capsys):
    out = tmp_path / "student"
    removed = write_student_copy(REPO, out)
    assert [e.id for e in removed] == [e.id for e in find_exercises(REPO)]
    summary = capsys.readouterr().out
    assert f"{len(removed)} exercise(s) removed" in summary and f"python -m minifsdp grade {out}" in summary

    assert find_exercises(out) == []
    for path in (out / "minifsdp").rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
    for ex in removed:
        text = (out / ex.path.relative_to(REPO)).read_text()
        assert f'raise NotImplementedError("Exercise {ex.id}: ' in text
    assert (out / "tests" / "test_course.py").read_text() == Path(__file__).read_text()
    assert not any(p.name in {".git", "__pycache__", ".pytest_cache"} or p.name.endswith(".egg-info")
                   for p in out.rglob("*"))

    # The copy's package, not the installed one, and it imports: no exercise sits at module level.
    where = _python(out, "-c", "import minifsdp; print(minifsdp.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == out / "minifsdp" / "__init__.py"


def test_student_copy_skips_build_outputs_and_itself(tmp_path, capsys):
    src = _project(tmp_path / "src", {
        "minifsdp/__init__.py": "", "minifsdp/three.py": SOURCE, "README.md": "hello\n",
        "notebooks/01.ipynb": "{}", "tests/test_ch03_x.py": "",
        ".git/HEAD": "ref\n", "minifsdp/__pycache__/three.cpython.pyc": "", "minifsdp.egg-info/PKG-INFO": "",
        "site/index.html": "", "build/lib/x.py": "", ".pytest_cache/v": "", "notebooks/.ipynb_checkpoints/c": ""})
    out = src / "student"  # inside the project, as `python -m minifsdp student student` makes it
    out.mkdir()
    write_student_copy(src, out, only="3.1")
    assert "1 exercise(s) removed" in capsys.readouterr().out
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "README.md", "minifsdp/__init__.py", "minifsdp/three.py", "notebooks/01.ipynb", "tests/test_ch03_x.py"]
    assert (out / "minifsdp/three.py").read_text() == strip_solutions(SOURCE, only="3.1")


def test_student_copy_refuses_a_non_empty_directory(tmp_path):
    src = _project(tmp_path / "src", {"minifsdp/three.py": SOURCE})
    out = _project(tmp_path / "work", {"minifsdp/three.py": "my answers\n"})
    with pytest.raises(FileExistsError, match="not empty"):
        write_student_copy(src, out)
    assert (out / "minifsdp/three.py").read_text() == "my answers\n"
    with pytest.raises(FileExistsError):
        write_student_copy(src, src)


def test_student_copy_of_an_unknown_exercise_is_an_error_and_writes_nothing(tmp_path):
    src = _project(tmp_path / "src", {"minifsdp/three.py": SOURCE})
    with pytest.raises(ValueError, match=r"no exercise '7\.7'.*3\.1, 3\.2"):
        write_student_copy(src, tmp_path / "out", only="7.7")
    assert not (tmp_path / "out").exists()


def test_student_copy_stops_before_writing_when_a_block_would_leave_invalid_python(tmp_path):
    # A block opened inside an expression: the source is fine, the raise in its place would not be.
    src = _project(tmp_path / "src", {"minifsdp/bad.py": "def f():\n    x = (\n    # BEGIN EXERCISE 1.1: t\n"
                                                         "        1)\n    # END EXERCISE\n    return x\n"})
    compile((src / "minifsdp/bad.py").read_text(), "bad.py", "exec")
    with pytest.raises(ValueError, match=r"bad\.py: removing 1\.1 leaves invalid Python"):
        write_student_copy(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- grading -------------------------------------------------------------------------------------------------

def test_chapter_test_files_groups_by_chapter_number(tmp_path):
    names = ["test_ch00_launch.py", "test_ch01_b.py", "test_ch01_a.py", "test_ch12_z.py", "test_course.py",
             "test_ch1.py", "test_chapter_x.py", "helpers_ch01_x.py"]
    _project(tmp_path, {f"tests/{n}": "" for n in names})
    tests = tmp_path / "tests"
    assert chapter_test_files(tmp_path) == {0: [tests / "test_ch00_launch.py"],
                                            1: [tests / "test_ch01_a.py", tests / "test_ch01_b.py"],
                                            12: [tests / "test_ch12_z.py"]}
    assert chapter_test_files(tmp_path / "nowhere") == {}


# A tiny project of its own, with a package *also named minifsdp*: if the grader imported the installed
# minifsdp instead of this one, `minifsdp.arith` would not even exist.
FAKE = {
    "pyproject.toml": "[tool.pytest.ini_options]\ntestpaths = ['tests']\n",
    "minifsdp/__init__.py": "",
    "minifsdp/arith.py": """\
        def double(x):
            # BEGIN EXERCISE 1.1: twice x
            return 2 * x
            # END EXERCISE


        def square(x):
            return x * x
        """,
    "tests/test_ch01_arith.py": """\
        from pathlib import Path

        import minifsdp
        from minifsdp.arith import double, square


        def test_the_package_is_this_projects():
            assert Path(minifsdp.__file__).resolve() == Path(__file__).resolve().parents[1] / "minifsdp" / "__init__.py"


        def test_double():
            assert double(3) == 6


        def test_square():
            assert square(3) == 9
        """,
    "tests/test_ch02_mixed.py": """\
        import pytest


        @pytest.fixture
        def broken():
            raise RuntimeError("set-up failed")


        def test_passes():
            pass


        def test_fails():
            assert 1 == 2


        def test_errors(broken):
            pass


        @pytest.mark.skip(reason="needs GPUs")
        def test_skipped():
            pass
        """,
}


def test_grade_scores_the_copy_it_is_pointed_at(tmp_path, capsys):
    original = _project(tmp_path / "original", {k: v for k, v in FAKE.items() if "ch02" not in k})
    assert grade(original) == 0
    table = capsys.readouterr().out
    assert "      1        3/3   100%" in table and "  total        3/3   100%" in table

    student = tmp_path / "student"
    write_student_copy(original, student)
    capsys.readouterr()
    assert grade(student) == 1
    table = capsys.readouterr().out
    assert "      1        2/3    67%  1 failed" in table
    assert "tests/test_ch01_arith.py::test_double" in table and "Exercise 1.1: twice x" in table

    returncode, counts = run_chapter_tests(student, 1)
    assert returncode == 1 and (counts.passed, counts.failed, counts.errors) == (2, 1, 0)
    assert counts.problems[0].test == "tests/test_ch01_arith.py::test_double"


def test_run_chapter_tests_counts_every_outcome(tmp_path):
    project = _project(tmp_path, FAKE)
    returncode, counts = run_chapter_tests(project, 2)
    assert returncode == 1
    assert (counts.passed, counts.failed, counts.errors, counts.skipped, counts.total) == (1, 1, 1, 1, 3)
    assert {p.test for p in counts.problems} == {"tests/test_ch02_mixed.py::test_fails",
                                                 "tests/test_ch02_mixed.py::test_errors"}
    assert "set-up failed" in next(p.details for p in counts.problems if p.test.endswith("test_errors"))
    with pytest.raises(ValueError, match="chapter 5 has no tests"):
        run_chapter_tests(project, 5)


def test_a_chapter_that_cannot_run_scores_nothing(tmp_path, capsys):
    project = _project(tmp_path, {"minifsdp/__init__.py": "",
                                  "tests/test_ch03_broken.py": "import minifsdp.not_written_yet\n",
                                  "tests/test_ch04_empty.py": "X = 1\n",
                                  "tests/test_ch05_slow.py": "import time\n\ndef test_slow():\n"
                                                             "    time.sleep(60)\n"})
    returncode, counts = run_chapter_tests(project, 3)
    assert returncode != 0 and counts.errors == 1 and "not_written_yet" in counts.problems[0].details
    returncode, counts = run_chapter_tests(project, 4)  # pytest's "no tests collected"
    assert returncode == 5 and counts.errors == 1 and counts.total == 1
    returncode, counts = run_chapter_tests(project, 5, timeout=3)
    assert returncode != 0 and counts.errors == 1 and "stopped after 3 s" in counts.output

    assert grade(tmp_path / "nowhere") == 1
    assert "Nothing to grade" in capsys.readouterr().out


def test_the_command_line_writes_a_copy_and_grades_it(tmp_path):
    project = _project(tmp_path / "project", {k: v for k, v in FAKE.items() if "ch02" not in k})
    made = _python(project, "-m", "minifsdp", "student", str(tmp_path / "copy"), "--only", "1.1")
    assert made.returncode == 0, made.stderr
    assert "1 exercise(s) removed" in made.stdout
    graded = _python(REPO, "-m", "minifsdp", "grade", str(tmp_path / "copy"))
    assert graded.returncode == 1, graded.stderr
    assert "2/3" in graded.stdout


# -- the removal check ---------------------------------------------------------------------------------------

EXERCISES = find_exercises(REPO)


def _original_chapter_passes(chapter: int) -> bool:
    returncode, counts = run_chapter_tests(REPO, chapter, extra_args=("-x",), timeout=REMOVAL_TIMEOUT)
    return returncode == 0 and counts.failed + counts.errors == 0


def _remove_and_run(exercise, tmp: Path):
    """A student copy without this one exercise, and its chapter's tests run on it (stopping at the first
    failure): (copy, exit code, counts)."""
    copy = tmp / f"student-{exercise.id}"
    write_student_copy(REPO, copy, only=exercise.id)
    if exercise.chapter not in chapter_test_files(copy):
        return copy, None, None
    # the chapter's test file named after the exercise's module first (oss.py -> test_ch03_oss.py), else after
    # its package (parallel/mappings.py -> test_ch12_tensor_parallel.py)
    names = [f.name for f in chapter_test_files(copy)[exercise.chapter]]
    first = next((w for w in (exercise.path.stem, exercise.path.parent.name) if any(w in n for n in names)), None)
    returncode, counts = run_chapter_tests(copy, exercise.chapter, extra_args=("-x",), timeout=REMOVAL_TIMEOUT,
                                           first=first)
    return copy, returncode, counts


@pytest.fixture(scope="module")
def removals(tmp_path_factory):
    """Every removal check, two at a time: each is mostly a fresh interpreter importing torch, and this
    machine has two cores."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("removals")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {ex.id: pool.submit(_remove_and_run, ex, tmp) for ex in EXERCISES}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.timeout(len(EXERCISES) * REMOVAL_TIMEOUT + 60)
@pytest.mark.parametrize("exercise", EXERCISES, ids=[ex.id for ex in EXERCISES])
def test_removal_of_each_exercise_fails_its_chapter(exercise, removals):
    copy, returncode, counts = removals[exercise.id]
    where = f"exercise {exercise.id} ({exercise.path.relative_to(REPO)}, line {exercise.begin}: {exercise.title})"
    if returncode is None:
        pytest.fail(f"{where} belongs to chapter {exercise.chapter}, which has no tests "
                    f"(tests/test_ch{exercise.chapter:02d}_*.py): nothing can grade it")
    assert returncode != 0 and counts.failed + counts.errors >= 1, (
        f"with {where} removed, chapter {exercise.chapter}'s tests still pass ({counts.passed} passed, "
        f"{counts.skipped} skipped): no test runs this code, so a student is never graded on it.\n"
        f"{counts.output[-3000:]}")

    # ... and they fail *because* the exercise is missing, not for a reason of their own: either the
    # failure reports the exercise's NotImplementedError, or the chapter passes with the solution in place.
    reported = any(f"Exercise {exercise.id}:" in p.details for p in counts.problems) or \
        f"Exercise {exercise.id}:" in counts.output
    assert reported or _original_chapter_passes(exercise.chapter), (
        f"chapter {exercise.chapter}'s tests fail even with {where} solved; fix them first:\n"
        f"{counts.output[-3000:]}")
