"""Exercise 12.4's contract figure (pipeline_interleaved_contract, chapters/diagrams/ch12_parallel.py) shows what
the package computes: the stages each rank holds (stages_of_rank), each rank's budget of pieces in flight (the
one the chapter's report predicts), the bubble of the formula against 1F1B's, and what two wrong orders hold and
leave idle when simulate runs them on the ideal machine (a forward 1/v, a backward 2/v)."""

from fractions import Fraction

import pytest

from diagram_modules import diagram_module

pytest.importorskip("torch")

from minifsdp.measure.pipeline_timeline import bubble_formula, bubble_fractions, in_flight_peak, simulate  # noqa: E402
from minifsdp.parallel.pipeline_orders import BACKWARD, FORWARD, Action, stages_of_rank  # noqa: E402
from minifsdp.reports.parallel.pp import predicted_in_flight  # noqa: E402

ch12 = diagram_module("ch12_parallel")
P, V, M = ch12.IL_P, ch12.IL_V, ch12.IL_M


def every_forward_then_every_backward(r):
    stages = stages_of_rank(r, P, V)
    return ([Action(FORWARD, s, i) for s in stages for i in range(M)]
            + [Action(BACKWARD, s, i) for s in reversed(stages) for i in range(M)])


def one_micro_batch_at_a_time(r):
    stages = stages_of_rank(r, P, V)
    return [a for i in range(M) for a in ([Action(FORWARD, s, i) for s in stages]
                                          + [Action(BACKWARD, s, i) for s in reversed(stages)])]


WRONG = {"every forward, then every backward": every_forward_then_every_backward,
         "one micro-batch at a time": one_micro_batch_at_a_time}


def _bubble(value):
    fraction = Fraction(value).limit_denominator(100)
    assert float(fraction) == pytest.approx(value)
    return fraction.numerator, fraction.denominator


def test_stages_and_budgets_are_the_package_s():
    for r in range(P):
        assert ch12.IL_STAGES[r] == stages_of_rank(r, P, V)
        assert ch12.IL_BUDGET[r] == predicted_in_flight("interleaved 1F1B", r, P, M)
        assert ch12.IL_BUDGET[r] < V * M  # the budget binds: holding every piece breaks it
    assert ch12.IL_BUBBLE == _bubble(bubble_formula(P, M, V))
    assert ch12.IL_BUBBLE_1F1B == _bubble(bubble_formula(P, M))


def test_the_wrong_orders_hold_and_idle_what_the_figure_says():
    assert list(ch12.IL_WRONG) == list(WRONG)
    for name, make in WRONG.items():
        orders = [make(r) for r in range(P)]
        spans = simulate(orders, 1 / V, 2 / V)
        held, bubble = ch12.IL_WRONG[name]
        assert held == tuple(in_flight_peak(s) for s in spans), name
        fractions = bubble_fractions(spans)
        assert all(f == pytest.approx(fractions[0]) for f in fractions)
        assert bubble == _bubble(fractions[0]), name
    # what each breaks: the first only the budget, the second only the time
    (held, bubble), (held_2, bubble_2) = ch12.IL_WRONG.values()
    formula = Fraction(*ch12.IL_BUBBLE)
    assert all(h > ch12.IL_BUDGET[r] for r, h in enumerate(held)) and Fraction(*bubble) <= formula
    assert all(h <= ch12.IL_BUDGET[r] for r, h in enumerate(held_2)) and Fraction(*bubble_2) > formula


def test_the_bars_are_the_pieces_held_after_each_action():
    for r in range(P):
        now, held = 0, []
        for a in every_forward_then_every_backward(r):
            now += 1 if a.kind == FORWARD else -1
            held.append(now)
        assert held == ch12.IL_ALL_FORWARDS_HELD, r
