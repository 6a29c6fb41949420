"""Bad input gets an error that names the problem, at construction -- not a confusing failure later.

Each case was a raw AttributeError, a silent misbehaviour, or a failure deep inside a collective before.
"""

import re

import pytest
import torch
import torch.nn as nn

from minifsdp import FSDP, OSS, DistributedDataParallel, FlatOSS, RankFailedError, launch
from minifsdp.models import Block, TinyGPT

CASES = {
    "DDP of a string": (lambda: DistributedDataParallel("model"), TypeError, "wraps a torch.nn.Module"),
    "FSDP of None": (lambda: FSDP(None), TypeError, "wraps a torch.nn.Module"),
    "DDP of DDP": (lambda: DistributedDataParallel(DistributedDataParallel(nn.Linear(2, 2))), ValueError,
                   "already a DistributedDataParallel"),
    "DDP of FSDP": (lambda: DistributedDataParallel(FSDP(nn.Linear(2, 2))), ValueError,
                    "already a FullyShardedDataParallel"),
    "DDP of a model holding a unit": (lambda: DistributedDataParallel(nn.Sequential(FSDP(nn.Linear(2, 2)))),
                                      ValueError, "submodule '0' is already a FullyShardedDataParallel"),
    "policy as a string": (lambda: FSDP(TinyGPT(), auto_wrap_policy="Block"), TypeError,
                           "auto_wrap_policy must be a policy"),
    "policy as a set": (lambda: FSDP(TinyGPT(), auto_wrap_policy={Block}), TypeError,
                        r"ModuleWrapPolicy\(\{<class"),
    "OSS given an optimizer instance": (
        lambda: OSS(nn.Linear(2, 2).parameters(), optim=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
        TypeError, "takes the optimizer's class"),
    "FlatOSS given an optimizer instance": (
        lambda: FlatOSS(nn.Linear(2, 2).parameters(), optim=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
        TypeError, "takes the optimizer's class"),
    "bucket_cap_mb zero": (lambda: DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0), ValueError,
                           "bucket_cap_mb must be a number of megabytes > 0, got 0"),
    "bucket_cap_mb a string": (lambda: DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb="25"), ValueError,
                               "got '25'"),
    "FlatOSS bucket_cap_mb negative": (
        lambda: FlatOSS(nn.Linear(2, 2).parameters(), optim=torch.optim.SGD, bucket_cap_mb=-1, lr=1), ValueError,
        "bucket_cap_mb must be None or a number of megabytes > 0"),
}


def raised(name):
    build, _, _ = CASES[name]
    try:
        build()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        return type(e), str(e)
    return None, "nothing was raised"


def all_cases():
    return {name: raised(name) for name in CASES}


@pytest.fixture(scope="module")
def results():
    return launch(all_cases, world_size=1)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_error_names_the_problem(results, name):
    kind, message = results[name]
    _, expected_kind, pattern = CASES[name]
    assert kind is expected_kind, message
    assert re.search(pattern, message), message


class _Branch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Branch(), _Branch()

    def forward(self, x, skip_b):
        return self.a(x) if skip_b else self.b(self.a(x))


def _unit_on_some_ranks_only():
    import torch.distributed as dist

    from minifsdp.fsdp import FSDP, ModuleWrapPolicy

    model = FSDP(_TwoBranches(), auto_wrap_policy=ModuleWrapPolicy({_Branch}))
    model(torch.ones(2, 4), dist.get_rank() == 1).sum().backward()  # unit 'b' runs on rank 0 only


def test_a_unit_used_on_some_ranks_only_is_named_when_its_collective_times_out():
    with pytest.raises(RankFailedError) as failed:
        launch(_unit_on_some_ranks_only, world_size=2, timeout=3)
    message = str(failed.value)
    # the rank that fails first names its collective; the other one's, when it says so in time, follows:
    # rank 0 in unit b's all-gather, rank 1 already in unit a's reduce-scatter -- each its 8th collective
    assert "CollectiveError" in message and "some ranks only" in message
    assert "all_gather 'unshard b', collective #8" in message or "reduce_scatter 'reduce_scatter a', collective #8" in message
