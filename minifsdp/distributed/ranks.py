"""What a rank runs: the body of each process that spawn.py starts, and the fake group's lone rank.

A process becomes a rank (its place in the world, where torch.distributed reads it), sends what it writes
to stderr to a file the launcher passes on, joins the process group, runs the work and leaves its result
behind -- or, at any failure, its error, and exits. A pooled rank does so for each work the launcher
sends it, put back to a fresh rank's state in between (pool.FreshState).

How a rank joins the group is the launcher's to say: `init_group` is launch.init_process_group.

launch(backend="fake") runs no processes: the caller's own is rank 0 of a fake process group whose
collectives move no data (`run_fake`), to measure one rank of a job larger than the machine.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback

import torch.distributed as dist

from minifsdp.distributed import failures, pool


def rank_main(rank, world_size, device, port, payload, timeout, out_dir, failed_rank, init_group, threads=None):
    """Body of one spawned process: join the group, run the work, leave a result (or a traceback) behind."""
    _become_rank(rank, world_size, port, failed_rank)
    _attach_stderr(out_dir, rank)
    open(os.path.join(out_dir, f"rank{rank}.started"), "wb").close()  # past the import of the caller's script
    _run_work(rank, payload, out_dir, failed_rank,
              lambda: init_group(rank, world_size, device, timeout, threads=threads))
    # Leave together, and without tearing the group down: past the barrier no rank has a collective in
    # flight, and gloo's teardown can abort a process whose peers are exiting at the same moment.
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 -- a peer gone after leaving its result: ours is written too
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pooled_rank_main(rank, world_size, device, port, timeout, failed_rank, conn, init_group):
    """Body of a pooled process: the fresh rank's, for each work the launcher sends, until it sends None.
    Between two works the rank returns to the state it had before the first (pool.FreshState), or, where
    it cannot, leaves as a fresh rank would -- the launcher then starts fresh ones."""
    _become_rank(rank, world_size, port, failed_rank)
    fresh = None

    def join_group():  # the payload is unpickled by now: the modules it imported count as fresh state
        nonlocal fresh
        if fresh is None:
            init_group(rank, world_size, device, timeout)
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
        failures.claim(rank, e, failed_rank)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("error", f"{type(e).__name__}: {e}", traceback.format_exc()), f)
        os.replace(path + ".tmp", path)
        sys.stderr.flush()
        os._exit(1)


def run_fake(work, world_size, args, kwargs):
    """work(*args, **kwargs) as rank 0 of `world_size`, in this process, on a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the 'fake' backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return work(*args, **kwargs)
    finally:
        dist.destroy_process_group()
