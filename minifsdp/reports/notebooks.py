"""`make notebooks` (python -m minifsdp.reports.notebooks): run every notebook and store its outputs.

The notebooks are stored with the outputs of a run on CPU ranks, so that the site and GitHub show what
each cell prints and draws. To keep those outputs from going stale, each notebook records in its
metadata (`metadata.minifsdp.code_hash`) a hash of the code cells that made them; tests/test_notebooks.py
fails when a code cell has changed since, naming the command that brings the outputs up to date.

Each notebook runs top to bottom in a fresh Jupyter kernel (nbclient, as the test does), two at a time.
The kernels are forked from one process that has imported torch and matplotlib (kernels.py), so none
spends seconds importing them again. A failing cell stops that notebook, leaves its file as it was, and
makes the command exit 1.

Running also puts the note on how to run a notebook (run_note) under the notebook's title, or brings an
older note up to date: the same words at the top of every notebook and of its page on the site, with a
link to the .ipynb (on the site, mkdocs-jupyter publishes it beside the page).

    python -m minifsdp.reports.notebooks                          # every notebook
    python -m minifsdp.reports.notebooks notebooks/05_flat_param.ipynb
    python -m minifsdp.reports.notebooks --check                  # only report stale or unrun notebooks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT = 300  # seconds; on a 2-core CPU each notebook takes well under a minute in all
COMMAND = "make notebooks"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks

NOTE_START, NOTE_END = "<!-- minifsdp:run-note -->", "<!-- /minifsdp:run-note -->"


def run_note(name: str) -> str:
    """The note at the top of notebook `name` (a file name such as "01_ddp.ipynb"): how to run it, where."""
    return f"""{NOTE_START}
> **Running this notebook** ([{name}]({name})). On a laptop, or any machine without a GPU, it runs as it
> is: each rank is a CPU process and the ranks talk through gloo; the whole notebook takes a minute or
> two. On a machine with a GPU for every rank (up to 4), `launch` gives each rank its own GPU and the
> ranks talk through NCCL; run `python -m minifsdp gpu-check` there first, which says whether minifsdp's
> strategies train correctly on that machine. Install with `pip install -e ".[test]"` from the
> repository, then open the notebook from `notebooks/` in Jupyter. The outputs stored with it, shown on
> this page, are from a run on CPU ranks (`{COMMAND}`).
{NOTE_END}"""


def code_hash(nb) -> str:
    """sha256 of the notebook's code cells, in order: what its outputs depend on. Markdown is left out."""
    sources = [cell["source"] for cell in nb["cells"] if cell["cell_type"] == "code"]
    return hashlib.sha256(json.dumps(sources, ensure_ascii=False).encode("utf-8")).hexdigest()


def recorded_hash(nb) -> str | None:
    return nb.get("metadata", {}).get("minifsdp", {}).get("code_hash")


def with_run_note(source: str, name: str) -> str:
    """A first cell's source with run_note(name) right under its title line (replacing any older note)."""
    source = re.sub(re.escape(NOTE_START) + r".*?" + re.escape(NOTE_END) + r"\n*", "", source, flags=re.DOTALL)
    title, _, rest = source.partition("\n")
    return f"{title}\n\n{run_note(name)}\n\n{rest.lstrip(chr(10))}"


def problems(nb, name: str) -> list[str]:
    """Why stored notebook `name`'s outputs are not those of its current code ([] when they are)."""
    out = []
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    counts = [cell.get("execution_count") for cell in code]
    if counts != list(range(1, len(code) + 1)):
        out.append(f"its code cells were not run once each, top to bottom (execution counts {counts})")
    if not any(cell.get("outputs") for cell in code):
        out.append("no code cell has an output")
    recorded = recorded_hash(nb)
    if recorded is None:
        out.append("it records no hash of the code that made its outputs (metadata.minifsdp.code_hash)")
    elif recorded != code_hash(nb):
        out.append("a code cell changed after its outputs were made (metadata.minifsdp.code_hash differs)")
    if run_note(name) not in nb["cells"][0]["source"]:
        out.append("its first cell lacks the current note on how to run it")
    return out


def execute(path: Path, kernel_manager_class=None) -> str | None:
    """Run one notebook in a fresh kernel and write it back with its outputs and code hash: None, or
    what the failing cell raised (the file is then left as it was). `kernel_manager_class`: how the kernel
    is started (kernels.warm_kernels), or None for jupyter_client's own."""
    import nbclient
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source = with_run_note(nb.cells[0].source, path.name)
    extra = {"kernel_manager_class": kernel_manager_class} if kernel_manager_class else {}
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(path.parent)}}, **extra)
    try:
        client.execute()
    except CellExecutionError as e:
        return ANSI_ESCAPE.sub("", str(e))
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # per-cell timestamps: noise in every diff
    nb.metadata.setdefault("minifsdp", {})["code_hash"] = code_hash(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minifsdp.reports.notebooks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks to run (default: every notebooks/*.ipynb)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks run at once (default 2)")
    parser.add_argument("--check", action="store_true", help="run nothing: list the notebooks with stale outputs")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(NOTEBOOKS_DIR.glob("*.ipynb"))

    if args.check:
        import nbformat

        stale = {p: problems(nbformat.read(p, as_version=4), p.name) for p in paths}
        for p, why in stale.items():
            print(f"{p.name}: " + ("; ".join(why) if why else "up to date"))
        return 1 if any(stale.values()) else 0

    # the kernels inherit it: every figure is drawn into the cell's output, with or without %matplotlib inline
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    from minifsdp.reports.kernels import warm_kernels

    with warm_kernels() as manager, ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        ran = pool.map(lambda path: execute(path, manager), paths)
        failures = {p: err for p, err in zip(paths, ran) if err is not None}
    for p in paths:
        print(f"{p.name}: {'FAILED' if p in failures else 'ran, outputs stored'}")
    for p, err in failures.items():
        print(f"\n{p.name}: a cell raised\n{err}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
