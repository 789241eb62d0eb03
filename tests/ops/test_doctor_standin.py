"""`neuron-train doctor`'s gathering half, through stand-ins for the Neuron and EFA tools.

STAND-INS, NOT THE TOOLS: `neuron-ls`, `fi_info` and `dpkg-query` below are shell scripts put first
on PATH that replay the recorded real outputs of tests/fixtures/doctor/ (see its README), and a
temporary file plays /sys/module/neuron/version. They test only OUR contract with those tools: the
arguments `gather_facts` passes, that their stdout, stderr and exit code reach the checks intact,
and which checks that makes pass or fail. Whether the real tools behave so is what the recorded
fixtures are for; nothing here says this machine has a Neuron device.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from neuron_train.ops import checks as doctor_checks
from neuron_train.ops import facts as doctor_facts
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "doctor"
PINS = doctor_checks.load_pins()
PINNED = PINS["releases"][PINS["neuron_sdk"]]

# Each stand-in accepts exactly the command line gather_facts must use, else exits 2 loudly.
DPKG_FORMAT = "${db:Status-Abbrev} ${Package} ${Version}\\n"
STANDINS = {
    "neuron-ls": (["--json-output"], "NEURON_LS_REPLAY"),
    "fi_info": (["-p", "efa"], "FI_INFO_REPLAY"),
    "dpkg-query": (["-W", "-f", DPKG_FORMAT, "aws-neuronx-*"], "DPKG_REPLAY"),
}


def write_standin(bindir: Path, name: str, expected: list[str], replay_var: str) -> None:
    script = f"""#!/usr/bin/env bash
# Stand-in for `{name}` (tests only our contract with it): replays a recorded real output.
# ${replay_var}=<stdout file>[:<stderr file>:<exit code>]
expected=({' '.join(shlex.quote(a) for a in expected)})
if [[ "$*" != "${{expected[*]}}" ]]; then echo "stand-in {name}: unexpected arguments: $*" >&2; exit 2; fi
IFS=: read -r out err code <<< "${replay_var}"
[[ -n $out ]] && cat "$out"
[[ -n $err ]] && cat "$err" >&2
exit "${{code:-0}}"
"""
    path = bindir / name
    path.write_text(script)
    path.chmod(0o755)


@pytest.fixture
def standins(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, (expected, var) in STANDINS.items():
        write_standin(bindir, name, expected, var)
    monkeypatch.setenv("PATH", f"{bindir}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("NEURON_LS_REPLAY", str(FIXTURES / "neuron_ls_trn1_32xlarge.json"))
    monkeypatch.setenv("FI_INFO_REPLAY", str(FIXTURES / "fi_info_hpc6a.txt"))
    monkeypatch.setenv("DPKG_REPLAY", str(FIXTURES / "dpkg_sdk_2_29_1.txt"))
    driver = tmp_path / "neuron_module_version"
    driver.write_text(PINNED["aws-neuronx-dkms"] + "\n")  # what the kernel shows for a loaded module
    return driver


def gather(driver: Path, tmp_path: Path) -> doctor_facts.Facts:
    return doctor_facts.gather_facts(multi_node=True, compile_cache=str(tmp_path / "cache"),
                          driver_version_file=str(driver))


def test_recorded_tool_outputs_reach_the_checks_through_gather_facts(standins, tmp_path):
    facts = gather(standins, tmp_path)
    # Each tool was called with the arguments its stand-in insists on, and its output kept whole.
    assert facts.neuron_ls == doctor_facts.ToolRun(0, (FIXTURES / "neuron_ls_trn1_32xlarge.json").read_text(), "")
    assert facts.fi_info == doctor_facts.ToolRun(0, (FIXTURES / "fi_info_hpc6a.txt").read_text(), "")
    assert facts.dpkg == doctor_facts.ToolRun(0, (FIXTURES / "dpkg_sdk_2_29_1.txt").read_text(), "")
    assert facts.driver_loaded == PINNED["aws-neuronx-dkms"]

    by_name = {c.name: c for c in doctor_checks.run_checks(facts, PINS, multi_node=True, require_neuron=True)}
    devices = by_name["devices"]
    assert (devices.status, devices.found) == (doctor_checks.OK,
                                               "16 Neuron device(s), 32 NeuronCore(s), 32 GiB per device")
    driver = by_name["driver"]
    assert (driver.status, driver.found) == (doctor_checks.OK, f"neuron module {PINNED['aws-neuronx-dkms']} loaded")
    # The hpc6a recording has one EFA device; 16 Neuron devices (trn1.32xlarge) want 8.
    efa = by_name["efa"]
    assert (efa.status == doctor_checks.WARN and efa.found.startswith("1 EFA device(s)")
            and "8 EFA interfaces" in efa.advice)


def test_a_failing_neuron_ls_is_reported_with_its_own_message(standins, tmp_path, monkeypatch):
    """The recorded degraded host: empty stdout, a logfmt line on stderr, exit code 1."""
    monkeypatch.setenv("NEURON_LS_REPLAY", f":{FIXTURES / 'neuron_ls_no_driver.stderr'}:1")
    standins.unlink()  # no neuron module loaded either
    facts = gather(standins, tmp_path)
    assert facts.neuron_ls.returncode == 1 and facts.neuron_ls.stdout == ""
    assert facts.driver_loaded is None
    checks = doctor_checks.run_checks(facts, PINS, multi_node=True, require_neuron=True)
    devices = next(c for c in checks if c.name == "devices")
    assert devices.status == doctor_checks.FAIL and "failed to discover Neuron devices" in devices.found
    assert "modprobe neuron" in devices.advice
    assert doctor_checks.exit_code(checks) == 1


def test_without_the_tools_nothing_is_run_and_the_checks_say_so(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(doctor_facts, "NEURON_BIN", str(tmp_path / "no-neuron"))
    monkeypatch.setattr(doctor_facts, "EFA_BIN", str(tmp_path / "no-efa"))
    facts = doctor_facts.gather_facts(multi_node=True, compile_cache=None,
                           driver_version_file=str(tmp_path / "absent"))
    assert (facts.neuron_ls, facts.fi_info, facts.dpkg, facts.driver_loaded) == (None, None, None, None)
    by_name = {c.name: c.status for c in doctor_checks.run_checks(facts, PINS, multi_node=True)}
    assert by_name["efa"] == doctor_checks.FAIL  # a multi-node run needs EFA
