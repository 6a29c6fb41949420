"""Start N ranks: the one place minifsdp launches processes.

From Python (a test, a notebook cell, a script):

    from minifsdp import launch
    results = launch(work, world_size=2)        # one process per rank, CPU + gloo by default
    results[0]                                  # what rank 0's work(...) returned

From the command line the same code runs under torchrun, which starts the processes itself:

    torchrun --nproc-per-node 2 -m minifsdp tour

`launch` notices torchrun's environment (RANK, WORLD_SIZE, ...) and runs `work` in place on each rank.

Failure is loud and bounded: every collective has a timeout, and when one rank raises or dies, the
launcher stops the others (each prints which rank it is stopping for) and raises `RankFailedError` with
its traceback (or how it died and the end of its stderr). Nothing waits forever.

Starting ranks costs a process each and a rendezvous. Where one program launches many times (a test
module, a script comparing configurations), ranks can stay and take the next launch of the same shape:

    with rank_pool():
        launch(work, world_size=2)      # starts two ranks, which stay until the block ends
        launch(other, world_size=2)     # the same two processes, put back to a fresh rank's state first

See pool.py for what is put back between works, and when a pool is given up for fresh ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from minifsdp.distributed import pool

DEFAULT_TIMEOUT = 60.0  # seconds any one collective may wait for its peers
# How gloo (and its store) say that a peer vanished: a rank failing so is an echo of that death, not its cause.
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection was likely closed")
_SIGNAL_NAMES = {s.value: s.name for s in signal.Signals}

# Ask NVML, not the CUDA runtime, how many GPUs there are: the runtime's answer initialises CUDA in this
# process, and ranks forked from a process with CUDA initialised cannot use their GPU.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


class RankFailedError(RuntimeError):
    """A rank raised or died; `rank` is the cause (not an echo of it), `remote_traceback` its traceback."""

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
                       init_method: str = "env://", threads: int | None = None) -> None:
    """Join the group: gloo for the CPU, NCCL for GPUs (one per rank), with a timeout on every collective.
    `threads`: the rank's CPU threads (threads_per_rank's share of the cores by default)."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(threads or threads_per_rank(world_size))
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
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if getattr(mp.current_process(), "_inheriting", False):
        # a spawned rank imports the caller's script to find `work`; a call at the top level runs again there
        raise RuntimeError(
            "launch() was called while a rank was importing the script that calls it. Each rank starts as a "
            "fresh process and imports that script, so the call must sit under `if __name__ == \"__main__\":`.")
    kwargs = kwargs or {}
    if backend == "fake":
        return [_run_fake(work, world_size, args, kwargs)]
    if backend is not None:
        raise ValueError(f"backend must be None (chosen from the device) or 'fake', not {backend!r}")
    if dist.is_initialized() or _under_torchrun():
        return _run_in_place(work, world_size, args, kwargs, device, timeout)
    return _spawn(work, world_size, args, kwargs, resolve_device(device, world_size), timeout)


@contextlib.contextmanager
def rank_pool():
    """Inside the block, a launch reuses the ranks an earlier one left, if it has the same start method,
    world size, device and timeout, instead of starting processes and a rendezvous; leaving the block ends
    the ranks started in it. MINIFSDP_POOL=1 pools every launch (ranks stay until the process exits),
    MINIFSDP_POOL=0 none, not even in a block.

    Functions typed into a notebook are still started fresh, forked from the kernel: a rank that already
    runs could not see a function defined after it started, nor what the kernel changed since."""
    pool.enter_scope()
    try:
        yield
    finally:
        pool.leave_scope()


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
        # one GPU per rank *of this machine*: across nodes, torchrun starts LOCAL_WORLD_SIZE ranks on each
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        init_process_group(int(os.environ["RANK"]), env_world, resolve_device(device, local_world), timeout)
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


def _rank_main(rank, world_size, device, port, payload, timeout, out_dir, failed_rank, threads=None):
    """Body of one spawned process: join the group, run the work, leave a result (or a traceback) behind."""
    _become_rank(rank, world_size, port, failed_rank)
    _attach_stderr(out_dir, rank)
    open(os.path.join(out_dir, f"rank{rank}.started"), "wb").close()  # past the import of the caller's script
    _run_work(rank, payload, out_dir, failed_rank,
              lambda: init_process_group(rank, world_size, device, timeout, threads=threads))
    # Leave together, and without tearing the group down: past the barrier no rank has a collective in
    # flight, and gloo's teardown can abort a process whose peers are exiting at the same moment.
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 -- a peer gone after leaving its result: ours is written too
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _pooled_rank_main(rank, world_size, device, port, timeout, failed_rank, conn):
    """Body of a pooled process: the fresh rank's, for each work the launcher sends, until it sends None.
    Between two works the rank returns to the state it had before the first (pool.FreshState), or, where
    it cannot, leaves as a fresh rank would -- the launcher then starts fresh ones."""
    _become_rank(rank, world_size, port, failed_rank)
    fresh = None

    def join_group():  # the payload is unpickled by now: the modules it imported count as fresh state
        nonlocal fresh
        if fresh is None:
            init_process_group(rank, world_size, device, timeout)
            fresh = pool.FreshState(timeout, device)
        fresh.note_new_modules()

    while True:
        try:
            command = conn.recv()
        except (EOFError, KeyboardInterrupt):  # the launcher is gone (or Ctrl-C reached us too): so are we
            command = None
        if command is None:
            os._exit(0)
        out_dir, payload = command
        _attach_stderr(out_dir, rank)
        open(os.path.join(out_dir, f"rank{rank}.started"), "wb").close()
        _run_work(rank, payload, out_dir, failed_rank, join_group)
        try:
            dist.barrier()  # as a fresh rank leaves: no collective of this work is in flight past it
            reusable = fresh.reusable(rank)
            if reusable:
                fresh.restore()
        except Exception:  # noqa: BLE001 -- a peer gone, or a group that cannot be put back
            reusable = False
        sys.stdout.flush()
        sys.stderr.flush()
        if reusable:
            try:
                conn.send("ready")
                continue
            except OSError:  # the launcher is gone
                pass
        os._exit(0)


def _become_rank(rank, world_size, port, failed_rank):
    def stop(signum, frame):  # the launcher stops us because another rank failed
        print(f"[minifsdp] rank {rank}: stopping because rank {failed_rank.value} failed", file=sys.stderr,
              flush=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    faulthandler.enable()  # on fd 2, wherever _attach_stderr points it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))


def _attach_stderr(out_dir, rank):
    """Everything written to fd 2 (by Python, by gloo's C++, by faulthandler on a segfault) goes to a file
    that the launcher passes on to its own stderr, and quotes if this rank dies without a traceback."""
    sys.stderr.flush()
    fd = os.open(os.path.join(out_dir, f"rank{rank}.stderr"), os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)


def _run_work(rank, payload, out_dir, failed_rank, join_group):
    """Run the work and leave its result; on any failure leave the error behind and exit."""
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        work, args, kwargs = pickle.loads(payload)
        join_group()
        result = work(*args, **kwargs)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("ok", result), f)
        os.replace(path + ".tmp", path)  # the launcher only ever sees a whole file
    except BaseException as e:  # noqa: BLE001 -- every failure must reach the launcher
        lost_peer = _LOST_PEER.search(str(e))
        with failed_rank.get_lock():  # the first rank to raise is the cause; later ones are its echoes
            if failed_rank.value == -1 and not lost_peer:
                failed_rank.value = rank
        if failed_rank.value != rank:
            why = "a peer vanished" if failed_rank.value == -1 else f"rank {failed_rank.value} failed"
            print(f"[minifsdp] rank {rank}: exiting because {why} (here: {type(e).__name__})", file=sys.stderr,
                  flush=True)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("error", f"{type(e).__name__}: {e}", traceback.format_exc()), f)
        os.replace(path + ".tmp", path)
        sys.stderr.flush()
        os._exit(1)


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
    # Plain pickle, so every rank gets its own copy of the arguments: multiprocessing's own pickler would
    # put tensors in shared memory, and a rank updating one in place would change it for all the others
    # (and for the caller).
    payload = pickle.dumps((work, args, kwargs))
    with tempfile.TemporaryDirectory(prefix="minifsdp-") as out_dir:
        for r in range(world_size):  # the rank appends its stderr to it
            open(os.path.join(out_dir, f"rank{r}.stderr"), "wb").close()
        if method != "fork" and pool.enabled():
            return _run_pooled(ctx, (method, world_size, device, timeout), payload, out_dir)
        failed_rank = ctx.Value("i", -1)
        port = _free_port()
        # A forked rank computes on one thread: the caller's OpenMP threads, if it has run a parallel op,
        # are not copied by fork, and a child that asks the OpenMP pool for more than one waits on them forever.
        threads = 1 if method == "fork" else None
        procs = [ctx.Process(target=_rank_main, daemon=True, name=f"minifsdp-rank{r}",
                             args=(r, world_size, device, port, payload, timeout, out_dir, failed_rank, threads))
                 for r in range(world_size)]
        with _rank_environment():
            for p in procs:
                p.start()
        sent = [0] * world_size  # bytes of each rank's stderr passed on to ours
        try:
            return _collect(procs, out_dir, sent, failed_rank)
        finally:
            for p in procs:  # e.g. KeyboardInterrupt in the launcher: never leave ranks behind
                if p.is_alive():
                    p.kill()
                p.join()
            _pass_on_stderr(out_dir, sent, everything=True)


def _run_pooled(ctx, key, payload, out_dir):
    """_spawn on the pool's ranks for `key`, started (and left in the pool) if there are none."""
    _, world_size, device, timeout = key
    ranks = pool.take(key)
    if ranks is None:
        failed_rank, port = ctx.Value("i", -1), _free_port()
        pipes = [ctx.Pipe() for _ in range(world_size)]
        procs = [ctx.Process(target=_pooled_rank_main, daemon=True, name=f"minifsdp-pooled-rank{r}",
                             args=(r, world_size, device, port, timeout, failed_rank, pipes[r][1]))
                 for r in range(world_size)]
        with _rank_environment():
            for p in procs:
                p.start()
        for _, theirs in pipes:  # only the rank holds its end: when the rank dies, ours reads EOF
            theirs.close()
        ranks = pool.Pool(key, procs, [ours for ours, _ in pipes], failed_rank)
    ranks.send((out_dir, payload))
    sent, results = [0] * world_size, None
    try:
        results = _collect(ranks.procs, out_dir, sent, ranks.failed_rank, pooled=True)
        return results
    finally:
        if results is None:  # a rank failed, or the launcher was interrupted: no state to trust
            ranks.close(kill=True)
        else:
            pool.give_back(ranks)
        _pass_on_stderr(out_dir, sent, everything=True)


def _collect(procs, out_dir, sent, failed_rank, pooled=False) -> list[Any]:
    """Every rank's result, in rank order, passing on their stderr meanwhile; or, at the first failure, stop
    the other ranks and raise RankFailedError for its cause."""
    ended: dict[int, tuple] = {}  # rank -> what it left behind, in the order the ranks were seen to end
    while len(ended) < len(procs) and not _failures(ended):
        _watch(procs, out_dir, ended, sent, pooled)
    if _failures(ended):
        rank, message, tb = _blame(procs, out_dir, ended, sent, failed_rank, pooled)
        failed_rank.value = rank  # what the ranks stopped below say they stop for
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        raise RankFailedError(rank, message, tb)
    return [ended[r][1] for r in range(len(procs))]


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


def _watch(procs, out_dir, ended, sent, pooled=False):
    """One poll: note what each rank that ended since the last one left behind -- ("ok", result), ("error",
    message, traceback) or () -- and pass on to our stderr what the ranks wrote to theirs. A rank's launch
    ends with its process; a pooled rank's, as soon as it leaves its result (the process stays)."""
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if r not in ended and (p.exitcode is not None or pooled and os.path.exists(path)):
            ended[r] = ()
            if os.path.exists(path):
                with open(path, "rb") as f:
                    ended[r] = pickle.load(f)
    _pass_on_stderr(out_dir, sent)
    time.sleep(0.02)


def _failures(ended) -> list[int]:
    """Ranks that ended without a result, in the order seen (a result left before dying on the way out stands)."""
    return [r for r, left in ended.items() if left[:1] != ("ok",)]


def _pass_on_stderr(out_dir, sent, everything=False):
    """Whole lines only (unless `everything`), so that the ranks' lines never interleave mid-line."""
    for r in range(len(sent)):
        with open(os.path.join(out_dir, f"rank{r}.stderr"), "rb") as f:
            f.seek(sent[r])
            data = f.read()
        cut = len(data) if everything else data.rfind(b"\n") + 1
        if cut:
            sent[r] += cut
            sys.stderr.write(data[:cut].decode(errors="replace"))


def _blame(procs, out_dir, ended, sent, failed_rank, pooled=False) -> tuple[int, str, str]:
    """(rank, message, traceback) of the cause: the first rank to raise, unless it raised only that a peer
    vanished; else the first seen to fail that is no such echo (killed, segfault, os._exit). An echo can end
    before the death behind it is seen, so until there is a cause, wait (a little) for the ranks to end."""
    deadline = time.monotonic() + 2
    while True:
        failed, first_raised = _failures(ended), failed_rank.value
        reports = {r: _error_report(r, procs[r].exitcode, ended[r], out_dir) for r in failed}
        causes = [r for r in [first_raised, *failed] if r in reports and not _LOST_PEER.search("".join(reports[r]))]
        raised_but_running = first_raised != -1 and first_raised not in ended
        if (causes and not raised_but_running) or len(ended) == len(procs) or time.monotonic() > deadline:
            rank = (causes or [first_raised if first_raised in reports else failed[0]])[0]
            return (rank, *reports[rank])
        _watch(procs, out_dir, ended, sent, pooled)


def _error_report(rank, exitcode, left, out_dir) -> tuple[str, str]:
    """(message, traceback) of a failed rank: the error it left behind, or how its process ended; where there
    is no traceback (killed, os._exit, an abort in C++), the last lines it wrote to stderr stand in for it."""
    if left:
        _, message, tb = left
    else:
        how = f"killed by signal {_SIGNAL_NAMES.get(-exitcode, -exitcode)}" if exitcode < 0 else \
            f"exited (code {exitcode})"
        message, tb = f"process {how} without returning a result", ""
    if not tb.strip() and not os.path.exists(os.path.join(out_dir, f"rank{rank}.started")):
        tb = (f"(rank {rank} died before it could run the work, most often while importing the script that "
              "called launch(): its process's own error is printed above. A script must call launch() under "
              "`if __name__ == \"__main__\":`.)")
    if not tb.strip():
        with open(os.path.join(out_dir, f"rank{rank}.stderr"), "rb") as f:
            tail = "\n".join(f.read().decode(errors="replace").splitlines()[-20:]) or "(nothing)"
        tb = f"(no Python traceback; the last lines rank {rank} wrote to stderr:)\n{tail}"
    return message, tb
