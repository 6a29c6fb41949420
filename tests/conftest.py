"""Shared test set-up. Ranks are started once per test module where possible (a module-scoped fixture
launches every case of a world size in one go); each test then only looks at the results."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

# Start the ranks from a fork server (one clean process that has imported torch once) instead of fresh
# interpreters: a launch then costs milliseconds, not seconds of `import torch`. Forking the test process
# itself would be faster still, but it has threads by then, and a fork can inherit a held lock.
# (MINIFSDP_START_METHOD=spawn runs the suite the default way.)
os.environ.setdefault("MINIFSDP_START_METHOD", "forkserver")
