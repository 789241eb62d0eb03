"""The README's two set-up commands are what users paste and what CI runs: keep them in step."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import ROOT, cpu_env


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")]  # the opening, before the first section
    blocks = re.findall(r"```bash\n(.*?)```", head, re.S)
    return [next(line for line in b.splitlines() if line and not line.startswith("#")) for b in blocks]


def test_readme_opens_with_exactly_two_setup_commands():
    install_and_train, install_and_test = setup_commands()
    assert "pip install -e ." in install_and_train
    assert "torchrun --standalone --nproc_per_node=2 neuron_train/run.py" in install_and_train
    assert "pip install -e '.[test]'" in install_and_test and "pytest" in install_and_test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert setup_commands()[1] in ci


@pytest.mark.slow
def test_the_first_command_keeps_the_readme_promise(tmp_path):
    """Runs the README's first command as printed (after its install step; only an output folder and
    no progress bar added) and checks the figures the README states."""
    install_and_train, _ = setup_commands()
    train = shlex.split(install_and_train.split(" && ")[-1])
    assert train[0] == "torchrun" and shutil.which("torchrun"), train
    out = tmp_path / "run"
    proc = subprocess.run([*train, "--output-dir", str(out), "--no-progress"], cwd=ROOT, env=cpu_env(),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["eval_accuracy"] >= 0.90, summary["eval_accuracy"]
    assert summary["compile_count"] <= 4, summary["compile_count"]
