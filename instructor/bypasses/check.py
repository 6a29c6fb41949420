"""Run the wrong solutions of this directory and show which tests catch each.

    python instructor/bypasses/check.py              # every bypass, every test marked with its exercise
    python instructor/bypasses/check.py 6.1 7.2      # some of them
    python instructor/bypasses/check.py --quick      # only the tests CAUGHT_BY names (what tests/ runs)

A bypass (ch01_06.py, ch07_12.py) is an exercise solved the wrong way: the numbers come out right, the
lesson is skipped -- torch's collectives called around `comm`, an all-reduce sliced where a reduce-scatter
belongs, a prefetch left out. For each one this writes a copy of the project with the bypass between the
exercise's markers (the rest as it is) and runs the tests marked with the exercise, through the grader's
own plugin. What should come out:
- every test that checks values passes, but those NUMERICAL_FAILURES lists;
- every test CAUGHT_BY names fails on an assertion of its own: a bypass that only crashes (a NameError, a
  TypeError) proves nothing about the tests, so a failure with any other cause counts as not caught.
The full run takes about ten minutes on two cores; `--quick` runs one or two tests per bypass, and
tests/test_course.py runs it that way.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT = 300  # seconds for one bypass's tests


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"minifsdp_bypasses_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> tuple[dict[str, str], dict[str, list[str]], dict[str, list[str]]]:
    """BYPASSES, CAUGHT_BY and NUMERICAL_FAILURES of every chapter, merged."""
    bypasses, caught_by, numerical = {}, {}, {}
    for name in ("ch01_06", "ch07_12"):
        module = _module(name)
        bypasses.update(module.BYPASSES)
        caught_by.update(module.CAUGHT_BY)
        numerical.update(module.NUMERICAL_FAILURES)
    return bypasses, caught_by, numerical


def write_bypassed_copy(root: Path, exercise, code: str, dest: Path) -> None:
    """A copy of the project at `root` with `code` (written at indentation zero) between the exercise's
    markers, at the markers' indentation."""
    write_bypassed(root, {exercise: code}, dest)


def write_bypassed(root: Path, codes: dict, dest: Path) -> None:
    """A copy of the project at `root` with each exercise of `codes` solved the wrong way at once."""
    from minifsdp.course.student import copy_files, project_files

    copy_files(root, dest, project_files(root, skip=dest))
    # bottom up within each file: the line numbers of the blocks above still hold
    for exercise in sorted(codes, key=lambda ex: (str(ex.path), -ex.begin)):
        target = dest / exercise.path.relative_to(root)
        lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
        marker = lines[exercise.begin - 1]
        indent = marker[:len(marker) - len(marker.lstrip())]
        body = [(indent + line if line.strip() else line) for line in codes[exercise].splitlines(keepends=True)]
        lines[exercise.begin:exercise.end - 1] = body
        target.unlink()  # a link is copied as a link: never write through it
        target.write_text("".join(lines), encoding="utf-8")


@dataclass
class Outcome:
    exercise: str
    caught: list[str] = field(default_factory=list)        # named in CAUGHT_BY, failed on an assertion
    not_caught: list[str] = field(default_factory=list)    # named in CAUGHT_BY, passed or failed otherwise
    values_failed: list[str] = field(default_factory=list)  # tests of values that failed, not expected to
    output: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.caught) and not self.not_caught and not self.values_failed


def _on_an_assertion(result: dict) -> bool:
    cause = result["cause"] or ""
    return result["outcome"] == "failed" and ("AssertionError" in cause or cause.startswith("assert "))


def _chosen(node: str, names: list[str]) -> bool:
    """The node is one CAUGHT_BY names: a whole node id, or a test function (every parametrization of it)."""
    return any(node == name or node.startswith(name + "[") for name in names)


def check_one(exercise, code: str, caught_by: list[str], numerical: list[str], plugins: Path, tmp: Path,
              quick: bool, marked: list[dict] | None = None, warm=None) -> Outcome:
    """Run one bypass: `marked` -- the reference's collected tests marked with this exercise ({id,
    mechanism}); in a quick run only CAUGHT_BY's tests run. `warm`: a course.warm.WarmPool to run them in."""
    from minifsdp.course.runner import run_pytest

    copy = tmp / f"bypass-{exercise.id}"
    write_bypassed_copy(REPO, exercise, code, copy)
    plugin_args = ["-p", "pytest_timeout"] if importlib.util.find_spec("pytest_timeout") else []
    tests = caught_by if quick else [t["id"] for t in marked or []]
    run = run_pytest(copy, [*plugin_args, *tests], plugins, TIMEOUT, warm=warm)
    results = (run.report or {}).get("results", {})
    outcome = Outcome(exercise.id, output=run.output)
    for name in caught_by:
        runs = {node: r for node, r in results.items() if _chosen(node, [name])}
        caught = runs and any(_on_an_assertion(r) for r in runs.values())
        (outcome.caught if caught else outcome.not_caught).append(name)
    mechanism = {t["id"] for t in marked or [] if t["mechanism"]}
    outcome.values_failed = [node for node, r in results.items() if r["outcome"] != "passed" and
                             node not in mechanism and not _chosen(node, caught_by) and node not in numerical]
    if run.report is None:
        outcome.not_caught = outcome.not_caught or ["(pytest wrote no report)"]
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="exercises to check (all by default)")
    parser.add_argument("--quick", action="store_true", help="run only the tests CAUGHT_BY names")
    args = parser.parse_args(argv)
    # The bypassed copies need no plugin but the grader's and pytest-timeout (passed with -p below): loading
    # every installed one is slow, and a second registration of pytest-timeout is an error.
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    sys.path.insert(0, str(REPO))
    from minifsdp.course.grade import collect_reference
    from minifsdp.course.runner import plugin_dir
    from minifsdp.course.student import find_exercises
    from minifsdp.course.warm import WarmPool

    bypasses, caught_by, numerical = load()
    exercises = {e.id: e for e in find_exercises(REPO)}
    ids = args.ids or sorted(bypasses, key=lambda i: tuple(map(int, i.split("."))))
    with plugin_dir() as plugins, tempfile.TemporaryDirectory() as tmp, WarmPool(2) as warm:
        marked: dict[str, list[dict]] = {}
        if not args.quick:
            reference = collect_reference(REPO, None, plugins, TIMEOUT)
            for tests in reference.tests.values():
                for t in tests:
                    for ex in t.exercises:
                        marked.setdefault(ex, []).append({"id": t.id, "mechanism": t.mechanism})
        with ThreadPoolExecutor(max_workers=2) as pool:
            outcomes = pool.map(lambda i: check_one(exercises[i], bypasses[i], caught_by[i], numerical.get(i, []),
                                                    plugins, Path(tmp), args.quick, marked.get(i), warm), ids)
            failures = 0
            for out in outcomes:
                failures += not out.ok
                print(f"{out.exercise:>5}  {'ok  ' if out.ok else 'FAIL'}  caught by {', '.join(out.caught) or '-'}")
                for name in out.not_caught:
                    print(f"         not caught by {name}")
                for node in out.values_failed:
                    print(f"         a test of values failed: {node}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
