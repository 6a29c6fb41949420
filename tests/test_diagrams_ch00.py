"""The home page (chapters/index.md) and its picture of the road (chapters/diagrams/ch00_landing.py).

The road draws, under each data-parallel stop, the model states one rank keeps: they are the analytic
model's. The page's road reaches every chapter, and the manual it moved out of the way (chapters/setup.md)
comes right after it in the site's navigation.
"""

import re
from pathlib import Path

from minifsdp.measure import analytic

from diagram_modules import diagram_module

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = REPO / "chapters"


def _road():
    return diagram_module("ch00_landing")


def test_the_road_draws_the_analytic_model_states():
    road = _road()
    psi, n = 1_000_000, road.ROAD_N
    for stage, per_param in road.ROAD_STATES.items():
        model = analytic.model_state_bytes(psi, n, stage, analytic.FP32_ADAM)
        assert tuple(model[k] / psi for k in ("params", "grads", "optim")) == per_param, stage
    drawn = {stop[3] for stop in road.ROAD if isinstance(stop[3], int)}
    assert drawn == {0, 1, 2, 3}, "every ZeRO stage is a stop of the road"


def test_the_road_reaches_every_chapter():
    page = (CHAPTERS / "index.md").read_text(encoding="utf-8")
    road = page.split("## The road through the chapters", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\((\d\d_[a-z0-9_]+\.md)\)", road))
    chapters = {p.name for p in CHAPTERS.glob("[0-9][0-9]_*.md")}
    assert chapters <= linked, f"the road does not link {sorted(chapters - linked)}"


def test_setup_follows_the_home_page_in_the_nav():
    nav = re.findall(r"^\s+- \"[^\"]+\": (\S+)$", (REPO / "mkdocs.yml").read_text(encoding="utf-8"), re.MULTILINE)
    assert nav[:2] == ["index.md", "setup.md"], nav[:3]
