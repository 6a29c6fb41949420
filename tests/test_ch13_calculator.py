"""Chapter 13: the memory calculator. analytic.estimate on numbers worked by hand and from the papers, and
chapters/js/memory_calculator.js, the same formulas for the browser, equal to it over a grid of inputs."""

import dataclasses
import itertools
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from minifsdp.measure import analytic
from minifsdp.measure.analytic import PRESETS, ModelShape, estimate, gpt_shape, param_count
from test_site_links import built_site

REPO = Path(__file__).resolve().parents[1]
JS = REPO / "chapters" / "js" / "memory_calculator.js"
PAGE = REPO / "chapters" / "13_calculator.md"
GB = 1e9

# --- the Python, by hand ---------------------------------------------------------------------------------


def test_zero_paper_7_5b_on_64_ranks():
    """The ZeRO paper's Figure 1: Ψ = 7.5B, N = 64, K = 12: 120 / 31.4 / 16.6 / 1.9 GB of model states."""
    psi, n = 7_500_000_000, 64
    printed = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    exact = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n, "zero3": 16 * psi / n}
    for strategy in printed:
        r = estimate(psi=psi, world_size=n, strategy=strategy, precision="bf16")
        assert r["total"] == exact[strategy]
        assert round(r["total"] / GB, 1) == printed[strategy]
        assert r["units"] == r["activations"] == 0  # no shape: model states only


def test_ddp_fp32_is_16_psi_and_the_bytes_sent():
    psi, n = 1_000_000, 8
    r = estimate(psi=psi, world_size=n, strategy="ddp", precision="fp32")
    assert (r["params"], r["grads"], r["optim"], r["total"]) == (4 * psi, 4 * psi, 8 * psi, 16 * psi)
    assert r["sent"] == 2 * psi * 4 * (n - 1) / n
    z3 = estimate(psi=psi, world_size=n, strategy="zero3", precision="fp32")
    assert z3["total"] == 16 * psi / n and z3["sent"] == 1.5 * r["sent"]
    assert estimate(psi=psi, world_size=n, strategy="ddp", precision="bf16")["sent"] == r["sent"] / 2


def test_param_count_gpt_and_the_llama_presets():
    """GPT: 12·L·h² + V·h. The presets plus their RMSNorm weights, (2L + 1)·h, are the published counts."""
    assert param_count(gpt_shape(layers=48, hidden=1600, heads=25, vocab=50257)) == 12 * 48 * 1600**2 + 50257 * 1600
    published = {"1B": 1_235_814_400, "7B": 6_738_415_616, "13B": 13_015_864_320, "70B": 68_976_648_192}
    for name, shape in PRESETS.items():
        assert param_count(shape) + (2 * shape.layers + 1) * shape.hidden == published[name], name


def test_activations_and_units_by_hand():
    tiny = ModelShape(layers=3, hidden=4, heads=2, vocab=10, ffn=16, kv_heads=2, gated=False, tied=True)
    s, b = 2, 1
    block = s * b * 4 * (34 + 5 * 2 * s / 4)  # 312 bytes in 16 bits
    logits = 4 * s * b * 10
    act = lambda ck, precision="bf16": estimate(tiny, seq=s, micro_batch=b, world_size=1, strategy="ddp",
                                                precision=precision, checkpointing=ck)["activations"]
    assert act("none") == 3 * block + logits
    assert act("selective") == 3 * s * b * 4 * 34 + logits
    assert act("full") == 3 * 2 * s * b * 4 + block + logits
    assert act("none", "fp32") == 2 * 3 * block + logits
    layer = 4 * 4096**2 + 3 * 4096 * 11008  # Llama 2 7B's block
    r = estimate(PRESETS["7B"], world_size=8, strategy="fsdp", precision="bf16")
    assert r["units"] == 2 * layer * 2
    assert estimate(PRESETS["7B"], world_size=8, strategy="fsdp", precision="fp32", prefetch=False)["units"] == layer * 4
    assert estimate(PRESETS["7B"], world_size=1, strategy="fsdp")["units"] == 0  # one rank: nothing to gather
    assert estimate(PRESETS["7B"], world_size=8, strategy="zero2")["units"] == 0
    assert r["total"] == r["params"] + r["grads"] + r["optim"] + r["units"] + r["activations"]


def test_hsdp_between_ddp_and_fsdp():
    psi, n = 6_000_000_000, 64
    hsdp = lambda s: estimate(psi=psi, world_size=n, strategy="hsdp", shard_size=s)
    assert hsdp(n)["total"] == estimate(psi=psi, world_size=n, strategy="fsdp")["total"]
    assert hsdp(n)["sent"] == estimate(psi=psi, world_size=n, strategy="fsdp")["sent"]
    assert hsdp(1)["total"] == estimate(psi=psi, world_size=n, strategy="ddp")["total"]
    assert hsdp(1)["sent"] == estimate(psi=psi, world_size=n, strategy="ddp")["sent"]
    r = hsdp(8)  # 8 groups of 8: FSDP in the group, an all-reduce of the shard across the 8 groups
    assert r["total"] == 16 * psi / 8
    assert r["sent_within"] == 3 * psi * 2 * 7 / 8 and r["sent_across"] == 2 * (psi / 8) * 2 * 7 / 8
    with pytest.raises(ValueError, match="divide"):
        hsdp(3)
    with pytest.raises(ValueError, match="strategy"):
        estimate(psi=psi, strategy="zero4")


# --- the JavaScript, against the Python ------------------------------------------------------------------

NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed: the JavaScript calculator cannot run")

RUN_JS = """
const m = require(process.argv[1]);
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = cases.map((c) => { try { return m.estimate(c); } catch (err) { return { error: err.message }; } });
process.stdout.write(JSON.stringify({ results: out, presets: m.PRESETS }));
"""


def grid() -> list[dict]:
    models = [{"shape": dataclasses.asdict(s), "psi": None} for s in PRESETS.values()] + [
        {"shape": dataclasses.asdict(gpt_shape(48, 1600, 25, 50257)), "psi": None},       # GPT-2 XL's shape
        {"shape": dataclasses.asdict(PRESETS["7B"]), "psi": 7_000_000_000},              # Ψ given, the shape kept
        {"shape": None, "psi": 7_500_000_000},                                           # Ψ alone
    ]
    cases = []
    for model, n, precision, ck, prefetch, (seq, mb) in itertools.product(
            models, (1, 8, 64, 1024), ("fp32", "bf16"), ("none", "selective", "full"), (True, False),
            ((2048, 1), (4096, 2))):
        strategies = [(s, None) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")]
        strategies += [("hsdp", g) for g in (1, 2, 8, 64, 3) if g <= n] + [("hsdp", None)]  # 3 divides none: an error
        for strategy, group in strategies:
            cases.append(dict(model, seq=seq, micro_batch=mb, world_size=n, strategy=strategy, shard_size=group,
                              precision=precision, checkpointing=ck, prefetch=prefetch))
    return cases


def python_estimate(case: dict) -> dict:
    kwargs = dict(case, shape=ModelShape(**case["shape"]) if case["shape"] else None)
    try:
        return estimate(**kwargs)
    except ValueError as err:
        return {"error": str(err)}


@needs_node
def test_javascript_equals_python_over_the_grid():
    cases = grid()
    out = subprocess.run([NODE, "-e", RUN_JS, str(JS)], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=60, check=True)
    answer = json.loads(out.stdout)
    assert answer["presets"] == {k: dataclasses.asdict(v) for k, v in PRESETS.items()}
    worst, errors = 0.0, 0
    for case, js in zip(cases, answer["results"], strict=True):
        py = python_estimate(case)
        if "error" in py:
            errors += 1
            assert "error" in js and re.search(r"must divide", js["error"]), (case, js)
            continue
        assert set(js) == set(py), case
        for key, value in py.items():
            assert math.isclose(js[key], value, rel_tol=1e-9, abs_tol=0.0), (case, key, js[key], value)
            if value:
                worst = max(worst, abs(js[key] - value) / abs(value))
    assert len(cases) > 5000 and 0 < errors < len(cases) // 10
    print(f"{len(cases)} cases ({errors} refused alike by both), largest relative difference {worst:.3g}")


@needs_node
def test_javascript_loads_without_a_document():
    """Under node the file exports the formulas and touches no DOM."""
    out = subprocess.run([NODE, "-e", "const m = require(process.argv[1]); console.log(Object.keys(m).sort().join(' '))",
                          str(JS)], capture_output=True, text=True, timeout=30, check=True)
    assert {"estimate", "modelStateBytes", "commBytesPerStep", "activationBytes", "paramCount"} <= set(out.stdout.split())


# --- the page ---------------------------------------------------------------------------------------------


def test_the_site_loads_the_calculator_on_its_page():
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^extra_javascript:\s*\n\s+- js/memory_calculator\.js\s*$", config, re.MULTILINE)
    assert re.search(r"^extra_css:\s*\n\s+- css/calculator\.css\s*$", config, re.MULTILINE)
    assert re.search(r'^\s+- "Memory calculator": 13_calculator\.md$', config, re.MULTILINE)
    assert (REPO / "chapters" / "css" / "calculator.css").is_file()
    page = PAGE.read_text(encoding="utf-8")
    assert '<div id="memory-calculator"></div>' in page and "<noscript>" in page
    head = JS.read_text(encoding="utf-8")[:1500]
    assert "minifsdp/measure/analytic.py" in head and "estimate" in head


def test_python_formulas_named_on_the_page_exist():
    for name in ("estimate", "param_count", "layer_params", "activation_bytes", "model_state_bytes",
                 "comm_bytes_per_step"):
        assert callable(getattr(analytic, name)), name


# --- in a browser (only where chromium is installed) -----------------------------------------------------

BROWSER = next((b for b in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if b), None)


def dump_dom(url: str) -> tuple[str, str]:
    """The page's DOM after its scripts ran, and the browser's log, with the console's messages in it."""
    out = subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                          "--v=0", "--virtual-time-budget=3000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, "\n".join(line for line in out.stderr.splitlines() if ":CONSOLE" in line)


def shown_total(dom: str) -> str:
    match = re.search(r"total per rank</td><td>([\d.]+)</td>", dom)
    assert match, "the calculator drew no table"
    return match.group(1)


@pytest.mark.skipif(BROWSER is None, reason="no chromium: the page is not run in a browser (apt-get install chromium)")
def test_the_page_runs_in_a_browser(request, tmp_path_factory, tmp_path):
    """The built page (the run's one build of the site) mounts the calculator with no console error, and
    what it shows is estimate()'s."""
    site = built_site(request, tmp_path_factory)
    dom, log = dump_dom((site / "13_calculator" / "index.html").as_uri())
    assert "Uncaught" not in log and "mc-error" not in dom, log[-2000:]
    assert dom.count('data-mounted="1"') == 1
    default = estimate(PRESETS["7B"], seq=4096, micro_batch=1, world_size=64, strategy="fsdp", precision="bf16",
                       checkpointing="selective")
    assert shown_total(dom) == f"{default['total'] / GB:.2f}"

    # the form answers its inputs: 70B, HSDP in groups of 8 over 1024 ranks, fp32, full checkpointing
    page = tmp_path / "form.html"
    page.write_text(f"""<html><body><div id="memory-calculator"></div>
<script src="{JS.as_uri()}"></script>
<script>document.addEventListener("DOMContentLoaded", () => {{  // after the calculator's own listener
  const set = (name, value) => {{ document.querySelector(`[name=${{name}}]`).value = value; }};
  set("preset", "70B");
  document.querySelector("[name=preset]").dispatchEvent(new Event("change", {{ bubbles: true }}));
  set("strategy", "hsdp"); set("shard_size", "8"); set("world_size", "1024");
  set("precision", "fp32"); set("checkpointing", "full");
  document.querySelector("form").dispatchEvent(new Event("input", {{ bubbles: true }}));
}});</script></body></html>""", encoding="utf-8")
    dom, log = dump_dom(page.as_uri())
    assert "Uncaught" not in log, log[-2000:]
    chosen = estimate(PRESETS["70B"], seq=4096, micro_batch=1, world_size=1024, strategy="hsdp", shard_size=8,
                      precision="fp32", checkpointing="full")
    assert shown_total(dom) == f"{chosen['total'] / GB:.2f}"
    assert f"{chosen['sent_across'] / GB:.2f} GB across the groups" in dom


def test_the_calculator_draws_in_the_figures_palette():
    """One palette on the site: the calculator's bars are coloured as every chart and diagram colours the model
    states (minifsdp/reports/style.py's CATEGORY: parameters blue, gradients orange, optimizer state green,
    the rest grey), in both of material's schemes (no scheme sets other colours), FSDP's unsharded units in
    the parameters' blue and its pale."""
    from minifsdp.reports import style

    css = (REPO / "chapters" / "css" / "calculator.css").read_text(encoding="utf-8")
    colours = dict(re.findall(r"--mc-([a-z-]+):\s*(#[0-9a-fA-F]{6})", css))
    assert {k: colours[k].lower() for k in ("params", "grads", "optim", "activations")} == {
        "params": style.CATEGORY["params"], "grads": style.CATEGORY["grads"], "optim": style.CATEGORY["optim"],
        "activations": style.CATEGORY["other"]}
    assert colours["units"].lower() == style.CATEGORY["params"]
    assert colours["units-stripe"].lower() == style.pale(style.CATEGORY["params"], 0.5)
    assert len(re.findall(r"--mc-[a-z-]+:\s*#", css)) == len(colours), "a colour is set twice (a scheme of its own?)"


WIDGETS = REPO / "chapters" / "widgets"


@pytest.mark.skipif(BROWSER is None, reason="no chromium: the widgets are not run in a browser (apt-get install chromium)")
def test_the_compact_widgets_show_estimate_s_numbers(tmp_path):
    """The chapters' compact widgets (chapters/widgets/*.html), mounted by the calculator's script: chapter 2's
    bars are the four ZeRO stages' model states for the Ψ and N it starts on; chapter 6's are FSDP's at each
    world size, its unsharded units with them."""
    page = tmp_path / "widgets.html"
    page.write_text('<html><head><meta charset="utf-8"></head><body>'
                    + (WIDGETS / "memory_zero.html").read_text(encoding="utf-8")
                    + (WIDGETS / "memory_fsdp.html").read_text(encoding="utf-8")
                    + f'<script src="{JS.as_uri()}"></script></body></html>', encoding="utf-8")
    dom, log = dump_dom(page.as_uri())
    assert "Uncaught" not in log and "mc-error" not in dom, log[-2000:]
    assert dom.count('data-mounted="1"') == 2
    values = re.findall(r'class="mc-bar-value">([\d.]+) GB', dom)
    states = lambda r: r["params"] + r["grads"] + r["optim"]
    zero = [estimate(psi=7.5e9, world_size=64, strategy=s, precision="bf16") for s in ("ddp", "zero1", "zero2", "fsdp")]
    fsdp = [estimate(PRESETS["70B"], world_size=n, strategy="fsdp", precision="bf16") for n in (8, 32, 128, 512, 1024)]
    assert values == [f"{states(r) / GB:.2f}" for r in zero] + [f"{(states(r) + r['units']) / GB:.2f}" for r in fsdp]
    assert f"{fsdp[-1]['units'] / GB:.2f} GB are the unsharded units" in dom
    assert f"{zero[-1]['sent'] / GB:.2f} GB sent per rank per step (1.50 × DDP's)" in dom
