"""The layers docs/architecture.md writes down are the layers the code has (issue 33).

The ``layers`` block of docs/architecture.md lists the folders and top-level modules of ``src/phalanx``, top
to bottom; a line's names, separated by ``|``, are independent of each other. Every import is read from the
source (module level, inside functions, under ``TYPE_CHECKING``: an import that only a type checker runs
still ties the folders together), and each must go from a unit to one on a lower line.
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


def imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, where) for every import of phalanx inside phalanx."""
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
