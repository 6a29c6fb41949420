"""The built site holds together without a browser: every internal link and anchor resolves, every page
loads its images, scripts and stylesheets from the site itself, and KaTeX can typeset every formula.

mkdocs --strict checks the links written in the Markdown; this reads the HTML it produced, so it also sees
the links the theme, the plugins (mkdocs-jupyter's notebook pages, glightbox) and the includes add.
tests/test_site_browser.py loads the same pages in Chromium; this file runs wherever the site builds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[1]
KATEX = REPO / "chapters" / "vendor" / "katex" / "katex.min.js"


# What a build of the site needs installed, by the name each is imported as, with what to install.
SITE_TOOLS = {"mkdocs": "mkdocs", "material": "mkdocs-material", "pymdownx": "pymdown-extensions"}


def skip_without_site_tools() -> None:
    """Skip the calling test where the site cannot be built: a tool of SITE_TOOLS is not installed."""
    for module, package in SITE_TOOLS.items():
        pytest.importorskip(module, reason=f"{package} is not installed: the site cannot be built here")


def mkdocs_build(site: Path, flavour: str = "public", timeout: float = 600) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of this project into `site`: the public site, or (flavour "student") the one
    without solutions (chapters/hooks/solutions.py)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "MINIFSDP_SITE": flavour})


def built_site(request, tmp_path_factory) -> Path:
    """The public site: tests/conftest.py's site_build (one build per test run) where there is one, else a
    build of this module's own."""
    try:
        build = request.getfixturevalue("site_build")
    except pytest.FixtureLookupError:
        build = None
    if build is not None:
        out = build("public")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.site
    skip_without_site_tools()
    site = tmp_path_factory.mktemp("site") / "site"
    out = mkdocs_build(site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return site


class _Page(HTMLParser):
    """What one HTML page links to, loads, and offers as anchors; and its formulas."""

    LOADED = {"stylesheet", "icon", "preload"}  # <link rel=...> that the browser fetches

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []      # <a href>: may point anywhere
        self.resources: list[str] = []  # what the page loads: img/script src, stylesheet and icon hrefs
        self.formulas: list[tuple[str, bool]] = []  # (TeX, display) of each pymdownx.arithmatex element
        self._formula: list | None = None
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if a.get(key):
                self.ids.add(a[key])
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"])
        elif tag in ("img", "script", "source", "iframe") and a.get("src"):
            self.resources.append(a["src"])
        elif tag == "link" and a.get("href") and self.LOADED & set((a.get("rel") or "").split()):
            self.resources.append(a["href"])
        if self._formula is not None:
            self._depth += 1
        elif "arithmatex" in (a.get("class") or "").split():
            self._formula, self._depth = [tag == "div"], 1

    def handle_endtag(self, tag):
        if self._formula is not None:
            self._depth -= 1
            if self._depth == 0:
                display, *text = self._formula
                self.formulas.append(("".join(text), display))
                self._formula = None

    def handle_data(self, data):
        if self._formula is not None:
            self._formula.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def site(request, tmp_path_factory) -> Path:
    return built_site(request, tmp_path_factory)


@pytest.fixture(scope="module")
def pages(site) -> dict[str, _Page]:
    """Every HTML page of the site, by its path in the site ("01_ddp/index.html")."""
    return {p.relative_to(site).as_posix(): _parse(p) for p in sorted(site.rglob("*.html"))}


def _target(site: Path, page: str, ref: str) -> tuple[str | None, str]:
    """The site file a reference from `page` points at ("" when it is not in the site) and its fragment;
    (None, "") for a reference that leaves the site (another scheme, another host)."""
    parts = urlsplit(ref)
    if parts.scheme or parts.netloc:
        return None, ""
    if not parts.path:  # "#anchor": this page
        return page, unquote(parts.fragment)
    path = urlsplit(urljoin("http://site/" + page, parts.path)).path.lstrip("/")
    path = unquote(path)
    if path == "" or path.endswith("/"):
        path += "index.html"
    elif (site / path).is_dir():
        path += "/index.html"
    return (path if (site / path).is_file() else ""), unquote(parts.fragment)


def test_the_site_has_the_chapters_and_the_notebooks(pages):
    chapters = {p.stem for p in (REPO / "chapters").glob("*.md")} - {"index"}
    notebooks = {p.stem for p in (REPO / "notebooks").glob("*.ipynb")}
    assert "index.html" in pages
    assert {f"{c}/index.html" for c in chapters} <= set(pages), "a chapter page is missing from the site"
    assert {f"notebooks/{n}/index.html" for n in notebooks} <= set(pages), "a notebook page is missing"


def test_every_internal_link_and_anchor_resolves(site, pages):
    broken = []
    for name, page in pages.items():
        for ref in page.links:
            if ref.startswith(("mailto:", "javascript:", "data:")):
                continue
            target, fragment = _target(site, name, ref)
            if target is None:
                continue
            if target == "":
                broken.append(f"{name}: {ref} (no such file in the site)")
            elif fragment and target.endswith(".html") and fragment not in pages[target].ids:
                broken.append(f"{name}: {ref} (no id {fragment!r} on {target})")
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken[:50])


def test_every_page_loads_only_files_of_the_site(site, pages):
    """Images, scripts and stylesheets come from the site itself: it needs no network, to build or to read
    (KaTeX is vendored under chapters/vendor/katex)."""
    bad = []
    for name, page in pages.items():
        for ref in page.resources:
            if ref.startswith("data:"):
                continue
            target, _ = _target(site, name, ref)
            if target is None:
                bad.append(f"{name}: {ref} (from the network)")
            elif target == "":
                bad.append(f"{name}: {ref} (no such file in the site)")
    assert not bad, f"{len(bad)} resource(s) not served by the site:\n" + "\n".join(bad[:50])


def test_formulas_are_marked_up_for_katex(pages):
    """pymdownx.arithmatex found the chapters' formulas, and left the `$` of code alone."""
    formulas = {name: page.formulas for name, page in pages.items() if page.formulas}
    for chapter in ("01_ddp", "02_memory", "05_flat_param", "06_fsdp", "12_parallel", "13_scaling"):
        assert formulas.get(f"{chapter}/index.html"), f"{chapter}: no formula on the page"
    # chapter 3 shows a grep whose pattern has a "$" in a code span: still code, not maths
    ch3 = (REPO / "chapters" / "03_zero1.md").read_text(encoding="utf-8")
    assert "(#|$)" in ch3 and not formulas.get("03_zero1/index.html")


def test_katex_typesets_every_formula(pages):
    """Each formula through the vendored katex.min.js under node, as the page's script renders it (with
    throwOnError): a formula KaTeX cannot parse fails here with its page, not only as a red box there."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the browser test still catches formulas KaTeX rejects")
    formulas = []
    for name, page in pages.items():
        for tex, display in page.formulas:
            tex = unescape(tex).strip()
            for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
                if tex.startswith(left) and tex.endswith(right):
                    tex = tex[len(left):-len(right)]
            formulas.append({"page": name, "tex": tex, "display": display})
    assert formulas
    script = (
        "const katex = require(process.argv[1]); let input = '';"
        "process.stdin.on('data', d => input += d).on('end', () => {"
        "  const bad = [];"
        "  for (const f of JSON.parse(input)) {"
        "    try { katex.renderToString(f.tex, {displayMode: f.display, throwOnError: true}); }"
        "    catch (e) { bad.push(f.page + ': ' + JSON.stringify(f.tex) + ': ' + e.message); }"
        "  }"
        "  console.log(JSON.stringify(bad));"
        "});")
    out = subprocess.run([node, "-e", script, str(KATEX)], input=json.dumps(formulas), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    bad = json.loads(out.stdout)
    assert not bad, f"KaTeX rejects {len(bad)} of {len(formulas)} formulas:\n" + "\n".join(bad)


def test_katex_is_vendored_with_its_licence():
    vendor = REPO / "chapters" / "vendor" / "katex"
    for rel in ("katex.min.js", "katex.min.css", "contrib/auto-render.min.js", "LICENSE"):
        assert (vendor / rel).is_file(), f"chapters/vendor/katex/{rel} is missing"
    css = (vendor / "katex.min.css").read_text(encoding="utf-8")
    woff2 = set(re.findall(r"url\((fonts/[^)]+\.woff2)\)", css))
    assert woff2 and all((vendor / f).is_file() for f in woff2), "a KaTeX font the stylesheet names is missing"
