"""The package's dependency rules, read from the source (no import is executed):

- no import circle between neuron_train modules (module-level imports, and function-level ones);
- `neuron_train.common` imports no other neuron_train subpackage;
- only `neuron_train.cli` imports command modules;
- the training loop never imports the checker's or the cache's internals, only their hook objects;
- the checker (`graphs`) imports nothing of `training`, `precompile` or `cost`.
Each rule is checked on a planted violation too, so the test can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "neuron_train"
COMMANDS = {"neuron_train.training.command", "neuron_train.graphs.command", "neuron_train.precompile.command",
            "neuron_train.precompile.cache_command", "neuron_train.cost.bench", "neuron_train.cost.report",
            "neuron_train.ops.doctor", "neuron_train.commands.plan"}
TRAINING_MAY_USE = {"neuron_train.graphs", "neuron_train.precompile.hook"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, known: set[str]) -> set[str]:
    """neuron_train modules imported anywhere in `source` (`from a import b` counts a.b if it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return {m for m in found if m.startswith("neuron_train")}


def load_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py") if "_instrument" not in p.parts}
    known = set(files)
    return {name: imports_of(path.read_text(), known) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = [f"import circle: {' <-> '.join(c)}" for c in cycles(graph)]
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if dep in COMMANDS and mod != "neuron_train.cli":
                found.append(f"{mod} imports the command module {dep} (only neuron_train.cli may)")
            if mod.startswith("neuron_train.common") and not dep.startswith("neuron_train.common"):
                found.append(f"{mod} (common) imports {dep}")
            if mod.startswith("neuron_train.graphs") and dep.startswith(
                    ("neuron_train.training", "neuron_train.precompile", "neuron_train.cost")):
                found.append(f"{mod} (the checker) imports {dep}")
            if mod.startswith("neuron_train.training") and dep.startswith(
                    ("neuron_train.graphs", "neuron_train.precompile", "neuron_train.cost", "neuron_train.ops")) \
                    and dep not in TRAINING_MAY_USE:
                found.append(f"{mod} (training) imports {dep}: use the hook objects only")
    return found


def test_the_package_follows_its_dependency_rules():
    assert violations(load_graph()) == []


@pytest.mark.parametrize("planted, expected", [
    ({"neuron_train.training.data": {"neuron_train.training.loop"}}, "import circle"),
    ({"neuron_train.training.loop": {"neuron_train.precompile.command"}}, "imports the command module"),
    ({"neuron_train.common.fileio": {"neuron_train.training.config"}}, "(common) imports"),
    ({"neuron_train.graphs.analyzer": {"neuron_train.training.config"}}, "(the checker) imports"),
    ({"neuron_train.training.loop": {"neuron_train.precompile.store"}}, "use the hook objects only"),
])
def test_each_rule_catches_a_planted_violation(planted, expected):
    graph = load_graph()
    for mod, extra in planted.items():
        graph[mod] = graph[mod] | extra
    assert any(expected in v for v in violations(graph)), violations(graph)
