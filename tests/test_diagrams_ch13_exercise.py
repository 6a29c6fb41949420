"""What exercise 13.2's figure (chapters/figures/diagrams/simulate_contract.svg) shows is what the package computes.

The figure's program (ch13_scaling.STREAMS_PROGRAM) is built from program.py's Compute, Collective and Wait and
run through the real `simulate`: every span the figure draws is the one simulate gives, and the step is its step.
The counter-example is the same program with every collective on one channel, a design with one queue for every
channel, run through the same `simulate`.
"""

from dataclasses import replace

import pytest

from diagram_modules import diagram_module

ch13 = diagram_module("ch13_scaling")


@pytest.fixture(scope="module")
def program():
    pytest.importorskip("torch")
    from minifsdp.measure.step_time.program import Collective, Compute, Wait

    steps = []
    for op in ch13.STREAMS_PROGRAM:
        if op[0] == "compute":
            steps.append(Compute(op[1], op[2]))
        elif op[0] == "collective":
            steps.append(Collective(op[1], op[2], op[3], op[4], after=op[5]))
        else:
            assert op[0] == "wait", op
            steps.append(Wait(op[1]))
    return steps


def _spans(sim):
    return {(s.lane, s.name): (s.start, s.end) for s in sim.spans}


def test_the_drawn_spans_are_simulates(program):
    from minifsdp.measure.step_time.program import simulate

    sim = simulate(program)
    assert _spans(sim) == ch13.STREAMS_SPANS
    assert sim.step == ch13.STREAMS_STEPS[0]
    # what the figure marks: x and r start when compute A ends, w when x ends (FIFO on c1, though w is shorter),
    # y when w (its `after`) ends although c2 is idle earlier; the wait for w ends with w, before y ends
    spans = ch13.STREAMS_SPANS
    assert spans[("all_gather", "x")][0] == spans[("all_reduce", "r")][0] == spans[("compute", "A")][1]
    assert spans[("reduce_scatter", "w")][0] == spans[("all_gather", "x")][1]
    assert spans[("all_reduce", "y")][0] == spans[("reduce_scatter", "w")][1] > spans[("all_reduce", "r")][1]
    assert spans[("wait", "w")][1] == spans[("reduce_scatter", "w")][1] < spans[("all_reduce", "y")][1]
    assert ("wait", "y") not in spans


def test_the_counter_example_is_one_queue_for_every_channel(program):
    from minifsdp.measure.step_time.program import Collective, simulate

    one_queue = [replace(op, channel="one") if isinstance(op, Collective) else op for op in program]
    sim = simulate(one_queue)
    assert _spans(sim) == ch13.STREAMS_ONE_QUEUE_SPANS
    assert sim.step == ch13.STREAMS_STEPS[1] > ch13.STREAMS_STEPS[0]
