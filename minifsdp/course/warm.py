"""Many short pytest runs without importing torch for each: a warm interpreter that forks one child per run.

Most of a short pytest run that launches ranks is importing torch twice: once in the pytest process, once
in the fork server its ranks come from (spawn.py's forkserver start method), more than three seconds of
the four or five such a run takes. A server process imports torch and pytest once -- nothing of any
project, so every child still imports the package from the copy it runs in -- starts one fork server for
all the runs' ranks, and forks a child per run. The child becomes what `python -m pytest ARGS` started in
that directory with that environment would be: its working directory, its environment, the sys.path such
an interpreter would build from PYTHONPATH, its own session (so a time limit stops it and the processes
it started together), its output in a file.

    with WarmPython() as warm:
        returncode, output, timed_out = warm.run(project, ["-q", "tests/test_x.py"], env, timeout=300)

`runner.run_pytest(..., warm=...)` runs through it. The course's own tests use it to run one short pytest
per exercise; a grader's run is minutes of tests, where two seconds do not matter, so `grade` does not.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

# The server: import once, then for each job (one JSON line on stdin) fork a child that runs pytest, and
# answer with two lines: the child's pid at once, its exit code when it ends.
#
# It also starts, once, the fork server that the children's ranks are forked from (spawn.py's forkserver
# start method), with torch imported and nothing of any project. Each run would otherwise start its own, and
# that server's `import torch` is most of a short run: more than three seconds, all before its first rank.
# A rank still imports the package from the copy its run is in: multiprocessing hands every new process its
# parent's sys.path and working directory. Two differences from a fork server of the run's own: the ranks
# start with the server's environment (launch sets what a rank needs itself), and a run stopped at its time
# limit leaves its ranks to end on their own (their pipes close, their collectives time out).
_SERVER = r"""
import json, os, sys, traceback
preload, shared = json.loads(sys.argv[1])
for name in preload:
    __import__(name)
base = [p for p in sys.path if p]  # what a fresh interpreter puts after PYTHONPATH's entries
if shared:
    import multiprocessing.forkserver as forkserver
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what launch starts its ranks with
    forkserver.set_forkserver_preload(shared)
    forkserver.ensure_running()
for line in sys.stdin:
    job = json.loads(line)
    out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0); os.dup2(out, 1); os.dup2(out, 2)
            os.chdir(job["cwd"])
            os.environ.clear(); os.environ.update(job["env"])
            extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:] = [job["cwd"], *extra, *base]
            sys.argv = ["pytest", *job["args"]]
            if shared:  # the server is the parent's child: ensure_running() here would waitpid() on it and fail
                forkserver._forkserver.ensure_running = lambda: None
            import pytest
            code = int(pytest.main(job["args"]))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(out)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""

PRELOAD = ("torch", "torch.distributed", "pytest")
FORK_SERVER = ("torch", "torch.distributed", "torch._dynamo")  # launch's preload, but the project's package


class WarmPython:
    """One warm server; `run` may be called from one thread at a time (use one per worker thread).
    `fork_server`: what the shared fork server imports (empty: none is shared, each run starts its own)."""

    def __init__(self, preload: Sequence[str] = PRELOAD, fork_server: Sequence[str] = FORK_SERVER):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the jobs bring their own
        env["PYTHONNOUSERSITE"] = "1"
        # The ranks' semaphores outlive the runs that made them (a rank leaves by os._exit): not a leak to report.
        env["PYTHONWARNINGS"] = "ignore:resource_tracker:UserWarning"
        self._dir = tempfile.TemporaryDirectory(prefix="minifsdp-warm-")
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps([list(preload), list(fork_server)])],
                                      cwd=self._dir.name, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # the server is gone

    def _answer(self, timeout: float | None) -> dict:
        line = self._lines.get(timeout=timeout)
        if not line:
            raise RuntimeError(f"the warm interpreter exited (status {self._proc.wait()})")
        return json.loads(line)

    def run(self, cwd: str | Path, args: Sequence[str], env: dict[str, str],
            timeout: float | None = None) -> tuple[int, str, bool]:
        """`python -m pytest *args` in `cwd` with `env`: (returncode, output, timed out)."""
        output = Path(self._dir.name) / f"out-{threading.get_ident()}.txt"
        job = {"cwd": str(Path(cwd).resolve()), "args": list(args), "env": env, "output": str(output)}
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        pid = self._answer(60)["pid"]
        timed_out = False
        try:
            returncode = self._answer(timeout)["returncode"]
        except queue.Empty:
            timed_out = True
            try:
                os.killpg(pid, signal.SIGKILL)  # pytest and the ranks it started: one session
            except ProcessLookupError:
                pass
            returncode = self._answer(60)["returncode"]
        return returncode, output.read_text(encoding="utf-8", errors="replace"), timed_out

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> WarmPython:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WarmPool:
    """`size` warm interpreters for as many threads: each run borrows one that is free."""

    def __init__(self, size: int = 2, preload: Sequence[str] = PRELOAD, fork_server: Sequence[str] = FORK_SERVER):
        self._all = [WarmPython(preload, fork_server) for _ in range(size)]
        self._free: queue.Queue[WarmPython] = queue.Queue()
        for warm in self._all:
            self._free.put(warm)

    def run(self, cwd: str | Path, args: Sequence[str], env: dict[str, str],
            timeout: float | None = None) -> tuple[int, str, bool]:
        warm = self._free.get()
        try:
            return warm.run(cwd, args, env, timeout)
        finally:
            self._free.put(warm)

    def close(self) -> None:
        for warm in self._all:
            warm.close()

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
