"""Chapter 3's diagrams show what the package computes (chapters/diagrams/ch03_oss.py).

- oss_when_it_pays: each optimizer's model-state bytes under DDP and OSS are the analytic model's
  (minifsdp.measure.analytic.model_state_bytes, ZeRO stages 0 and 1), and the state each optimizer keeps is
  what torch's optimizer really allocates: none for plain SGD, one buffer with momentum, two for AdamW.
- flat_oss_step: the example's layout is minifsdp.zero.flat.flat_layout's.
"""


import pytest

torch = pytest.importorskip("torch")

from minifsdp.measure import analytic  # noqa: E402
from minifsdp.zero.flat import flat_layout  # noqa: E402

from diagram_modules import diagram_module  # noqa: E402

ch03 = diagram_module("ch03_oss")

OPTIMIZERS = {"SGD(lr)": (torch.optim.SGD, {"lr": 0.1}),
              "SGD(lr, momentum=0.9)": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "AdamW(lr)": (torch.optim.AdamW, {"lr": 0.1})}


def test_model_state_bytes_are_the_analytic_model_s():
    for name, state, ddp, oss in ch03.PAYS_ROWS:
        per_param = (4, 4, state)
        assert analytic.model_state_bytes(1, ch03.PAYS_N, 0, per_param)["total"] == ddp, name
        assert analytic.model_state_bytes(1, ch03.PAYS_N, 1, per_param)["total"] == oss, name


def test_each_optimizer_keeps_the_state_drawn():
    for name, state, _, _ in ch03.PAYS_ROWS:
        cls, kw = OPTIMIZERS[name]
        weight = torch.nn.Parameter(torch.randn(64, 32))
        optimizer = cls([weight], **kw)
        weight.grad = torch.randn_like(weight)
        optimizer.step()
        kept = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.numel() == weight.numel())
        assert kept == state * weight.numel(), name


def test_flat_example_is_flat_layout():
    numels = [numel for _, numel in ch03.FLAT_PARAMS]
    assert flat_layout(numels, ch03.FLAT_N) == (ch03.FLAT_OFFSETS, ch03.FLAT_PADDED)
