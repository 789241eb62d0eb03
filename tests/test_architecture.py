"""The package's dependency rules, read from the source (no import is executed):

- no import circle between neuron_train modules (module-level imports, and function-level ones);
- no circle between its subpackages either (training -> precompile and precompile -> training is one);
- libraries never import commands: only `neuron_train.cli` names a module of `neuron_train.commands`
  (a command may import any library, not another command);
- `neuron_train.common` imports no other neuron_train subpackage;
- the training loop uses the checker through `neuron_train.graphs` only, and the compile cache
  library from its cache hook (training/cache_hook.py) only;
- the checker (`graphs`) imports nothing but `common`: it checks any script.
Each rule is checked on a planted violation too, so the test can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "neuron_train"
COMMANDS = "neuron_train.commands"
TRAINING_MAY_USE = {"neuron_train.graphs"}
CACHE_HOOK = "neuron_train.training.cache_hook"  # the loop's one link to the compile cache


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
    files = {module_name(p): p for p in PACKAGE.rglob("*.py") if "_startup" not in p.parts}
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


def package(module: str) -> str:
    """The subpackage a module belongs to (neuron_train.training.loop -> neuron_train.training)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        edges = packages.setdefault(package(mod), set())
        edges |= {package(d) for d in deps if package(d) != package(mod) and d != "neuron_train"}
    return packages


def is_command(module: str) -> bool:
    return module.startswith(COMMANDS + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = [f"import circle: {' <-> '.join(c)}" for c in cycles(graph)]
    found += [f"package circle: {' <-> '.join(c)}" for c in cycles(package_graph(graph))]
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if is_command(dep) and mod != "neuron_train.cli":
                found.append(f"{mod} imports the command module {dep} (only neuron_train.cli may)")
            if mod.startswith("neuron_train.common") and not dep.startswith("neuron_train.common"):
                found.append(f"{mod} (common) imports {dep}")
            if mod.startswith("neuron_train.graphs") and not dep.startswith(("neuron_train.graphs",
                                                                               "neuron_train.common")):
                found.append(f"{mod} (the checker) imports {dep}")
            if mod.startswith("neuron_train.training") and dep.startswith(
                    ("neuron_train.graphs", "neuron_train.precompile", "neuron_train.cost", "neuron_train.ops",
                     "neuron_train.instrument")) \
                    and dep not in TRAINING_MAY_USE and not (mod == CACHE_HOOK and dep.startswith("neuron_train.precompile")):
                found.append(f"{mod} (training) imports {dep}: use the hook objects only")
    return found


def test_the_package_follows_its_dependency_rules():
    assert violations(load_graph()) == []


@pytest.mark.parametrize("planted, expected", [
    ({"neuron_train.training.data": {"neuron_train.training.loop"}}, "import circle"),
    ({"neuron_train.precompile.coverage": {"neuron_train.training.config"}}, "package circle"),
    ({"neuron_train.instrument.steps": {"neuron_train.precompile.store"}}, "package circle"),
    ({"neuron_train.training.loop": {"neuron_train.commands.precompile"}}, "imports the command module"),
    ({"neuron_train.cost.measure": {"neuron_train.commands.bench"}}, "imports the command module"),
    ({"neuron_train.commands.bench": {"neuron_train.commands.report"}}, "imports the command module"),
    ({"neuron_train.common.fileio": {"neuron_train.training.config"}}, "(common) imports"),
    ({"neuron_train.graphs.analyzer": {"neuron_train.training.config"}}, "(the checker) imports"),
    ({"neuron_train.graphs.api": {"neuron_train.instrument.runner"}}, "(the checker) imports"),
    ({"neuron_train.graphs.report": {"neuron_train.cost.rows"}}, "(the checker) imports"),
    ({"neuron_train.training.loop": {"neuron_train.precompile.store"}}, "use the hook objects only"),
    ({"neuron_train.training.cache_hook": {"neuron_train.graphs.recorder"}}, "use the hook objects only"),
])
def test_each_rule_catches_a_planted_violation(planted, expected):
    graph = load_graph()
    for mod, extra in planted.items():
        graph[mod] = graph[mod] | extra
    assert any(expected in v for v in violations(graph)), violations(graph)


def test_a_package_circle_is_caught_even_without_a_module_circle():
    graph = load_graph()
    graph["neuron_train.precompile.listing"] = graph["neuron_train.precompile.listing"] | {"neuron_train.training.data"}
    assert not any("import circle" in v for v in violations(graph))  # no module imports back...
    assert any("package circle" in v and "neuron_train.training" in v for v in violations(graph))  # ...but a package does
