"""What chapter 7's and chapter 8's newer diagrams (chapters/diagrams/ch07_overlap.py, ch08_precision.py) show
is what the package and torch do: the step model's claims, the buffers alive at once against the memory model
chapter 7 measures, a Block's modules in their flat order, the float formats against torch.finfo, and the
names the pictures use. (tests/test_diagrams.py checks that the SVGs are what the script draws, and legible.)
"""

import re
from pathlib import Path

import pytest
import torch

from diagram_modules import diagram_module

REPO = Path(__file__).resolve().parents[1]
ch07 = diagram_module("ch07_overlap")
ch08 = diagram_module("ch08_precision")


# -- chapter 7 ----------------------------------------------------------------------------------------------------
def _waits(compute):
    return [(a, b) for kind, _, a, b in compute if kind == "wait"]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_model_keeps_one_collective_at_a_time_in_issue_order(overlap):
    compute, channel = ch07.step_timeline(overlap)
    for (_, _, _, end), (_, _, start, _) in zip(channel, channel[1:]):
        assert start >= end, "the channel carries one collective at a time"
    for (_, _, _, end), (_, _, start, _) in zip(compute, compute[1:]):
        assert start == end, "the compute lane has no gap: the rank computes or waits"
    units = ch07.STEP_UNITS
    assert [u for k, u, *_ in compute if k == "F"] == list(units)
    assert [u for k, u, *_ in compute if k == "B"] == list(units)[::-1]
    assert sorted(k for k, *_ in channel) == ["AG"] * 2 * len(units) + ["RS"] * len(units)


def test_without_overlap_the_rank_waits_through_every_collective():
    compute, channel = ch07.step_timeline(False)
    assert ch07.exposed(compute) == sum(b - a for *_, a, b in channel)


def test_with_overlap_only_the_first_all_gather_of_each_pass_and_the_last_reduce_scatter_are_exposed():
    plain, _ = ch07.step_timeline(False)
    compute, channel = ch07.step_timeline(True)
    assert ch07.exposed(compute) == 3 * ch07.T_COLLECTIVE < ch07.exposed(plain)
    assert compute[-1][3] < plain[-1][3], "the step is shorter"
    # every all-gather but the first of each pass travels while a unit computes
    computing = [(a, b) for kind, _, a, b in compute if kind in ("F", "B")]
    hidden = [(k, u) for k, u, a, b in channel if k == "AG" and any(ca <= a and b <= cb for ca, cb in computing)]
    assert len(hidden) == 2 * len(ch07.STEP_UNITS) - 2


def test_the_buffers_alive_at_once_are_chapter_7_s_memory_model():
    from minifsdp.reports.overlap import expected_full_units
    assert ch07.most_alive(ch07.buffers_alive(True)) == expected_full_units("forward_prefetch", "forward") == 2
    assert ch07.most_alive(ch07.buffers_alive(False)) == expected_full_units("no prefetch", "forward") == 1


def test_the_limiter_the_picture_describes_allows_two_frees():
    from minifsdp.fsdp.prefetch import AllGatherLimiter
    assert AllGatherLimiter().limit == 2


def test_a_block_s_views_are_its_modules_in_flat_order():
    from minifsdp.models import TinyGPT
    names = [n.split(".", 2)[2].rsplit(".", 1)[0] for n, _ in TinyGPT().named_parameters() if n.startswith("blocks.0.")]
    assert tuple(dict.fromkeys(names)) == ch07.BUFFER_VIEWS


# -- chapter 8 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ch08.FORMATS))
def test_the_formats_are_torch_s(name):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    exponent, significand, largest, spacing = ch08.FORMATS[name]
    info = torch.finfo(dtype)
    assert 1 + exponent + significand == info.bits
    assert info.eps == 2.0 ** -significand
    assert float(largest) == pytest.approx(info.max, rel=0.01)
    assert float(spacing.split("≈")[1]) == pytest.approx(info.eps, rel=0.02)


def test_the_update_is_lost_in_bf16_and_kept_in_fp32():
    weight, update = ch08.LOST_UPDATE
    assert (torch.tensor(weight, dtype=torch.bfloat16) + update).item() == weight
    assert (torch.tensor(weight, dtype=torch.float32) + update).item() != weight
    assert update < torch.finfo(torch.bfloat16).eps / 2, "closer to 1.0 than to its next bf16 neighbour"


# -- the names the pictures use -----------------------------------------------------------------------------------
NAMES_USED = {  # file: names the chapter 7 and 8 diagrams take from it
    "minifsdp/fsdp/streams.py": ["record_stream"],
    "minifsdp/fsdp/flat_param.py": ["unshard", "reshard", "_full"],
    "minifsdp/fsdp/prefetch.py": ["limit_all_gathers", "forward_prefetch"],
    "minifsdp/measure/meter.py": ["num_alloc_retries"],
    "minifsdp/fsdp/precision.py": ["grad_for_optimizer", "reduce_dtype"],
    "minifsdp/mixed_precision.py": ["unscale_", "found_inf", "MAX"],
    "minifsdp/distributed/comm.py": ["copy_to", "host_to_device", "device_to_host"],
}
DRAWN = "".join((REPO / "chapters" / "figures" / "diagrams" / f"{f.__name__}.svg").read_text(encoding="utf-8")
                for f in ch07.DIAGRAMS + ch08.DIAGRAMS)


@pytest.mark.parametrize("path", sorted(NAMES_USED))
def test_the_names_drawn_are_the_code_s(path):
    source = (REPO / path).read_text(encoding="utf-8")
    for name in NAMES_USED[path]:
        assert re.search(rf"\b{re.escape(name)}\b", source), f"{path} has no {name}"
        assert name in DRAWN, f"no chapter 7 or 8 diagram uses {name} any more: drop it from this list"


def test_the_allocator_s_names_are_torch_s():
    for name in ("memory_allocated", "memory_reserved", "memory_stats"):
        assert hasattr(torch.cuda, name)
    assert "memory_allocated" in DRAWN and "memory_reserved" in DRAWN
