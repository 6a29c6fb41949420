"""Chapter 5: the flat gradient is a concatenation -- two flat sizes of gradient alive at once, measured.

The views of a unit are cut by one split of its flat parameter, and autograd's backward of a split copies the
per-parameter gradients (zeros for the gaps) into a new flat gradient. The meter, on one unit of odd sizes at
two ranks (minifsdp/reports/grad_buffers.py, `python -m minifsdp grad-buffers`), must find exactly what
analytic.fsdp_gradient_bytes counts. The rest of the "other" bytes are the loss and its gradient, 4 bytes
each: the unit is fed a single row, so the activations are gone by the time the flat gradient is made.
"""

import pytest

from minifsdp import launch
from minifsdp.measure import analytic
from minifsdp.reports.grad_buffers import measure

SCALARS = 8  # the loss and its gradient, one fp32 each


@pytest.fixture(scope="module")
def res():
    return launch(measure, world_size=2, device="cpu")[0]


@pytest.mark.mechanism  # measured memory
@pytest.mark.exercise("5.3")
def test_the_split_backward_holds_two_flat_gradients(res):
    ours = res["ours"]
    # 60x50 + 50 + 50x30 + 30 = 4,580 parameters, each started on a 16-element boundary: 4,608 with the gaps
    assert (ours["numel"], ours["padded"]) == (4580, 4608), (
        f"the unit holds {ours['numel']:,} elements, padded to {ours['padded']:,}: expected 4,580 and 4,608 "
        f"(chapter 5's layout)")
    model = analytic.fsdp_gradient_bytes(ours["padded"], world_size=2)
    assert model["concat"] == 2 * 4 * 4608, f"the model counts {model['concat']:,} B, expected two flat gradients"
    assert ours["concat"] == model["concat"] + SCALARS, (
        f"backward held {ours['concat']:,} B at the concatenation, expected two flat gradients, "
        f"{model['concat'] + SCALARS:,} B (exercise 5.3): are the views cut by one split of the flat buffer? "
        f"A view per slice makes a zero-filled flat gradient for each slice")


@pytest.mark.mechanism  # measured memory
@pytest.mark.exercise("5.2")
def test_gloo_allocates_an_input_sized_buffer_and_the_shard_is_what_stays(res):
    ours = res["ours"]
    model = analytic.fsdp_gradient_bytes(ours["padded"], world_size=2)
    assert ours["reduce_scatter"] == model["reduce_scatter"] + SCALARS, (  # in place, plus gloo's own buffer
        f"the reduce-scatter's peak was {ours['reduce_scatter']:,} B, expected {model['reduce_scatter'] + SCALARS:,} B,"
        f" the flat gradient and gloo's buffer of its size (exercise 5.2): does the result land in this rank's own "
        f"chunk of the flat gradient, or in a tensor (or a copy) of your own?")
    assert ours["kept"] == model["kept"] == 4 * 4608 / 2, (
        f"a rank kept {ours['kept']:,} B of gradient after the reduce-scatter, expected its shard, "
        f"{model['kept']:,} B (exercise 5.2): is the flat gradient freed, and the shard a tensor of its own?")
    assert analytic.fsdp_gradient_bytes(4608, 2, backend_buffer=False)["reduce_scatter"] == 4 * 4608, (
        "without the backend's buffer, the model's reduce-scatter should hold one flat gradient")


def test_torch_fsdp1_holds_the_same_two_flat_gradients_beside_its_full_parameters(res):
    theirs = res["torch"]
    flat = 4 * theirs["padded"]  # packed end to end: no gaps, padded to a multiple of N only
    assert theirs["padded"] == 4580
    assert theirs["peak"] == theirs["shard"] + flat + 2 * flat + SCALARS
