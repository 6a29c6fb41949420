"""When a collective fails: say which one, on which rank, and where the other ranks were.

A timeout or a dead peer surfaces as the backend's bare error on whichever rank noticed first. comm.py's
Handle.wait() turns it into a CollectiveError naming this rank's collective (its kind, its tag -- for FSDP,
the unit -- and its number in the group), and, through the rendezvous store every rank shares, the
collective each other rank was in: ranks in different collectives are the usual bug (a unit run on some
ranks only), and this is where it shows.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out: which one, on which rank, and the usual reason why."""


def where_the_others_are(here: str, rank: int, world_size: int, patience: float = 2.0) -> str:
    """After a collective failed: leave where this rank was in the rendezvous store, and read where the
    others were, as far as they say so within `patience` seconds (those that failed too say so)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"minifsdp/stuck/{rank}", here)
        others, deadline = {}, time.perf_counter() + patience
        while len(others) < world_size - 1 and time.perf_counter() < deadline:
            for r in set(range(world_size)) - {rank} - set(others):
                if store.check([f"minifsdp/stuck/{r}"]):
                    others[r] = store.get(f"minifsdp/stuck/{r}").decode()
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 -- the store is gone too: say what this rank knows
        return ""
    return "".join(f"rank {r} was in {where}\n" for r, where in sorted(others.items()))


def collective_error(here: str, rank: int, world_size: int, error: Exception) -> CollectiveError:
    """The error to raise instead of the backend's: where this rank was, where the others were, and why
    that usually happens."""
    return CollectiveError(
        f"rank {rank} waited in {here} and it failed: {str(error).splitlines()[0]}\n"
        f"{where_the_others_are(here, rank, world_size)}"
        f"Every rank of a group must issue the same collectives in the same order. Usual causes: "
        f"a FullyShardedDataParallel unit (named in the tag) that ran its forward or backward on "
        f"some ranks only, a branch of the model taken on some ranks only, or a rank that stopped "
        f"early or died (see its own error)")
