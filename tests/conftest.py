"""Shared test set-up. Ranks are started once per test module where possible (a module-scoped fixture
launches every case of a world size in one go); each test then only looks at the results."""

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

# Start the ranks from a fork server (one clean process that has imported torch once) instead of fresh
# interpreters: a launch then costs milliseconds, not seconds of `import torch`. Forking the test process
# itself would be faster still, but it has threads by then, and a fork can inherit a held lock.
# (MINIFSDP_START_METHOD=spawn runs the suite the default way.)
os.environ.setdefault("MINIFSDP_START_METHOD", "forkserver")


@pytest.fixture(scope="session", autouse=True)
def pooled_ranks():
    """One pool of ranks for the whole run: a launch reuses the ranks of an earlier one of its shape, which
    saves starting them and their rendezvous (0.1-1.5 s a launch here). The pool puts each rank back to a
    fresh one's state between works (minifsdp/distributed/pool.py), and gives up ranks after any failure.
    Per test module would start each world size's ranks again in every module. (MINIFSDP_POOL=0: none.)"""
    from minifsdp.distributed.launch import rank_pool

    with rank_pool():
        yield
