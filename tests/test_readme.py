"""The README's two set-up commands are what users paste and what CI runs: keep them in step."""

from __future__ import annotations

import re

from tests.conftest import ROOT


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


def test_the_readme_test_command_runs_the_fast_tier_and_prints_the_slowest_tests():
    install_and_test = setup_commands()[1]
    assert install_and_test.endswith('python -m pytest -q -n 2 -m "not slow" --durations=25')


def test_ci_runs_the_fast_tier_then_the_slow_tier_then_ruff_then_mypy():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [setup_commands()[1],
             "python -m pytest -q -n 2 -m slow --durations=25 || [ $? -eq 5 ]",  # 5: no test collected
             "ruff check neuron_train tests scripts",
             "mypy"]
    assert [line for line in ci if line in steps] == steps
