"""The layout rules of the source tree, read from the files with ``ast`` (nothing is imported).

- No import cycle among the project's modules (``routers``, ``baselines``, ``repro``). Every import
  statement counts as an edge: those at module level, those inside functions (deferred imports), and
  those under ``if TYPE_CHECKING:``, since each of them says one module needs the other. So does a string
  that names a project module (``"repro.studies.mini"``, ``"repro.training.cli:main"``): what
  ``importlib.import_module`` or a dispatch table imports by name. An edge goes to
  the module a statement names (``from pkg import mod`` counts ``pkg.mod`` when it is a module, else
  ``pkg``); the parent packages that Python imports on the way are not counted as edges.
- No import from a lower layer to one above it (:data:`LOWER_LAYERS`).
- No source file over ``MAX_FILE_LINES`` lines and no function over ``MAX_FUNCTION_LINES`` lines.
- Every ``torch.load`` passes ``weights_only=True``: a checkpoint is data, never code to run.

``python tests/test_layout.py`` prints the cycles, the largest file and the longest function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("routers", "baselines", "repro")
MAX_FILE_LINES = 650
MAX_FUNCTION_LINES = 120


def source_files() -> list[Path]:
    """Returns:
        The project's Python files bound by the rules: the packages and ``noxfile.py``."""
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    return files + [ROOT / "noxfile.py"]


def module_name(path: Path) -> str:
    """Args:
        path: a file under one of ``PACKAGES``.

    Returns:
        Its dotted module name (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules one import statement names (empty for other statements and outside imports)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = importer.split(".")
            # A package's own module is its __init__: level 1 is the package itself.
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # `import repro.x.y` of a name inside a module: its module
            name = name.rpartition(".")[0]
        if name and name != importer:
            found.add(name)
    return found


def _named(node: ast.AST, importer: str, modules: set[str]) -> set[str]:
    """The project module a string constant names (``"pkg.mod"`` or ``"pkg.mod:function"``), if any."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value.split(":")[0]
        if name in modules and name != importer:
            return {name}
    return set()


def import_graph() -> dict[str, set[str]]:
    """Returns:
        Each project module mapped to the project modules it imports (every import statement in the file)."""
    paths = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set().union(*(_imported(n, name, is_package, modules) | _named(n, name, modules)
                                    for n in ast.walk(tree)))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iterative).

    Args:
        graph: module -> the modules it imports.

    Returns:
        Each group of modules that import one another in a loop, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def function_lengths(path: Path) -> list[tuple[int, str]]:
    """Args:
        path: a Python file.

    Returns:
        (lines, "file:line name") for every function and method in it, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT)
    return [
        (node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}")
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_the_cycle_finder_sees_a_loop_and_a_clean_graph():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_resolves_relative_deferred_and_type_checking_imports(tmp_path):
    modules = {"repro", "repro.training", "repro.training.trainer", "repro.training.config", "repro.errors"}
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .config import TrainConfig\n"
        "def f():\n    from ..errors import ReproError\n    import repro.training.config as c\n"
        "from repro.training import config\n"
    )
    found = set().union(*(_imported(n, "repro.training.trainer", False, modules) for n in ast.walk(tree)))
    assert found == {"repro.training.config", "repro.errors"}
    init = ast.parse("from . import trainer\nfrom .config import X\n")
    found = set().union(*(_imported(n, "repro.training", True, modules) for n in ast.walk(init)))
    assert found == {"repro.training.trainer", "repro.training.config"}


#: The one loop by design: the router registry imports the built-in routers by name on first lookup, and they
#: import it to register themselves (the plug-in pattern; other packages' routers come through entry points).
ROUTER_PLUGINS = {"routers.registry": {"routers.dirmoe", "baselines"}}


def test_no_import_cycles_between_modules():
    graph = import_graph()
    assert "repro.training.trainer" in graph and graph["repro.training.trainer"], "the graph read nothing"
    assert ROUTER_PLUGINS["routers.registry"] <= graph["routers.registry"], "the plug-in edges are seen"
    graph = {m: targets - ROUTER_PLUGINS.get(m, set()) for m, targets in graph.items()}
    assert cycles(graph) == []


#: The packages above the base modules (errors, io_utils, schema, stats, config, experiments, launch), lowest first.
_ABOVE_BASE = ("repro.model", "repro.records", "repro.training", "repro.evaluation", "repro.report", "repro.studies",
               "repro.golden", "repro.cli", "repro.__main__")
#: Packages -> the project packages they must not import: the routers stand alone; the data and the model sit
#: below the records; the records (what a run leaves) below training and evaluation, which write them; the
#: reports only present records; the studies run all of it; the command line is on top.
LOWER_LAYERS = {
    "routers": ("repro",),
    "baselines": ("repro",),
    **{base: _ABOVE_BASE for base in ("repro.errors", "repro.io_utils", "repro.schema", "repro.stats", "repro.config",
                                      "repro.experiments", "repro.flavours", "repro.launch", "repro.wheelhouse")},
    "repro.data": _ABOVE_BASE,
    "repro.model": _ABOVE_BASE[1:],
    "repro.records": _ABOVE_BASE[2:],
    "repro.training": _ABOVE_BASE[4:],
    "repro.evaluation": _ABOVE_BASE[4:],
    "repro.report": _ABOVE_BASE[5:],
    "repro.studies": _ABOVE_BASE[6:],
}


def test_lower_layers_import_nothing_above_them():
    graph = import_graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for layer, above in LOWER_LAYERS.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if any(target == a or target.startswith(a + ".") for a in above)
    )
    assert upward == []
    assert "repro.studies.mini_writeup" in graph and "repro.cli" in graph["repro.__main__"]


def test_no_file_over_the_line_bound():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in source_files()}
    assert len(sizes) > 50
    assert {f: n for f, n in sizes.items() if n > MAX_FILE_LINES} == {}


def test_no_function_over_the_line_bound():
    lengths = [item for path in source_files() for item in function_lengths(path)]
    assert len(lengths) > 500
    assert [item for item in lengths if item[0] > MAX_FUNCTION_LINES] == []


if __name__ == "__main__":
    graph = import_graph()
    loops = cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges, {len(loops)} cycles")
    for loop in loops:
        print("  cycle:", " ".join(loop))
    sizes = sorted((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in source_files())
    print("largest file:", *sizes[-1])
    print("longest function:", *max(item for p in source_files() for item in function_lengths(p)))


def unsafe_loads(path: Path) -> list[int]:
    """Returns:
        The lines of ``path`` calling ``torch.load`` without ``weights_only=True``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                and func.value.id == "torch"):
            continue
        safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in node.keywords)
        if not safe:
            lines.append(node.lineno)
    return lines


def test_unsafe_loads_are_found(tmp_path):
    source = tmp_path / "m.py"
    # The call, the keyword and the unsafe flag are formatted in when the test runs: no line of the sources holds an
    # unsafe load, for a reader of the text or of the AST (adjacent literals would be one constant to it).
    load, flag = ".".join(("torch", "load")), "_".join(("weights", "only"))
    source.write_text(f"import torch\n{load}('a', {flag}={True})\n{load}('b')\n{load}('c', {flag}={not True})\n")
    assert unsafe_loads(source) == [3, 4]


def test_every_checkpoint_read_is_tensors_only():
    files = [*source_files(), *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    offenders = {str(p.relative_to(ROOT)): lines for p in files if (lines := unsafe_loads(p))}
    assert offenders == {}


def test_a_module_named_in_a_string_is_an_edge():
    """``importlib.import_module("repro.x")`` and a dispatch table's ``"repro.x:main"`` count as imports."""
    modules = {"repro.cli", "repro.x"}
    tree = ast.parse('COMMANDS = {"x": ("repro.x:main", "help")}\nimportlib.import_module("repro.x")\nDOC = "repro.x is"')
    assert set().union(*(_named(n, "repro.cli", modules) for n in ast.walk(tree))) == {"repro.x"}
