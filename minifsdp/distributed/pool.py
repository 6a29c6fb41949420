"""A warm pool of ranks: processes that stay alive after a launch, their process group joined, and run the
next launch of the same shape (start method, world size, device, timeout) without a new process or a
rendezvous. spawn.py starts and watches them, ranks.py is what runs in each; this module keeps them
between launches and, inside each rank, puts back between two works what a fresh rank would have found.

    with rank_pool():                       # minifsdp.rank_pool
        launch(work, world_size=2)          # starts two ranks, which stay
        launch(other, world_size=2)         # runs on the same two processes
                                            # leaving the block ends the ranks started in it

MINIFSDP_POOL=1 pools every launch of the process (the ranks stay until it exits), MINIFSDP_POOL=0 none,
not even inside a block; unset, the blocks decide.

A pool is given up, and the next launch starts fresh ranks, whenever reusing it could change what a work
sees: a rank failed or died, a rank is not ready in time, or a work left what cannot be put back (the
default process group destroyed or replaced, a collective that failed).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import random
import sys
import time
import types
import warnings

import torch
import torch.distributed as dist

READY_PATIENCE = 10.0  # seconds an idle rank may take to report ready before its pool is replaced
MAX_IDLE_RANKS = 16    # pools kept at once hold at most this many processes; the least recently used go first

_pools: dict[tuple, Pool] = {}  # (start method, world size, device, timeout) -> idle ranks, oldest first
_depth = 0                      # how many rank_pool() blocks are open


def enabled() -> bool:
    chosen = os.environ.get("MINIFSDP_POOL", "")
    return chosen not in ("", "0") or (_depth > 0 and chosen != "0")


@contextlib.contextmanager
def rank_pool():
    """Inside the block, a launch reuses the ranks an earlier one left, if it has the same start method,
    world size, device and timeout, instead of starting processes and a rendezvous; leaving the block ends
    the ranks started in it. MINIFSDP_POOL=1 pools every launch (ranks stay until the process exits),
    MINIFSDP_POOL=0 none, not even in a block.

    Functions typed into a notebook are still started fresh, forked from the kernel: a rank that already
    runs could not see a function defined after it started, nor what the kernel changed since."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        # leaving a block ends the ranks started inside it; those of an enclosing block stay for it
        _depth -= 1
        for key in [key for key, pool in _pools.items() if pool.depth > _depth]:
            _pools.pop(key).close()


class Pool:
    """The launcher's side of one pool: the ranks' processes and a pipe to each."""

    def __init__(self, key, procs, conns, failed_rank):
        self.key, self.procs, self.conns, self.failed_rank = key, procs, conns, failed_rank
        self.depth = _depth  # the block that started them (0: none, MINIFSDP_POOL=1)

    def send(self, command) -> None:
        for conn in self.conns:
            try:
                conn.send(command)
            except OSError:  # a rank gone: the launcher sees it end without a result
                pass

    def ready(self, patience: float = READY_PATIENCE) -> bool:
        """Every rank says it is back in a fresh state (it does so after each work)."""
        deadline = time.monotonic() + patience
        try:
            return all(conn.poll(max(0.0, deadline - time.monotonic())) and conn.recv() == "ready"
                       for conn in self.conns)
        except (EOFError, OSError):  # a rank left: it could not be reused
            return False

    def close(self, kill: bool = False) -> None:
        """Ask the ranks to leave (idle ones do at once), or, with `kill` or after a while, make them."""
        if not kill:
            self.send(None)
        deadline = time.monotonic() + (0 if kill else 2)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        for conn in self.conns:
            conn.close()


def take(key) -> Pool | None:
    """The idle ranks for `key`, ready for a work, or None (then the caller starts fresh ones)."""
    pool = _pools.pop(key, None)
    if pool is not None and not pool.ready():
        pool.close()
        pool = None
    return pool


def give_back(pool: Pool) -> None:
    _pools[pool.key] = pool
    while sum(len(p.procs) for p in _pools.values()) > MAX_IDLE_RANKS and len(_pools) > 1:
        _pools.pop(next(iter(_pools))).close()


def close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()


# Before multiprocessing's own handler, which would only terminate the ranks: these leave when asked.
atexit.register(close_all)


# -- inside a pooled rank ----------------------------------------------------------------------------------

class FreshState:
    """What a rank looked like before its first work, and the means to return to it after each work.

    Covered: every minifsdp module's globals (counters, caches, subscribers, functions a work replaced), the
    process groups a work created, the default group's timeout, torch's global settings that works change
    (threads, default dtype, grad mode, determinism, matmul precision, anomaly detection), the random
    generators (torch, Python, numpy), and the environment, working directory, sys.path and warning filters.
    Not covered: state in other modules (a test module's globals, torch internals beyond those above)."""

    def __init__(self, timeout: float, device: str):
        self.timeout, self.device = timeout, device
        self.world = dist.group.WORLD
        self.modules: dict[str, tuple[dict, dict]] = {}
        self.note_new_modules()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.anomaly = torch.is_anomaly_enabled()
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state() if device == "cuda" else None
        self.py_rng = random.getstate()
        np = sys.modules.get("numpy")
        self.np_rng = np.random.get_state() if np is not None else None
        self.environ, self.cwd, self.path = dict(os.environ), os.getcwd(), list(sys.path)
        self.warning_filters = list(warnings.filters)

    def note_new_modules(self) -> None:
        """Remember the globals of minifsdp modules imported since: a module first seen after a work began
        is remembered as that work left it (the best that can be done without importing it again)."""
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if (name == "minifsdp" or name.startswith("minifsdp.")) and name not in self.modules and namespace:
                self.modules[name] = (dict(namespace), {k: _contents(v) for k, v in namespace.items()
                                                        if _holds_state(k, v)})

    def reusable(self, rank: int) -> bool:
        """False where a work left what cannot be put back: then the rank leaves, as a fresh one would."""
        if not dist.is_initialized() or dist.group.WORLD is not self.world:
            return False
        try:  # a collective that failed here (failures.py leaves this key) may have broken the group
            return not dist.distributed_c10d._get_default_store().check([f"minifsdp/stuck/{rank}"])
        except Exception:  # noqa: BLE001 -- the store is gone
            return False

    def restore(self) -> None:
        world = dist.group.WORLD
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not world:  # a group of the last work's (a mesh's, a new_group): nobody uses it now
                dist.destroy_process_group(group)
        if hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout))
        for name, (namespace, contents) in self.modules.items():
            module = sys.modules.get(name)
            if module is not None:
                _restore_namespace(vars(module), namespace, contents)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            # (only then: the first call imports enough of torch to take seconds)
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_anomaly_enabled(self.anomaly)
        torch.set_rng_state(self.rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        warnings.filters[:] = self.warning_filters
        if self.device == "cuda":  # the allocator's figures are the process's: a fresh one's start at zero
            gc.collect()  # (on the CPU it costs more than it is worth: ~0.2 s with torch loaded)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
            torch.cuda.set_rng_state(self.cuda_rng)


def _holds_state(name, value) -> bool:
    """A plain container of the module's own (not __builtins__ and the like), put back in place after a
    work: other modules may hold the same object."""
    return isinstance(value, (dict, list, set)) and not name.startswith("__")


def _contents(value):
    return dict(value) if isinstance(value, dict) else list(value)


def _restore_namespace(now: dict, then: dict, contents: dict) -> None:
    for name in [n for n in now if n not in then]:
        if not isinstance(now[name], types.ModuleType):  # a submodule imported since stays reachable from its package
            del now[name]
    for name, value in then.items():
        now[name] = value
        if name in contents:
            if isinstance(value, list):
                value[:] = contents[name]
            else:
                value.clear()
                value.update(contents[name])
