"""`plan`'s bad and weak rows of the reliability reviews (issue 31 round 4, issue 42 round 5),
in-process: an output the kernel will not create is refused before anything is measured (plan, and
bench alike), instances named twice are one and a list of none is refused, Ctrl-C to `plan -- COMMAND`
is exit 130, and more processes than an instance's cores are said to be capped. Each test was seen
failing with its rule removed (docs/reliability.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from neuron_train import cli
from tests.precompile.test_reliability_cache import one_line, run


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_an_output_the_kernel_will_not_create_is_refused_before_measuring(tmp_path, capsys, monkeypatch, command):
    """Bad row 5 (plan's part): `--output /proc/plan.json` passed every permission check (root) and
    failed with a traceback after the measurement. Now a file is created and removed up front."""
    from neuron_train.cost.bench import sweep as bench_sweep
    from neuron_train.cost.plan import measure as plan_measure

    def measured(*args, **kwargs):
        raise AssertionError("measured before the output was probed")

    for module, name in ((plan_measure, "measure_loop"), (plan_measure, "from_shapes"),
                         (bench_sweep, "measure_train"), (bench_sweep, "InferBench")):
        monkeypatch.setattr(module, name, measured)
    workload = ["--model", "vit-nano", *(["--mode", "infer"] if command == "bench" else [])]  # else measured
    code, _, err = run(capsys, command, *workload, "--output", "/proc/result.json")
    assert code == 2 and "--output: cannot write in /proc: /proc is a kernel file system" in one_line(err)
    assert not list(tmp_path.iterdir())


def test_instances_named_twice_in_any_case_are_one_and_a_list_of_none_is_refused(capsys):
    """Weak rows: `--instances trn1.2xlarge,TRN1.2xlarge` estimated twice; `--instances ,` ran with none."""
    from neuron_train.cost.plan import data as plan_data

    assert plan_data.wanted_instances(" trn1.2xlarge,TRN1.2xlarge,inf2.xlarge ") == ["trn1.2xlarge", "inf2.xlarge"]
    assert plan_data.wanted_instances(None) is None
    for given in (",", "", " , "):
        code = cli.main(["plan", "--model", "vit-nano", "--instances", given])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "--instances: no instance type in" in err, err

WAITS = """
import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(120)
"""

def test_ctrl_c_to_plan_is_interrupted_exit_130(tmp_path, capsys, monkeypatch):
    """Weak row: SIGINT to `plan -- COMMAND` said the command never imported torch_xla (exit 1)."""
    ready = tmp_path / "ready"

    def ctrl_c() -> None:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C; proc.run passes it on to the command

    threading.Thread(target=ctrl_c, daemon=True).start()
    code = cli.main(["plan", "--instances", "trn1.2xlarge", "--", sys.executable, "-c", WAITS, str(ready)])
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines()[-1] == "neuron-train plan: interrupted", err

def test_more_processes_than_an_instances_cores_are_said_to_be_capped():
    """Weak row: `--nproc-per-instance 64` was capped at each type's NeuronCores silently."""
    from neuron_train.cost.plan import data as plan_data

    known = plan_data.targets()
    chosen = [known["trn1.2xlarge"], known["trn1.32xlarge"]]
    assert plan_data.capped_note(64, chosen) == ("plan: warning: --nproc-per-instance 64 is more than the NeuronCores "
                                             "of trn1.2xlarge (2), trn1.32xlarge (32): capped at each one's cores")
    assert plan_data.capped_note(2, chosen) is None and plan_data.capped_note(None, chosen) is None
