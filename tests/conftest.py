"""Shared test set-up. Ranks are started once per test module where possible (a module-scoped fixture
launches every case of a world size in one go); each test then only looks at the results."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

# Start the ranks from a fork server (one clean process that has imported torch once) instead of fresh
# interpreters: a launch then costs milliseconds, not seconds of `import torch`. Forking the test process
# itself would be faster still, but it has threads by then, and a fork can inherit a held lock.
# (MINIFSDP_START_METHOD=spawn runs the suite the default way.)
os.environ.setdefault("MINIFSDP_START_METHOD", "forkserver")


def pytest_collection_finish(session):
    """A test module may start slow work that needs nothing else from the run as soon as the run is
    collected: its start_early(items), given the module's selected tests (test_course.py's checks)."""
    modules = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_early"):
            modules.setdefault(module, []).append(item)
    for module, items in modules.items():
        module.start_early(items)


@pytest.fixture(scope="session", autouse=True)
def pooled_ranks():
    """One pool of ranks for the whole run: a launch reuses the ranks of an earlier one of its shape, which
    saves starting them and their rendezvous (0.1-1.5 s a launch here). The pool puts each rank back to a
    fresh one's state between works (minifsdp/distributed/pool.py), and gives up ranks after any failure.
    Per test module would start each world size's ranks again in every module. (MINIFSDP_POOL=0: none.)"""
    from minifsdp.distributed.launch import rank_pool

    with rank_pool():
        yield


class SiteBuild:
    """One `mkdocs build --strict` of the docs site: where it went and what it printed."""

    def __init__(self, flavour: str, site: Path, returncode: int, stdout: str, stderr: str):
        self.flavour, self.site, self.returncode, self.stdout, self.stderr = flavour, site, returncode, stdout, stderr

    def page(self, rel: str) -> str:
        return (self.site / rel).read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def site_build(tmp_path_factory):
    """The docs site, built at most once per flavour in a test run (a build takes tens of seconds):
    site_build("public") as published, site_build("student") with MINIFSDP_SITE=student (no solutions).
    Tests that need it skip when mkdocs, mkdocs-material or pymdown-extensions is missing."""
    built: dict[str, SiteBuild] = {}

    def build(flavour: str = "public") -> SiteBuild:
        from test_site_links import mkdocs_build, skip_without_site_tools

        skip_without_site_tools()
        if flavour not in built:
            site = tmp_path_factory.mktemp(f"site_{flavour}") / "site"
            out = mkdocs_build(site, flavour, timeout=300)
            built[flavour] = SiteBuild(flavour, site, out.returncode, out.stdout, out.stderr)
        return built[flavour]

    return build
