"""Starting the ranks' processes, watching them, and stopping them: the machinery under launch().

Each rank is a process (ranks.py is what runs in it) that leaves its result, or its error, in a file of a
temporary folder, and appends what it writes to stderr to another; the launcher polls them, passes the
stderr on to its own, line by line, and returns the results in rank order. At the first rank that fails,
it stops the others (each says which rank it stops for) and raises RankFailedError for the cause
(failures.py tells the cause from its echoes).

How the processes start: spawned fresh by default; forked from a server that imported torch once with
MINIFSDP_START_METHOD=forkserver; forked from the caller for a function typed into a notebook. In a
rank_pool() block they stay for the next launch of the same shape (pool.py).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
from typing import Any

import torch

from minifsdp.distributed import failures, pool, ranks

# Ask NVML, not the CUDA runtime, how many GPUs there are: the runtime's answer initialises CUDA in this
# process, and ranks forked from a process with CUDA initialised cannot use their GPU.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def refuse_while_importing() -> None:
    """A spawned rank imports the caller's script to find `work`; a launch() at its top level runs again
    there: refuse it, saying why."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            "launch() was called while a rank was importing the script that calls it. Each rank starts as a "
            "fresh process and imports that script, so the call must sit under `if __name__ == \"__main__\":`.")


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


def spawn(work, world_size, args, kwargs, device, timeout, init_group) -> list[Any]:
    """Run `work(*args, **kwargs)` on `world_size` new processes (or a pool's), each joining the process
    group with `init_group(rank, world_size, device, timeout, threads=...)`; each rank's result, in order."""
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
            return _run_pooled(ctx, (method, world_size, device, timeout), payload, out_dir, init_group)
        failed_rank = ctx.Value("i", -1)
        port = _free_port()
        # A forked rank computes on one thread: the caller's OpenMP threads, if it has run a parallel op,
        # are not copied by fork, and a child that asks the OpenMP pool for more than one waits on them forever.
        threads = 1 if method == "fork" else None
        procs = [ctx.Process(target=ranks.rank_main, daemon=True, name=f"minifsdp-rank{r}",
                             args=(r, world_size, device, port, payload, timeout, out_dir, failed_rank, init_group,
                                   threads))
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


def _run_pooled(ctx, key, payload, out_dir, init_group):
    """spawn on the pool's ranks for `key`, started (and left in the pool) if there are none."""
    _, world_size, device, timeout = key
    pooled = pool.take(key)
    if pooled is None:
        failed_rank, port = ctx.Value("i", -1), _free_port()
        pipes = [ctx.Pipe() for _ in range(world_size)]
        procs = [ctx.Process(target=ranks.pooled_rank_main, daemon=True, name=f"minifsdp-pooled-rank{r}",
                             args=(r, world_size, device, port, timeout, failed_rank, pipes[r][1], init_group))
                 for r in range(world_size)]
        with _rank_environment():
            for p in procs:
                p.start()
        for _, theirs in pipes:  # only the rank holds its end: when the rank dies, ours reads EOF
            theirs.close()
        pooled = pool.Pool(key, procs, [ours for ours, _ in pipes], failed_rank)
    pooled.send((out_dir, payload))
    sent, results = [0] * world_size, None
    try:
        results = _collect(pooled.procs, out_dir, sent, pooled.failed_rank, pooled=True)
        return results
    finally:
        if results is None:  # a rank failed, or the launcher was interrupted: no state to trust
            pooled.close(kill=True)
        else:
            pool.give_back(pooled)
        _pass_on_stderr(out_dir, sent, everything=True)


def _collect(procs, out_dir, sent, failed_rank, pooled=False) -> list[Any]:
    """Every rank's result, in rank order, passing on their stderr meanwhile; or, at the first failure, stop
    the other ranks and raise RankFailedError for its cause."""
    ended: dict[int, tuple] = {}  # rank -> what it left behind, in the order the ranks were seen to end
    while len(ended) < len(procs) and not failures.failed(ended):
        _watch(procs, out_dir, ended, sent, pooled)
    if failures.failed(ended):
        rank, message, tb = failures.blame(procs, out_dir, ended, failed_rank,
                                           watch=lambda: _watch(procs, out_dir, ended, sent, pooled))
        failed_rank.value = rank  # what the ranks stopped below say they stop for
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        raise failures.RankFailedError(rank, message, tb)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
