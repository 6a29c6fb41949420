"""Course mode (minifsdp/course/): exercise markers, student copies, and the grader.

The grader is tried on tiny projects of its own, each with a package also named minifsdp, passed as the
reference explicitly: a submission that tampers with the tests, the configuration or the code around
the exercises must score exactly what an untouched student copy scores.

The test that matters most is the removal check at the end: for every exercise in the package, a
student copy with just that exercise removed must fail its tests. A chapter whose tests pass without
the solution grades nothing.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from minifsdp.course import find_exercises, project_files, strip_solutions, write_student_copy
from minifsdp.course import grade as grading
from minifsdp.course.assignment import add_points, check_pass_line, exercise_points, pass_line_for
from minifsdp.course.assemble import assemble, scan_regions
from minifsdp.course.grade import chapter_test_files, collect_reference, grade_all, grade_submission
from minifsdp.course.report import gradescope_results
from minifsdp.course.runner import plugin_dir, run_pytest

from early import Early
from instructor_bypasses import instructor_bypasses

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


def test_strip_keeps_the_markers_and_puts_a_raise_between_them():
    assert strip_solutions(SOURCE) == textwrap.dedent('''\
        """A module with two exercises."""


        def double(x):
            # BEGIN EXERCISE 3.1: twice x
            raise NotImplementedError(
                "Exercise 3.1: twice x")
            # END EXERCISE
            return y


        class Worker:
            def run(self, items):
                total = 0
                for item in items:
                    if item:
                        # BEGIN EXERCISE 3.2: add up the "true" items, say \\"why\\"
                        raise NotImplementedError(
                            "Exercise 3.2: add up the \\"true\\" items, say \\\\\\"why\\\\\\"")
                        # END EXERCISE
                return total
        ''')
    # A student copy is stripped again as it is: what is between the markers is replaced, nothing else.
    assert strip_solutions(strip_solutions(SOURCE)) == strip_solutions(SOURCE)


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
    assert strip_solutions(SOURCE, chapters=[4]) == SOURCE
    assert strip_solutions(SOURCE, chapters=[3]) == strip_solutions(SOURCE)


def test_text_without_markers_is_unchanged_and_markers_in_strings_do_not_count():
    text = 'DOC = """\n    # BEGIN EXERCISE 1.1: an example in a docstring\n    # END EXERCISE\n"""\nx = 1\n'
    assert strip_solutions(text) == text
    assert strip_solutions("") == ""


def test_line_endings_and_a_last_line_without_newline_are_kept():
    text = "def f():\r\n    # BEGIN EXERCISE 1.1: t\r\n    return 1\r\n    # END EXERCISE"
    assert strip_solutions(text) == ('def f():\r\n    # BEGIN EXERCISE 1.1: t\r\n'
                                     '    raise NotImplementedError(\r\n        "Exercise 1.1: t")\r\n'
                                     '    # END EXERCISE')


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
    for ex in find_exercises(REPO):  # a student copy has the same, with a raise between the markers
        assert ex.id == f"{ex.chapter}.{ex.id.split('.')[1]}" and ex.title and ex.begin < ex.end




# -- the student copy ----------------------------------------------------------------------------------------

def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter that imports this checkout's minifsdp (cwd first, as `python -m` has it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_student_copy_of_the_real_project_imports_and_keeps_the_markers(tmp_path, capsys):
    out = tmp_path / "student"
    removed = write_student_copy(REPO, out)
    assert [e.id for e in removed] == [e.id for e in find_exercises(REPO)]
    summary = capsys.readouterr().out
    assert f"{len(removed)} exercise(s) removed" in summary and f"python -m minifsdp grade {out}" in summary

    # The same exercises, where they were, each with the raise between its markers and nothing else.
    copied = find_exercises(out)
    assert [(e.id, e.title, e.path.relative_to(out)) for e in copied] == \
        [(e.id, e.title, e.path.relative_to(REPO)) for e in removed]
    for ex in copied:
        inside = ex.path.read_text(encoding="utf-8").splitlines()[ex.begin:ex.end - 1]
        assert [line.strip() for line in inside] == \
            ["raise NotImplementedError(", f"{json.dumps(str(ex), ensure_ascii=False)})"]
    for path in (out / "minifsdp").rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
    assert (out / "tests" / "test_course.py").read_text() == Path(__file__).read_text()
    # The instructor's key and wrong solutions never reach a student.
    assert (REPO / "instructor").is_dir() and not (out / "instructor").exists()
    # What git ignores stays behind (the project is a git work tree): caches, egg-info, the built site.
    assert not any(p.name in {".git", "__pycache__", ".pytest_cache", "site"} or p.name.endswith(".egg-info")
                   for p in out.rglob("*"))

    # The copy's package, not the installed one, and it imports: no exercise sits at module level.
    where = _python(out, "-c", "import minifsdp; print(minifsdp.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == out / "minifsdp" / "__init__.py"


def test_student_copy_outside_git_skips_build_outputs_and_itself(tmp_path, capsys):
    src = _project(tmp_path / "src", {
        "minifsdp/__init__.py": "", "minifsdp/three.py": SOURCE, "README.md": "hello\n",
        "notebooks/01.ipynb": "{}", "tests/test_ch03_x.py": "",
        ".git/HEAD": "ref\n", "minifsdp/__pycache__/three.cpython.pyc": "", "minifsdp.egg-info/PKG-INFO": "",
        "site/index.html": "", "build/lib/x.py": "", ".pytest_cache/v": "", "notebooks/.ipynb_checkpoints/c": "",
        "env/pyvenv.cfg": "", "env/lib/conftest.py": ""})
    out = src / "student"  # inside the project, as `python -m minifsdp student student` makes it
    out.mkdir()
    write_student_copy(src, out, only="3.1")
    assert "1 exercise(s) removed" in capsys.readouterr().out
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "README.md", "assignment.json", "minifsdp/__init__.py", "minifsdp/three.py", "notebooks/01.ipynb",
        "tests/test_ch03_x.py"]  # assignment.json: what was handed out, and the course that grades it
    assert (out / "minifsdp/three.py").read_text() == strip_solutions(SOURCE, only="3.1")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_student_copy_of_a_git_work_tree_is_what_git_would_commit(tmp_path, capsys):
    src = _project(tmp_path / "src", {
        "minifsdp/__init__.py": "", "minifsdp/three.py": SOURCE, "README.md": "hello\n", "tests/test_ch03_x.py": "",
        ".gitignore": "secret.txt\ndata/\n*.log\n", "notes.md": "not added, not ignored\n",
        "secret.txt": "ignored\n", "data/big.bin": "ignored\n", "minifsdp/run.log": "ignored\n"})
    git = ["git", "-C", str(src), "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", ".gitignore", "README.md", "minifsdp", "tests"], check=True)
    expected = [".gitignore", "README.md", "minifsdp/__init__.py", "minifsdp/three.py", "notes.md",
                "tests/test_ch03_x.py"]
    assert [str(p) for p in project_files(src)] == expected
    out = tmp_path / "out"
    removed = write_student_copy(src, out, chapters=[3])
    assert [e.id for e in removed] == ["3.1", "3.2"] and "2 exercise(s) removed" in capsys.readouterr().out
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        expected + ["assignment.json"])


def test_student_copy_of_some_chapters_leaves_the_others_solved(tmp_path):
    one = "def f():\n    # BEGIN EXERCISE 1.1: one\n    return 1\n    # END EXERCISE\n"
    src = _project(tmp_path / "src", {"minifsdp/three.py": SOURCE, "minifsdp/one.py": one})
    removed = write_student_copy(src, tmp_path / "out", chapters=[1], quiet=True)
    assert [e.id for e in removed] == ["1.1"]
    assert (tmp_path / "out/minifsdp/three.py").read_text() == SOURCE
    assert (tmp_path / "out/minifsdp/one.py").read_text() == strip_solutions(one)
    with pytest.raises(ValueError, match=r"chapter\(s\) 7 have no exercise"):
        write_student_copy(src, tmp_path / "other", chapters=[3, 7])
    assert not (tmp_path / "other").exists()


def test_a_student_copy_knows_its_assignment_and_is_graded_against_the_course(tmp_path):
    """`grade .` in a copy grades what was handed out, on the course's tests: never on the copy's own."""
    from minifsdp.course.student import read_assignment

    one = "def f():\n    # BEGIN EXERCISE 1.1: one\n    return 1\n    # END EXERCISE\n"
    src = _project(tmp_path / "src", {"minifsdp/three.py": SOURCE, "minifsdp/one.py": one,
                                      "tests/test_ch01_one.py": "def test_one():\n    pass\n"})
    out = tmp_path / "out"
    write_student_copy(src, out, chapters=[1], quiet=True)
    assert read_assignment(out) == {"course": str(src.resolve()), "exercises": ["1.1"], "chapters": [1]}
    assert grading.assignment_defaults(out, None, None) == (src.resolve(), [1])
    assert grading.assignment_defaults(out, src, "3") == (src, "3")  # what the grader is told comes first
    assert grading.assignment_defaults(src, None, None) == (None, None)  # not a student copy
    with pytest.raises(ValueError, match="cannot be its own reference"):
        grading.assignment_defaults(out, out, None)
    shutil.move(src, tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="not on this machine.*--reference PATH"):
        grading.assignment_defaults(out, None, None)
    assert pass_line_for(out, None) == 60 and pass_line_for(out, 75) == 75  # the grader's default, or as told
    (out / "assignment.json").write_text("{}")
    with pytest.raises(ValueError, match="not an assignment"):
        grading.assignment_defaults(out, None, None)
    # the instructor's pass line travels with the copy; a bad one writes nothing
    write_student_copy(src if src.exists() else tmp_path / "moved", tmp_path / "lined", chapters=[1], quiet=True,
                       pass_line=45)
    assert read_assignment(tmp_path / "lined")["pass_line"] == 45 and pass_line_for(tmp_path / "lined", None) == 45
    assert pass_line_for(tmp_path / "lined", 80) == 80
    with pytest.raises(ValueError, match="pass line"):
        write_student_copy(tmp_path / "moved", tmp_path / "bad", chapters=[1], quiet=True, pass_line=120)
    assert not (tmp_path / "bad").exists()


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


def test_chapter_test_files_groups_by_chapter_number(tmp_path):
    names = ["test_ch00_launch.py", "test_ch01_b.py", "test_ch01_a.py", "test_ch12_z.py", "test_course.py",
             "test_ch1.py", "test_chapter_x.py", "helpers_ch01_x.py"]
    _project(tmp_path, {f"tests/{n}": "" for n in names})
    tests = tmp_path / "tests"
    assert chapter_test_files(tmp_path) == {0: [tests / "test_ch00_launch.py"],
                                            1: [tests / "test_ch01_a.py", tests / "test_ch01_b.py"],
                                            12: [tests / "test_ch12_z.py"]}
    assert chapter_test_files(tmp_path / "nowhere") == {}


# -- what is graded: the reference, with the submission's code between the markers ---------------------------

def test_scan_regions_reads_a_students_markers_leniently():
    text = ('DOC = """\n# BEGIN EXERCISE 9.9: an example in a docstring\n# END EXERCISE\n"""\n'
            + strip_solutions(SOURCE) + "# BEGIN EXERCISE 4.1: never closed\nx = 1\n")
    regions, notes = scan_regions(text, Path("m.py"))
    assert [(r.id, r.indent, [line.strip() for line in r.body]) for r in regions] == [
        ("3.1", "    ", ["raise NotImplementedError(", '"Exercise 3.1: twice x")']),
        ("3.2", " " * 16, [line.strip() for line in strip_solutions(SOURCE).splitlines()[17:19]])]
    assert notes == [("4.1", "BEGIN on m.py, line 26 has no END")]
    # Not valid Python (the student's code may not be): read line by line, the region still found.
    regions, notes = scan_regions("def f(:\n    # BEGIN EXERCISE 1.1: t\n    return (\n    # END EXERCISE\n",
                                  Path("m.py"))
    assert [(r.id, r.body) for r in regions] == [("1.1", ["    return (\n"])] and notes == []


# A tiny course of its own, with a package *also named minifsdp*: if the grader imported the installed
# minifsdp instead of this one, `minifsdp.arith` would not even exist. Chapter 2 builds on exercise 1.1.
FAKE = {
    "pyproject.toml": "[tool.pytest.ini_options]\ntestpaths = ['tests']\n"
                      "markers = ['exercise(*ids): e', 'mechanism: m']\n",
    "minifsdp/__init__.py": "",
    "minifsdp/arith.py": """\
        def double(x):
            # BEGIN EXERCISE 1.1: twice x
            return x + x
            # END EXERCISE


        def square(x):
            return x * x
        """,
    "minifsdp/quad.py": """\
        from minifsdp.arith import double


        def quadruple(x):
            # BEGIN EXERCISE 2.1: twice twice x
            return double(double(x))
            # END EXERCISE
        """,
    "tests/test_ch01_arith.py": """\
        from pathlib import Path

        import pytest

        import minifsdp
        from minifsdp.arith import double, square


        def test_the_package_is_this_projects():
            assert Path(minifsdp.__file__).resolve() == Path(__file__).resolve().parents[1] / "minifsdp" / "__init__.py"


        @pytest.mark.exercise("1.1")
        def test_double():
            assert double(3) == 6


        @pytest.mark.exercise("1.1")
        @pytest.mark.mechanism
        def test_double_keeps_the_type():
            assert double(0.5) == 1.0 and isinstance(double(2), int)


        def test_square():
            assert square(3) == 9
        """,
    "tests/test_ch02_quad.py": """\
        import pytest

        from minifsdp.arith import double
        from minifsdp.quad import quadruple


        @pytest.mark.exercise("2.1")
        def test_quadruple():
            assert quadruple(3) == 12


        def test_double_twice():
            assert double(double(1)) == 4
        """,
}

FORCE_PASS = """\
import pathlib
import pytest

pathlib.Path(__file__).with_name("EXECUTED").write_text("conftest")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def _insert_before_marker(path: Path, exercise: str, line: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, text in enumerate(lines) if f"BEGIN EXERCISE {exercise}:" in text)
    path.write_text("".join(lines[:at] + [line] + lines[at:]))


def _escape_the_markers(sub: Path) -> None:
    """1.1 solved, then a line at column 0 inside its markers: it closes `double`, and whatever follows would
    run at import, outside any exercise (here harmless; it could redefine anything in the file)."""
    path = sub / "minifsdp/arith.py"
    text = path.read_text()
    start = text.index("\n", text.index("BEGIN EXERCISE 1.1:")) + 1
    end = text.index("    # END EXERCISE", start)
    path.write_text(text[:start] + "    return x + x\nESCAPED = True\n" + text[end:])


# Each way of scoring without doing the work, and how the report lists it.
TAMPERING = {
    "code indented out of its markers": (_escape_the_markers, []),
    "conftest hook": (lambda sub: [(sub / name).write_text(FORCE_PASS)
                                   for name in ("conftest.py", "tests/conftest.py")],
                      [("added", "conftest.py"), ("added", "tests/conftest.py")]),
    "deleted test file": (lambda sub: (sub / "tests/test_ch02_quad.py").unlink(),
                          [("missing", "tests/test_ch02_quad.py")]),
    "pyproject.toml": (lambda sub: (sub / "pyproject.toml").write_text(
                           "[tool.pytest.ini_options]\ntestpaths = ['elsewhere']\n"
                           "addopts = '-k square -p no:warnings'\n"),
                       [("changed", "pyproject.toml")]),
    "sitecustomize.py": (lambda sub: (sub / "sitecustomize.py").write_text(
                             "import pathlib\npathlib.Path(__file__).with_name('EXECUTED').write_text('site')\n"),
                         [("added", "sitecustomize.py")]),
    "code outside the markers": (lambda sub: (_insert_before_marker(sub / "minifsdp/arith.py", "1.1",
                                                                    "    return 2 * x\n"),
                                              _insert_before_marker(sub / "minifsdp/quad.py", "2.1",
                                                                    "    return 4 * x\n")),
                                 [("changed", "minifsdp/arith.py"), ("changed", "minifsdp/quad.py")]),
}


def _solve(submission: Path, exercise: str, code: str) -> None:
    """Write `code` between the exercise's markers in the submission, as a student would."""
    for path in (submission / "minifsdp").rglob("*.py"):
        lines = path.read_text().splitlines(keepends=True)
        begin = next((i for i, text in enumerate(lines) if f"BEGIN EXERCISE {exercise}:" in text), None)
        if begin is not None:
            end = next(i for i in range(begin, len(lines)) if "END EXERCISE" in lines[i])
            indent = lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())]
            lines[begin + 1:end] = [indent + line + "\n" for line in code.splitlines()]
            path.write_text("".join(lines))
            return
    raise AssertionError(f"no exercise {exercise} in {submission}")


@pytest.fixture(scope="module")
def plugins():
    with plugin_dir() as directory:
        yield directory


@contextmanager
def bare_pytest():
    """The tiny courses' pytest runs without the plugins installed here (hypothesis, benchmark, ...): they
    need none, and loading them is most of what such a run costs."""
    before = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
        else:
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = before


@pytest.fixture
def bare():
    with bare_pytest():
        yield


@pytest.fixture(scope="module")
def fake(tmp_path_factory, plugins):
    """The tiny course, a student copy of it, and its tests collected once."""
    root = tmp_path_factory.mktemp("fake")
    reference = _project(root / "reference", FAKE)
    write_student_copy(reference, root / "student", quiet=True)
    with bare_pytest():
        return reference, root / "student", collect_reference(reference, "1,2", plugins)


def _submission(fake, name: str, tmp: Path) -> Path:
    reference, student, _ = fake
    sub = tmp / name.replace(" ", "_")
    shutil.copytree(reference if name == "solved" else student, sub)
    if name in TAMPERING:
        TAMPERING[name][0](sub)
    return sub


@pytest.fixture(scope="module")
def graded(fake, plugins, tmp_path_factory):
    """An untouched student copy, a solved one, and each tampered one, graded two at a time."""
    tmp = tmp_path_factory.mktemp("submissions")
    names = ["student", "solved", *TAMPERING]
    subs = {name: _submission(fake, name, tmp) for name in names}
    with bare_pytest(), ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(grade_submission, subs[name], fake[2], plugins) for name in names}
        results = {name: future.result() for name, future in futures.items()}
    results["executed"] = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("EXECUTED"))
    return results


def _scores(result: dict) -> dict:
    return {"chapters": [(c["chapter"], c["score"], c["max"], c["passed"]) for c in result["chapters"]],
            "exercises": [(e["id"], e["score"], e["max"], e["mechanism"], e["from_submission"])
                          for e in result["exercises"]],
            "total": result["total"]}


def test_assembly_takes_only_the_code_between_the_markers_found_by_id(fake, tmp_path):
    reference, student, _ = fake
    sub = shutil.copytree(student, tmp_path / "sub")
    _solve(sub, "1.1", "y = 2 * x\nreturn y")
    # 2.1 moved to a file of its own, at another indentation; its old markers gone from quad.py.
    quad = (sub / "minifsdp/quad.py").read_text().splitlines(keepends=True)
    (sub / "minifsdp/quad.py").write_text("".join(quad[:4] + ["    return None\n"]))
    (sub / "minifsdp/moved.py").write_text("if True:\n        # BEGIN EXERCISE 2.1: mine\n"
                                           "        return double(double(x))\n        # END EXERCISE\n")
    copy = tmp_path / "copy"
    assembly = assemble(reference, sub, copy)
    assert (copy / "minifsdp/arith.py").read_text() == (reference / "minifsdp/arith.py").read_text().replace(
        "    return x + x\n", "    y = 2 * x\n    return y\n")
    assert (copy / "minifsdp/quad.py").read_text() == (reference / "minifsdp/quad.py").read_text()
    assert not (copy / "minifsdp/moved.py").exists() and assembly.missing == {}
    assert sorted((e.kind, e.path) for e in assembly.edits) == [("added", "minifsdp/moved.py"),
                                                                ("changed", "minifsdp/quad.py")]

    # Markers that are broken cost their own exercise only: the raise goes in, and the report says why.
    text = (sub / "minifsdp/moved.py").read_text().replace("        # END EXERCISE\n", "")
    (sub / "minifsdp/moved.py").write_text(text)
    assembly = assemble(reference, sub, tmp_path / "copy2", chapters=[2])
    assert set(assembly.missing) == {"2.1"} and "has no END" in assembly.missing["2.1"]
    assert 'raise NotImplementedError(\n        "Exercise 2.1: twice twice x")' in \
        (tmp_path / "copy2/minifsdp/quad.py").read_text()
    assert (tmp_path / "copy2/minifsdp/arith.py").read_text() == (reference / "minifsdp/arith.py").read_text()


def test_a_solved_copy_scores_full_marks_and_a_student_copy_what_it_has(graded):
    solved, student = graded["solved"], graded["student"]
    assert solved["total"] == {"score": 6, "max": 6} and solved["edits_outside_exercises"] == []
    assert [(e["id"], e["score"], e["max"], e["mechanism"]) for e in solved["exercises"]] == [
        ("1.1", 2, 2, {"score": 1, "max": 1}), ("2.1", 1, 1, {"score": 0, "max": 0})]
    # Chapter 2's test of no exercise calls 1.1's double(): it runs with the reference's 1.1, so the missing
    # 1.1 costs points in chapter 1 only.
    assert [(c["chapter"], c["score"], c["max"]) for c in student["chapters"]] == [(1, 2, 4), (2, 1, 2)]
    assert [(e["id"], e["score"], e["max"], e["mechanism"], e["from_submission"]) for e in student["exercises"]] == [
        ("1.1", 0, 2, {"score": 0, "max": 1}, True), ("2.1", 0, 1, {"score": 0, "max": 0}, True)]
    failed = {t["id"]: t["cause"] for t in student["chapters"][0]["failed"]}
    assert failed["tests/test_ch01_arith.py::test_double"] == "NotImplementedError: Exercise 1.1: twice x"
    assert student["edits_outside_exercises"] == [] and student["warnings"] == []


def test_a_wrong_solution_costs_points_in_its_own_exercise_only(fake, plugins, tmp_path, bare):
    """A wrong 1.1 (three times x) breaks 2.1's quadruple() too, in a copy holding both: 2.1's test and
    chapter 2's test of no exercise still run with the reference's 1.1, so they keep their points."""
    reference, _, collected = fake
    wrong = shutil.copytree(reference, tmp_path / "wrong")
    _solve(wrong, "1.1", "return 3 * x")
    result = grade_submission(wrong, collected, plugins)
    assert [(e["id"], e["score"], e["max"]) for e in result["exercises"]] == [("1.1", 0, 2), ("2.1", 1, 1)]
    assert [(c["chapter"], c["score"], c["max"]) for c in result["chapters"]] == [(1, 2, 4), (2, 2, 2)]
    # and 2.1 wrong as well: each loses its own, chapter 2's test of no exercise still passes
    _solve(wrong, "2.1", "return double(x)")
    result = grade_submission(wrong, collected, plugins)
    assert [(e["id"], e["score"], e["max"]) for e in result["exercises"]] == [("1.1", 0, 2), ("2.1", 0, 1)]
    assert [(c["chapter"], c["score"], c["max"]) for c in result["chapters"]] == [(1, 2, 4), (2, 1, 2)]
    # 2.1's own mistake, with the reference's 1.1 (with the submission's, 9 == 12)
    assert result["chapters"][1]["failed"][0]["cause"] == "assert 6 == 12"


def test_an_exercise_that_skips_its_mechanism_scores_at_most_the_pass_line(fake, plugins, tmp_path, bare):
    """2 * x as a float: test_double passes (6.0 == 6), the mechanism test (the type kept) fails. Half the tests,
    so 50 points where the line is above that, and the line where it is below."""
    reference, _, collected = fake
    sub = shutil.copytree(reference, tmp_path / "sub")
    _solve(sub, "1.1", "return 2.0 * x")
    result = grade_submission(sub, collected.restricted([1]), plugins, pass_line=40)
    (ex,) = result["exercises"]
    assert (ex["score"], ex["max"], ex["points"], ex["capped"]) == (1, 2, 40, True)
    assert result["points"] == {"score": 40, "max": 100, "pass_line": 40}
    assert add_points(result, 60)["exercises"][0]["points"] == 50 and not result["exercises"][0]["capped"]


def test_the_pass_line_holds_a_right_valued_solution_that_skips_the_lesson():
    # 6.1 waiting for its reduce-scatter at once: every value right, one mechanism test of 79 failed
    row = {"score": 78, "max": 79, "mechanism": {"score": 12, "max": 13}}
    assert exercise_points(row, 60) == (60, True) and exercise_points(row, 100) == (98.7, False)
    assert exercise_points({**row, "mechanism": {"score": 13, "max": 13}}, 60) == (98.7, False)
    assert exercise_points({**row, "score": 30}, 60) == (38.0, False)  # below the line: the tests decide
    assert exercise_points({"score": 0, "max": 0, "mechanism": {"score": 0, "max": 0}}, 60) == (0.0, False)
    for bad in (-1, 101, "half", None):
        with pytest.raises(ValueError, match="pass line is a number of points from 0 to 100"):
            check_pass_line(bad)


@pytest.mark.parametrize("name", list(TAMPERING))
def test_tampering_scores_what_an_untouched_copy_scores_and_is_listed(graded, name):
    scores = lambda result: {**_scores(result), "exercises": [e[:4] for e in _scores(result)["exercises"]]}  # noqa: E731
    assert scores(graded[name]) == scores(graded["student"])
    assert [(e["kind"], e["path"]) for e in graded[name]["edits_outside_exercises"]] == TAMPERING[name][1]
    assert graded["executed"] == [], "a file of the submission was run"
    if name == "code indented out of its markers":  # the placeholder was graded instead, and the report says why
        (ex,) = [e for e in graded[name]["exercises"] if e["id"] == "1.1"]
        assert not ex["from_submission"] and "indented less than its markers" in ex["note"]


def test_a_chapter_graded_alone_takes_the_other_solutions_from_the_reference(fake, plugins, tmp_path, bare):
    reference, student, collected = fake
    sub = shutil.copytree(student, tmp_path / "sub")
    _solve(sub, "2.1", "return double(double(x))")  # 1.1, which it calls, is still the raise
    alone = collected.restricted([2])
    result = grade_submission(sub, alone, plugins)
    assert result["chapters_graded"] == [2] and [e["id"] for e in result["exercises"]] == ["2.1"]
    assert result["total"] == {"score": 2, "max": 2}
    assert grade_submission(student, alone, plugins)["total"] == {"score": 1, "max": 2}  # 2.1 not written


ODD = {
    "pyproject.toml": "[tool.pytest.ini_options]\nmarkers = ['exercise(*ids): e', 'mechanism: m']\n",
    "minifsdp/__init__.py": "",
    "minifsdp/answer.py": "def answer():\n    # BEGIN EXERCISE 3.1: the answer\n    return 42\n    # END EXERCISE\n",
    "tests/test_ch03_answer.py": """\
        import pytest

        from minifsdp.answer import answer


        @pytest.mark.exercise("3.1")
        def test_answer():
            assert answer() == 42


        def test_other():
            pass
        """,
    "tests/test_ch04_mixed.py": """\
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


        def test_skips_itself():
            pytest.skip("no GPU here")
        """,
}


def test_every_outcome_is_counted_and_a_hung_or_broken_chapter_scores_zero_of_its_maximum(tmp_path, plugins, bare):
    reference = _project(tmp_path / "reference", ODD)
    collected = collect_reference(reference, None, plugins)
    assert {c: collected.maximum(c) for c in collected.tests} == {3: 2, 4: 4}  # the skip mark is known already
    hung, broken = (shutil.copytree(reference, tmp_path / name) for name in ("hung", "broken"))
    _solve(hung, "3.1", "import time\ntime.sleep(600)\nreturn 42")
    _solve(broken, "3.1", "return (")
    with ThreadPoolExecutor(max_workers=2) as pool:
        hung_result = pool.submit(grade_submission, hung, collected.restricted([3]), plugins, timeout=3)
        broken_result = pool.submit(grade_submission, broken, collected, plugins)
        hung_result, broken_result = hung_result.result(), broken_result.result()

    chapter = hung_result["chapters"][0]
    assert (chapter["chapter"], chapter["score"], chapter["max"]) == (3, 0, 2) and "time limit" in chapter["status"]
    assert hung_result["exercises"][0]["score"] == 0 and hung_result["exercises"][0]["max"] == 1

    three, four = broken_result["chapters"]
    assert (three["score"], three["max"], three["status"]) == (0, 2, "ran")
    assert all(t["cause"].startswith("not collected") for t in three["failed"])
    assert any("answer.py is not valid Python" in w for w in broken_result["warnings"])
    assert (four["score"], four["max"]) == (1, 3)  # a skipped test neither earns nor costs a point
    assert {t["id"].split("::")[1]: t["cause"] for t in four["failed"]} == {
        "test_fails": "assert 1 == 2", "test_errors": "error at setup: RuntimeError: set-up failed"}
    assert sorted(t["id"].split("::")[1] for t in four["skipped"]) == ["test_skipped", "test_skips_itself"]


# -- results for machines ------------------------------------------------------------------------------------

def _check_types(data: dict, fields: dict, where: str) -> None:
    for key, kind in fields.items():
        assert key in data, f"{where}: no {key!r}"
        assert isinstance(data[key], kind) and not (kind in (int, (int, float)) and isinstance(data[key], bool)), \
            f"{where}: {key!r} is {data[key]!r}, not {kind}"


def check_result_json(result: dict) -> None:
    """The --json document's schema: required keys and their types."""
    _check_types(result, {"submission": str, "reference": str, "chapters_graded": list, "chapters": list,
                          "exercises": list, "total": dict, "edits_outside_exercises": list, "warnings": list,
                          "seconds": (int, float)}, "result")
    for chapter in result["chapters"]:
        _check_types(chapter, {"chapter": int, "score": int, "max": int, "status": str, "seconds": (int, float),
                               "passed": list, "failed": list, "skipped": list, "test_seconds": dict}, "chapter")
        assert 0 <= chapter["score"] <= chapter["max"] and chapter["score"] == len(chapter["passed"])
        for failed in chapter["failed"]:
            _check_types(failed, {"id": str, "cause": str}, "failed test")
            assert "\n" not in failed["cause"]
    for ex in result["exercises"]:
        _check_types(ex, {"id": str, "chapter": int, "title": str, "from_submission": bool, "score": int, "max": int,
                          "mechanism": dict, "tests": list, "passed": list, "failed": list, "seconds": (int, float)},
                     "exercise")
        assert sorted(ex["passed"] + ex["failed"]) == sorted(ex["tests"]) and ex["score"] == len(ex["passed"])
        _check_types(ex["mechanism"], {"score": int, "max": int}, "mechanism")
        assert ex["chapter"] in result["chapters_graded"] and 0 <= ex["score"] <= ex["max"]
    _check_types(result["total"], {"score": int, "max": int}, "total")
    assert result["total"]["score"] == sum(c["score"] for c in result["chapters"])
    _check_types(result["points"], {"score": (int, float), "max": int, "pass_line": (int, float)}, "points")
    for ex in result["exercises"]:
        _check_types(ex, {"points": (int, float), "capped": bool}, "exercise")
        assert 0 <= ex["points"] <= 100
    assert result["points"]["score"] == pytest.approx(sum(ex["points"] for ex in result["exercises"] if ex["max"]))
    assert sum(c["points"]["max"] for c in result["chapters"]) == result["points"]["max"]
    for edit in result["edits_outside_exercises"]:
        _check_types(edit, {"path": str, "kind": str, "what": str}, "edit")
        assert edit["kind"] in {"changed", "missing", "added"}
    json.dumps(result)


GRADESCOPE_TOP = {"score": (int, float), "execution_time": (int, float), "output": str, "output_format": str,
                  "test_output_format": str, "test_name_format": str, "visibility": str, "stdout_visibility": str,
                  "extra_data": dict, "tests": list, "leaderboard": list}
GRADESCOPE_TEST = {"score": (int, float), "max_score": (int, float), "status": str, "name": str,
                   "name_format": str, "number": str, "output": str, "output_format": str, "tags": list,
                   "visibility": str, "extra_data": dict}
VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


def check_gradescope(results: dict) -> None:
    """Gradescope's results.json, as its autograder specification documents it: only its fields, of their
    types; a score at the top or on every test; status passed/failed; visibility one of four words."""
    assert set(results) <= set(GRADESCOPE_TOP), set(results) - set(GRADESCOPE_TOP)
    _check_types(results, {k: GRADESCOPE_TOP[k] for k in results}, "results.json")
    assert "score" in results or all("score" in t for t in results.get("tests", []))
    for test in results.get("tests", []):
        assert set(test) <= set(GRADESCOPE_TEST), set(test) - set(GRADESCOPE_TEST)
        _check_types(test, {k: GRADESCOPE_TEST[k] for k in test}, f"test {test.get('name')}")
        assert test.get("status", "passed") in {"passed", "failed"}
        assert test.get("visibility", "visible") in VISIBILITY
        assert 0 <= test["score"] <= test["max_score"]
    json.dumps(results)


def test_the_json_and_gradescope_results_validate(graded):
    for name in ("student", "solved", "conftest hook"):
        check_result_json(graded[name])
        check_gradescope(gradescope_results(graded[name]))
    results = gradescope_results(graded["student"])
    assert results["score"] == 0 and results["extra_data"]["tests_passed"] == 3
    assert [(t["name"], t["score"], t["max_score"], t["status"]) for t in results["tests"]] == [
        ("Exercise 1.1: twice x", 0, 100, "failed"), ("Chapter 1: tests of no single exercise", 0, 0, "passed"),
        ("Exercise 2.1: twice twice x", 0, 100, "failed"), ("Chapter 2: tests of no single exercise", 0, 0, "passed")]
    assert gradescope_results(graded["solved"])["score"] == 200
    assert "NotImplementedError: Exercise 1.1: twice x" in results["tests"][0]["output"]
    tampered = gradescope_results(graded["conftest hook"])
    assert "added conftest.py" in tampered["output"]


def test_the_command_line_writes_a_copy_grades_it_and_writes_every_format(fake, tmp_path, bare, capsys,
                                                                          monkeypatch):
    from minifsdp.__main__ import main

    reference, _, _ = fake
    monkeypatch.chdir(reference)  # `student` copies the project it is run in
    assert main(["student", str(tmp_path / "copy"), "--chapters", "1"]) == 0
    assert "1 exercise(s) removed" in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["grade", str(tmp_path / "copy"), "--reference", str(reference), "--chapters", "1",
                 "--json", str(out / "r.json"), "--gradescope", str(out / "gs.json"),
                 "--junit", str(out / "junit")]) == 1
    table = capsys.readouterr().out
    assert "chapter 1                                2/4    50%     0/100  2 failed" in table
    assert "  1.1 twice x                            0/2     0%     0/100  mechanism 0/1" in table
    assert "at most 60 where one of its mechanism tests fails" in table
    assert "chapter 1: 2/4 tests passed with all its exercises in place" in table
    assert "NotImplementedError: Exercise 1.1: twice x" in table
    check_result_json(json.loads((out / "r.json").read_text()))
    check_gradescope(json.loads((out / "gs.json").read_text()))
    assert [p.name for p in (out / "junit").iterdir()] == ["chapter_01.xml"]

    assert main(["grade", str(tmp_path / "copy"), "--reference", str(reference), "--chapters", "9"]) == 2
    assert "chapter(s) 9 have no tests" in capsys.readouterr().err
    assert main(["student", str(tmp_path / "other"), "--chapters", "one"]) == 2
    assert "--chapters takes chapter numbers" in capsys.readouterr().err
    assert main(["grade", str(tmp_path / "copy"), "--reference", str(reference), "--pass-line", "150"]) == 2
    assert "pass line is a number of points from 0 to 100" in capsys.readouterr().err


def test_the_default_reference_is_the_running_packages_project(monkeypatch, tmp_path):
    import minifsdp

    assert grading.default_reference() == REPO
    monkeypatch.setattr(minifsdp, "__file__", str(tmp_path / "site-packages/minifsdp/__init__.py"))
    with pytest.raises(FileNotFoundError, match="pass --reference"):
        grading.default_reference()


def test_grade_all_grades_a_class_and_survives_a_submission_that_breaks_the_grader(fake, tmp_path, monkeypatch,
                                                                                   capsys, bare):
    reference, student, _ = fake
    class_dir = tmp_path / "class"
    shutil.copytree(reference, class_dir / "ada")
    shutil.copytree(student, class_dir / "bob")
    shutil.copytree(student, class_dir / "eve")
    TAMPERING["conftest hook"][0](class_dir / "eve")
    (class_dir / "zed").mkdir()
    real_assembler = grading.Assembler

    def assembler(reference, submission, *args, **kwargs):
        if Path(submission).name == "zed":
            raise OSError("unreadable submission")
        return real_assembler(reference, submission, *args, **kwargs)

    monkeypatch.setattr(grading, "Assembler", assembler)
    assert grade_all(class_dir, reference=reference, chapters="1,2", out=tmp_path / "grades") == 0
    assert "zed" in capsys.readouterr().out
    with open(tmp_path / "grades/summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["submission", "chapter_1", "chapter_1_max", "chapter_2", "chapter_2_max",
                             "exercise_1.1", "exercise_1.1_max", "exercise_1.1_points", "exercise_2.1",
                             "exercise_2.1_max", "exercise_2.1_points", "total", "total_max", "points",
                             "edits_outside_exercises", "error"]
    assert [list(row.values()) for row in rows] == [
        ["ada", "4", "4", "2", "2", "2", "2", "100.0", "1", "1", "100.0", "6", "6", "200.0", "0", ""],
        ["bob", "2", "4", "1", "2", "0", "2", "0.0", "0", "1", "0.0", "3", "6", "0.0", "0", ""],
        ["eve", "2", "4", "1", "2", "0", "2", "0.0", "0", "1", "0.0", "3", "6", "0.0", "2", ""],
        ["zed", "0", "4", "0", "2", "0", "2", "0", "0", "1", "0", "0", "6", "0", "0",
         "OSError: unreadable submission"]]
    for name in ("ada", "bob", "eve"):
        check_result_json(json.loads((tmp_path / f"grades/{name}.json").read_text()))
    assert json.loads((tmp_path / "grades/zed.json").read_text())["error"] == "OSError: unreadable submission"


# -- the removal check ---------------------------------------------------------------------------------------

EXERCISES = find_exercises(REPO)
INDEPENDENT_CHAPTER = 2  # its DDP measurements run chapter 1's exercises: a plain student copy fails them


# pytest-timeout stays (the real tests' time limits); the other plugins installed here are not needed, and
# loading them costs each run a second.
PLUGINS = ["-p", "pytest_timeout"] if importlib.util.find_spec("pytest_timeout") else []


def _removal_args(exercise, reference) -> list[str] | None:
    """The tests to run with this exercise removed, stopping at the first failure: those marked with it
    (its own chapter's only, if it has some there: fewer files to import), else its chapter's. Either way
    the test file named after its module comes first (oss.py -> test_ch03_oss.py; else after its package:
    parallel/ -> test_ch12_tensor_parallel.py): its tests are the likeliest to fail soonest."""
    marked = [t for tests in reference.tests.values() for t in tests if exercise.id in t.exercises and t.skip is None]
    marked = [t for t in marked if t.chapter == exercise.chapter] or marked
    names = [t.id.split("::")[0] for t in marked] or reference.chapter_files.get(exercise.chapter, [])
    if not names:
        return None
    first = next((w for w in (exercise.path.stem, exercise.path.parent.name) if any(w in n for n in names)), "")
    later = lambda name: first not in Path(name.split("::")[0]).name  # noqa: E731 -- a sort key
    if marked:
        return ["-x", *PLUGINS, *sorted((t.id for t in marked), key=later)]
    return ["-x", *PLUGINS, *sorted(names, key=later)]


def _remove_and_run(exercise, tmp: Path, reference, plugins, warm):
    copy = tmp / f"student-{exercise.id}"
    write_student_copy(REPO, copy, only=exercise.id, quiet=True)
    args = _removal_args(exercise, reference)
    return args, (run_pytest(copy, args, plugins, REMOVAL_TIMEOUT, warm=warm) if args else None)


def _graded_alone(tmp: Path, plugins) -> dict:
    """A student copy with every other chapter's exercises removed, graded on chapter INDEPENDENT_CHAPTER."""
    copy = tmp / "other-chapters-removed"
    others = sorted({ex.chapter for ex in EXERCISES} - {INDEPENDENT_CHAPTER})
    write_student_copy(REPO, copy, chapters=others, quiet=True)
    reference = collect_reference(REPO, [INDEPENDENT_CHAPTER], plugins, REMOVAL_TIMEOUT)
    return grade_submission(copy, reference, plugins, REMOVAL_TIMEOUT)


BYPASS = instructor_bypasses()
BYPASSES, CAUGHT_BY, NUMERICAL_FAILURES = BYPASS.load() if BYPASS else ({}, {}, {})


def course_checks() -> dict:
    """The real tests' exercise marks, every removal check, every bypass, and the chapter graded alone,
    two at a time. Each removal or bypass is a pytest run of a few seconds, most of which would be a fresh
    interpreter importing torch: they run as children of two warm interpreters that imported it once
    (course/warm.py). The chapter graded alone, the longest, starts first, while the marks are collected."""
    from minifsdp.course.warm import WarmPool

    exercises = {ex.id: ex for ex in EXERCISES}
    with bare_pytest(), plugin_dir() as plugins, tempfile.TemporaryDirectory(prefix="minifsdp-checks-") as tmp, \
            ThreadPoolExecutor(max_workers=2) as pool, WarmPool(2) as warm:
        tmp = Path(tmp)
        alone = pool.submit(_graded_alone, tmp, plugins)
        reference = collect_reference(REPO, None, plugins, REMOVAL_TIMEOUT)
        futures = {ex.id: pool.submit(_remove_and_run, ex, tmp, reference, plugins, warm) for ex in EXERCISES}
        bypassed = {i: pool.submit(BYPASS.check_one, exercises[i], code, CAUGHT_BY[i],
                                   NUMERICAL_FAILURES.get(i, []), plugins, tmp, True, None, warm)
                    for i, code in BYPASSES.items() if i in exercises}
        results = {k: f.result() for k, f in futures.items()}
        results["bypass"] = {k: f.result() for k, f in bypassed.items()}
        results["alone"], results["reference"] = alone.result(), reference
        return results


# Two minutes of both cores that need nothing else from the run: started once it is collected (tests/early.py).
CHECKS = Early("test_course", "course_checks")


def start_early(items) -> None:
    if any("removals" in getattr(item, "fixturenames", ()) for item in items):
        CHECKS.start()


@pytest.fixture(scope="module")
def removals():
    return CHECKS.result()


@pytest.mark.timeout(len(EXERCISES) * REMOVAL_TIMEOUT + 60)
def test_the_real_tests_collect_and_mark_only_real_exercises(removals):
    reference = removals["reference"]
    assert reference.warnings == []
    assert all(reference.tests.values()), "a chapter without a single test"


@pytest.mark.timeout(len(EXERCISES) * REMOVAL_TIMEOUT + 60)
def test_a_chapter_graded_alone_scores_full_marks_without_the_other_chapters_solutions(removals):
    # The check means something only if the chapter's tests run other chapters' exercises.
    borrowed = {e for t in removals["reference"].tests[INDEPENDENT_CHAPTER] for e in t.exercises
                if not e.startswith(f"{INDEPENDENT_CHAPTER}.")}
    assert borrowed, f"no test of chapter {INDEPENDENT_CHAPTER} is marked with another chapter's exercise"
    result = removals["alone"]
    chapter = result["chapters"][0]
    assert chapter["chapter"] == INDEPENDENT_CHAPTER and chapter["max"] > 0
    assert chapter["score"] == chapter["max"], chapter["failed"][:5]
    assert result["edits_outside_exercises"] == [] and all(ex["from_submission"] for ex in result["exercises"])


@pytest.mark.timeout(len(EXERCISES) * REMOVAL_TIMEOUT + 60)
@pytest.mark.parametrize("exercise", EXERCISES, ids=[ex.id for ex in EXERCISES])
def test_removal_of_each_exercise_fails_its_tests(exercise, removals, plugins):
    args, run = removals[exercise.id]
    where = f"exercise {exercise.id} ({exercise.path.relative_to(REPO)}, line {exercise.begin}: {exercise.title})"
    if run is None:
        pytest.fail(f"{where} belongs to chapter {exercise.chapter}, which has no tests "
                    f"(tests/test_ch{exercise.chapter:02d}_*.py) and no test is marked with it: nothing grades it")
    results = (run.report or {}).get("results", {})
    failed = [r for r in results.values() if r["outcome"] in ("failed", "incomplete")]
    failed += (run.report or {}).get("collect_errors", [])
    passed = sum(r["outcome"] == "passed" for r in results.values())
    which = "the tests marked with it" if "::" in args[-1] else f"chapter {exercise.chapter}'s tests"
    assert run.returncode != 0 and (failed or run.report is None), (
        f"with {where} removed, {which} still pass ({passed} passed): no test runs this code, so a student is "
        f"never graded on it.\n{run.output[-3000:]}")

    # ... and they fail *because* the exercise is missing, not for a reason of their own: either the
    # failure reports the exercise's NotImplementedError, or the same tests pass with the solution in place.
    reported = any(f"Exercise {exercise.id}:" in (r["cause"] or "") for r in failed) or \
        f"Exercise {exercise.id}:" in run.output
    with bare_pytest():
        solved = reported or run_pytest(REPO, args, plugins, REMOVAL_TIMEOUT).returncode == 0
    assert solved, (
        f"{which} fail even with {where} solved; fix them first:\n{run.output[-3000:]}")


# -- the bypasses: each exercise solved the wrong way (instructor/bypasses/) must lose its mechanism tests ----

# Exercises that are pure functions of their arguments: any code that returns the right values has learnt
# what the exercise teaches, so there is no wrong way that the numbers would not show.
NO_BYPASS = {"2.1": "which states a ZeRO stage divides by N: the totals are the whole answer",
             "13.1": "a collective's steps per algorithm: a count, checked for every algorithm and N"}

needs_the_instructor_files = pytest.mark.skipif(BYPASS is None, reason="a student copy has no instructor/ directory")


@needs_the_instructor_files
def test_every_exercise_has_a_bypass_or_a_reason_why_none_can_exist():
    ids = [ex.id for ex in EXERCISES]
    missing = [i for i in ids if i not in BYPASSES and i not in NO_BYPASS]
    assert not missing, f"exercises with no wrong solution in instructor/bypasses/ to check their mechanism tests: {missing}"
    assert set(BYPASSES) | set(NO_BYPASS) <= set(ids), "a bypass or NO_BYPASS entry for an exercise that is gone"
    assert set(CAUGHT_BY) == set(BYPASSES), "every bypass names the mechanism tests that catch it (CAUGHT_BY)"


@needs_the_instructor_files
@pytest.mark.timeout(len(EXERCISES) * REMOVAL_TIMEOUT + 60)
@pytest.mark.parametrize("exercise", sorted(BYPASSES, key=lambda i: tuple(map(int, i.split(".")))))
def test_each_bypass_fails_the_mechanism_tests_that_name_it(exercise, removals):
    """Solved the wrong way, an exercise still gets its values right (instructor/bypasses/check.py runs all
    its tests to show that) and fails, on an assertion, the mechanism tests CAUGHT_BY names: tests that
    are marked with the exercise and as mechanism tests, so that the grader counts them for it."""
    tests = [t for ts in removals["reference"].tests.values() for t in ts]
    for name in CAUGHT_BY[exercise]:
        named = [t for t in tests if t.id == name or t.id.startswith(name + "[")]
        assert named, f"CAUGHT_BY[{exercise!r}] names {name}, which the reference does not have"
        assert all(t.mechanism and exercise in t.exercises for t in named), (
            f"{name} is not marked both mechanism and exercise({exercise!r}): the grader would not count it")
    outcome = removals["bypass"][exercise]
    assert outcome.ok, (f"exercise {exercise} solved the wrong way: caught by {outcome.caught}, not caught by "
                        f"{outcome.not_caught}, tests of values failed {outcome.values_failed}\n"
                        f"{outcome.output[-3000:]}")


def _region(copy: Path, exercise) -> list[str]:
    """The lines between an exercise's markers in a copy of the project."""
    rel = exercise.path.relative_to(REPO)
    return next(r.body for r in scan_regions((copy / rel).read_text(encoding="utf-8"), rel)[0] if r.id == exercise.id)


@needs_the_instructor_files
@pytest.mark.parametrize("exercise", sorted(BYPASSES, key=lambda i: tuple(map(int, i.split(".")))))
def test_a_bypass_costs_points_in_its_own_exercise_only(exercise, removals, monkeypatch, tmp_path):
    """The grader on a copy holding one exercise solved the wrong way (the reference's solution elsewhere),
    with pytest replaced by the worst a wrong solution can do: every test that runs in a copy holding it
    fails, whatever it tests. The exercise scores nothing and every other exercise full points: no test that
    counts for another exercise ran beside the wrong code ([Note: where a wrong solution costs points])."""
    from minifsdp.course.runner import PytestRun

    ex = next(e for e in EXERCISES if e.id == exercise)
    reference = removals["reference"]
    BYPASS.write_bypassed_copy(REPO, ex, BYPASSES[exercise], tmp_path / "submission")
    wrong = _region(tmp_path / "submission", ex)
    by_file: dict[str, list[str]] = {}
    for t in (t for tests in reference.tests.values() for t in tests):
        by_file.setdefault(t.id.split("::")[0], []).append(t.id)

    def worst_case(copy, args, plugins, limit, keep_out=(), warm=None):
        ids = [i for a in args if not a.startswith("-") for i in (by_file.get(a) or [a])]
        held = _region(Path(copy), ex) == wrong
        results = {i: {"outcome": "failed" if held else "passed", "seconds": 0.0,
                       "cause": f"AssertionError: ran beside the wrong {exercise}" if held else None} for i in ids}
        return PytestRun(int(held), {"results": results, "collect_errors": []}, "", 0.0, False)

    monkeypatch.setattr(grading, "run_pytest", worst_case)
    result = grade_submission(tmp_path / "submission", reference, tmp_path / "no-plugins")
    points = {e["id"]: (e["points"], e["score"], e["max"]) for e in result["exercises"]}
    assert points.pop(exercise)[:2] == (0.0, 0), f"the wrong {exercise} kept points: {result['exercises']}"
    lost = {i: p for i, p in points.items() if p[0] != 100.0 or p[1] != p[2]}
    assert not lost, f"the wrong {exercise} cost other exercises points (points, tests passed, tests): {lost}"


def test_a_warm_run_imports_the_copys_package_and_stops_at_its_time_limit(tmp_path, plugins, bare):
    """A child of the warm interpreter is the `python -m pytest` it stands for: the package comes from the
    directory it runs in (not from the running one's), in the run and in the ranks it forks from the shared
    fork server; and a hung run is stopped, its processes too."""
    from minifsdp.course.warm import WarmPython

    project = _project(tmp_path / "p", {
        "minifsdp/__init__.py": "WHERE = 'the copy'\n",
        "tests/test_a.py": textwrap.dedent('''\
            import multiprocessing, os, subprocess, sys, time
            import minifsdp

            def where():
                import minifsdp
                return minifsdp.WHERE, os.getppid()

            def test_the_copy():
                assert minifsdp.WHERE == "the copy"
                with multiprocessing.get_context("forkserver").Pool(1) as pool:
                    copy, server = pool.apply(where)
                assert copy == "the copy"
                # the rank's parent is the warm interpreter's fork server, not one this run started
                assert int(open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[1]) != os.getpid()

            def test_hangs():
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                open("child.pid", "w").write(str(child.pid))
                time.sleep(600)
            ''')})
    with WarmPython(preload=("pytest",), fork_server=("json",)) as warm:  # a fork server that imports little
        run = run_pytest(project, ["tests/test_a.py::test_the_copy"], plugins, 60, warm=warm)
        assert run.returncode == 0 and run.report["results"]["tests/test_a.py::test_the_copy"]["outcome"] == "passed"
        run = run_pytest(project, ["tests/test_a.py::test_hangs"], plugins, 3, warm=warm)
        assert run.timed_out and run.report is None and "stopped after 3 s" in run.output
        pid = int((project / "child.pid").read_text())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and \
                not open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
            "the hung run's own child outlived the time limit"
        run = run_pytest(project, ["tests/test_a.py::test_the_copy"], plugins, 60, warm=warm)  # still serving
        assert run.returncode == 0


# -- the guide's table and the "why" questions --------------------------------------------------------------

@pytest.mark.timeout(len(EXERCISES) * REMOVAL_TIMEOUT + 60)
def test_the_guides_exercise_table_is_current(removals):
    """The guide counts an exercise's test cases as the grader does (the run's collection of the real tests)."""
    from minifsdp.reports.exercises import table

    stored = (REPO / "chapters/generated/exercises.md").read_text(encoding="utf-8")
    assert stored == table(REPO, removals["reference"]) + "\n", (
        "chapters/generated/exercises.md is not what the exercises are now: run "
        "python -m minifsdp.reports.exercises --markdown chapters/generated/exercises.md")


def _why_questions() -> dict[str, str]:
    """exercise id -> the question its chapter page asks (the admonition's body, as one line)."""
    found = {}
    for page in sorted((REPO / "chapters").glob("[0-9][0-9]_*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = re.fullmatch(r'!!! question "Why\? \(exercise (\d+\.\d+)\)"', line)
            if m:
                body = []
                for follow in lines[i + 1:]:
                    if follow and not follow.startswith("    "):
                        break
                    body.append(follow.strip())
                assert m[1] not in found, f"exercise {m[1]} has two why questions"
                found[m[1]] = (page.name, " ".join(" ".join(body).split()))
    return found


def test_every_exercise_asks_why_on_its_own_chapters_page():
    questions = _why_questions()
    for ex in EXERCISES:
        assert ex.id in questions, f"exercise {ex.id} has no '!!! question \"Why? (exercise {ex.id})\"' on its page"
        page, text = questions[ex.id]
        assert page.startswith(f"{ex.chapter:02d}_") and len(text) > 40, (ex.id, page, text)
    assert set(questions) <= {ex.id for ex in EXERCISES}, "a why question for an exercise that is gone"


@needs_the_instructor_files
def test_the_key_answers_every_why_question_as_the_page_asks_it():
    questions = _why_questions()
    for chapter in sorted({ex.chapter for ex in EXERCISES}):
        key = (REPO / "instructor" / "answers" / f"ch{chapter:02d}.md").read_text(encoding="utf-8")
        sections = re.split(r"^## ", key, flags=re.M)[1:]
        by_id = {re.match(r"Exercise (\d+\.\d+): ", s)[1]: s for s in sections}
        for ex in (e for e in EXERCISES if e.chapter == chapter):
            assert ex.id in by_id, f"instructor/answers/ch{chapter:02d}.md has no section for exercise {ex.id}"
            section = by_id[ex.id]
            assert section.splitlines()[0] == f"Exercise {ex.id}: {ex.title}", section.splitlines()[0]
            asked = re.search(r"\*\*Question\.\*\* (.*?)\n\n\*\*Answer\.\*\*", section, re.S)
            assert asked and " ".join(asked[1].split()) == questions[ex.id][1], (
                f"exercise {ex.id}: the key's question is not the one its page asks")
            answer = section.split("**Answer.**", 1)[1]
            assert "**Grading.**" in answer and len(answer.split("**Grading.**")[0].split()) > 40, (
                f"exercise {ex.id}: the key needs an answer and what a full answer must contain")


# -- each exercise stated where it is, as a contract ---------------------------------------------------------

CONTRACT = ("**Where.**", "**In.**", "**Out.**", "**Must hold.**", "**Graded by.**")


def _exercise_sections() -> dict[str, tuple[str, str]]:
    """exercise id -> (its chapter page, its section: from its `### Exercise X.Y:` heading to the next heading)."""
    found = {}
    for page in sorted((REPO / "chapters").glob("[0-9][0-9]_*.md")):
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"^### Exercise (\d+\.\d+): .*?(?=^#{1,3} |\Z)", text, re.M | re.S):
            assert m[1] not in found, f"exercise {m[1]} is stated twice"
            found[m[1]] = (page.name, m[0])
    return found


def test_every_exercise_states_a_contract_that_names_its_file_and_function():
    """What goes in, what must come out, what must hold and which tests grade it -- not the calls, which sit in
    a folded hint; and where the code is: the file and the function, and where to read the listing (a student
    reading the page's markdown sees no code: its listings are includes)."""
    from minifsdp.reports.exercises import enclosing_function

    sections = _exercise_sections()
    for ex in EXERCISES:
        assert ex.id in sections, f"exercise {ex.id} has no '### Exercise {ex.id}: ...' section on its page"
        page, text = sections[ex.id]
        assert page.startswith(f"{ex.chapter:02d}_"), f"exercise {ex.id} is stated on {page}"
        missing = [part for part in CONTRACT if part not in text]
        assert not missing, f"exercise {ex.id} ({page}) does not say {missing}"
        where = text.split("**Where.**", 1)[1].split("\n\n", 1)[0]
        path, function = ex.path.relative_to(REPO).as_posix(), enclosing_function(ex).split(".")[-1]
        assert f"`{path}`" in where and function in where and ("listing" in where or "student site" in where), (
            f"exercise {ex.id}: **Where.** must name `{path}`, {function} and where to read the listing: {where!r}")
        assert f'??? tip "Hints (exercise {ex.id})"' in text, f"exercise {ex.id}: its hints are not folded"
    designs = {ex.chapter for ex in EXERCISES if "(design)" in sections[ex.id][1].splitlines()[0]}
    assert designs == {ex.chapter for ex in EXERCISES}, (
        f"chapters with no exercise marked (design): {sorted({ex.chapter for ex in EXERCISES} - designs)}")
