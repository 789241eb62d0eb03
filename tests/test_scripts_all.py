"""Every file in scripts/ (issue 32): what a script needs of neuron_train still exists, and each one
starts. A moved module, a renamed function or a dropped subcommand fails here, not on a rented
instance; shell scripts are read by their `neuron_train` references, which no type checker sees.

The scripts that run end to end in CI, each in its own test file: neuron_first_run.sh (test_first_run,
with stand-ins for neuron_parallel_compile and torch-neuronx's metadata), precompile.sh
(test_precompile), slurm_train.sbatch (test_ami, test_slurm), inf1_bench.py (test_bench_inf1, with a
stand-in torch.neuron), validate_plan.py (test_plan), bench_loop.py (test_config; its --outside in-run
reading: test_bench_loop). The others measure for minutes to hours (benchmarks, mutation testing, the
example report): here they are imported and asked for --help (bench_ops.py's reading of the profiler's
trace is tested in test_bench_ops).
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys

import pytest

from neuron_train.cli import COMMANDS
from tests.conftest import ROOT, cpu_env

SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())
PYTHON = [p for p in SCRIPTS if p.suffix == ".py"]
SHELL = [p for p in SCRIPTS if p.suffix in (".sh", ".sbatch")]
NO_HELP = {"make_example_report.sh": "it measures as soon as it starts", "mutation.sh": "it mutates as soon as it "
           "starts", "slurm_train.sbatch": "its arguments are train flags (tests/test_ami.py runs it)",
           "bench_runs.py": "a module the bench scripts import, not a command"}


def neuron_train_uses(path) -> list[tuple[str, str | None]]:
    """(module, name or None) for every neuron_train import of a script, at any depth, and in shell
    scripts every `from neuron_train... import ...`, `-m neuron_train.x` and find_spec("neuron_train.x")."""
    text = path.read_text()
    uses: list[tuple[str, str | None]] = []
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("neuron_train"):
                uses += [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                uses += [(a.name, None) for a in node.names if a.name.startswith("neuron_train")]
        return uses
    for module, names in re.findall(r"from (neuron_train[\w.]*) import ([\w, ]+)", text):
        uses += [(module, n.strip()) for n in names.split(",")]
    uses += [(m, None) for m in re.findall(r"-m (neuron_train\.[\w.]+)", text)]
    uses += [(m, None) for m in re.findall(r"find_spec\(\"(neuron_train[\w.]*)\"\)", text)]
    return uses


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_what_each_script_uses_of_neuron_train_exists(script):
    for module, name in neuron_train_uses(script):
        imported = importlib.import_module(module)  # a moved module: ModuleNotFoundError, naming it
        if name is not None:
            assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), \
                f"{script.name}: {module} has no {name}"
    for command in re.findall(r"-m neuron_train (\w[\w-]*)", script.read_text()):
        assert command in COMMANDS, f"{script.name}: neuron-train has no command {command}"


def test_the_import_reader_sees_a_moved_import(tmp_path):
    moved = tmp_path / "old.sh"
    moved.write_text("python3 -c 'from neuron_train.cost.instance import resolve_instance_type'\n")
    ((module, name),) = neuron_train_uses(moved)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


@pytest.mark.slow  # one process per script
@pytest.mark.parametrize("script", [p for p in PYTHON + SHELL if p.name not in NO_HELP], ids=lambda p: p.name)
def test_each_script_starts_and_answers_help(script):
    argv = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=300,
                          env=cpu_env(AWS_EC2_METADATA_DISABLED="true"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip() and "Traceback" not in proc.stderr
