"""Start N ranks: the one place minifsdp launches processes.

From Python (a test, a notebook cell, a script):

    from minifsdp import launch
    results = launch(work, world_size=2)        # one process per rank, CPU + gloo by default
    results[0]                                  # what rank 0's work(...) returned

Each rank joins the process group (`init_process_group`: gloo on the CPU, NCCL with one GPU per rank),
runs `work`, and hands back what it returned. From the command line the same code runs under torchrun,
which starts the processes itself:

    torchrun --nproc-per-node 2 -m minifsdp tour

`launch` notices torchrun's environment (RANK, WORLD_SIZE, ...) and runs `work` in place on each rank.

Failure is loud and bounded: every collective has a timeout, and when one rank raises or dies, the
launcher stops the others and raises `RankFailedError` with its traceback (or how it died and the end of
its stderr). Nothing waits forever.

The machinery lives apart: spawn.py starts the processes and watches them, ranks.py is what runs in
each, failures.py tells the rank that failed first from its echoes, and pool.py keeps ranks for the
next launch of the same shape, inside `with rank_pool():`.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from minifsdp.distributed import ranks, spawn
from minifsdp.distributed.failures import RankFailedError  # noqa: F401 -- what launch raises
from minifsdp.distributed.pool import rank_pool  # noqa: F401 -- launch's, kept in pool.py

DEFAULT_TIMEOUT = 60.0  # seconds any one collective may wait for its peers


def current_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    spawn.refuse_while_importing()
    kwargs = kwargs or {}
    if backend == "fake":
        return [ranks.run_fake(work, world_size, args, kwargs)]
    if backend is not None:
        raise ValueError(f"backend must be None (chosen from the device) or 'fake', not {backend!r}")
    if dist.is_initialized() or _under_torchrun():
        return _run_in_place(work, world_size, args, kwargs, device, timeout)
    return spawn.spawn(work, world_size, args, kwargs, resolve_device(device, world_size), timeout,
                       init_group=init_process_group)


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


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


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
