"""Every page of the site as a reader sees it: headless Chromium, 1280 px and 390 px wide.

All of it runs in a process of its own, started as soon as the run is collected (tests/early.py,
site_measurements below): the site is built, served on 127.0.0.1 by http.server in a thread, and each page
is loaded in Chromium, driven over the DevTools protocol (--remote-debugging-port and a websocket); the
tests read what it measured. At each width a page fails on
- any console error or uncaught exception (a formula KaTeX cannot parse is one, see js/katex_render.js),
  or a formula left untypeset;
- an image that did not load (naturalWidth 0);
- a figure whose text is drawn smaller than MIN_TEXT_PX on the screen;
- a table wider than the content column (table.scrollWidth > .md-content__inner's clientWidth);
- a page wider than the screen, that scrolls sideways (documentElement.scrollWidth > its clientWidth).
At 1280 px, besides:
- a chapter page (index, NN_*.md) that is not a lesson's shape: its main path, folded blocks closed, taller
  than LIMITS allow, its first figure too far down, or too long a stretch without a figure (main_path;
  NOT_YET_LESSONS lists the pages not yet in shape, with their numbers);
- a listing of the public site that shows an exercise's placeholder instead of its solution. The students'
  site (MINIFSDP_SITE=student, the run's shared build of tests/conftest.py) must show only placeholders.
Screenshots go to site-screenshots/, the directory a CI job keeps: on every run, the first screen of every
page at each width (PAGE-WIDTH-top.jpg) and the whole of the pages in WHOLE_PAGES (PAGE-WIDTH.jpg); with
MINIFSDP_SCREENSHOTS=1, every page whole: drawing them all, tens of thousands of px tall, would be most of
the test's time. Every run writes measurements.json there: each page's height, its figures' text sizes and
its tables' widths.

How big a figure's text is drawn. A raster figure of the site is a matplotlib PNG, saved at a dpi that the
PNG records (its pHYs chunk): text of f points is f * dpi / 72 px in the file, and the page draws the file
at rendered width / natural width of that. The smallest font size f is the one the PNG records (a text
chunk, written by minifsdp/reports/style.py); any other PNG, such as a notebook's output, is taken to use
matplotlib's smallest default size, 10 pt. An SVG's is its smallest font-size (16 where its text sets none), times rendered width / its
viewBox's width.

Known failures. The pages listed in KNOWN (from FIGURES_TOO_SMALL, TABLES_TOO_WIDE and NOT_YET_LESSONS)
are marked xfail(strict=False), element by element: the test raises KnownFailure (which the mark expects)
when every failure is one listed, and fails outright on any failure not listed, on any page. A page that
gets fixed simply passes; then remove its entry. Every run writes the lists as they stand to
site-screenshots/known_failures.py, in the form they take here.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.util
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from early import Early
from test_site_links import SITE_TOOLS, mkdocs_build

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "site-screenshots"
# Drawn whole on every run: the home page, and the longest chapter at the desktop width (whole at 390 px it
# is 60,000 px tall, seconds to draw).
WHOLE_PAGES = {("index", 1280), ("index", 390), ("06_fsdp", 1280)}
WIDTHS = (1280, 390)
VIEWPORT_HEIGHT = 900
MIN_TEXT_PX = 13.3  # the smallest text a figure may draw on the screen: 10 pt, 13.33 CSS px (less rounding)

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

# A figure is named by its file, or "image/png #i" for a notebook's plot (the page's i-th image). None is
# listed: the notebooks draw their plots at most about 5.8 in wide, so at their 100 dpi the 1280 px layout
# shows them at their own size, 10 pt text at 13.9 px. On a phone every figure keeps its text legible
# (hooks/narrow.py), and every table fits as a stack of cards.
FIGURES_TOO_SMALL: dict[str, dict[int, set[str]]] = {}

# Tables wider than the column, by their first two headers (" | x": the first one is empty).
TABLES_TOO_WIDE: dict[str, dict[int, set[str]]] = {}

# A chapter page is a lesson: at 1280 px, its folded blocks closed and its first tabs shown (main_path), its
# main path is at most LIMITS["height"] px tall, its first figure starts within LIMITS["first_figure"] px of
# the top, and no stretch of it (top to the first figure, figure to figure, the last to the end) runs over
# LIMITS["largest_gap"] px without a figure. The chapter pages are index and the NN_*.md ones.
LIMITS = {"height": 15_000, "first_figure": 2_500, "largest_gap": 4_000}

# Chapter pages not yet in that shape, one line a page: what they measured last (main path, first figure,
# largest gap, in px; None: no figure). The test passes a page over a limit that its line shows it over, and
# fails it on any other. Once a page is within LIMITS, delete its line. `python tests/site_metrics.py` prints
# the numbers; every run of this file writes this dict as it stands to site-screenshots/known_failures.py.
NOT_YET_LESSONS: dict[str, tuple[int, int | None, int]] = {
    # page            main path  1st figure  largest gap
}


def _is_chapter(page_id: str) -> bool:
    return page_id == "index" or re.match(r"\d\d_", page_id) is not None


CHAPTERS = [(page_id, path) for page_id, path in PAGES if _is_chapter(page_id)]


def _over_limits(height: int, first_figure: int | None, largest_gap: int) -> dict[str, str]:
    """The limits a main path is over, each with why."""
    out = {}
    if height > LIMITS["height"]:
        out["height"] = f"main path {height:,} px, over {LIMITS['height']:,}"
    if first_figure is None or first_figure > LIMITS["first_figure"]:
        where = "no figure" if first_figure is None else f"first figure at {first_figure:,} px"
        out["first_figure"] = f"{where}, over {LIMITS['first_figure']:,}"
    if largest_gap > LIMITS["largest_gap"]:
        out["largest_gap"] = f"{largest_gap:,} px without a figure, over {LIMITS['largest_gap']:,}"
    return out


KNOWN: dict[tuple[str, str, int], set[str]] = {
    **{("figure_text", page, width): names
       for page, widths in FIGURES_TOO_SMALL.items() for width, names in widths.items()},
    **{("table_width", page, width): names
       for page, widths in TABLES_TOO_WIDE.items() for width, names in widths.items()},
    **{("lesson", page, WIDTHS[0]): set(_over_limits(*numbers)) for page, numbers in NOT_YET_LESSONS.items()},
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


def _chapter_cases(check: str):
    """Each chapter page at 1280 px, xfail where KNOWN lists it."""
    out = []
    for page_id, path in CHAPTERS:
        known = KNOWN.get((check, page_id, WIDTHS[0]))
        marks = [pytest.mark.xfail(raises=KnownFailure, strict=False,
                                   reason=f"known: {', '.join(sorted(known))}")] if known else []
        out.append(pytest.param(page_id, path, marks=marks, id=page_id))
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
  // code listings wider than their block: the part past the edge is read only by scrolling it sideways
  const listings = [...document.querySelectorAll(".md-content__inner pre")].map((pre, i) => [pre,
    pre.querySelector(":scope > code") || pre, i]).map(([pre, code, i]) => ({  // material scrolls the <code>
    index: i, scrollWidth: code.scrollWidth, clientWidth: code.clientWidth,
    title: ((pre.closest(".highlight") || pre).querySelector(".filename") || {}).textContent || "",
    first: (pre.textContent.split("\n").find(l => l.trim()) || "").trim().slice(0, 50),
    // a student copy's raise in place of an exercise's solution (folded or not: textContent has it either way)
    placeholder: (pre.textContent.match(/NotImplementedError\(\s*"Exercise \d+\.\d+:[^"]*"/) || [""])[0]}));
  const untypeset = [...document.querySelectorAll(".arithmatex")].filter(e => !e.querySelector(".katex")).length;
  // where each figure starts on the page, as a reader scrolls to it (folded blocks and hidden tabs are
  // closed: a figure inside one is not on the main path)
  // a figure: an image, or the bars the memory calculator draws (its page's widget and the chapters' compact
  // ones: a chart like any other, live)
  const figureTops = [...document.querySelectorAll(".md-content__inner img, .md-content__inner .mc-bars")]
    .filter(img => img.getClientRects().length && !img.closest("details:not([open])") &&
                   (!img.checkVisibility || img.checkVisibility()))
    .map(img => Math.round(img.getBoundingClientRect().top + scrollY));
  return {height: document.documentElement.scrollHeight, column, images, tables, listings, untypeset, figureTops,
          formulas: document.querySelectorAll(".arithmatex").length,
          pageScrollWidth: document.documentElement.scrollWidth,
          pageClientWidth: document.documentElement.clientWidth};
})()
"""


def main_path(r: dict) -> dict:
    """What a reader meets on the main path (folded blocks closed, first tabs shown): its height, where the
    first figure starts, how many figures it shows, and the largest stretch without one (from the top to the
    first figure, between two, or from the last to the end)."""
    tops = sorted(r["figureTops"])
    edges = [0, *tops, r["height"]]
    return {"height": r["height"], "first_figure": tops[0] if tops else None, "figures": len(tops),
            "largest_gap": max(b - a for a, b in zip(edges, edges[1:]))}


def _hook():
    """chapters/hooks/narrow.py, which reads a figure's smallest text the way this test judges it: the site
    sizes figures for phones by it, and the two must agree."""
    spec = importlib.util.spec_from_file_location("minifsdp_site_narrow", REPO / "chapters" / "hooks" / "narrow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NARROW = _hook()


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
        smallest, own_width = NARROW.svg_text(data.decode("utf-8", "replace"))
        if smallest is None:
            return name, None
        return name, smallest * img["width"] / (own_width or img["naturalWidth"])
    _, dpi, texts = NARROW.png_info(data)
    dpi = float(texts.get(DPI_KEY, dpi or 0)) or None
    if dpi is None:
        return name, None
    points = float(texts.get(MIN_FONT_KEY, DEFAULT_MIN_FONT_PT))
    return name, points * dpi / 72 * img["width"] / img["naturalWidth"]


def _missing() -> str | None:
    """Why the pages cannot be measured here, or None."""
    if _chromium() is None:
        return "Chromium is not installed (.ci/setup installs it with apt-get where it can)"
    for module, package in {"websocket": "websocket-client", **SITE_TOOLS}.items():
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (the test extra has it)"
    return None


@contextlib.contextmanager
def _serve(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _browser():
    """Headless Chromium, one page target driven over DevTools."""
    exe = _chromium()
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
                raise RuntimeError(f"Chromium did not start its DevTools server ({exe})")
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


def _measure(site: Path, server: str, browser: DevTools) -> dict[tuple[str, int], dict]:
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
            # Every run keeps what a reader sees first, and WHOLE_PAGES whole; MINIFSDP_SCREENSHOTS=1 all whole.
            whole = shoot or (page_id, width) in WHOLE_PAGES
            report["screenshot"] = _screenshot(browser, width, report["height"] if whole else VIEWPORT_HEIGHT,
                                               SCREENSHOTS / f"{page_id}-{width}{'' if whole else '-top'}").name
            out[(page_id, width)] = report
    summary = {f"{page_id}@{width}": {k: v for k, v in r.items() if k != "images"}
               for (page_id, width), r in out.items()}
    (SCREENSHOTS / "measurements.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (SCREENSHOTS / "known_failures.py").write_text(_known_lists(out), encoding="utf-8")
    return out


def site_measurements() -> dict:
    """The whole measurement, run by tests/early.py in a process of its own as soon as the run is
    collected: a build of the site, served, and every page loaded at each width. It needs nothing from
    the rest of the run, and a browser leaves a core idle much of the time (about a minute of the suite's
    time here, when the tests waited for it instead). The build is its own, not the run's shared one
    (conftest.py's site_build): it starts before any test has built that."""
    why = _missing()
    if why is not None:
        return {"skip": why}
    with tempfile.TemporaryDirectory(prefix="minifsdp-site-") as tmp:
        site = Path(tmp) / "site"
        out = mkdocs_build(site)
        if out.returncode != 0:
            raise RuntimeError(f"the site did not build:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        with _serve(site) as server, _browser() as browser:
            return {"pages": _measure(site, server, browser)}


MEASUREMENTS = Early("test_site_browser", "site_measurements")


def start_early(items) -> None:
    if any("measured" in getattr(item, "fixturenames", ()) for item in items):
        MEASUREMENTS.start()


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, int], dict]:
    result = MEASUREMENTS.result()
    if "skip" in result:
        pytest.skip(result["skip"])
    return result["pages"]


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


def _listing_failures(r: dict) -> dict[str, str]:
    return {f"listing {c['index']}: {c['title'] or c['first']}":
            f"{c['scrollWidth']} px of code in a {c['clientWidth']} px block"
            for c in r["listings"] if c["scrollWidth"] > c["clientWidth"] + 1}


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
    text.append("NOT_YET_LESSONS: dict[str, tuple[int, int | None, int]] = {")
    text.append("    # page            main path  1st figure  largest gap")
    for page_id, _ in CHAPTERS:
        if (page_id, WIDTHS[0]) not in out:
            continue
        m = main_path(out[(page_id, WIDTHS[0])])
        if _over_limits(m["height"], m["first_figure"], m["largest_gap"]):
            height, first = f"{m['height']:_},", "None," if m["first_figure"] is None else f"{m['first_figure']:_},"
            text.append(f"    {json.dumps(page_id) + ':':<17} ({height:<10} {first:<11} {m['largest_gap']:_}),")
    text.append("}\n")
    return "\n".join(text)


@pytest.mark.parametrize("page_id, path, width", _cases("figure_text"))
def test_figure_text_is_large_enough(page_id, path, width, measured):
    """At every width: on a phone a figure is kept as wide as its text needs and pans in its own frame
    (hooks/narrow.py, css/narrow.css), rather than shrinking with the column."""
    _judge("figure_text", page_id, width, _figure_failures(measured[(page_id, width)]))


@pytest.mark.parametrize("page_id, path, width", _cases("page_width"))
def test_page_does_not_scroll_sideways(page_id, path, width, measured):
    """The page itself is never wider than the screen: a wide figure or table pans inside its own frame."""
    r = measured[(page_id, width)]
    failures = {}
    if r["pageScrollWidth"] > r["pageClientWidth"] + 1:
        failures["page"] = f"{r['pageScrollWidth']} px wide on a {r['pageClientWidth']} px screen"
    _judge("page_width", page_id, width, failures)


@pytest.mark.parametrize("page_id, path, width", _cases("table_width"))
def test_tables_fit_the_column(page_id, path, width, measured):
    _judge("table_width", page_id, width, _table_failures(measured[(page_id, width)]))


@pytest.mark.parametrize("page_id, path", [c for c in PAGES if not c[0].startswith("notebook-")],
                         ids=[c[0] for c in PAGES if not c[0].startswith("notebook-")])
def test_listings_fit_the_column_on_a_desktop(page_id, path, measured):
    """At 1280 px every listing of a chapter shows its lines whole (tests/test_docs.py holds the source to 80
    columns; this checks that 80 columns do fit the column as drawn). On a phone no listing can: there a
    listing pans in its own frame, and the page does not (test_page_does_not_scroll_sideways). A notebook's
    code cells are the notebook's, as a reader running it sees them."""
    _judge("listing_width", page_id, WIDTHS[0], _listing_failures(measured[(page_id, WIDTHS[0])]))


@pytest.mark.parametrize("page_id, path", _chapter_cases("lesson"))
def test_chapter_page_is_a_lesson(page_id, path, measured):
    """At 1280 px, folded blocks closed: the main path within LIMITS["height"], a figure within the first
    LIMITS["first_figure"] px, and no stretch over LIMITS["largest_gap"] px without one."""
    m = main_path(measured[(page_id, WIDTHS[0])])
    _judge("lesson", page_id, WIDTHS[0], _over_limits(m["height"], m["first_figure"], m["largest_gap"]))


@pytest.mark.parametrize("page_id, path", PAGES, ids=[c[0] for c in PAGES])
def test_public_listings_show_no_placeholder(page_id, path, measured):
    """The public site shows each exercise's solution in its listing (chapters/hooks/solutions.py): no
    listing, folded or not, holds a student copy's raise NotImplementedError("Exercise ...")."""
    shown = {f"listing {c['index']}: {c['title'] or c['first']}": c["placeholder"]
             for c in measured[(page_id, WIDTHS[0])]["listings"] if c["placeholder"]}
    assert not shown, f"{page_id}: listings show a placeholder: {shown}"


def test_student_site_shows_only_placeholders(site_build):
    """The students' site (MINIFSDP_SITE=student; the run's shared build, tests/conftest.py): every listing
    that includes an exercise shows its placeholder, and no line of a solution is on any page or in the
    search index. tests/test_site_solutions.py checks both flavours listing by listing."""
    solutions = importlib.import_module("test_site_solutions")
    build = site_build("student")
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    leaks = solutions._leaks(solutions._site_texts(build, search_index=True))
    assert not leaks, "student site: solutions shown:\n" + "\n".join(leaks[:20])
    missing = [f"{html}: {ex.id}" for ex in solutions.EXERCISES for html in solutions._shown_by(ex)
               if not solutions.has_placeholder(ex, solutions.listings_text(build.page(html)))]
    assert solutions.listings() and not missing, f"student site: listings without their placeholder: {missing}"


def test_page_heights(measured, capsys):
    """Each page as a reader meets it at 1280 px, folded blocks closed (main_path: its height, where its first
    figure starts, how many figures it shows, its largest stretch without one), and its height at 390 px (in
    site-screenshots/measurements.json too): a table to read."""
    rows = [(page_id, main_path(measured[(page_id, WIDTHS[0])]), measured[(page_id, WIDTHS[1])]["height"])
            for page_id, _ in PAGES]
    with capsys.disabled():
        print(f"\n{'page':<28} {'height @1280':>13} {'1st figure':>11} {'figures':>8} {'largest gap':>12} "
              f"{'height @390':>12}")
        for page_id, m, h2 in rows:
            first = "-" if m["first_figure"] is None else f"{m['first_figure']:,}"
            print(f"{page_id:<28} {m['height']:>13,} {first:>11} {m['figures']:>8} {m['largest_gap']:>12,} {h2:>12,}")
    assert all(m["height"] > 0 for _, m, _ in rows)


def test_every_page_leaves_a_screenshot_and_some_are_whole(measured):
    """What the CI job keeps: a JPEG (PNG past JPEG's height limit) of each page's first screen, and of the
    whole of WHOLE_PAGES, as tall as the page."""
    for (page_id, width), report in measured.items():
        shot = SCREENSHOTS / report["screenshot"]
        data = shot.read_bytes()
        assert data[:3] == b"\xff\xd8\xff" or data[:8] == b"\x89PNG\r\n\x1a\n", shot
        if (page_id, width) in WHOLE_PAGES:
            PIL = pytest.importorskip("PIL.Image")
            with PIL.open(shot) as image:
                assert image.size == (width, report["height"]), (shot, image.size, report["height"])
