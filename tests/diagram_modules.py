"""A chapter's module of diagrams (chapters/diagrams/chNN_*.py), imported for the tests that check what it
draws against the package: with its folder on the path, as make_diagrams.py imports it (each draws with
`from canvas import *`)."""

import importlib
import sys
from pathlib import Path

DIAGRAMS = Path(__file__).resolve().parents[1] / "chapters" / "diagrams"


def diagram_module(name: str):
    """chapters/diagrams/<name>.py, e.g. diagram_module("ch06_runtime")."""
    if str(DIAGRAMS) not in sys.path:
        sys.path.insert(0, str(DIAGRAMS))
    return importlib.import_module(name)
