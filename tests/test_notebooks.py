"""Every notebook runs top to bottom in a fresh Jupyter kernel, and is stored with current outputs.

The notebooks launch their ranks from inside the kernel (functions typed into cells are started with the
fork start method), so running them under nbclient also checks that `minifsdp.launch` works from a
notebook. A failing cell fails the test with that cell's source and traceback.

Each kernel is forked from a server that has imported torch and matplotlib once
(minifsdp/reports/kernels.py): a new process with none of another notebook's state, without the four
seconds of imports that a kernel started from scratch spends before the first cell is done.

The notebooks are stored with the outputs of a run on CPU ranks (`make notebooks`, that is
minifsdp/reports/notebooks.py), which the site shows. Each records the hash of the code cells that made its
outputs, so a code cell edited without running `make notebooks` again fails
test_notebook_outputs_are_current.
"""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from nbclient.exceptions import CellExecutionError  # noqa: E402

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds; on a 2-core CPU each notebook takes well under a minute in all
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


def _execute(path: Path, kernel_manager_class) -> str | None:
    """Run one notebook in a fresh kernel: None, or what the failing cell raised."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     kernel_manager_class=kernel_manager_class,
                                     resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    try:
        client.execute()
    except CellExecutionError as e:
        return ANSI_ESCAPE.sub("", str(e))
    return None


@pytest.fixture(scope="module")
def executed():
    """Every notebook, two at a time: much of a notebook's time is a kernel starting and importing torch,
    one core's work, so two share this machine's two cores better than one does."""
    from concurrent.futures import ThreadPoolExecutor

    from minifsdp.reports.kernels import warm_kernels

    os.environ["MPLBACKEND"] = "Agg"  # the kernel server inherits it: plots render without a display
    with warm_kernels() as manager, ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(NOTEBOOKS, pool.map(lambda path: _execute(path, manager), NOTEBOOKS)))


@pytest.mark.timeout(len(NOTEBOOKS) * 300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, executed):
    if executed[path] is not None:
        pytest.fail(f"{path.name}: a cell raised\n{executed[path]}", pytrace=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_outputs_are_current(path):
    """Stored with outputs, from one top-to-bottom run of the code cells it has now, under the note on how
    to run it."""
    from minifsdp.reports.notebooks import COMMAND, problems

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    why = problems(nb, path.name)
    assert not why, (f"{path.name}: its stored outputs are not those of its code: " + "; ".join(why) +
                     f". Run `{COMMAND}` (or python -m minifsdp.reports.notebooks notebooks/{path.name})"
                     f" and commit the notebook with its new outputs")


def test_every_notebook_is_on_the_site():
    """mkdocs.yml's nav lists every notebook (mkdocs-jupyter renders it from chapters/notebooks, a link to
    notebooks/)."""
    nav = (NOTEBOOKS_DIR.parent / "mkdocs.yml").read_text(encoding="utf-8")
    missing = [p.name for p in NOTEBOOKS if f"notebooks/{p.name}" not in nav]
    assert not missing, f"mkdocs.yml's nav lacks these notebooks: {missing}"
    link = NOTEBOOKS_DIR.parent / "chapters" / "notebooks"
    assert link.resolve() == NOTEBOOKS_DIR, "chapters/notebooks should be a link to ../notebooks"
