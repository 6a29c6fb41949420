"""When something fails: say what, where, and which rank was the cause.

A collective that fails. A timeout or a dead peer surfaces as the backend's bare error on whichever rank
noticed first. comm.py's Handle.wait() turns it into a CollectiveError naming this rank's collective (its
kind, its tag -- for FSDP, the unit -- and its number in the group, from `where`), and, through the
rendezvous store every rank shares, the collective each other rank was in: ranks in different
collectives are the usual bug (a unit run on some ranks only), and this is where it shows.

A rank that fails. When one rank raises or dies, the others soon fail too, only because it is gone. The
launcher (spawn.py) raises a RankFailedError for the cause, not for an echo of it: the first rank to
raise (`claim`), unless all it raised is that a peer vanished; else the first seen to die (`blame`).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import sys
import time

import torch.distributed as dist

# How gloo (and its store) say that a peer vanished: a rank failing so is an echo of that death, not its cause.
LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection was likely closed")
_SIGNAL_NAMES = {s.value: s.name for s in signal.Signals}


# -- a collective that fails -------------------------------------------------------------------------------

class CollectiveError(RuntimeError):
    """A collective failed or timed out: which one, on which rank, and the usual reason why."""


_issued: collections.Counter = collections.Counter()  # group name -> collectives issued on it by this rank


def where(kind: str, tag: str, group_name: str) -> str:
    """Number this rank's next collective in its group, and say where it is, for the error should it fail."""
    _issued[group_name] += 1
    return (f"{kind} {tag!r}, collective #{_issued[group_name]} of group {group_name!r} "
            f"on this rank")


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
    return "".join(f"rank {r} was in {place}\n" for r, place in sorted(others.items()))


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


# -- a rank that fails -------------------------------------------------------------------------------------

class RankFailedError(RuntimeError):
    """A rank raised or died; `rank` is the cause (not an echo of it), `remote_traceback` its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} failed: {message}\n\n--- traceback from rank {rank} ---\n{remote_traceback}")


def claim(rank: int, error: BaseException, failed_rank) -> None:
    """In a rank whose work raised `error`: the first rank to raise is the cause, and says so in
    `failed_rank` (shared by every rank); a later one, or one that only lost a peer, is an echo, and says
    on its stderr what it echoes."""
    lost_peer = LOST_PEER.search(str(error))
    with failed_rank.get_lock():
        if failed_rank.value == -1 and not lost_peer:
            failed_rank.value = rank
    if failed_rank.value != rank:
        why = "a peer vanished" if failed_rank.value == -1 else f"rank {failed_rank.value} failed"
        print(f"[minifsdp] rank {rank}: exiting because {why} (here: {type(error).__name__})", file=sys.stderr,
              flush=True)


def failed(ended) -> list[int]:
    """Ranks that ended without a result, in the order seen (a result left before dying on the way out stands)."""
    return [r for r, left in ended.items() if left[:1] != ("ok",)]


def blame(procs, out_dir, ended, failed_rank, watch) -> tuple[int, str, str]:
    """(rank, message, traceback) of the cause: the first rank to raise, unless it raised only that a peer
    vanished; else the first seen to fail that is no such echo (killed, segfault, os._exit). An echo can end
    before the death behind it is seen, so until there is a cause, `watch` (a little) for the ranks to end."""
    deadline = time.monotonic() + 2
    while True:
        failures, first_raised = failed(ended), failed_rank.value
        reports = {r: _error_report(r, procs[r].exitcode, ended[r], out_dir) for r in failures}
        causes = [r for r in [first_raised, *failures] if r in reports and not LOST_PEER.search("".join(reports[r]))]
        raised_but_running = first_raised != -1 and first_raised not in ended
        if (causes and not raised_but_running) or len(ended) == len(procs) or time.monotonic() > deadline:
            rank = (causes or [first_raised if first_raised in reports else failures[0]])[0]
            return (rank, *reports[rank])
        watch()


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
