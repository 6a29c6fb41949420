"""Chapter 12's report (minifsdp/reports/parallel/, `python -m minifsdp parallel`) at tiny sizes: its tables
hold what the ranks measured, and those numbers are the formulas' (the chapter's own tests prove the mechanisms;
this only checks that the report measures and prints them). A smoke test: times are printed, never checked.
Model states: 16 bytes per parameter a rank holds, and 4 per tensor for AdamW's step counters.

Tolerances: bytes, parameter counts, saved activations and micro-batches in flight are exact (integers). The
bubble, with forwards made to last 20 ms and backwards 40 ms, within 0.1 of the formula (a loose bound: the
pipeline tests hold it to 0.05 with longer delays). The compositions' losses within 1e-5 of DDP's after 3 AdamW
steps (the tolerance of tests/test_ch12_composition.py). The overlap of the input gradient's all-reduce with the
weight-gradient matmul: the order of events on the timeline, not their durations (the report itself raises if the two
paths' gradients differ by a bit)."""

import pytest

from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.reports import parallel as report
from minifsdp.reports.parallel import compare, overlap, pp, tp

TINY = GPTConfig(n_layer=4, n_embd=16, n_head=4, vocab_size=32, block_size=8)


@pytest.mark.exercise("12.1", "12.3")
def test_tp_table_measures_the_formulas():
    b = 2
    rows = tp.tp_results(world_sizes=(2,), config=TINY, b=b)
    row, = rows
    assert row["param_bytes"] == row["param_theory"]
    for sp in (False, True):
        assert row[("bytes", sp)] == row[("bytes_theory", sp)] > 0
        assert row[("bytes_off_tp", sp)] == 0  # every byte on the tensor-parallel group
    assert row[("ln_region", False)] == row["ln_region_theory"] == 2 * row[("ln_region", True)]
    # everything outside the LayerNorm region is already split by t: sequence parallelism leaves it alone
    assert row[("saved", False)] - row[("ln_region", False)] == row[("saved", True)] - row[("ln_region", True)]
    table = tp.tp_table(rows, config=TINY, b=b)
    assert f"| 2 | {row['param_bytes']:,} | {row['param_theory']:,} |" in table
    assert f"| 2 | {row[('bytes', False)]:,.0f} | {row[('bytes_theory', False)]:,.0f} |" in table
    assert "| 1/2 |" in table


@pytest.mark.exercise("12.2", "12.4")
def test_pp_table_and_gantt(tmp_path):
    # Stage times long next to what each action costs beside them (a send, a recv, a wake-up): the interleaved
    # schedule halves them (v = 2), and at 20/40 ms its measured bubble ranged 0.16-0.25 against the formula's
    # 0.111 (a run in eight out of the tolerance); at 40/80 ms, 0.135-0.145 over six runs.
    p, m, batch, delays = 2, 4, 8, (0.040, 0.080)
    results = pp.pp_results(p=p, config=TINY, batch=batch, m=m, compute_time=delays)
    assert list(results) == list(pp.SCHEDULES)
    for name, r in results.items():
        if name == "interleaved 1F1B":  # a budget: exercise 12.4 allows other orders than Megatron's
            assert all(h <= b for h, b in zip(r["in_flight"], r["in_flight_predicted"])), (
                f"{name} held {r['in_flight']} pieces by rank, more than Megatron's {r['in_flight_predicted']}")
        else:
            assert r["in_flight"] == r["in_flight_predicted"], (
                f"{name} held {r['in_flight']} micro-batches by rank, expected {r['in_flight_predicted']}")
        assert r["sent"] == r["sent_formula"], name
        assert all(abs(b - r["formula"]) < 0.1 for b in r["bubbles"]), (name, r["bubbles"], r["formula"])
        assert all(a > 0 for a in r["activation_peak"]), name
    # GPipe holds every micro-batch, 1F1B at most p - r of them
    assert all(g > o for g, o in zip(results["GPipe"]["activation_peak"], results["1F1B"]["activation_peak"]))
    table = pp.pp_table(results, p=p, m=m, config=TINY, batch=batch, compute_time=delays)
    assert f"{results['GPipe']['formula']:.3f}" in table
    assert table.count("| GPipe |") == 1 and table.count('=== "GPipe"') == 1
    assert table.count("\n    | ") == len(results) * (1 + p)  # a tab per schedule: its header and a row per rank
    pp.plot_gantt(results, str(tmp_path / "gantt.png"), p=p, m=m)
    assert (tmp_path / "gantt.png").stat().st_size > 10_000


@pytest.mark.exercise("12.1", "12.2", "12.3")
def test_compare_table_every_contender_on_four_ranks():
    results = compare.compare_results(config=TINY, batch=16, steps=3)
    assert list(results) == list(compare.CONTENDERS)
    groups = {"DDP": {"dp"}, "FSDP": {"dp"}, "TP + SP": {"tp"}, "PP 1F1B": {"pp"}, "DP x TP": {"dp", "tp"},
              "PP x DP": {"dp", "pp"}}
    for name, r in results.items():
        assert {g for g, b in r["bytes"].items() if b > 0} == groups[name], name
        assert r["other_groups"] == [], name
        assert r["loss_diff"] <= 1e-5, name
        assert r["peak"] >= r["states"] > 0, name
        # 16 bytes per parameter held, and AdamW's step counter (4 bytes) per tensor it steps
        if name != "FSDP":
            assert r["states"] == r["theory_with_counters"], name
        else:  # (FSDP's flat parameters may be padded to divide by d)
            assert r["theory_with_counters"] <= r["states"] <= 1.01 * r["theory_with_counters"]
    psi = 4 * sum(p.numel() for p in TinyGPT(TINY, seed=0).parameters())
    assert results["DDP"]["bytes"]["dp"] == pytest.approx(2 * psi * 3 / 4)  # one all-reduce of the gradients
    assert results["DDP"]["time_ratio"] == 1.0
    table = compare.compare_table(results, config=TINY, batch=16, steps=3)
    assert table.count("\n| ") == 2 * (1 + len(compare.CONTENDERS))  # the memory table, then bytes and time


@pytest.mark.exercise("12.1", "12.3")
def test_overlap_timelines_and_figure(tmp_path):
    config, b = GPTConfig(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=8), 2
    results = overlap.overlap_results(config=config, b=b, reps=1)
    assert list(results) == list(overlap.PATHS)
    layers = ["lm_head", "blocks.1.fc", "blocks.1.attn.qkv", "blocks.0.fc", "blocks.0.attn.qkv"]  # backward's order
    sync, overlapped = results["synchronous"], results["async_grad_allreduce"]
    # async: each column layer's all-reduce issued before its weight-gradient matmul began, waited for after it ended
    assert overlapped["order"] == {layer: f"backward {layer} input gradient" for layer in layers}
    # synchronous: no all-reduce under any matmul; each issued after its layer's matmuls, done before the next's
    assert sync["order"] == dict.fromkeys(layers)
    matmuls = overlap.matmul_spans(sync["spans"])
    collectives = [c for c, _ in overlap.input_gradient_collectives(sync["spans"])]
    assert [layer for layer, _ in matmuls] == layers and len(collectives) == len(layers)
    for k, ((_, m), c) in enumerate(zip(matmuls, collectives)):
        assert m.end <= c.start, matmuls[k][0]
        assert k + 1 == len(matmuls) or c.end <= matmuls[k + 1][1].start, matmuls[k][0]
    for name, r in results.items():
        assert r["backward"] > r["matmuls"] > 0 and r["all_reduce"] > 0 and 0 <= r["hidden"] <= 1, name
        assert r["blocked"] > 0, name  # (each all-reduce's call, at least)
    table = overlap.overlap_table(results, config=config, b=b)
    assert table.count("\n| ") == 1 + len(overlap.PATHS)
    r = overlapped
    assert (f"| async_grad_allreduce | {r['backward'] * 1e3:.1f} ms | {r['matmuls'] * 1e3:.1f} ms | "
            f"{r['all_reduce'] * 1e3:.1f} ms | {r['blocked'] * 1e3:.1f} ms | {100 * r['hidden']:.0f}% |") in table
    overlap.plot_overlap(results, str(tmp_path / "overlap.png"))
    assert (tmp_path / "overlap.png").stat().st_size > 10_000


def test_markdown_paths(tmp_path):
    assert report._markdown_path(None, "tp", ["tp"]) is None
    assert report._markdown_path(str(tmp_path), "pp", ["tp", "pp"]) == str(tmp_path / "parallel_pp.md")
    assert report._markdown_path("out/x.md", "tp", ["tp"]) == "out/x.md"
    assert report._markdown_path("out/parallel", "compare", ["tp", "compare"]) == "out/parallel_compare.md"
    # --plot likewise, for the parts that draw
    assert report._plot_path(None, "pp", ["pp"]) is None
    assert report._plot_path("out/g.png", "overlap", ["tp", "overlap"]) == "out/g.png"
    assert report._plot_path("out/g.svg", "overlap", ["tp", "overlap"]) == "out/g.svg"
    assert report._plot_path(str(tmp_path), "overlap", ["overlap", "pp"]) == str(tmp_path / "tp_overlap.svg")
    assert report._plot_path("out/fig.png", "pp", ["overlap", "pp"]) == "out/fig_pp.png"
    assert report._plot_path("out/fig", "pp", ["overlap", "pp"]) == "out/fig_pp.svg"
