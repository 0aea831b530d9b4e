"""The layers docs/architecture.md writes down are the layers the code has (issue 33), and no file imports
itself back (issue 43).

The ``layers`` block of docs/architecture.md lists the folders and top-level modules of ``src/phalanx``, top
to bottom; a line's names, separated by ``|``, are independent of each other. Every import is read from the
source (module level, inside functions, under ``TYPE_CHECKING``: an import that only a type checker runs
still ties the folders together), and each must go from a unit to one on a lower line.

Between files, no module may reach itself again through the imports that run: module level and inside
functions (a function's import is a cycle deferred, not removed: it works only while the other module is
already loaded by the time it is called). An import under ``TYPE_CHECKING`` does not count there: it never
runs, and it is how a helper names the class that calls it (a strategy's runtime its options, the config's
checks the config) without making that class's module load first (PEP 484; pylint's cyclic-import leaves
them out likewise); across folders the layers above still count it. A package's ``__init__`` is a module like
the others (``from . import Pipeline`` in a submodule imports it), but the parent package Python loads before
any submodule is not an import the file makes, and the root package's lazy names (``importlib``, PEP 562) are
not read.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "phalanx"


def written_layers(text: str) -> list[set[str]]:
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    return [{name.strip() for name in line.split("|")} for line in block.group(1).splitlines() if line.strip()]


def _unit(module: str) -> str:
    """phalanx.strategies.sync.costs -> strategies; phalanx.cli -> cli; phalanx -> the root package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_module(dotted: str) -> bool:
    path = SOURCE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imported(module: str, package: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    submodules = [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")]
    return submodules if len(submodules) == len(node.names) else [base, *submodules]


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) blocks."""
    inside = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING"):
            inside |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return inside


def imports(type_checking: bool = True) -> list[tuple[str, str, str]]:
    """(importing module, imported module, where) for every import of phalanx inside phalanx; without
    ``type_checking``, less those under ``if TYPE_CHECKING:``."""
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        skipped = set() if type_checking else _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            for target in _imported(module, package, node):
                if target == "phalanx" or target.startswith("phalanx."):
                    found.append((module, target, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def violations(layers: list[set[str]], edges: list[tuple[str, str, str]]) -> list[str]:
    level = {name: i for i, line in enumerate(layers) for name in line}
    wrong = []
    for source, target, where in edges:
        a, b = _unit(source), _unit(target)
        if a == b or b == "" or a == "":  # within a folder; the root package's __version__; the root package's
            continue                        # public names (above every layer: imported when first used)
        for unit in (a, b):
            if unit not in level:
                wrong.append(f"{where}: {unit!r} is in no layer: add it to the layers block of docs/architecture.md")
        if a in level and b in level and level[b] <= level[a]:
            how = "beside it" if level[a] == level[b] else "above it"
            wrong.append(f"{where}: {a} imports {target}, which is {how}")
    return sorted(set(wrong))


def cycles(edges: list[tuple[str, str, str]]) -> list[list[tuple[str, str]]]:
    """Each group of modules that import each other (a strongly connected component of the import graph),
    as one shortest cycle through its first module: ``[(module, where it imports the next), ...]``."""
    graph: dict[str, dict[str, str]] = {}
    for source, target, where in edges:
        if source != target:
            graph.setdefault(source, {}).setdefault(target, where)
    found = []
    for group in _components(graph):
        start = min(group)
        path = _shortest_cycle(graph, start, group)
        found.append([(module, graph[module][after]) for module, after in zip(path, path[1:])])
    return sorted(found)


def _components(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def _shortest_cycle(graph: dict[str, dict[str, str]], start: str, group: set[str]) -> list[str]:
    """start, ..., start by the fewest imports, inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph.get(module, {})):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target in group and target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a cycle that does not come back to it")


def described(cycle: list[tuple[str, str]]) -> str:
    return " -> ".join(f"{module} ({where})" for module, where in cycle) + f" -> {cycle[0][0]}"


def test_no_module_imports_itself_back_through_other_files():
    assert [described(c) for c in cycles(imports(type_checking=False))] == []


def test_a_cycle_is_named_with_where_each_file_imports_the_next():
    edges = [("p.a", "p.b", "a.py:1"), ("p.b", "p.c", "b.py:2"), ("p.c", "p.a", "c.py:3"), ("p.c", "p.d", "c.py:4"),
             ("p.d", "p.e", "d.py:5"), ("p.a", "p.a", "a.py:6")]
    assert [described(c) for c in cycles(edges)] == ["p.a (a.py:1) -> p.b (b.py:2) -> p.c (c.py:3) -> p.a"]
    assert cycles([("p.a", "p.b", "a.py:1"), ("p.b", "p.c", "b.py:2")]) == []


def test_an_import_only_a_type_checker_runs_is_no_cycle_but_still_a_layer_edge():
    everything, running = set(imports()), set(imports(type_checking=False))
    only_typed = {(a, b) for a, b, _ in everything - running}
    assert ("phalanx.train.config_checks", "phalanx.train.config") in only_typed
    assert running < everything


@pytest.mark.slow
def test_every_import_goes_down_the_layers_docs_architecture_writes():
    layers = written_layers((ROOT / "docs" / "architecture.md").read_text())
    assert violations(layers, imports()) == []


def test_every_folder_and_top_level_module_is_in_a_layer_once():
    layers = written_layers((ROOT / "docs" / "architecture.md").read_text())
    named = [name for line in layers for name in line]
    assert len(named) == len(set(named))
    units = {p.stem if p.is_file() else p.name for p in SOURCE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert units == set(named)


@pytest.mark.parametrize("edge, says", [
    (("phalanx.simulate.world", "phalanx.strategies.ps.gate", "w.py:1"),
     "simulate imports phalanx.strategies.ps.gate, which is above it"),
    (("phalanx.costs.model", "phalanx.simulate.registry", "m.py:2"), "which is beside it"),
    (("phalanx.newthing", "phalanx.errors", "n.py:3"), "'newthing' is in no layer"),
])
def test_an_import_up_or_sideways_or_from_an_unlisted_folder_is_named(edge, says):
    layers = [{"strategies"}, {"simulate", "costs"}, {"errors"}]
    found = violations(layers, [edge])
    assert len(found) == 1 and says in found[0] and found[0].startswith(edge[2])
    assert violations(layers, [("phalanx.strategies.sync", "phalanx.simulate", "s.py:1")]) == []
