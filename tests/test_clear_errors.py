"""Bad input gets an error that names the problem, at construction -- not a confusing failure later.

Each case was a raw AttributeError, a silent misbehaviour, or a failure deep inside a collective before.
"""

import re

import pytest
import torch
import torch.nn as nn

from minifsdp import FSDP, OSS, DistributedDataParallel, FlatOSS, launch
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
