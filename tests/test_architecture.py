"""The package's dependency rules, read from the source (no import is executed):

- no import circle between neuron_train modules (module-level imports, and function-level ones);
- no circle between its subpackages either (training -> precompile and precompile -> training is one);
- libraries never import commands: only `neuron_train.cli` names a module of `neuron_train.commands`
  (a command may import any library, not another command), and it uses only their `configure_parser`
  and `main`; no test or script takes anything else from a command module either, and a command
  module defines nothing public but those two (its helpers are `_private`): what others need lives
  in a library;
- `neuron_train.common` imports no other neuron_train subpackage;
- the training loop uses the checker through `neuron_train.graphs` only, and the compile cache
  library from its cache hook (training/cache_hook.py) only;
- the checker (`graphs`) imports nothing but `common`: it checks any script;
- `cost` is three wings (bench, plan, report) over its ground (the modules directly in cost/): a wing
  imports no other wing, the ground imports no wing.
Each rule is checked on a planted violation too, so the test can fail.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "neuron_train"
COMMANDS = "neuron_train.commands"
TRAINING_MAY_USE = {"neuron_train.graphs"}
CACHE_HOOK = "neuron_train.training.cache_hook"  # the loop's one link to the compile cache
COMMAND_API = {"configure_parser", "main"}  # all that neuron_train.cli calls in a command module
COST = "neuron_train.cost"
COST_WINGS = ("bench", "plan", "report")  # cost's products; what two of them share lives in cost/ itself


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


def cost_wing(module: str) -> str | None:
    """The wing of cost a module belongs to (neuron_train.cost.plan.model -> plan), None for its ground."""
    parts = module.split(".")
    return parts[2] if parts[:2] == COST.split(".") and len(parts) > 3 and parts[2] in COST_WINGS else None


def cost_violation(mod: str, dep: str) -> str | None:
    if not (mod.startswith(COST + ".") and dep.startswith(COST + ".")):
        return None
    wing, dep_wing = cost_wing(mod), cost_wing(dep)
    if dep_wing is None or dep_wing == wing:
        return None
    if wing is None:
        return f"{mod} (cost's ground) imports the wing module {dep}: the ground serves the wings, not one of them"
    return f"{mod} (cost/{wing}) imports {dep} of another wing: move what both need to cost/ (the ground)"


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
                    and dep not in TRAINING_MAY_USE \
                    and not (mod == CACHE_HOOK and dep.startswith("neuron_train.precompile")):
                found.append(f"{mod} (training) imports {dep}: use the hook objects only")
            if (problem := cost_violation(mod, dep)) is not None:
                found.append(problem)
    return found


def command_uses(source: str) -> dict[str, set[str]]:
    """What `source` takes from each command module: the names it imports from one, the attributes it
    reads of one imported whole, MODULE where it uses such a module otherwise (monkeypatch, passing it)."""
    uses: dict[str, set[str]] = {}
    bound: dict[str, str] = {}  # local name -> command module
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and is_command(node.module):
            uses.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == COMMANDS:
            bound |= {a.asname or a.name: f"{COMMANDS}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            bound |= {a.asname: a.name for a in node.names if a.asname and is_command(a.name)}
    reads = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            uses.setdefault(bound[node.value.id], set()).add(node.attr)
        elif isinstance(node, ast.Name) and node.id in bound and isinstance(node.ctx, ast.Load) \
                and id(node) not in reads:
            uses.setdefault(bound[node.id], set()).add("MODULE")
    return uses


def command_api_violations(sources: dict[str, str]) -> list[str]:
    """A command module used for more than its configure_parser/main."""
    found = []
    for where, source in sorted(sources.items()):
        for module, names in sorted(command_uses(source).items()):
            extra = names - COMMAND_API
            if extra:
                found.append(f"{where} takes {', '.join(sorted(extra))} from the command module {module}: "
                             "move it into its library and import it from there")
    return found


def public_definitions(source: str) -> set[str]:
    """The public names a module defines at its top level (functions, classes, assignments, also under
    a top-level if/try): what another module could import from it."""
    names: set[str] = set()
    body = list(ast.parse(source).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return {n for n in names if not n.startswith("_")}


def command_definition_violations(sources: dict[str, str]) -> list[str]:
    """A command module that defines something public besides configure_parser and main: library code
    (or a constant) others would import from it."""
    return [f"{where} defines {', '.join(sorted(extra))}: a command module defines only configure_parser and "
            "main (and _private helpers); move the rest into its library"
            for where, source in sorted(sources.items())
            if (extra := public_definitions(source) - COMMAND_API)]


def command_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in (PACKAGE / "commands").glob("*.py")
            if p.name != "__init__.py"}


def cli_command_attributes(source: str) -> set[str]:
    """The attributes neuron_train.cli reads of the command module it imports by name."""
    tree = ast.parse(source)
    modules = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
               and ast.unparse(n.value.func) == "importlib.import_module" for t in n.targets
               if isinstance(t, ast.Name)}
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id in modules}


def outside_sources() -> dict[str, str]:
    """Every Python file that is not a command module nor the cli: the package, tests, scripts."""
    tests = [p for p in (ROOT / "tests").rglob("*.py") if not {"corpus", "fixtures"} & set(p.relative_to(ROOT).parts)]
    files = [*PACKAGE.rglob("*.py"), *tests, *(ROOT / "scripts").rglob("*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files
            if not is_command(module_name(p)) or p.parent != PACKAGE / "commands"}


def test_the_package_follows_its_dependency_rules():
    assert violations(load_graph()) == []


def test_command_modules_are_used_only_through_configure_parser_and_main():
    assert command_api_violations(outside_sources()) == []
    assert cli_command_attributes((PACKAGE / "cli.py").read_text()) == COMMAND_API


def test_command_modules_define_only_configure_parser_and_main():
    sources = command_sources()
    assert "neuron_train/commands/bench.py" in sources  # the modules are found
    assert command_definition_violations(sources) == []


@pytest.mark.parametrize("source", [
    "def sweep(plan, measure, log):\n    pass",                     # library code a test would import
    "class Plan:\n    pass",
    "OUTPUT_FILES = ('report.md',)",                               # a constant a library would import
    "MODES: tuple[str, ...] = ('train',)",
    "if True:\n    def helper():\n        pass",
    "_USAGE = 'x'\ndef _helper():\n    pass\ndef main(args):\n    pass\nbench_main = main",
])
def test_a_command_module_defining_library_code_is_caught(source):
    assert command_definition_violations({"neuron_train/commands/planted.py": source}), source


def test_a_command_module_with_private_helpers_only_passes():
    source = ("import argparse\nfrom x import helper\n_USAGE = 'x'\n\ndef configure_parser(p):\n    pass\n\n"
              "def _helper():\n    pass\n\ndef main(args):\n    return 0\n")
    assert command_definition_violations({"neuron_train/commands/planted.py": source}) == []


@pytest.mark.parametrize("source", [
    "from neuron_train.commands.doctor import format_report",
    "from neuron_train.commands import cache as c\nc.list_entries()",
    "import neuron_train.commands.train as t\nt.format_summary(s)",
    "from neuron_train.commands import precompile\nmonkeypatch.setattr(precompile, 'x', 1)",
    "from neuron_train.commands.bench import resolve_instance_type",  # the debt this rule once allowed
    "from neuron_train.commands import plan\nmonkeypatch.setattr(plan, '_measure_loop', f)",
])
def test_a_command_module_used_for_its_library_code_is_caught(source):
    assert command_api_violations({"tests/test_planted.py": source}), source


def test_a_command_module_used_for_its_parser_and_main_only_passes():
    source = "from neuron_train.commands import train\ntrain.configure_parser(p)\ntrain.main(a)"
    assert command_api_violations({"tests/test_planted.py": source}) == []


def test_the_cli_calling_more_of_a_command_module_is_caught():
    source = "module = importlib.import_module(name)\nmodule.configure_parser(p)\nmodule.main(a)\nmodule.helper()"
    assert cli_command_attributes(source) == COMMAND_API | {"helper"}


@pytest.mark.parametrize("planted, expected", [
    ({"neuron_train.training.data": {"neuron_train.training.loop"}}, "import circle"),
    ({"neuron_train.precompile.coverage": {"neuron_train.training.config"}}, "package circle"),
    ({"neuron_train.instrument.steps": {"neuron_train.precompile.store"}}, "package circle"),
    ({"neuron_train.training.loop": {"neuron_train.commands.precompile"}}, "imports the command module"),
    ({"neuron_train.cost.bench.measure": {"neuron_train.commands.bench"}}, "imports the command module"),
    ({"neuron_train.commands.bench": {"neuron_train.commands.report"}}, "imports the command module"),
    ({"neuron_train.common.fileio": {"neuron_train.training.config"}}, "(common) imports"),
    ({"neuron_train.graphs.analyzer": {"neuron_train.training.config"}}, "(the checker) imports"),
    ({"neuron_train.graphs.api": {"neuron_train.instrument.runner"}}, "(the checker) imports"),
    ({"neuron_train.graphs.report": {"neuron_train.cost.report.rows"}}, "(the checker) imports"),
    ({"neuron_train.training.loop": {"neuron_train.precompile.store"}}, "use the hook objects only"),
    ({"neuron_train.training.cache_hook": {"neuron_train.graphs.recorder"}}, "use the hook objects only"),
    ({"neuron_train.cost.report.compare": {"neuron_train.cost.plan.result"}}, "of another wing"),
    ({"neuron_train.cost.plan.result": {"neuron_train.cost.report.rows"}}, "of another wing"),
    ({"neuron_train.cost.plan.measure": {"neuron_train.cost.bench.script_bench"}}, "of another wing"),
    ({"neuron_train.cost.results": {"neuron_train.cost.plan.result"}}, "(cost's ground) imports the wing"),
])
def test_each_rule_catches_a_planted_violation(planted, expected):
    graph = load_graph()
    for mod, extra in planted.items():
        graph[mod] = graph[mod] | extra
    assert any(expected in v for v in violations(graph)), violations(graph)


def test_cost_has_three_wings_and_a_ground():
    graph = load_graph()
    wings = {cost_wing(m) for m in graph if m.startswith(COST + ".")}
    assert wings == {*COST_WINGS, None}  # each wing holds modules, and so does the ground
    # a wing's own modules and the ground are allowed
    assert cost_violation("neuron_train.cost.plan.result", "neuron_train.cost.plan.model") is None
    assert cost_violation("neuron_train.cost.plan.result", "neuron_train.cost.schema") is None


def test_a_package_circle_is_caught_even_without_a_module_circle():
    graph = load_graph()
    graph["neuron_train.precompile.listing"] = graph["neuron_train.precompile.listing"] | {"neuron_train.training.data"}
    assert not any("import circle" in v for v in violations(graph))  # no module imports back...
    # ...but a package does
    assert any("package circle" in v and "neuron_train.training" in v for v in violations(graph))


# ----- docs/architecture.md's diagram, held to the code ---------------------------------------------------
DOC = ROOT / "docs" / "architecture.md"
FLOORS = ("commands", "cost", "training", "precompile", "instrument", "graphs", "common", "ops")


def diagram(text: str) -> str:
    """The first code block of docs/architecture.md: the floors, top to bottom."""
    return text.split("```\n", 2)[1]


def unnamed_modules(picture: str) -> list[str]:
    """The package's modules (and subfolders) the diagram does not name."""
    words = set(re.findall(r"[\w]+", picture))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) < 2 or "_startup" in rel.parts[:-1]:
            continue
        name = rel.parent.name if rel.name == "__init__.py" else path.stem
        if name not in words and name not in FLOORS:
            missing.append(rel.as_posix())
    return missing


def floors_drawn_upside_down(picture: str, graph: dict[str, set[str]]) -> list[str]:
    """A subpackage importing one the diagram draws above it (ops sits beside common, both at the bottom)."""
    order = {name: picture.index(f" {name}/") for name in FLOORS}
    order["ops"] = order["common"]  # drawn beside it, on the bottom floor
    return [f"{a} imports {b}, drawn above it" for a, deps in sorted(package_graph(graph).items())
            for b in sorted(deps) if (a_ := a.split(".")[-1]) in order and (b_ := b.split(".")[-1]) in order
            and order[b_] < order[a_]]


def test_the_diagram_names_every_module_and_draws_no_import_upward():
    picture = diagram(DOC.read_text())
    assert unnamed_modules(picture) == []
    assert floors_drawn_upside_down(picture, load_graph()) == []


def test_the_diagram_checks_fail_on_a_planted_drift():
    picture = diagram(DOC.read_text())
    assert "cost/plan/model.py" in unnamed_modules(picture.replace("model,", ""))
    swapped = picture.replace(" cost/", " COST/").replace(" training/", " cost/").replace(" COST/", " training/")
    assert "neuron_train.cost imports neuron_train.training, drawn above it" in \
        floors_drawn_upside_down(swapped, load_graph())
