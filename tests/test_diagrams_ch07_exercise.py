"""What exercises 7.1 and 7.2's contract figure (prefetch_next_unit, chapters/diagrams/ch07_overlap.py) shows is
what the package does on the tests' own models (tests/test_ch07_overlap.py's OutOfOrder and Reordered, each
Linear a unit, in the mode those tests prefetch with): the module tree's order and the orders the root records,
the all-gathers a step issues with the package's "next unit", and those of the two wrong designs the figure
draws -- "next" read from the module tree (7.1), and the recorded next unit prefetched even when its backward
has begun (7.2). Each wrong design is put in place inside the rank, for that run only.
"""

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402

from minifsdp import comm, launch  # noqa: E402
from minifsdp.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from minifsdp.fsdp import ModuleWrapPolicy  # noqa: E402
from minifsdp.fsdp.prefetch import PrefetchingUnit  # noqa: E402
from minifsdp.reports.overlap import MODES  # noqa: E402
from minifsdp.train import OPTIMIZERS  # noqa: E402
from test_ch07_overlap import OutOfOrder, Reordered  # noqa: E402  the models the graded tests use

from diagram_modules import diagram_module  # noqa: E402

ch07 = diagram_module("ch07_overlap")
MODE = MODES["forward_prefetch + BACKWARD_PRE"]  # as test_ch07_overlap's dynamic_order


def _names(units):
    return tuple(u.unit_name for u in units)


def _next_in_the_module_tree(self):
    """7.1's wrong design: the unit after this one in root.units()."""
    if not self.root_state.order.recorded:
        return None
    tree = self.root_state.root.units()
    i = tree.index(self)
    return tree[i + 1] if i + 1 < len(tree) else None


def _next_even_if_begun(self):
    """7.2's wrong design: the unit after this one in the recorded backward order, whatever its state."""
    order = self.root_state.order
    units = order.order["backward"]
    if order.recorded and self in units[:-1]:
        return units[units.index(self) + 1]
    return None


def _steps(model, steps, inputs):
    """The all-gathers of each step's forward and backward, their units in issue order."""
    opt = OPTIMIZERS["sgd"](model.parameters())
    gathered = []
    for i in range(steps):
        with comm.counting(record=True) as forward:
            loss = model(*inputs(i))
        with comm.counting(record=True) as backward:
            loss.backward()
        opt.step()
        opt.zero_grad()
        gathered.append(tuple(tuple(e.tag.split(" ", 1)[1] for e in c.events if e.kind == "all_gather")
                              for c in (forward, backward)))
    return gathered


def _with(method, design, run):
    """run() with PrefetchingUnit's `method` replaced by `design` (None: the package's own)."""
    own = getattr(PrefetchingUnit, method)
    if design is not None:
        setattr(PrefetchingUnit, method, design)
    try:
        return run()
    finally:
        setattr(PrefetchingUnit, method, own)


def _figure_runs():
    g = torch.Generator().manual_seed(0)
    out = {}

    def out_of_order():
        model = FSDP(OutOfOrder(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **MODE)
        gathered = _steps(model, 3, lambda i: (torch.randn(4, 6, generator=g),))
        order = model.root_state.order
        return _names(model.units()), _names(order.order["forward"]), _names(order.order["backward"]), gathered

    out["tree"], out["forward"], out["backward"], out["gathered"] = out_of_order()
    out["gathered from the tree"] = _with("_next_in_forward", _next_in_the_module_tree, out_of_order)[3]

    def reordered(first_odd=False):
        model = FSDP(Reordered(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **MODE)
        gathered = _steps(model, 4, lambda i: (torch.randn(4, 6, generator=g), (i % 2 == 1) != first_odd))
        return _names(model.root_state.order.order["backward"]), gathered

    out["swap recorded"], out["swap gathered"] = reordered()
    out["swap odd recorded"], _ = reordered(first_odd=True)
    out["swap gathered, begun"] = _with("_next_in_backward", _next_even_if_begun, reordered)[1]
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_figure_runs, world_size=1, device="cpu")[0]


def test_out_of_order_is_listed_in_one_order_and_run_in_another(runs):
    assert runs["tree"] == ch07.NEXT_TREE
    assert runs["forward"] == ch07.NEXT_FORWARD
    assert runs["backward"] == ch07.NEXT_BACKWARD
    assert ch07.NEXT_TREE != ch07.NEXT_FORWARD, "the model is there to list its units out of run order"


def test_forward_all_gathers_with_the_next_unit_and_with_the_module_tree_s(runs):
    right, wrong = ch07.NEXT_FORWARD_GATHERS
    assert runs["gathered"][0][0] == runs["gathered from the tree"][0][0] == right, (
        "the first step cannot prefetch: both designs gather each unit as it runs")
    assert [forward for forward, _ in runs["gathered"][1:]] == [right, right]
    assert [forward for forward, _ in runs["gathered from the tree"][1:]] == [wrong, wrong]
    assert right == ch07.NEXT_FORWARD[1:], "the root has no parameters of its own"
    assert sorted(set(wrong)) == sorted(right) and ch07._twice(wrong) == {4, 5}


def test_a_swapping_model_s_backward_gathers_each_unit_once_unless_a_begun_unit_is_prefetched(runs):
    assert runs["swap recorded"] == ch07.SWAP_RECORDED
    assert runs["swap odd recorded"] == ch07.SWAP_ODD
    right, wrong = ch07.SWAP_GATHERS
    assert [backward for _, backward in runs["swap gathered"][1:]] == [right] * 3
    assert [backward for _, backward in runs["swap gathered, begun"][1::2]] == [wrong, wrong], "the odd steps"
    assert [backward for _, backward in runs["swap gathered, begun"][2::2]] == [right], "an even step runs as recorded"
    assert ch07._twice(right) == set() and [wrong[i] for i in ch07._twice(wrong)] == ["b"]
