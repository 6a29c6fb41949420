"""Start N ranks: the one place minifsdp launches processes.

From Python (a test, a notebook cell, a script):

    from minifsdp import launch
    results = launch(work, world_size=2)        # one process per rank, CPU + gloo by default
    results[0]                                  # what rank 0's work(...) returned

From the command line the same code runs under torchrun, which starts the processes itself:

    torchrun --nproc-per-node 2 -m minifsdp tour

`launch` notices torchrun's environment (RANK, WORLD_SIZE, ...) and runs `work` in place on each rank.

Failure is loud and bounded: every collective has a timeout, and when one rank raises, the launcher
stops the others (each prints which rank it is stopping for) and raises `RankFailedError` with the
failed rank's traceback. Nothing waits forever.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 60.0  # seconds any one collective may wait for its peers

# Ask NVML, not the CUDA runtime, how many GPUs there are: the runtime's answer initialises CUDA in this
# process, and ranks forked from a process with CUDA initialised cannot use their GPU.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


class RankFailedError(RuntimeError):
    """A rank raised (or died); `rank` is the first one that did, `remote_traceback` its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} failed: {message}\n\n--- traceback from rank {rank} ---\n{remote_traceback}")


def resolve_device(device: str, world_size: int) -> str:
    """'auto' means one GPU per rank when there are enough GPUs, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"device='cuda' needs one GPU per rank: world_size={world_size}, "
                         f"but {torch.cuda.device_count()} GPU(s) are visible")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', not {device!r}")
    return device


def current_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def threads_per_rank(world_size: int) -> int:
    """Ranks share the machine's cores; giving each all of them makes every rank slower."""
    return max(1, (os.cpu_count() or 1) // world_size)


def init_process_group(rank: int, world_size: int, device: str, timeout: float = DEFAULT_TIMEOUT,
                       init_method: str = "env://") -> None:
    """Join the group: gloo for the CPU, NCCL for GPUs (one per rank), with a timeout on every collective."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(threads_per_rank(world_size))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


def launch(work: Callable[..., Any], world_size: int = 2, *, args: tuple = (), kwargs: dict | None = None,
           device: str = "auto", timeout: float = DEFAULT_TIMEOUT, backend: str | None = None) -> list[Any]:
    """Run `work(*args, **kwargs)` on `world_size` ranks and return each rank's result, indexed by rank.

    device:  'auto' (GPUs if there is one per rank, else CPU), 'cpu' (gloo) or 'cuda' (NCCL).
    timeout: seconds a collective may wait before it raises instead of hanging.
    backend: 'fake' runs only rank 0 of world_size, in this process, with a process group whose
             collectives move no data -- for measuring one rank of a job larger than the machine.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    kwargs = kwargs or {}
    if backend == "fake":
        return [_run_fake(work, world_size, args, kwargs)]
    if backend is not None:
        raise ValueError(f"backend must be None (chosen from the device) or 'fake', not {backend!r}")
    if dist.is_initialized() or _under_torchrun():
        return _run_in_place(work, world_size, args, kwargs, device, timeout)
    return _spawn(work, world_size, args, kwargs, resolve_device(device, world_size), timeout)


def _run_fake(work, world_size, args, kwargs):
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the 'fake' backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return work(*args, **kwargs)
    finally:
        dist.destroy_process_group()


def _run_in_place(work, world_size, args, kwargs, device, timeout):
    """Under torchrun every rank is already a process: join the group (if needed), run, share results."""
    owns_group = not dist.is_initialized()
    if owns_group:
        env_world = int(os.environ["WORLD_SIZE"])
        init_process_group(int(os.environ["RANK"]), env_world, resolve_device(device, env_world), timeout)
    if dist.get_world_size() != world_size:
        raise ValueError(f"launch(world_size={world_size}) inside a group of {dist.get_world_size()} ranks; "
                         f"pass world_size={dist.get_world_size()} or start torchrun with --nproc-per-node "
                         f"{world_size}")
    try:
        result = work(*args, **kwargs)
        results = [None] * world_size
        dist.all_gather_object(results, result)
        return results
    finally:
        if owns_group:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, device, port, payload, timeout, out_dir, failed_rank):
    """Body of one spawned process: join the group, run the work, leave a result (or a traceback) behind."""

    def stop(signum, frame):  # the launcher stops us because another rank failed
        print(f"[minifsdp] rank {rank}: stopping because rank {failed_rank.value} failed", file=sys.stderr,
              flush=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        work, args, kwargs = pickle.loads(payload)
        init_process_group(rank, world_size, device, timeout)
        result = work(*args, **kwargs)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("ok", result), f)
        os.replace(path + ".tmp", path)  # the launcher only ever sees a whole file
    except BaseException as e:  # noqa: BLE001 -- every failure must reach the launcher
        with failed_rank.get_lock():  # the first rank to fail is the cause; the others are its echoes
            if failed_rank.value == -1:
                failed_rank.value = rank
        if failed_rank.value != rank:
            print(f"[minifsdp] rank {rank}: exiting because rank {failed_rank.value} failed "
                  f"(here: {type(e).__name__})", file=sys.stderr, flush=True)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("error", f"{type(e).__name__}: {e}", traceback.format_exc()), f)
        os.replace(path + ".tmp", path)
        sys.stderr.flush()
        os._exit(1)
    # Leave together, and without tearing the group down: past the barrier no rank has a collective in
    # flight, and gloo's teardown can abort a process whose peers are exiting at the same moment.
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 -- a peer gone after leaving its result: ours is written too
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_method(work) -> str:
    """spawn is the safe default; a function typed into a notebook can't be imported by a fresh process, so
    fork. MINIFSDP_START_METHOD=forkserver forks every rank from one clean server process that has imported
    torch once: a launch then takes milliseconds instead of seconds (the test suite uses it)."""
    chosen = os.environ.get("MINIFSDP_START_METHOD", "spawn")
    if chosen not in ("spawn", "forkserver"):
        raise ValueError(f"MINIFSDP_START_METHOD must be 'spawn' or 'forkserver', not {chosen!r}")
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)  # none in a notebook; "<stdin>" for `python -`
    interactive = getattr(work, "__module__", None) == "__main__" and not (main_file and os.path.exists(main_file))
    return "fork" if interactive else chosen


def _spawn(work, world_size, args, kwargs, device, timeout):
    method = _start_method(work)
    if method == "fork":
        if device == "cuda" and torch.cuda.is_initialized():
            raise RuntimeError(
                f"{work.__name__} is defined interactively, so the ranks must be forked from this process, "
                "but CUDA is already initialised here and forked ranks could not use their GPUs. Put the "
                "function in a .py file and import it (then the ranks are spawned fresh), or restart the "
                "kernel and launch before touching CUDA.")
        # the first optimizer imports it (~2 s): fork it in, once, instead. (Not `import torch._dynamo`: that
        # would make `torch` a local name of this function, unbound in the check above.)
        importlib.import_module("torch._dynamo")
    ctx = mp.get_context(method)
    if method == "forkserver":  # imported once, by the server, before it forks any rank
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "minifsdp"])
    failed_rank = ctx.Value("i", -1)
    port = _free_port()
    # Plain pickle, so every rank gets its own copy of the arguments: multiprocessing's own pickler would
    # put tensors in shared memory, and a rank updating one in place would change it for all the others
    # (and for the caller).
    payload = pickle.dumps((work, args, kwargs))
    with tempfile.TemporaryDirectory(prefix="minifsdp-") as out_dir:
        procs = [ctx.Process(target=_rank_main, daemon=True, name=f"minifsdp-rank{r}",
                             args=(r, world_size, device, port, payload, timeout, out_dir, failed_rank))
                 for r in range(world_size)]
        with _rank_environment():
            for p in procs:
                p.start()
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) and not _succeeded(out_dir, r) for r, p in enumerate(procs)):
                    break
                time.sleep(0.02)
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and not _succeeded(out_dir, r)]
            if dead:
                with failed_rank.get_lock():
                    if failed_rank.value == -1:  # died without a Python exception (killed, segfault)
                        failed_rank.value = dead[0]
                rank = failed_rank.value
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                for p in procs:
                    p.join(timeout=10)
                raise RankFailedError(rank, *_error_report(rank, procs[rank], out_dir))
            results = []
            for r in range(world_size):
                with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f)[1])
            return results
        finally:
            for p in procs:  # e.g. KeyboardInterrupt in the launcher: never leave ranks behind
                if p.is_alive():
                    p.kill()
                p.join()


@contextlib.contextmanager
def _rank_environment():
    """Environment the spawned ranks start with. OpenMP threads that have nothing to do spin by default;
    on a machine with few cores they then take the core that gloo's thread needs to finish an async
    collective, and a step can take 50x longer. Passive waiting (unless the user chose) avoids that."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        yield
    finally:
        if saved is None:
            del os.environ["OMP_WAIT_POLICY"]


def _succeeded(out_dir, rank) -> bool:
    """Whether the rank left a result: if it then died on its way out, the result still stands."""
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        return pickle.load(f)[0] == "ok"


def _error_report(rank, proc, out_dir) -> tuple[str, str]:
    """(message, traceback) a failed rank left behind, or what its exit code says if it left nothing."""
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return f"process died with exit code {proc.exitcode}", ""
    with open(path, "rb") as f:
        _, message, tb = pickle.load(f)
    return message, tb
