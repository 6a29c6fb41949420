"""Chapter 2's picture of one rank's memory (chapters/diagrams/ch02_memory.py): the bytes it draws per
parameter for each model state are the analytic model's, in fp32 and in mixed precision."""

import importlib.util
import sys
from pathlib import Path

from minifsdp.measure import analytic

DIAGRAMS = Path(__file__).resolve().parents[1] / "chapters" / "diagrams"


def _module():
    """chapters/diagrams/ch02_memory.py, found as make_diagrams.py finds it (its folder on the path)."""
    spec = importlib.util.spec_from_file_location("make_diagrams", DIAGRAMS / "make_diagrams.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return sys.modules["ch02_memory"]


def test_the_model_states_drawn_are_the_analytic_model_s():
    drawn = _module().MODEL_STATES
    expected = {"fp32": analytic.FP32_ADAM, "mixed": analytic.mixed_precision_adam(12)}
    for key, per_param in expected.items():
        sums = {state: sum(n for _, n, s in drawn[key] if s == state) for state in ("params", "grads", "optim")}
        assert (sums["params"], sums["grads"], sums["optim"]) == tuple(per_param), key
        for label, n, _ in drawn[key]:
            assert label.endswith(f" {n}"), f"{label!r} is drawn {n} bytes wide"
