"""Chapter 2's picture of one rank's memory (chapters/diagrams/ch02_memory.py): the bytes it draws per
parameter for each model state are the analytic model's, in fp32 and in mixed precision."""


from minifsdp.measure import analytic

from diagram_modules import diagram_module


def _module():
    return diagram_module("ch02_memory")


def test_the_model_states_drawn_are_the_analytic_model_s():
    drawn = _module().MODEL_STATES
    expected = {"fp32": analytic.FP32_ADAM, "mixed": analytic.mixed_precision_adam(12)}
    for key, per_param in expected.items():
        sums = {state: sum(n for _, n, s in drawn[key] if s == state) for state in ("params", "grads", "optim")}
        assert (sums["params"], sums["grads"], sums["optim"]) == tuple(per_param), key
        for label, n, _ in drawn[key]:
            assert label.endswith(f" {n}"), f"{label!r} is drawn {n} bytes wide"
