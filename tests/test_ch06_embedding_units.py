"""Chapter 6: an untied embedding and output head, in the root or as units of their own, measured.

The root holds its full parameters from its forward to the end of its backward, so left there the two
vocabulary-sized matrices are unsharded all through the step. As units of their own they are gathered only
while they compute. `python -m minifsdp embedding-units` (minifsdp/reports/embedding_units.py) measures it;
here the meter's "unsharded" peak must be the model's to the byte, and the bytes sent must grow by exactly
the second all-gather of each.
"""

import pytest

from minifsdp import launch
from minifsdp.reports.embedding_units import embedding_units, unsharded_model

N = 2


@pytest.fixture(scope="module")
def res():
    return launch(embedding_units, world_size=N, device="cpu")[0]


@pytest.mark.mechanism  # measured memory and all-gathers
@pytest.mark.exercise("6.1", "6.2")
def test_the_unsharded_bytes_alive_at_once_are_the_root_and_one_unit(res):
    for m in res.values():
        assert m["forward"] == m["backward"] == unsharded_model(m["units"])


@pytest.mark.mechanism  # measured memory and all-gathers
@pytest.mark.exercise("6.1", "6.2")
def test_units_of_their_own_hold_less_and_send_each_one_all_gather_more(res):
    root, own = res["in the root"], res["units of their own"]
    embed, head = own["units"]["wte"], own["units"]["lm_head"]
    # left in the root, both matrices are held with the largest block; as units, only one of them at a time
    assert root["units"]["(root)"] == own["units"]["(root)"] + embed + head
    block = own["units"]["blocks.0"]
    assert root["forward"] - own["forward"] == embed + head + block - max(embed, head, block)
    assert own["peak"] < root["peak"]
    # each is all-gathered twice (forward, backward) instead of once with the root
    assert own["all_gathers"] - root["all_gathers"] == 4
    assert own["bytes"] - root["bytes"] == (embed + head) * (N - 1) / N
