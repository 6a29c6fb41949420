"""Running pytest for the grader: in a copy of a project, with the grader's own plugin (plugin.py) loaded from a
directory that holds only it, under a time limit, with imports that resolve to that copy alone -- never to a
submission's directory, the user's site-packages or an installed minifsdp.

    with plugin_dir() as plugins:
        run = run_pytest(copy, ["tests/test_ch06_fsdp.py"], plugins, timeout=900)
        run.report  # the plugin's: every test's outcome, cause and seconds (None if pytest never wrote it)

A time limit stops pytest and every rank process it started (they share its session). `warm`: run it as the child
of a warm interpreter (warm.py) instead of a fresh one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from minifsdp.course.student import PACKAGE
from minifsdp.course.warm import WarmPool, WarmPython

PLUGIN = "_minifsdp_grade_plugin"  # the name plugin.py is loaded under, which no project provides
_TAIL = 20_000  # characters of pytest's output kept


@contextmanager
def plugin_dir() -> Iterator[Path]:
    """A directory that holds only the grader's plugin, under a name no project provides."""
    with tempfile.TemporaryDirectory(prefix=f"{PACKAGE}-plugin-") as tmp:
        shutil.copyfile(Path(__file__).with_name("plugin.py"), Path(tmp) / f"{PLUGIN}.py")
        yield Path(tmp)


@dataclass
class PytestRun:
    returncode: int
    report: dict | None    # the plugin's (plugin.py); None when pytest never got to write it
    output: str            # the end of what pytest printed
    seconds: float
    timed_out: bool


def _environment(project: Path, plugins: Path, keep_out: Sequence[Path]) -> dict[str, str]:
    env = dict(os.environ)
    # Options and plugins from the environment would change what runs; so would the user's site-packages.
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(name, None)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    inherited = [p for p in inherited if not any(Path(p).resolve().is_relative_to(k) for k in keep_out)]
    # PYTHONPATH reaches the rank processes the tests start; with the working directory first on sys.path
    # (python -m pytest), it beats an installed, even editable, minifsdp.
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(plugins), *inherited])
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop pytest and the rank processes it started (they share its new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError):  # no process groups (Windows), or already gone
        proc.kill()


def run_pytest(project: str | Path, args: Sequence[str], plugins: Path, timeout: float | None = None,
               keep_out: Sequence[Path] = (), warm: WarmPython | WarmPool | None = None) -> PytestRun:
    """pytest in `project` with the grader's plugin; `keep_out`: directories never put on the path; `warm`:
    run it as a child of this warm interpreter (warm.py) instead of a fresh one."""
    project = Path(project).resolve()
    with tempfile.TemporaryDirectory(prefix=f"{PACKAGE}-report-") as tmp:
        report_file = Path(tmp) / "report.json"
        pytest_args = ["-q", "-p", "no:cacheprovider", "-p", PLUGIN, f"--grade-report={report_file}",
                       f"--rootdir={project}", *args]
        started = time.monotonic()
        env = _environment(project, plugins, [Path(k).resolve() for k in keep_out])
        if warm is not None:
            returncode, output, timed_out = warm.run(project, pytest_args, env, timeout)
            if timed_out:
                output += f"\n[{PACKAGE}] stopped after {timeout:g} s"
            return _finish(returncode, report_file, output, started, timed_out)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=project, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            output, _ = proc.communicate()
            output += f"\n[{PACKAGE}] stopped after {timeout:g} s"
        except BaseException:  # e.g. Ctrl-C while grading: leave no test processes behind
            _stop(proc)
            proc.wait()
            raise
        return _finish(proc.returncode, report_file, output, started, timed_out)


def _finish(returncode: int, report_file: Path, output: str, started: float, timed_out: bool) -> PytestRun:
    report = None
    if report_file.is_file() and not timed_out:
        try:
            report = json.loads(report_file.read_text(encoding="utf-8"))
        except ValueError:
            report = None
    return PytestRun(returncode, report, output[-_TAIL:], time.monotonic() - started, timed_out)
