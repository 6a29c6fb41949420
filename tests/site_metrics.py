"""The chapter pages as a reader first meets them, at 1280 px: `python tests/site_metrics.py [PAGE ...]`.

Builds the public site, loads each page (every page, or those named: 06_fsdp, index, ...) in headless
Chromium with its folded blocks closed and its first tab shown, and prints the main path's height, where
the first figure starts, how many figures the main path shows, and the largest gap between two of them
(from the top of the page to the first, between figures, from the last to the end). The browser test
(tests/test_site_browser.py) measures the same, with the same script, and holds the limits in LIMITS there.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_site_browser as t  # noqa: E402


def main(argv: list[str]) -> int:
    wanted = set(argv)
    pages = [(pid, path) for pid, path in t.PAGES if not pid.startswith("notebook-") and (not wanted or pid in wanted)]
    with tempfile.TemporaryDirectory(prefix="minifsdp-site-") as tmp:
        site = Path(tmp) / "site"
        out = t.mkdocs_build(site)
        if out.returncode != 0:
            print(out.stdout[-3000:], out.stderr[-3000:])
            return 1
        with t._serve(site) as server, t._browser() as browser:
            print(f"{'page':<16} {'main path':>10} {'1st figure':>11} {'figures':>8} {'largest gap':>12}")
            for pid, path in pages:
                browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=t.VIEWPORT_HEIGHT,
                             deviceScaleFactor=1, mobile=False)
                browser.call("Page.navigate", url=server + path)
                browser.wait_for("Page.loadEventFired", timeout=60)
                r = browser.evaluate(t.MEASURE)
                m = t.main_path(r)
                first = "-" if m["first_figure"] is None else f"{m['first_figure']:,}"
                print(f"{pid:<16} {m['height']:>10,} {first:>11} {m['figures']:>8} {m['largest_gap']:>12,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
