"""Slow work of a test module, started as soon as the run is collected, in a process of its own.

Some fixtures need nothing from the rest of the run and take minutes of both cores: the course's checks
(test_course.py), two minutes here. Started when their module's tests come up, the run waits for them all
that time; started at once, at the lowest priority, they take the time the other modules' tests leave the
cores idle (a rank waiting on a collective, a browser, a subprocess), and the fixture waits only for what
is left. tests/conftest.py calls each module's start_early(items) once the run is collected, with the
module's selected tests. (Measured on 2 cores: the suite took 35 s less with the course's checks started
early; with the notebooks started early as well, 11 s more than that. Work in the background still slows
what runs in front of it.)

    CHECKS = Early("test_course", "course_checks")   # module-level: test_course.course_checks()

    def start_early(items):
        CHECKS.start()

    @pytest.fixture(scope="module")
    def removals():
        return CHECKS.result()      # starts it now if nothing did (a run without tests/conftest.py)
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# The child: lowest priority, then the module's function, its value pickled to a file.
_CHILD = ("import os, pickle, sys; os.nice(19); sys.path.insert(0, sys.argv[1]); "
          "module = __import__(sys.argv[2]); value = getattr(module, sys.argv[3])(); "
          "pickle.dump(value, open(sys.argv[4], 'wb'))")


class Early:
    def __init__(self, module: str, function: str):
        self.module, self.function = module, function
        self._proc: subprocess.Popen | None = None
        self._out: Path | None = None

    def start(self) -> None:
        if self._proc is not None:
            return
        self._out = Path(tempfile.mkdtemp(prefix=f"minifsdp-{self.function}-"))
        with open(self._out / "output.txt", "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(TESTS), self.module, self.function, str(self._out / "value.pkl")],
                cwd=TESTS.parent, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        atexit.register(self._stop)  # a run stopped early leaves neither processes nor files behind

    def result(self):
        """The function's value, once its process is done (started now if it was not)."""
        self.start()
        self._proc.wait()
        output = (self._out / "output.txt").read_text(errors="replace")
        assert self._proc.returncode == 0, f"{self.module}.{self.function}() failed:\n{output[-5000:]}"
        with open(self._out / "value.pkl", "rb") as f:
            return pickle.load(f)

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        if self._out is not None:
            shutil.rmtree(self._out, ignore_errors=True)
