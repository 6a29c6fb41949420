"""The package's architecture, checked: no import cycles, the algorithms never import measurement, and the
book's form -- no module over 400 lines, no function of the algorithms over 60 lines of code.

Algorithms emit events and talk through distributed/comm.py; the meter, the timeline, the reports and the
course tooling observe or drive them from outside. So nothing in ddp/, zero/, fsdp/, fsdp2/ or parallel/
may import -- directly or through any chain of imports -- from measure/, reports/ or course/.

The graph is read from the source (every import statement, function-level ones included, except those
under `if TYPE_CHECKING:`, which never run). `from minifsdp.x import y` is an edge to minifsdp.x.y when
that is a module, else to minifsdp.x. Importing a submodule also runs its parents' __init__.py; those
implicit edges are left out (Python initialises a package before its submodules, so they cannot deadlock).
"""

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "minifsdp"
ALGORITHMS = ("ddp", "zero", "fsdp", "fsdp2", "parallel")
OBSERVERS = ("measure", "reports", "course")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _type_checking_only(node, parents) -> bool:
    for parent in parents:
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test) and node in ast.walk(parent):
            return True
    return False


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guards = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, guards):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        out |= {t for t in targets if t in known}
    return out - {name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not, with the module that imports it (to explain a chain)."""
    seen, todo = {}, [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen and nxt != start:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def chain(via: dict[str, str], start: str, end: str) -> str:
    path = [end]
    while path[-1] != start:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


def test_the_detectors_detect():
    """On graphs made to break the rules: a cycle is found and named, and so is an indirect import."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    via = reachable({"x.ddp.m": {"x.events"}, "x.events": {"x.measure.meter"}}, "x.ddp.m")
    assert chain(via, "x.ddp.m", "x.measure.meter") == "x.ddp.m -> x.events -> x.measure.meter"


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "minifsdp.distributed.comm" in graph["minifsdp.ddp.ddp"]
    assert "minifsdp.fsdp.flat_param" in graph["minifsdp.fsdp.runtime"]
    assert "minifsdp.measure.meter" in graph["minifsdp.train"]  # the harness measures: allowed


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("package", ALGORITHMS)
def test_algorithms_import_no_measurement(package):
    graph = import_graph()
    mine = [m for m in graph if m == f"minifsdp.{package}" or m.startswith(f"minifsdp.{package}.")]
    if package in ("ddp", "zero", "fsdp"):
        assert mine, f"minifsdp/{package}/ is missing"
    for module in mine:
        via = reachable(graph, module)
        bad = sorted(m for m in via if m.split(".")[1] in OBSERVERS)
        assert not bad, f"{module} imports {bad[0]}: {chain(via, module, bad[0])}"


def test_one_subpackage_per_idea():
    """The tree shows the architecture: the sub-packages SPEC names exist, and nothing else is loose."""
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages >= {"distributed", "ddp", "zero", "fsdp", "measure", "reports", "course"}
    loose = {p.name for p in PACKAGE.glob("*.py")}
    assert loose <= {"__init__.py", "__main__.py", "events.py", "mixed_precision.py", "models.py", "state_dict.py",
                     "train.py"}, loose


# -- the book's form: modules a reader can hold, functions of one sitting ------------------------------------
ALGORITHM_PACKAGES = ("distributed", "ddp", "zero", "fsdp", "fsdp2", "parallel", "checkpoint")
MAX_MODULE_LINES = 400
MAX_FUNCTION_CODE_LINES = 60


def code_lines(function: ast.AST, source: list[str]) -> int:
    """Lines of code in a function: its lines less blank ones, comments and its docstring."""
    body = function.body
    docstring = (body[0] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                 and isinstance(body[0].value.value, str) else None)
    skip = set(range(docstring.lineno, docstring.end_lineno + 1)) if docstring else set()
    return sum(1 for n in range(function.lineno, function.end_lineno + 1)
               if n not in skip and source[n - 1].strip() and not source[n - 1].strip().startswith("#"))


def test_the_line_counter_counts_code_only():
    source = textwrap.dedent('''\
        def f(x):
            """A docstring
            of two lines."""
            # a comment

            return x
        ''')
    tree = ast.parse(source)
    assert code_lines(tree.body[0], source.splitlines()) == 2


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by idea): {long}"


@pytest.mark.parametrize("package", ALGORITHM_PACKAGES)
def test_no_function_of_the_algorithms_over_60_lines_of_code(package):
    long = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        source = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = code_lines(node, source)
                if n > MAX_FUNCTION_CODE_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"
