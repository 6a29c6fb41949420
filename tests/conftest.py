"""Shared test set-up. Ranks are started once per test module where possible (a module-scoped fixture
launches every case of a world size in one go); each test then only looks at the results."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
