"""The grader's pytest plugin: what each test is (its exercise marks) and how it ended, written to a JSON file.

    python -m pytest -p <this module> --grade-report FILE [--collect-only] tests/...

The grader reads scores from this file, not from pytest's exit code, its printed summary or a report
the project under test configures: those can be changed by a conftest.py or an ini file, this cannot.
The module imports nothing from the package, so the grader can load it from a directory that holds only
it (under a name of its own): the copy under test never supplies the plugin that judges it.

The file holds
    collected       [{id, exercises, mechanism, skip}]   every test collected, in order; skip: the reason
                                                         when a skip/skipif mark skips it before it runs
    results         {id: {outcome, cause, seconds}}      outcome passed / failed / skipped / incomplete
    collect_errors  [{id, cause}]                        files that could not be collected
    exitstatus      pytest's exit status
"""

from __future__ import annotations

import json
import os
import re

import pytest

_MISSING = re.compile(r"NotImplementedError: Exercise \d+\.\d+: [^\n]*")
_LONGEST_CAUSE = 300


def pytest_addoption(parser):
    parser.addoption("--grade-report", default=None, metavar="FILE",
                     help="write each test's exercise marks and outcome to this JSON file (the grader reads it)")


def pytest_configure(config):
    path = config.getoption("--grade-report")
    if path:
        config.pluginmanager.register(_Recorder(path), "minifsdp-grade-recorder")


def _cause(report) -> str:
    """One line on why: a missing exercise says which one, wherever in the traceback it was raised."""
    text = getattr(report, "longreprtext", "") or ""
    missing = _MISSING.findall(text)  # the last is the innermost: a failed rank's own traceback
    if missing:
        return missing[-1][:_LONGEST_CAUSE]
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
        return str(report.longrepr[2])[:_LONGEST_CAUSE]
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", "") or ""
    lines = message.strip().splitlines() or [line for line in text.strip().splitlines() if line.strip()][-1:]
    return (lines[0] if lines else report.outcome)[:_LONGEST_CAUSE]


def _static_skip(item) -> str | None:
    """The reason a skip or skipif mark skips this test before it runs (None if none does)."""
    try:
        from _pytest.skipping import evaluate_skip_marks  # pytest's own evaluation; private, hence the guard
        skipped = evaluate_skip_marks(item)
    except Exception:  # an older or newer pytest, or a condition that cannot be evaluated now
        return None
    return (skipped.reason or "skipped") if skipped is not None else None


class _Recorder:
    def __init__(self, path: str):
        self.path = path
        self.collected: list[dict] = []
        self.collect_errors: list[dict] = []
        self.phases: dict[str, dict] = {}  # node id -> {when: outcome}, causes and seconds

    def pytest_collection_finish(self, session):
        for item in session.items:
            exercises = [str(arg) for mark in item.iter_markers("exercise") for arg in mark.args]
            self.collected.append({"id": item.nodeid, "exercises": sorted(set(exercises)),
                                   "mechanism": item.get_closest_marker("mechanism") is not None,
                                   "skip": _static_skip(item)})

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors.append({"id": report.nodeid, "cause": _cause(report)})

    def pytest_runtest_logreport(self, report):
        test = self.phases.setdefault(report.nodeid, {"phases": {}, "cause": None, "seconds": 0.0})
        test["phases"][report.when] = report.outcome
        test["seconds"] += report.duration
        if (report.failed or report.skipped) and test["cause"] is None:
            where = "" if report.when == "call" or report.skipped else f"error at {report.when}: "
            test["cause"] = where + _cause(report)

    def _results(self) -> dict[str, dict]:
        results = {}
        for node, test in self.phases.items():
            outcomes = test["phases"].values()
            if "failed" in outcomes:
                outcome = "failed"
            elif "skipped" in outcomes:
                outcome = "skipped"
            elif test["phases"].get("call") == "passed":
                outcome = "passed"
            else:  # set up, never called: the run stopped in between
                outcome = "incomplete"
            results[node] = {"outcome": outcome, "cause": test["cause"] if outcome != "passed" else None,
                             "seconds": round(test["seconds"], 3)}
        return results

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        report = {"collected": self.collected, "results": self._results(),
                  "collect_errors": self.collect_errors, "exitstatus": int(exitstatus)}
        partial = f"{self.path}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(partial, self.path)  # whole or not at all: a half-written file is no report
