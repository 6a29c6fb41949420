"""Jupyter kernels forked from one process that has already imported torch.

Each notebook runs in a kernel of its own, and each begins by importing torch, torch._dynamo (which the
first optimizer would import in every rank) and matplotlib: about four seconds of one core, on every
kernel, more than most of the notebooks' own cells take. Here one server process imports them once, and
every kernel is a fork of it: a new process, with nothing of any notebook in it, whose imports cost
nothing.

    with warm_kernels() as manager_class:
        nbclient.NotebookClient(nb, kernel_manager_class=manager_class, ...).execute()

Jupyter starts a kernel by running a command and watching that process. The command here is this file,
run as a small script with no imports beyond the standard library (`relay`): it asks the server to fork
a kernel with its arguments, directory and environment, passes on the signals Jupyter sends it, and
exits with the kernel's exit status. If the relay is killed, the server kills its kernel; when the `with`
block ends, the server kills what is left and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "matplotlib", "matplotlib.pyplot",
           "matplotlib_inline.backend_inline", "ipykernel.kernelapp", "minifsdp")


def _recv_line(conn) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _become_kernel(request: dict, fds: list[int]) -> None:
    """In the forked child: take the relay's stdin, stdout, stderr, directory, environment and arguments,
    and run ipykernel."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()  # the kernel's ranks go in its group: the relay signals it as Jupyter would signal it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    args = argv[argv.index("ipykernel_launcher") + 1:]  # the kernel spec: python -m ipykernel_launcher -f ...
    sys.argv = [argv[0], *args]
    from ipykernel import kernelapp

    # the app reads JPY_PARENT_PID when its module is imported, which was in the server, before this env
    kernelapp.IPKernelApp.launch_instance(argv=args, parent_handle=int(os.environ.get("JPY_PARENT_PID") or 0))


def serve(path: str) -> None:
    """The server: import PRELOAD, then fork a kernel for every relay that connects to `path`, until stdin
    closes. Single-threaded, so that a fork never copies a lock held by another thread."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    kernels: dict = {}  # relay connection -> the pid of its kernel
    try:
        while True:
            readable, _, _ = select.select([listener, sys.stdin, *kernels], [], [], 0.1)
            for conn, pid in list(kernels.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    conn.close()
                    del kernels[conn]
            for r in readable:
                if r is sys.stdin:
                    return  # the caller's `with` block ended
                if r is listener:
                    conn, _ = listener.accept()
                    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                    request = json.loads(_recv_line(conn))
                    pid = os.fork()
                    if pid == 0:
                        try:
                            listener.close()
                            conn.close()
                            _become_kernel(request, fds)
                        finally:
                            os._exit(0)
                    for fd in fds:
                        os.close(fd)
                    kernels[conn] = pid
                    conn.sendall(f"{pid}\n".encode())
                elif r in kernels and not r.recv(1):  # the relay is gone: so is its kernel
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(kernels[r], signal.SIGKILL)
    finally:
        for pid in kernels.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def relay(path: str, argv: list[str]) -> int:
    """The kernel command: have the server fork a kernel, pass signals on to it, return its exit code."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [b"."], [0, 1, 2])
    conn.sendall(json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n")
    pid = int(_recv_line(conn))

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, forward)
    line = _recv_line(conn)
    return int(line) if line.strip() else 1


@contextlib.contextmanager
def warm_kernels():
    """Start the server; yield a jupyter_client KernelManager class whose kernels it forks."""
    from jupyter_client import KernelManager

    with tempfile.TemporaryDirectory(prefix="minifsdp-kernels-") as tmp:
        path = os.path.join(tmp, "server.sock")
        server = subprocess.Popen([sys.executable, "-c", f"from minifsdp.reports.kernels import serve; serve({path!r})"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            if server.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the kernel server did not start (exit code {server.wait()})")

            class WarmKernelManager(KernelManager):
                def format_kernel_cmd(self, extra_arguments=None):
                    return [sys.executable, "-I", os.path.abspath(__file__), path,
                            *super().format_kernel_cmd(extra_arguments)]

            yield WarmKernelManager
        finally:
            server.stdin.close()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":  # run by path, as the kernel command: only the standard library is imported
    sys.exit(relay(sys.argv[1], sys.argv[2:]))
