"""Chapter 0 foundations: the launcher, failure handling, and the no-process-group error."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from minifsdp import RankFailedError, comm, launch
from minifsdp.ddp import DistributedDataParallel
from minifsdp.distributed import failures, recording
from minifsdp.distributed.comm import NoProcessGroupError
from minifsdp.distributed.launch import rank_pool, threads_per_rank
from minifsdp.models import ToyModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def whoami(offset):
    return (dist.get_rank(), dist.get_world_size(), dist.get_backend(), offset)


def test_launch_returns_each_ranks_result_in_rank_order():
    assert launch(whoami, world_size=3, args=(7,), device="cpu") == [(r, 3, "gloo", 7) for r in range(3)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, False])
def test_world_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        launch(whoami, world_size=bad, args=(0,))


def test_cuda_without_gpus_is_a_clear_error():
    if torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    with pytest.raises(ValueError, match="one GPU per rank"):
        launch(whoami, world_size=64, args=(0,), device="cuda")


def add_rank(t):
    t += dist.get_rank() + 1  # in place
    return t.clone()


def test_each_rank_gets_its_own_copy_of_the_arguments():
    t = torch.zeros(3)
    assert [r.tolist() for r in launch(add_rank, world_size=3, args=(t,), device="cpu")] == \
        [[1.0] * 3, [2.0] * 3, [3.0] * 3]
    assert t.tolist() == [0.0] * 3  # the caller's tensor is untouched


def fail_on_rank_one():
    t = torch.ones(3)
    comm.all_reduce(t)  # everyone is in the group and working...
    if dist.get_rank() == 1:
        raise KeyError("the data for rank 1 is missing")
    comm.all_reduce(t)  # ...rank 0 now waits for a peer that will never come
    time.sleep(60)


def test_a_rank_that_raises_stops_the_others_with_a_message(capfd, monkeypatch):
    # spawned fresh, so the ranks write to this test's stderr (a fork server's children write to the
    # server's, wherever that was when it started)
    monkeypatch.setenv("MINIFSDP_START_METHOD", "spawn")
    start = time.time()
    with pytest.raises(RankFailedError) as info:
        # a timeout far above what three fresh interpreters take to start on a loaded machine, so that
        # finishing well inside it can only mean the launcher stopped the survivors
        launch(fail_on_rank_one, world_size=3, device="cpu", timeout=120)
    assert time.time() - start < 90, "the launcher must not wait for the collective timeout"
    assert info.value.rank == 1
    assert "KeyError" in str(info.value) and "the data for rank 1 is missing" in str(info.value)
    assert "fail_on_rank_one" in info.value.remote_traceback
    err = capfd.readouterr().err
    # the survivors say why they exit, naming the rank that failed (whether their collective broke
    # first or the launcher stopped them)
    for survivor in (0, 2):
        assert f"rank {survivor}: exiting because rank 1 failed" in err or \
            f"rank {survivor}: stopping because rank 1 failed" in err, err


def hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(120)  # stuck without ever joining the collective
    comm.all_reduce(torch.ones(2))


def test_a_collective_never_waits_forever():
    start = time.time()
    with pytest.raises(RankFailedError) as info:
        launch(hang_on_rank_zero, world_size=2, device="cpu", timeout=3)
    assert time.time() - start < 60
    assert info.value.rank == 1  # rank 1 timed out waiting for rank 0, and says so


def leave_without_a_result():
    if dist.get_rank() == 1:
        os._exit(0)  # a clean exit code, but no result
    return "rank 0 is fine"


def test_a_rank_that_exits_cleanly_without_a_result_is_a_failure():
    with pytest.raises(RankFailedError) as info:
        launch(leave_without_a_result, world_size=2, device="cpu", timeout=30)
    assert info.value.rank == 1
    assert "exited (code 0) without returning a result" in str(info.value)


def killed_while_rank_zero_waits():
    if dist.get_rank() == 1:
        time.sleep(0.3)  # rank 0 is in the all_reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(2))  # rank 0's collective breaks when rank 1 vanishes: an echo, not the cause
    time.sleep(60)


def test_the_rank_that_died_first_is_named_not_its_echo():
    for _ in range(3):  # which rank the launcher sees end first is a race: the answer must not depend on it
        start = time.time()
        with pytest.raises(RankFailedError) as info:
            launch(killed_while_rank_zero_waits, world_size=2, device="cpu", timeout=30)
        assert time.time() - start < 25
        assert info.value.rank == 1, str(info.value)
        assert "killed by signal SIGKILL" in str(info.value)


def say_why_then_exit():
    if dist.get_rank() == 1:
        print("boom: the real reason", file=sys.stderr, flush=True)
        os._exit(3)
    return "rank 0 is fine"


def test_a_rank_that_dies_without_a_traceback_shows_its_stderr():
    with pytest.raises(RankFailedError) as info:
        launch(say_why_then_exit, world_size=2, device="cpu", timeout=30)
    assert info.value.rank == 1, str(info.value)
    assert "code 3" in str(info.value)
    assert "boom: the real reason" in str(info.value)


def state_seen():
    """What a work finds when it starts (its process aside)."""
    return {"rank": dist.get_rank(), "backend": dist.get_backend(), "threads": torch.get_num_threads(),
            "dtype": str(torch.get_default_dtype()), "random": torch.rand(2).tolist(),
            "groups": len(dist.distributed_c10d._world.pg_map), "counters": len(recording._active),
            "issued": dict(failures._issued), "named": len(comm._group_names), "env": "LEFT_BY_A_WORK" in os.environ}


def pid_and_state():
    return os.getpid(), state_seen()


def leave_state_behind():
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    group = dist.new_group(list(range(dist.get_world_size())))
    comm.name_group(group, "mine")
    comm.counting().__enter__()  # a counter never left
    comm.all_reduce(torch.ones(2), group=group)
    comm.all_reduce(torch.ones(2))
    os.environ["LEFT_BY_A_WORK"] = "1"
    return os.getpid()


def test_a_pool_reuses_its_ranks_and_they_start_each_work_fresh(monkeypatch):
    monkeypatch.setenv("MINIFSDP_POOL", "0")  # none, even in the test suite's block
    fresh = launch(pid_and_state, world_size=2, device="cpu")
    monkeypatch.delenv("MINIFSDP_POOL")
    with rank_pool():
        first = launch(pid_and_state, world_size=2, device="cpu")
        assert launch(leave_state_behind, world_size=2, device="cpu") == [pid for pid, _ in first]
        again = launch(pid_and_state, world_size=2, device="cpu")
        other_shape = launch(pid_and_state, world_size=3, device="cpu")
        assert launch(pid_and_state, world_size=2, device="cpu") == first  # both shapes stay
    assert again == first  # the same processes, and what the work left behind is gone
    assert not {pid for pid, _ in other_shape} & {pid for pid, _ in first}
    assert first[0][1]["threads"] == threads_per_rank(2) and first[0][1]["groups"] == 1
    # as a fresh rank finds it; the random numbers too where fresh ranks share a seed (forked from one server)
    if os.environ.get("MINIFSDP_START_METHOD") != "forkserver":
        for _, state in fresh + first:
            del state["random"]
    assert [state for _, state in first] == [state for _, state in fresh]
    assert not {pid for pid, _ in first} & {pid for pid, _ in fresh}


def raise_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("the data for rank 1 is missing")
    return os.getpid()


def leave_no_process_group():
    dist.destroy_process_group()
    return os.getpid()


def test_a_failure_in_a_pool_is_the_usual_error_and_the_next_launch_starts_fresh_ranks(monkeypatch):
    monkeypatch.delenv("MINIFSDP_POOL", raising=False)
    with rank_pool():
        pids = [pid for pid, _ in launch(pid_and_state, world_size=2, device="cpu")]
        with pytest.raises(RankFailedError) as info:
            launch(raise_on_rank_one, world_size=2, device="cpu")
        assert info.value.rank == 1
        assert str(info.value).startswith("rank 1 failed: KeyError: 'the data for rank 1 is missing'")
        assert "--- traceback from rank 1 ---" in str(info.value)
        assert "raise_on_rank_one" in info.value.remote_traceback
        after_failure = [pid for pid, _ in launch(pid_and_state, world_size=2, device="cpu")]
        assert not set(after_failure) & set(pids)
        # a work that destroys the process group cannot be followed on its ranks: the next gets fresh ones
        assert launch(leave_no_process_group, world_size=2, device="cpu") == after_failure
        after_destroy = launch(pid_and_state, world_size=2, device="cpu")
        assert not {pid for pid, _ in after_destroy} & set(after_failure)
        assert after_destroy[1][1]["rank"] == 1


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # ended, not yet reaped by its parent
    except FileNotFoundError:
        return True


def test_ranks_started_in_a_block_end_with_it(monkeypatch):
    monkeypatch.delenv("MINIFSDP_POOL", raising=False)
    with rank_pool():
        outer = launch(pid_and_state, world_size=2, device="cpu", timeout=41)  # a shape of this test's own
        with rank_pool():
            inner = launch(pid_and_state, world_size=2, device="cpu", timeout=42)
            assert launch(pid_and_state, world_size=2, device="cpu", timeout=41) == outer
        deadline = time.time() + 10
        while not all(_gone(pid) for pid, _ in inner) and time.time() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid, _ in inner)
        assert launch(pid_and_state, world_size=2, device="cpu", timeout=41) == outer  # the outer block's stay


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(NoProcessGroupError, match="minifsdp.launch"):
        DistributedDataParallel(ToyModel())
    with pytest.raises(NoProcessGroupError):
        comm.all_reduce(torch.ones(1))


def count_on_fake_group():
    with comm.counting() as c:
        comm.all_reduce(torch.ones(1000))
        comm.all_gather(torch.empty(8000), torch.ones(1000))
    return dist.get_world_size(), dict(c.bytes)


def test_fake_backend_measures_rank_zero_of_a_large_job():
    [(n, sent)] = launch(count_on_fake_group, world_size=8, backend="fake")
    assert n == 8
    assert sent == {"all_reduce": 2 * 4000 * 7 / 8, "all_gather": 32000 * 7 / 8}


def test_works_under_torchrun(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "minifsdp", "tour",
         "--world-size", "2", "--steps", "2", "--strategies", "ddp", "fsdp", "--plot", str(tmp_path / "m.png")],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    # its row in the tour table (plain columns in a terminal): max abs diff 0
    assert any(line.split()[:2] == ["ddp", "0"] for line in out.stdout.splitlines()), out.stdout
    assert (tmp_path / "m.png").exists()


def test_the_readme_example_runs(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    sent = eval(out.stdout.strip().splitlines()[-1])  # one figure per rank, e.g. [117504.0, 117504.0]
    assert len(sent) == 2 and sent[0] == sent[1] > 0


def test_gpu_check_says_so_without_a_gpu(capsys):
    # the command's own entry point, in this process: `python -m minifsdp` itself is started fresh by
    # test_works_under_torchrun, and another interpreter here would only import torch once more
    from minifsdp.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: gpu-check would run for real")
    assert main(["gpu-check"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_a_script_that_launches_unguarded_is_told_to_guard_it(tmp_path):
    # each spawned rank imports the script to find `work`; without the __main__ guard it would launch again
    script = tmp_path / "unguarded.py"
    script.write_text("from minifsdp import launch\n\ndef work():\n    return 1\n\n"
                      "print(launch(work, world_size=2, device='cpu'))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "launch() was called while a rank was importing the script" in out.stderr  # the rank's own error
    assert "died before it could run the work" in out.stderr  # and the launcher's, naming the cause
    assert 'if __name__ == "__main__":' in out.stderr.splitlines()[-1]


def test_ranks_forked_after_the_caller_computed_in_parallel_do_not_hang():
    # A notebook's function is forked into its ranks. Once the kernel has run a parallel op, its OpenMP
    # threads exist in it alone: a forked rank that asked for more than one thread would wait on them
    # forever (at N = 1 threads_per_rank gives a rank every core). The rank computes on one thread.
    code = ("import torch\nfrom minifsdp import launch\n"
            "a = torch.randn(1500, 1500); (a @ a).sum()  # the caller's OpenMP threads start here\n"
            "def work():\n    x = torch.randn(1500, 1500)\n    return float((x @ x).sum()), torch.get_num_threads()\n"
            "print(launch(work, world_size=1, device='cpu', timeout=30)[0][1])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a parallel parent, whatever this machine's cores
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(code, timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its hung rank
        proc.communicate()
        pytest.fail("the forked rank hung")
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.split() == ["1"]  # forked (defined in __main__, no file to import it from): one thread
