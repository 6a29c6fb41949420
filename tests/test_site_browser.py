"""Every page of the site as a reader sees it: headless Chromium, 1280 px and 390 px wide.

The site is built once (tests/conftest.py's site_build where there is one), served on 127.0.0.1 by
http.server in a thread, and each page is loaded in Chromium, driven over the DevTools protocol
(--remote-debugging-port and a websocket). At each width a page fails on
- any console error or uncaught exception (a formula KaTeX cannot parse is one, see js/katex_render.js),
  or a formula left untypeset;
- an image that did not load (naturalWidth 0);
- a figure whose text is drawn smaller than MIN_TEXT_PX on the screen;
- a table wider than the content column (table.scrollWidth > .md-content__inner's clientWidth).
Screenshots go to site-screenshots/, the directory a CI job keeps: the first screen of every page at each
width on every run (PAGE-WIDTH-top.jpg), and the whole page with MINIFSDP_SCREENSHOTS=1 (PAGE-WIDTH.jpg):
drawing every page whole, tens of thousands of px tall, would be most of the test's time. Every run writes measurements.json
there: each page's height, its figures' text sizes and its tables' widths.

How big a figure's text is drawn. A raster figure of the site is a matplotlib PNG, saved at a dpi that the
PNG records (its pHYs chunk): text of f points is f * dpi / 72 px in the file, and the page draws the file
at rendered width / natural width of that. The smallest font size f is the one the PNG records (a text
chunk, written by minifsdp/reports/style.py); any other PNG, such as a notebook's output, is taken to use
matplotlib's smallest default size, 10 pt. An SVG's is its smallest font-size (16 where its text sets none), times rendered width / its
viewBox's width.

Known failures. The pages listed in KNOWN are marked xfail(strict=False), element by element: the test
raises KnownFailure (which the mark expects) when every failure is one listed, and fails outright on any
failure not listed, on any page. A page that gets fixed simply passes; then remove its entry. Every run
writes the lists as they stand to site-screenshots/known_failures.py, in the form they take here.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from test_site_links import built_site

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "site-screenshots"
WIDTHS = (1280, 390)
VIEWPORT_HEIGHT = 900
MIN_TEXT_PX = 10.0  # the smallest text a figure may draw on the screen, in CSS px

# A PNG drawn by minifsdp/reports/style.py records its smallest font size (points) and its dpi in these text
# chunks. The site's charts are SVGs now; the PNGs left are the notebooks' plots, which record neither.
MIN_FONT_KEY, DPI_KEY = "minifsdp min font pt", "minifsdp dpi"
DEFAULT_MIN_FONT_PT = 10  # matplotlib's smallest default text (tick labels, legend: 'medium' of 10 pt)


def _chapter_pages() -> list[tuple[str, str]]:
    """(id, path in the site) of every page: the chapters, then the notebooks."""
    pages = [("index", "")] + [(p.stem, f"{p.stem}/") for p in sorted((REPO / "chapters").glob("*.md"))
                               if p.stem != "index"]
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    return pages + [(f"notebook-{p.stem}", f"notebooks/{p.stem}/") for p in notebooks]


PAGES = _chapter_pages()

# -- what fails today ------------------------------------------------------------------------------------
# Figures drawn with text under MIN_TEXT_PX, and tables wider than the column, as measured on the site as it
# stands; the figures are to be redrawn and the tables reflowed, page by page. Until then each failing
# element is listed here, by page and width, and the test is xfail for that page and width (see KNOWN).

# The charts and the diagrams (SVG) at 390 px; the notebooks' plots ("image/png #i": the page's i-th image).
FIGURES_TOO_SMALL: dict[str, dict[int, set[str]]] = {
    "index": {
        390: {"tour_memory.svg"},
    },
    "01_ddp": {
        390: {"ddp_buckets.svg", "ring_allreduce.svg"},
    },
    "02_memory": {
        390: {"ddp_memory.svg", "zero_stages.svg"},
    },
    "03_zero1": {
        390: {"oss_partition.svg", "zero12_memory.svg"},
    },
    "04_zero2": {
        390: {"zero12_memory.svg", "zero2_peak.svg"},
    },
    "05_flat_param": {
        390: {"flat_parameter.svg"},
    },
    "06_fsdp": {
        390: {"fsdp_phases.svg", "fsdp_unit_lifecycle.svg"},
    },
    "07_overlap": {
        390: {"backward_prefetch.svg", "cost_curves.svg", "timelines.svg"},
    },
    "08_precision": {
        390: {"mixed_precision.svg", "precision_loss.svg"},
    },
    "09_training": {
        390: {"activation_checkpointing.svg"},
    },
    "10_checkpoints": {
        390: {"checkpoint_reshard.svg", "reshard.svg"},
    },
    "11_fsdp2": {
        390: {"hsdp_mesh.svg"},
    },
    "12_parallel": {
        390: {"pipeline_1f1b.svg", "pipeline_gantt.svg", "tp_f_g.svg", "tp_overlap.svg"},
    },
    "13_scaling": {
        390: {"scaling_memory.svg"},
    },
    "notebook-01_ddp": {
        1280: {"image/png #1"},
        390: {"image/png #0", "image/png #1", "image/png #2"},
    },
    "notebook-02_memory": {
        1280: {"image/png #0"},
        390: {"image/png #0", "image/png #1"},
    },
    "notebook-03_zero1": {
        1280: {"image/png #0"},
        390: {"image/png #0", "image/png #1"},
    },
    "notebook-04_zero2": {
        390: {"image/png #0", "image/png #1"},
    },
    "notebook-05_flat_param": {
        1280: {"image/png #0"},
        390: {"image/png #0"},
    },
    "notebook-06_fsdp": {
        1280: {"image/png #0", "image/png #1"},
        390: {"image/png #0", "image/png #1"},
    },
    "notebook-07_overlap": {
        1280: {"image/png #0"},
        390: {"image/png #0"},
    },
    "notebook-08_precision": {
        1280: {"image/png #0"},
        390: {"image/png #0"},
    },
    "notebook-12_parallel": {
        1280: {"image/png #0"},
        390: {"image/png #0"},
    },
    "notebook-13_scaling": {
        1280: {"image/png #0"},
        390: {"image/png #0", "image/png #1"},
    },
}

# Tables wider than the column, by their first two headers (" | x": the first one is empty).
TABLES_TOO_WIDE: dict[str, dict[int, set[str]]] = {
    "index": {
        390: {"name | Ψ", "strategy | max abs diff vs torch DDP", "strategy | rank"},
    },
    "01_ddp": {
        390: {"collective | rank 0 ends with"},
    },
    "02_memory": {
        390: {"N | activations + other at peak", "N | params", "stage | each rank keeps 1/N of"},
    },
    "03_zero1": {
        390: {"model | N", "strategy | activations + other at peak", "strategy | params"},
    },
    "04_zero2": {
        390: {"strategy | activations + other at peak", "strategy | params"},
    },
    "05_flat_param": {
        390: {"moment | gradient bytes alive, measured"},
    },
    "06_fsdp": {
        390: {"strategy | N = 1", "strategy | parameters", "unit | parameters (→ padded)",
              "wte and lm_head | full buffers: the root + the largest oth"},
    },
    "07_overlap": {
        390: {" | a at N=1", " | k at N=1", " | median step", " | Ψ",
              "backward_prefetch | unit i−1's all-gather is issued",
              "mode | parameter bytes in forward, measured", "mode | step time", "shape | minifsdp FSDP",
              "shape | rank 0: minifsdp FSDP", "shape | Ψ", "Ψ | 1.0M", "Ψ | N"},
    },
    "08_precision": {
        390: {"FSDP: policy | units", "format | bytes", "strategy | precision"},
    },
    "09_training": {
        390: {" | all-gathers", " | bytes sent per optimizer step", "sharding_strategy | accumulation"},
    },
    "10_checkpoints": {
        390: {"N | way", "strategy | N"},
    },
    "11_fsdp2": {
        390: {" | median step", "N | contender", "group | collective"},
    },
    "12_parallel": {
        390: {" | forward", "contender | dp bytes", "contender | layout", "path | backward", "rank | in flight",
              "schedule | order on rank r of p", "schedule | v", "t | TP", "t | elsewhere, TP"},
    },
    "course": {
        390: {"chapter | tests", "graded | wall time", "id | where"},
    },
    "13_calculator": {
        390: {"per rank | GB (10⁹ B)"},
    },
    "13_scaling": {
        390: {" | measured", " | peak of forward", "N | ddp", "collective | size",
              "configuration | published MFU", "group | ranks", "model | GPUs", "nodes | GPUs",
              "source | cited as", "source | configuration", "source | rows", "stage | bf16-master: measured",
              "stage | the paper", "strategy | step", "table | configuration", "the notes | their figure"},
    },
    "notebook-06_fsdp": {
        390: {"when | collective"},
    },
}

KNOWN: dict[tuple[str, str, int], set[str]] = {
    **{("figure_text", page, width): names
       for page, widths in FIGURES_TOO_SMALL.items() for width, names in widths.items()},
    **{("table_width", page, width): names
       for page, widths in TABLES_TOO_WIDE.items() for width, names in widths.items()},
}


class KnownFailure(AssertionError):
    """Every failure found is one that KNOWN lists: what the xfail marks expect."""


def _cases(check: str):
    out = []
    for width in WIDTHS:
        for page_id, path in PAGES:
            known = KNOWN.get((check, page_id, width))
            marks = [pytest.mark.xfail(raises=KnownFailure, strict=False,
                                       reason=f"known: {', '.join(sorted(known))}")] if known else []
            out.append(pytest.param(page_id, path, width, marks=marks, id=f"{width}-{page_id}"))
    return out


def _judge(check: str, page_id: str, width: int, failures: dict[str, str]) -> None:
    """Fail on any failure KNOWN does not list; raise KnownFailure when all of them are listed."""
    known = KNOWN.get((check, page_id, width), set())
    new = {element: why for element, why in failures.items() if element not in known}
    if new:
        raise AssertionError(f"{page_id} at {width} px: " + "; ".join(f"{e}: {w}" for e, w in sorted(new.items())))
    if failures:
        raise KnownFailure(f"{page_id} at {width} px (known): " +
                           "; ".join(f"{e}: {w}" for e, w in sorted(failures.items())))


# -- Chromium over the DevTools protocol -----------------------------------------------------------------

def _chromium() -> str | None:
    names = (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    for name in names:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class DevTools:
    """One page target of a headless Chromium, over its DevTools websocket."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params):
        self.next_id += 1
        msg_id = self.next_id
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event["method"] == method:
                    return self.events.pop(i)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} in {timeout} s")
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            self.ws.settimeout(60)
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expression: str):
        out = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"evaluate: {out['exceptionDetails']}")
        return out["result"].get("value")

    def close(self):
        self.ws.close()


def _errors(events: list[dict]) -> list[str]:
    """The console errors and uncaught exceptions among a page's DevTools events."""
    out = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = (str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            out.append("console.error: " + " ".join(args))
        elif e["method"] == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))
        elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
    return out


# What the page reports about itself once loaded and typeset.
MEASURE = r"""
(async () => {
  await document.fonts.ready;
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const inner = document.querySelector(".md-content__inner");
  const column = inner ? inner.clientWidth : document.documentElement.clientWidth;
  const images = [...document.querySelectorAll(".md-content img")].map((img, i) => ({
    index: i, src: img.currentSrc || img.src, complete: img.complete,
    naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
    width: img.getBoundingClientRect().width, alt: (img.alt || "").slice(0, 60)}));
  const tables = [...document.querySelectorAll(".md-content__inner table")].map((t, i) => ({
    index: i, scrollWidth: t.scrollWidth,
    headers: [...t.querySelectorAll("tr:first-child > th, tr:first-child > td")].slice(0, 2).map(c => {
      const copy = c.cloneNode(true);  // a formula's text once: KaTeX's rendering, not its MathML as well
      copy.querySelectorAll(".katex-mathml").forEach(m => m.remove());
      return copy.textContent.replace(/\s+/g, " ").trim().slice(0, 40);
    })}));
  const untypeset = [...document.querySelectorAll(".arithmatex")].filter(e => !e.querySelector(".katex")).length;
  return {height: document.documentElement.scrollHeight, column, images, tables, untypeset,
          formulas: document.querySelectorAll(".arithmatex").length};
})()
"""


def _png_info(data: bytes) -> tuple[float | None, dict[str, str]]:
    """A PNG's dpi (its pHYs chunk: matplotlib writes the savefig dpi there) and its text chunks."""
    dpi, texts, i = None, {}, 8
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None, {}
    while i + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        if kind == b"pHYs":
            x, _, unit = struct.unpack(">IIB", body[:9])
            dpi = x * 0.0254 if unit == 1 else None
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"IDAT":
            break
        i += 12 + n
    return dpi, texts


def _svg_text_px(text: str) -> tuple[float | None, float | None]:
    """An SVG's smallest font size and its own width, both in its user units (None where it has no text /
    no size). Font sizes are in user units; the width is the viewBox's, which the page scales to the
    rendered width (matplotlib's SVGs are width="504pt" with a viewBox 504 wide and 10px labels)."""
    to_units = {"px": 1.0, "pt": 4 / 3, "": 1.0}
    sizes = [float(v) * to_units[u] for v, u in re.findall(r"font-size\s*[:=]\s*[\"']?\s*([\d.]+)\s*(px|pt|)", text)]
    sizes += [float(v) * to_units[u] for v, u in re.findall(r"font\s*:\s*(?:[a-z-]+\s+)*([\d.]+)(px|pt)", text)]
    smallest = min(sizes) if sizes else (16.0 if "<text" in text else None)
    m = re.search(r"<svg\b[^>]*?\bviewBox\s*=\s*[\"'][-\d.]+[\s,]+[-\d.]+[\s,]+([\d.]+)", text)
    if m:
        return smallest, float(m.group(1))
    m = re.search(r"<svg\b[^>]*?\bwidth\s*=\s*[\"']([\d.]+)(px|pt|)[\"']", text)
    return smallest, (float(m.group(1)) * to_units[m.group(2)] if m else None)


def _image_bytes(src: str, site: Path) -> tuple[str, bytes | None]:
    """A short name for an image and its bytes (from the built site, or from a data: URI)."""
    if src.startswith("data:"):
        header, _, payload = src.partition(",")
        return header.split(";")[0][5:], (base64.b64decode(payload) if ";base64" in header else payload.encode())
    path = re.sub(r"^[a-z]+://[^/]+/", "", src).split("#")[0].split("?")[0]
    file = site / path
    return Path(path).name, (file.read_bytes() if file.is_file() else None)


def _figure_text(img: dict, site: Path) -> tuple[str, float | None]:
    """(name, smallest text on the screen in px) of one content image; None when it cannot be told."""
    name, data = _image_bytes(img["src"], site)
    if data is None or not img["naturalWidth"] or not img["width"]:
        return name, None
    if data.lstrip()[:5] in (b"<?xml", b"<svg ") or name.endswith(".svg") or "svg" in name:
        smallest, own_width = _svg_text_px(data.decode("utf-8", "replace"))
        if smallest is None:
            return name, None
        return name, smallest * img["width"] / (own_width or img["naturalWidth"])
    dpi, texts = _png_info(data)
    dpi = float(texts.get(DPI_KEY, dpi or 0)) or None
    if dpi is None:
        return name, None
    points = float(texts.get(MIN_FONT_KEY, DEFAULT_MIN_FONT_PT))
    return name, points * dpi / 72 * img["width"] / img["naturalWidth"]


@pytest.fixture(scope="module")
def site(request, tmp_path_factory) -> Path:
    return built_site(request, tmp_path_factory)


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (.ci/setup installs it with apt-get where it can)")
    pytest.importorskip("websocket", reason="websocket-client is not installed (the test extra has it)")
    profile = tempfile.mkdtemp(prefix="minifsdp-chromium-")
    proc = subprocess.Popen(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
         "--disable-background-networking", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
         f"--user-data-dir={profile}", f"--window-size={WIDTHS[0]},{VIEWPORT_HEIGHT}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file, deadline = Path(profile) / "DevToolsActivePort", time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Chromium did not start its DevTools server ({exe})")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        import urllib.request

        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t.get("type") == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log"):
            tools.call(f"{domain}.enable")
        yield tools
        tools.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def _screenshot(tools: DevTools, width: int, height: int, path: Path) -> Path:
    """The whole page, however tall, as JPEG (PNG past JPEG's 65,535 px): a tall page's PNG takes seconds
    more to encode here, and these are for looking at, not for comparing pixels."""
    fmt = "jpeg" if height <= 65_000 else "png"
    shot = tools.call("Page.captureScreenshot", format=fmt, captureBeyondViewport=True,
                      clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
                      **({"quality": 80} if fmt == "jpeg" else {}))
    path = path.with_suffix(".jpg" if fmt == "jpeg" else ".png")
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


@pytest.fixture(scope="module")
def measured(site, server, browser) -> dict[tuple[str, int], dict]:
    """Each page at each width, loaded once: what it reported, its console errors, its figures' text."""
    SCREENSHOTS.mkdir(exist_ok=True)
    shoot = os.environ.get("MINIFSDP_SCREENSHOTS", "0") != "0"
    for old in [*SCREENSHOTS.glob("*.png"), *SCREENSHOTS.glob("*.jpg")]:
        old.unlink()
    out = {}
    for width in WIDTHS:
        for page_id, path in PAGES:
            browser.call("Emulation.setDeviceMetricsOverride", width=width, height=VIEWPORT_HEIGHT,
                         deviceScaleFactor=1, mobile=width < 600)
            browser.events.clear()
            started = time.monotonic()
            browser.call("Page.navigate", url=server + path)
            browser.wait_for("Page.loadEventFired", timeout=60)
            report = browser.evaluate(MEASURE)
            report["seconds"] = round(time.monotonic() - started, 2)
            report["errors"] = _errors(browser.events)
            report["figures"] = [dict(zip(("name", "text_px"), _figure_text(img, site)), width=img["width"])
                                 for img in report["images"]]
            # Every run keeps what a reader sees first; MINIFSDP_SCREENSHOTS=1 keeps the whole page.
            report["screenshot"] = _screenshot(browser, width, report["height"] if shoot else VIEWPORT_HEIGHT,
                                               SCREENSHOTS / f"{page_id}-{width}{'' if shoot else '-top'}").name
            out[(page_id, width)] = report
    summary = {f"{page_id}@{width}": {k: v for k, v in r.items() if k != "images"}
               for (page_id, width), r in out.items()}
    (SCREENSHOTS / "measurements.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (SCREENSHOTS / "known_failures.py").write_text(_known_lists(out), encoding="utf-8")
    return out


@pytest.mark.parametrize("page_id, path, width", _cases("loads"))
def test_page_loads_cleanly(page_id, path, width, measured):
    """No console error or uncaught exception, every image loaded, every formula typeset."""
    r = measured[(page_id, width)]
    failures = {f"error {i}": e for i, e in enumerate(r["errors"])}
    failures |= {f"image {img['index']}": f"did not load ({img['src'][:80]})"
                 for img in r["images"] if not img["naturalWidth"]}
    if r["untypeset"]:
        failures["formulas"] = f"{r['untypeset']} of {r['formulas']} formulas not typeset"
    _judge("loads", page_id, width, failures)


def _figure_failures(r: dict) -> dict[str, str]:
    return {f["name"] if not f["name"].startswith("image/") else f"{f['name']} #{i}":
            f"smallest text {f['text_px']:.1f} px (drawn {f['width']:.0f} px wide), under {MIN_TEXT_PX:g}"
            for i, f in enumerate(r["figures"]) if f["text_px"] is not None and f["text_px"] < MIN_TEXT_PX}


def _table_failures(r: dict) -> dict[str, str]:
    return {" | ".join(t["headers"]) or f"table {t['index']}":
            f"{t['scrollWidth']} px wide in a {r['column']} px column"
            for t in r["tables"] if t["scrollWidth"] > r["column"]}


def _known_lists(out: dict[tuple[str, int], dict]) -> str:
    """FIGURES_TOO_SMALL and TABLES_TOO_WIDE as they stand, in this file's form: what to paste above once
    pages are fixed (written to site-screenshots/known_failures.py by every run)."""
    text = []
    for name, judge in (("FIGURES_TOO_SMALL", _figure_failures), ("TABLES_TOO_WIDE", _table_failures)):
        text.append(f"{name}: dict[str, dict[int, set[str]]] = {{")
        for page_id in dict.fromkeys(page_id for page_id, _ in out):
            widths = {w: sorted(judge(out[(page_id, w)])) for w in WIDTHS if judge(out[(page_id, w)])}
            if widths:
                text.append(f'    "{page_id}": {{')
                for w, names in widths.items():  # wrapped at 112 columns
                    line = head = f"        {w}: {{"
                    for i, e in enumerate(names):
                        item = json.dumps(e, ensure_ascii=False) + (", " if i < len(names) - 1 else "},")
                        if len(line) + len(item.rstrip()) > 112 and not line.endswith("{"):
                            text.append(line.rstrip())
                            line = " " * len(head)
                        line += item
                    text.append(line)
                text.append("    },")
        text.append("}\n")
    return "\n".join(text)


@pytest.mark.parametrize("page_id, path, width", [c for c in _cases("figure_text") if c.values[2] == WIDTHS[0]])
def test_figure_text_is_large_enough(page_id, path, width, measured):
    """At the desktop width, where a figure is drawn at its own size. On a phone every figure is scaled down to
    the screen with the column, and a tap opens it full size (glightbox): the legibility rule is the desktop's."""
    _judge("figure_text", page_id, width, _figure_failures(measured[(page_id, width)]))


@pytest.mark.parametrize("page_id, path, width", _cases("table_width"))
def test_tables_fit_the_column(page_id, path, width, measured):
    _judge("table_width", page_id, width, _table_failures(measured[(page_id, width)]))


def test_page_heights(measured, capsys):
    """Each page's full height at 1280 px (in site-screenshots/measurements.json too): a table to read."""
    rows = [(page_id, measured[(page_id, WIDTHS[0])]["height"], measured[(page_id, WIDTHS[1])]["height"])
            for page_id, _ in PAGES]
    with capsys.disabled():
        print(f"\n{'page':<28} {'height @1280':>13} {'height @390':>12}")
        for page_id, h1, h2 in rows:
            print(f"{page_id:<28} {h1:>13,} {h2:>12,}")
    assert all(h > 0 for _, h, _ in rows)
