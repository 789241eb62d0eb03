"""The tests' tree mirrors the package: the tests of neuron_train/X/ (a subpackage, nested ones too)
sit in tests/X/, so the tree says which tests guard a module (scripts/mutation.sh derives its test
selection from it). At the top of tests/ only the declared files below: tests of what is not a
module of the package (README, scripts/, ami/) or of the whole tree. Every folder is a package
(an `__init__.py`: a test module imports another by its full name, `tests.graphs.test_graphs`), and
no two test files share a name (docs and reports name a test file by its name). Each rule is also
checked on a planted violation, so the test can fail.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections import Counter
from pathlib import PurePosixPath

from tests.conftest import ROOT

TESTS = ROOT / "tests"
NOT_TESTS = {"fixtures", "corpus", "__pycache__"}  # data and third-party scripts, not test modules
# test files at the top of tests/: name -> what they test
TOP_LEVEL = {
    "test_architecture.py": "the package's import rules, over every module",
    "test_layout.py": "this tree",
    "test_readme.py": "README.md's commands and .ci/run",
    "test_scripts_all.py": "every file in scripts/",
    "test_first_run.py": "scripts/neuron_first_run.sh and scripts/first_run_checks.py",
    "test_slurm.py": "scripts/slurm_train.sbatch under a real Slurm",
    "test_bench_loop.py": "scripts/bench_loop.py: --outside's in-run reading",
    "test_bench_ops.py": "scripts/bench_ops.py: reading the profiler's trace into ops",
    "test_ami.py": "the machine image (ami/), its provisioning script and the version pins",
}


def packages() -> set[str]:
    """Every subpackage of neuron_train as a folder path relative to it: {"graphs", "training/tasks", ...}."""
    pkg = ROOT / "neuron_train"
    return {p.parent.relative_to(pkg).as_posix() for p in pkg.rglob("__init__.py") if p.parent != pkg}


def tree() -> tuple[list[str], list[str]]:
    """(test files, folders) under tests/, as paths relative to it, leaving out data folders."""
    def kept(p):
        return not NOT_TESTS & set(p.relative_to(TESTS).parts)
    files = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py") if kept(p)]
    folders = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*") if p.is_dir() and kept(p)]
    return sorted(files), sorted(folders)


def layout_violations(files: list[str], folders: list[str], inits: set[str], known: set[str]) -> list[str]:
    """What breaks the layout: `files` and `folders` relative to tests/, `inits` the folders holding an
    __init__.py, `known` the package's subpackages (as `packages()` gives them)."""
    found = []
    for f in files:
        folder = str(PurePosixPath(f).parent)
        if folder == "." and PurePosixPath(f).name not in TOP_LEVEL:
            found.append(f"{f}: a test file at the top of tests/ that is not declared in TOP_LEVEL: "
                         f"move it to the folder of the subpackage it tests")
        elif folder != "." and folder not in known:
            found.append(f"{f}: tests/{folder}/ mirrors no subpackage of neuron_train (neuron_train/{folder}/)")
    for d in folders:
        if d not in known:
            found.append(f"tests/{d}/: no subpackage neuron_train/{d}/")
        if d not in inits:
            found.append(f"tests/{d}/: no __init__.py")
    names = Counter(PurePosixPath(f).name for f in files)
    found += [f"{name}: {n} test files of this name" for name, n in sorted(names.items()) if n > 1]
    return found


def test_every_test_file_sits_in_the_folder_of_a_subpackage_or_is_declared_at_the_top():
    files, folders = tree()
    inits = {d for d in folders if (TESTS / d / "__init__.py").is_file()}
    assert (TESTS / "__init__.py").is_file()
    assert layout_violations(files, folders, inits, packages()) == []
    assert set(TOP_LEVEL) <= set(files), "a declared top-level file that no longer exists"


def test_each_layout_rule_fails_on_a_planted_violation():
    known = {"graphs", "training", "training/tasks"}
    good = ["test_readme.py", "graphs/test_a.py", "training/tasks/test_b.py"]
    folders = ["graphs", "training", "training/tasks"]
    assert layout_violations(good, folders, set(folders), known) == []
    [stray] = layout_violations([*good, "test_stray.py"], folders, set(folders), known)
    assert stray.startswith("test_stray.py: a test file at the top of tests/ that is not declared")
    [unknown] = layout_violations([*good, "cost/plan/test_c.py"], folders, set(folders), known)
    assert "tests/cost/plan/ mirrors no subpackage" in unknown
    assert layout_violations(good, [*folders, "helpers"], {*folders, "helpers"}, known) == \
        ["tests/helpers/: no subpackage neuron_train/helpers/"]
    assert layout_violations(good, folders, {"graphs", "training"}, known) == ["tests/training/tasks/: no __init__.py"]
    assert layout_violations([*good, "training/test_a.py"], folders, set(folders), known) == \
        ["test_a.py: 2 test files of this name"]


def imported_modules(source: str) -> set[str]:
    """Modules a source imports: `from a.b import c` counts a.b and a.b.c (c may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def mutation_selection(*modules: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "mutation.sh"), "--tests", *modules],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_mutation_testing_finds_each_modules_tests_in_its_folder():
    """scripts/mutation.sh keeps no list of tests: for each module it mutates, the selection is the files
    of the module's folder that import it, and it is never empty."""
    script = (ROOT / "scripts" / "mutation.sh").read_text()
    modules = re.search(r"^ALL=\(([^)]*)\)", script, re.M).group(1).split()
    proc = mutation_selection(*modules)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(modules) and all(lines)
    for module, line in zip(modules, lines, strict=True):
        dotted = "neuron_train." + module.removesuffix(".py").replace("/", ".")
        for f in line.split():
            assert f.startswith(f"tests/{PurePosixPath(module).parent}/"), (module, f)
            assert dotted in imported_modules((ROOT / f).read_text()), (module, f)
    by_module = dict(zip(modules, lines, strict=True))
    assert "tests/training/test_guards.py" in by_module["training/optim.py"].split()  # the LR schedule's guard
    assert "tests/precompile/test_cache_guards.py" in by_module["precompile/archive.py"].split()


def test_mutation_testing_refuses_a_module_that_is_not_there_in_one_line():
    proc = mutation_selection("cost/no_such_module.py")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("mutation.sh: no module neuron_train/cost/no_such_module.py (a path under "
                           "neuron_train/, e.g. training/optim.py)\n")
