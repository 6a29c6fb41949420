"""bench/sweep.py in its smallest version: every contender runs at N = 1 and 2 on a tiny GPT, the costs it
reports are sane, and its tables and figure are made. A smoke test: nothing here is timed."""

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benches import each other by name

import sweep  # noqa: E402  (the ranks import it too: they start with this process's sys.path)

# 2 layers of width 128, 8 tokens per rank: Ψ ≈ 431k, and the model states (16Ψ ≈ 6.9 MB under DDP) outweigh
# the activations many times over, so sharding must lower the peak per rank at N = 2.
SIZE, WORLD_SIZES = "2x128", [1, 2]
SHARDED = ("oss", "sdp", "fsdp", "zero", "fsdp1", "fsdp2")


@pytest.fixture(scope="module")
def result():
    return sweep.sweep(list(sweep.CONTENDERS), [SIZE], WORLD_SIZES, steps=1, warmup=0, batch=1, seq=8,
                       log=io.StringIO())


def cases(result):
    return {c["n"]: c for c in result["cases"]}


def test_every_contender_ran_at_every_world_size(result):
    assert sorted(cases(result)) == WORLD_SIZES
    for c in result["cases"]:
        assert c["how"] == "all together" and c["skipped"] == []
        assert set(c["times"]) == set(c["peaks"]) == set(sweep.CONTENDERS), c["n"]
        assert all(t > 0 for t in c["times"].values())


def test_every_peak_holds_at_least_its_model_states(result):
    for c in result["cases"]:
        for name, peak in c["peaks"].items():
            floor = sweep.model_states(name, c["psi"], c["n"])
            assert peak >= floor, f"{name} at N={c['n']}: peak {peak} B below its model states {floor:.0f} B"


def test_sharding_lowers_the_peak_per_rank(result):
    at = cases(result)
    ddp = min(at[2]["peaks"]["ddp"], at[2]["peaks"]["torch_ddp"])
    for name in SHARDED:
        assert at[2]["peaks"][name] < ddp, f"{name} at N=2 holds as much as DDP"
        assert at[2]["peaks"][name] < at[1]["peaks"][name], f"{name}'s peak did not fall from N=1 to N=2"
    # DDP replicates everything: its peak per rank does not shrink with N
    assert at[2]["peaks"]["ddp"] >= 0.95 * at[1]["peaks"]["ddp"]


def test_tables_and_figure(result, tmp_path):
    text = sweep.markdown(result)
    for label, _ in sweep.CONTENDERS.values():
        assert label in text
    assert "minifsdp FSDP / torch FSDP2" in text and "peak ∝ N^b" in text
    assert "| — " not in text.split("**minifsdp / torch**")[0]  # nothing left out of the cost tables
    path = tmp_path / "curves.png"
    sweep.plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_slope_of_a_power_law():
    points = [(p, 3.0 * p ** 0.7) for p in (1e6, 1e7, 1e8, 1e9)]
    assert sweep.slope(points) == pytest.approx(0.7)
    assert sweep.slope(points[:1]) is None


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_plan_keeps_to_the_budget(n):
    names, budget = list(sweep.CONTENDERS), 18e9
    for size in sweep.SIZES:
        psi = sweep.count(sweep.config_of(size, 64))
        groups, how, skipped = sweep.plan(names, psi, n, budget)
        assert sorted([name for g in groups for name in g] + skipped) == sorted(names)  # each once
        assert all(sweep.estimate(g, psi, n) <= budget for g in groups), (size, how)
        assert all(sweep.estimate([name], psi, n) > budget for name in skipped)
    assert sweep.plan(names, 10**6, n, budget)[1] == "all together"
