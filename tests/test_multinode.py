"""Across nodes: two torchrun agents, each a node, train DDP, FSDP and fully_shard as one process would.

A cluster starts one torchrun agent on each node:

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB \\
        tests/test_multinode.py OUT

This test starts exactly those two agents on this machine, with the rendezvous endpoint on 127.0.0.1.
The agents meet in torchrun's c10d rendezvous, which gives each its node rank and its ranks' global ranks;
each starts one rank; the ranks form one gloo process group across the two agents (the script calls
`minifsdp.launch`, which finds torchrun's environment and joins the group); and every strategy's
collectives cross between the "nodes": DDP's all-reduce and its broadcast of rank 0's weights, FSDP's
all-gathers and reduce-scatters of FlatParameters (a unit per block, and the root), fully_shard's of its
per-parameter DTensors. Each rank builds its model from its own seed for DDP and FSDP, so only a
working broadcast ends right; fully_shard, like torch's, expects every rank to build the same weights.

What it compares, after STEPS steps of SGD with momentum (zero_grad alternating set_to_none) on the tiny GPT,
the global batch of 12 split between the two ranks:
- against one process training the same model on the whole global batch: SINGLE_PROCESS_ATOL, 2e-5
  absolute, chapter 1's for SGD against one process (it takes one mean over the batch, the ranks the
  mean of two means: a few ulps apart). Measured 7.5e-9 for each strategy (DDP, FSDP and fully_shard
  end with the same bits, below).
- FSDP and fully_shard against DDP, across the nodes: bit-exact, as chapters 6 and 11 state for two ranks
  (one addition of two gradients, commutative, whichever collective adds them).
- the two-node run against the same script's ranks on one node (`launch` starting them itself):
  bit-exact. The ranks compute the same thing in the same order; which agent started them changes
  nothing.
- every rank's full parameters are the same, and the two ranks were started by two different agents
  (torchrun's GROUP_RANK 0 and 1).

What it cannot show (chapters/gpu.md says so too): a real network between hosts (its bandwidth, latency,
a link that fails), NCCL, and how ranks are placed on real machines. Both agents and their ranks share
this machine's loopback.

The run is bounded: past AGENTS_TIMEOUT seconds both agents are killed with their ranks, and the test
fails naming the agents that had not finished. It skips only where torchrun cannot be started.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

from minifsdp import launch
from minifsdp.ddp import DistributedDataParallel
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from minifsdp.fsdp2 import fully_shard
from minifsdp.models import Block
from minifsdp.state_dict import get_full_state_dict
from minifsdp.train import OPTIMIZERS, batch, build_model, loss_of, max_abs_diff

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, RANKS_PER_NODE = 2, 1
WORLD_SIZE = NODES * RANKS_PER_NODE
STEPS, GLOBAL_BATCH = 4, 12
SINGLE_PROCESS_ATOL = 2e-5  # chapter 1's, SGD against one process (see the module docstring)
# seconds. The agents and their ranks use about 18 s of CPU between them (four interpreters importing torch,
# most of it): 60 s of wall time on two cores shared with a load average of 13.
AGENTS_TIMEOUT = 240


def _fully_shard(net):
    for block in net.blocks:
        fully_shard(block)
    return fully_shard(net)


WRAPS = {
    "ddp": DistributedDataParallel,
    "fsdp": lambda net: FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block})),
    "fully_shard": _fully_shard,
}
# DDP and FSDP start every rank from rank 0's weights; fully_shard expects the ranks to agree already
OWN_SEEDS = {"ddp": True, "fsdp": True, "fully_shard": False}


def train_steps(strategy: str | None, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """STEPS steps of the tiny GPT on this rank's slice of the global batch; the full parameters after them.
    strategy None: one process, the whole batch, no wrapper (the reference)."""
    net = build_model("gpt", seed=rank if strategy and OWN_SEEDS[strategy] else 0)
    model = WRAPS[strategy](net) if strategy else net
    opt = OPTIMIZERS["sgd"](model.parameters())
    for step in range(STEPS):
        loss_of("gpt", model, batch("gpt", step, GLOBAL_BATCH, rank, world_size, "cpu")).backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return get_full_state_dict(model)


def train_every_strategy() -> dict:
    """One rank's work: each strategy in turn, and which agent started this rank (None without torchrun)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    return {"node": os.environ.get("GROUP_RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
            "params": {name: train_steps(name, rank, n) for name in WRAPS}}


def main(out: str) -> None:
    """What each node runs: under torchrun `launch` joins the group torchrun set up, elsewhere it starts
    the ranks itself. Every rank gets every rank's result; rank 0 writes them."""
    results = launch(train_every_strategy, world_size=int(os.environ.get("WORLD_SIZE", WORLD_SIZE)),
                     device="cpu")
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(results, out)


# -- the test: two agents on this machine --------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_agents(out, logs) -> list[subprocess.Popen]:
    endpoint, job = f"127.0.0.1:{_free_port()}", f"minifsdp-test-{uuid.uuid4().hex[:12]}"
    # the ranks import this checkout's minifsdp, whatever the environment's path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    agents = []
    for log in logs:
        with open(log, "w") as f:  # the child keeps its own descriptor
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                 "--nproc-per-node", str(RANKS_PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", job, "--max-restarts", "0", "--monitor-interval", "0.1",
                 os.path.abspath(__file__), str(out)],
                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    return agents


def _wait_for(agents, logs, timeout: float) -> None:
    """Wait for every agent; past the timeout (or if this process is interrupted) kill those still running,
    each with its ranks (its own session), and say which had not finished. A failed agent shows its log's end."""
    deadline = time.monotonic() + timeout
    try:
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        late = [i for i, a in enumerate(agents) if a.poll() is None]
        for i in late:
            os.killpg(agents[i].pid, signal.SIGKILL)
            agents[i].wait()
    tails = "\n".join(f"--- agent {i} (exit code {a.returncode}) ---\n{open(logs[i]).read()[-3000:]}"
                      for i, a in enumerate(agents) if i in late or a.returncode != 0)
    if late:
        pytest.fail(f"agent(s) {late} of {len(agents)} had not finished after {timeout} s: killed\n{tails}")
    assert not tails, f"an agent failed\n{tails}"


@pytest.fixture(scope="module")
def across_nodes(tmp_path_factory):
    """Every rank's results from the two agents' run."""
    if importlib.util.find_spec("torch.distributed.run") is None or not torch.distributed.is_available():
        pytest.skip("torchrun (torch.distributed.run) cannot start here: this torch has no torch.distributed")
    tmp = tmp_path_factory.mktemp("multinode")
    logs = [tmp / f"agent{i}.log" for i in range(NODES)]
    _wait_for(_start_agents(tmp / "results.pt", logs), logs, AGENTS_TIMEOUT)
    return torch.load(tmp / "results.pt")


@pytest.fixture(scope="module")
def one_process():
    return train_steps(None, 0, 1)


def test_the_ranks_came_from_two_agents(across_nodes):
    assert len(across_nodes) == WORLD_SIZE
    assert sorted(int(r["node"]) for r in across_nodes) == [n for n in range(NODES) for _ in range(RANKS_PER_NODE)]
    assert [int(r["local_rank"]) for r in across_nodes] == list(range(RANKS_PER_NODE)) * NODES


@pytest.mark.parametrize("strategy", list(WRAPS))
def test_across_nodes_as_one_process(across_nodes, one_process, strategy):
    for rank in across_nodes:  # each computed its full parameters itself
        assert max_abs_diff(rank["params"][strategy], across_nodes[0]["params"][strategy]) == 0.0
    assert max_abs_diff(across_nodes[0]["params"][strategy], one_process) <= SINGLE_PROCESS_ATOL


@pytest.mark.parametrize("strategy", ["fsdp", "fully_shard"])
def test_sharded_across_nodes_is_bit_exact_with_ddp(across_nodes, strategy):
    assert max_abs_diff(across_nodes[0]["params"][strategy], across_nodes[0]["params"]["ddp"]) == 0.0


def test_two_nodes_compute_the_bits_of_one(across_nodes):
    one_node = launch(train_every_strategy, world_size=WORLD_SIZE, device="cpu")
    for strategy in WRAPS:
        assert max_abs_diff(across_nodes[0]["params"][strategy], one_node[0]["params"][strategy]) == 0.0


if __name__ == "__main__":
    main(sys.argv[1])
