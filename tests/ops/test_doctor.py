"""`neuron-train doctor`: each check against recorded outputs of the real tools, and one real run.

The fixtures under tests/fixtures/doctor/ are real tool outputs (their README says where each one
comes from); the checks are pure functions, so no tool is faked here. The gathering half, which runs
the tools, is tested through labelled stand-ins in tests/ops/test_doctor_standin.py.
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from neuron_train.common import neuron_env as ne
from neuron_train.common.errors import UsageError
from neuron_train.ops import checks as doctor_checks
from neuron_train.ops import facts as doctor_facts
from neuron_train.ops import report as doctor_report
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "doctor"
PINS = doctor_checks.load_pins()
PINNED = PINS["releases"][PINS["neuron_sdk"]]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def ok_run(name: str) -> doctor_facts.ToolRun:
    return doctor_facts.ToolRun(0, fixture(name))


def installed_from(release: str, **overrides: str | None) -> dict[str, str | None]:
    return {**PINS["releases"][release], **overrides}


# trn1.32xlarge has 8 EFA devices: eight RDM blocks in the layout of fi_info_hpc6a.txt.
EIGHT_EFA = "".join(f"provider: efa\n    fabric: efa\n    domain: rdmap{i}s31-rdm\n    version: 121.0\n"
                    f"    type: FI_EP_RDM\n    protocol: FI_PROTO_EFA\n" for i in range(8))


def healthy_facts(**changes) -> doctor_facts.Facts:
    """A trn1.32xlarge with the pinned SDK, EFA and limits set: the state the image aims for."""
    pip = {**PINS["framework"], **{c: PINNED[c] for c in doctor_facts.PIP_COMPONENTS}}
    dpkg = "\n".join(f"ii  {c} {PINNED[c]}" for c in doctor_facts.APT_COMPONENTS)
    facts = doctor_facts.Facts(
        neuron_ls=ok_run("neuron_ls_trn1_32xlarge.json"), dev_nodes=16,
        driver_loaded=PINNED["aws-neuronx-dkms"], dpkg=doctor_facts.ToolRun(0, dpkg), pip=pip, env={},
        python="3.10", nofile=(65536, 65536), memlock=(resource.RLIM_INFINITY, resource.RLIM_INFINITY),
        fi_info=doctor_facts.ToolRun(0, EIGHT_EFA),
        caches=[doctor_facts.CacheSpot("neuron", "Neuron default", ne.DEFAULT_NEURON_CACHE,
                            ne.PathFacts(ne.DEFAULT_NEURON_CACHE, True, True, 400 * doctor_facts.GIB, "/", "ext4"))],
    )
    return replace(facts, **changes)


# ----------------------------------------------------------------------------- parsers


def test_parse_neuron_ls_keeps_the_real_shapes_of_a_trn1_2xlarge():
    (dev,) = doctor_facts.parse_neuron_ls(fixture("neuron_ls_trn1_2xlarge.json"))
    assert dev["nc_count"] == 2 and dev["memory_size"] == 32 * doctor_facts.GIB
    assert dev["connected_to"] is None and dev["numa_node"] == "-1"


@pytest.mark.parametrize("text", ["{}", "[1, 2]", "not json"])
def test_parse_neuron_ls_rejects_what_is_not_a_device_array(text):
    with pytest.raises(ValueError):
        doctor_facts.parse_neuron_ls(text)


def test_parse_dpkg_reads_installed_packages_only():
    apt = doctor_facts.parse_dpkg(fixture("dpkg_sdk_2_29_1.txt"))
    assert apt == {c: PINNED[c] for c in doctor_facts.APT_COMPONENTS}  # the 'rc' oci-hook line is ignored


def test_parse_fi_info_reads_indented_and_flat_blocks():
    hpc = doctor_facts.parse_fi_info(fixture("fi_info_hpc6a.txt"))
    assert [(e["domain"], e["type"]) for e in hpc] == [("rdmap0s31-rdm", "FI_EP_RDM"),
                                                       ("rdmap0s31-dgrm", "FI_EP_DGRAM")]
    p4d = doctor_facts.parse_fi_info(fixture("fi_info_p4d_rdm.txt"))
    assert [e["domain"] for e in p4d] == ["efa_0-rdm", "efa_1-rdm", "efa_2-rdm", "efa_3-rdm"]


@pytest.mark.parametrize("raw, core", [
    ("2.31.24.0-9b5179492", "2.31.24.0"),        # Debian revision of aws-neuronx-runtime-lib
    ("2.16.372.0+4a9b2326", "2.16.372.0"),       # pip local label of a DLAMI neuronx-cc
    ("2.9.0.2.13.26312", "2.9.0.2.13.26312"),
])
def test_normalize_version_drops_build_suffixes(raw, core):
    assert doctor_checks.normalize_version(raw) == core


@pytest.mark.parametrize("env, expected", [
    ({}, (ne.DEFAULT_NEURON_CACHE, "Neuron default")),
    ({"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache"}, ("s3://bucket/cache", "NEURON_COMPILE_CACHE_URL")),
    ({"NEURON_COMPILE_CACHE_URL": "/a", "NEURON_CC_FLAGS": "--model-type transformer --cache_dir=/b"},
     ("/b", "NEURON_CC_FLAGS --cache_dir")),
    ({"NEURON_CC_FLAGS": "--retry_failed_compilation --cache_dir '/with space/c'"},
     ("/with space/c", "NEURON_CC_FLAGS --cache_dir")),
])
def test_neuron_cache_location_follows_the_documented_precedence(env, expected):
    assert ne.neuron_cache_location(env) == expected


@pytest.mark.parametrize("path, expected", [
    ("/home/ubuntu/neuron_cache/ip-10-0-0-1", ("/home", "nfs4")),
    ("/fsx/cache", ("/fsx", "lustre")),
    ("/scratch/cache", ("/scratch", "ext4")),
    ("/mnt/my data/cache", ("/mnt/my data", "ext4")),
    ("/homework/cache", ("/", "ext4")),         # a prefix of the name is not the mount
    ("/var/tmp/neuron-compile-cache", ("/", "ext4")),
])
def test_mount_of_finds_the_file_system_holding_a_path(path, expected):
    assert ne.mount_of(path, fixture("proc_mounts_parallelcluster.txt")) == expected


# ----------------------------------------------------------------------------- devices, driver


@pytest.mark.parametrize("name, status, words", [
    ("neuron_ls_trn1_2xlarge.json", doctor_checks.OK, "1 Neuron device(s), 2 NeuronCore(s), 32 GiB"),
    ("neuron_ls_trn1_32xlarge.json", doctor_checks.OK, "16 Neuron device(s), 32 NeuronCore(s), 32 GiB"),
    ("neuron_ls_inf1_6xlarge.json", doctor_checks.FAIL, "Inferentia (inf1"),
    ("neuron_ls_trn2_docs.json", doctor_checks.WARN, "in use by pid 113985 (neuron-bench exec"),
])
def test_check_devices_on_recorded_neuron_ls(name, status, words):
    check = doctor_checks.check_devices(ok_run(name), dev_nodes=1, require_neuron=False)
    assert (check.status, check.name) == (status, "devices")
    assert words in check.found


def test_check_devices_names_the_driver_problem_when_neuron_ls_fails_on_a_neuron_host():
    failed = doctor_facts.ToolRun(1, "", fixture("neuron_ls_no_driver.stderr"))
    check = doctor_checks.check_devices(failed, dev_nodes=2, require_neuron=False)
    assert check.status == doctor_checks.FAIL
    assert "failed to discover Neuron devices" in check.found and "modprobe neuron" in check.advice


def test_check_devices_on_a_cpu_machine_says_what_will_run():
    check = doctor_checks.check_devices(None, dev_nodes=0, require_neuron=False)
    assert check.status == doctor_checks.SKIP and "CPU XLA device" in check.advice
    assert doctor_checks.check_devices(None, dev_nodes=0, require_neuron=True).status == doctor_checks.FAIL
    failed = doctor_facts.ToolRun(1, "", fixture("neuron_ls_no_driver.stderr"))
    assert doctor_checks.check_devices(failed, dev_nodes=0, require_neuron=False).status == doctor_checks.SKIP


def test_check_devices_without_neuron_ls_but_with_devices_asks_for_the_tools():
    check = doctor_checks.check_devices(None, dev_nodes=16, require_neuron=False)
    assert check.status == doctor_checks.WARN and "aws-neuronx-tools" in check.advice


def test_check_devices_reports_unreadable_output():
    assert doctor_checks.check_devices(doctor_facts.ToolRun(0, "<html>"), 1, False).status == doctor_checks.FAIL


def test_check_driver():
    apt = doctor_facts.parse_dpkg(fixture("dpkg_sdk_2_29_1.txt"))
    assert doctor_checks.check_driver("2.27.4.0", apt, True).status == doctor_checks.OK
    stale = doctor_checks.check_driver("2.26.10.0", apt, True)  # package upgraded, old module still loaded
    assert stale.status == doctor_checks.WARN and "rmmod neuron" in stale.advice
    assert doctor_checks.check_driver(None, apt, True).status == doctor_checks.FAIL
    assert doctor_checks.check_driver(None, {}, False).status == doctor_checks.SKIP


# ----------------------------------------------------------------------------- SDK combination


def test_check_sdk_pinned_release_is_ok():
    check = doctor_checks.check_sdk(installed_from(PINS["neuron_sdk"], **{"neuronx-cc": PINNED["neuronx-cc"] + "+abc"}),
                        PINS)
    assert check.status == doctor_checks.OK and f"Neuron SDK {PINS['neuron_sdk']}" in check.found
    assert "(pinned)" in check.found


def test_check_sdk_other_supported_release_is_ok_with_a_cache_note():
    check = doctor_checks.check_sdk(installed_from("2.28.1"), PINS)
    assert check.status == doctor_checks.OK and "Neuron SDK 2.28.1" in check.found
    assert "neuronx-cc version" in check.advice


def test_check_sdk_recorded_sdk_2_19_packages_are_refused():
    apt = doctor_facts.parse_dpkg(fixture("dpkg_hyperpod_sdk_2_19.txt"))
    installed = {**apt, "neuronx-cc": "2.16.372.0+4a9b2326", "torch-neuronx": "2.5.1.2.4.0",
                 "libneuronxla": "2.1.714.0"}  # the pip versions of a 2.21-era DLAMI (issue 1143)
    check = doctor_checks.check_sdk(installed, PINS)
    assert check.status == doctor_checks.FAIL and "torch-neuronx 2.9" in check.advice
    assert "aws-neuronx-runtime-lib 2.23.112.0-9b5179492" in check.found


def test_check_sdk_mixed_releases_fail_and_name_each_release():
    check = doctor_checks.check_sdk(
        installed_from("2.29.1", **{"torch-neuronx": PINS["releases"]["2.28.1"]["torch-neuronx"]}), PINS)
    assert check.status == doctor_checks.FAIL and check.found.startswith("mixed releases")
    assert "SDK 2.28.0/2.28.1" in check.found


def test_check_sdk_driver_older_than_runtime_fails_newer_passes():
    older = doctor_checks.check_sdk(installed_from("2.29.1", **{"aws-neuronx-dkms": "2.26.5.0"}), PINS)
    assert older.status == doctor_checks.FAIL and "older than SDK 2.29.1" in older.found
    newer = doctor_checks.check_sdk(installed_from("2.28.1", **{"aws-neuronx-dkms": PINNED["aws-neuronx-dkms"]}), PINS)
    assert newer.status == doctor_checks.OK  # the driver is backward compatible with older runtimes


def test_check_sdk_flags_the_pypi_placeholder_wheels():
    placeholder = installed_from("2.29.1", **{"torch-neuronx": "1.0", "neuronx-cc": "1.0.post1"})
    check = doctor_checks.check_sdk(placeholder, PINS)
    assert check.status == doctor_checks.FAIL and "placeholder" in check.found


def test_check_sdk_missing_pieces_and_nothing_installed():
    partial = doctor_checks.check_sdk(installed_from("2.29.1", libneuronxla=None), PINS)
    assert partial.status == doctor_checks.FAIL and "libneuronxla" in partial.found
    assert doctor_checks.check_sdk({c: None for c in PINNED}, PINS).status == doctor_checks.SKIP


def test_check_sdk_tools_from_another_release_only_warn():
    check = doctor_checks.check_sdk(installed_from("2.29.1", **{"aws-neuronx-tools": "2.20.204.0"}), PINS)
    assert check.status == doctor_checks.WARN


# ----------------------------------------------------------------------------- python stack, PJRT


def test_check_framework():
    good = {**PINS["framework"]}
    assert doctor_checks.check_framework(good, "3.10", PINS).status == doctor_checks.OK
    assert doctor_checks.check_framework({**good, "torch-xla": None}, "3.10", PINS).status == doctor_checks.FAIL
    assert doctor_checks.check_framework({**good, "torch-xla": "2.8.0"}, "3.10", PINS).status == doctor_checks.FAIL
    assert doctor_checks.check_framework({**good, "torch": "2.10.0", "torch-xla": "2.10.0"}, "3.10",
                                         PINS).status == doctor_checks.FAIL
    assert doctor_checks.check_framework(good, "3.13", PINS).status == doctor_checks.WARN
    assert doctor_checks.check_framework({**good, "torchvision": "0.23.0"}, "3.11", PINS).status == doctor_checks.WARN


@pytest.mark.parametrize("env, has_neuron, plugin, status", [
    (None, True, True, doctor_checks.OK),
    ("NEURON", True, True, doctor_checks.OK),
    ("CPU", True, True, doctor_checks.WARN),
    ("TPU", True, True, doctor_checks.FAIL),
    (None, True, False, doctor_checks.FAIL),
    ("NEURON", False, False, doctor_checks.FAIL),
    (None, False, False, doctor_checks.OK),
    ("CPU", False, False, doctor_checks.OK),
])
def test_check_pjrt(env, has_neuron, plugin, status):
    check = doctor_checks.check_pjrt(env, has_neuron, plugin, cores=32 if has_neuron else 0)
    assert check.status == status
    if not has_neuron and status == doctor_checks.OK:
        assert "CPU XLA device" in check.found


# ----------------------------------------------------------------------------- cache, limits, EFA


def spot_on(path: str, *, free_gib: float = 200, writable: bool = True, exists: bool = True) -> doctor_facts.CacheSpot:
    point, fstype = ne.mount_of(path, fixture("proc_mounts_parallelcluster.txt"))
    return doctor_facts.CacheSpot("neuron", "NEURON_COMPILE_CACHE_URL", path,
                       ne.PathFacts(path, exists, writable, int(free_gib * doctor_facts.GIB), point, fstype))


def test_check_cache_on_shared_storage_fails_for_multi_node_only():
    for path in ("/home/ubuntu/neuron_cache", "/fsx/neuron_cache"):
        assert doctor_checks.check_cache(spot_on(path), multi_node=True).status == doctor_checks.FAIL
        single = doctor_checks.check_cache(spot_on(path), multi_node=False)
        assert single.status == doctor_checks.WARN and "one local cache directory per host" in single.advice


def test_check_cache_space_and_permissions():
    assert doctor_checks.check_cache(spot_on("/scratch/c"), multi_node=True).status == doctor_checks.OK
    assert doctor_checks.check_cache(spot_on("/scratch/c", free_gib=5), multi_node=False).status == doctor_checks.WARN
    assert doctor_checks.check_cache(spot_on("/scratch/c", free_gib=0.5), multi_node=False).status == doctor_checks.FAIL
    assert doctor_checks.check_cache(spot_on("/scratch/c", writable=False),
                                     multi_node=False).status == doctor_checks.FAIL
    fresh = doctor_checks.check_cache(spot_on("/scratch/c", exists=False), multi_node=False)
    assert fresh.status == doctor_checks.OK and "created on first use" in fresh.found
    remote = doctor_facts.CacheSpot("neuron", "NEURON_COMPILE_CACHE_URL", "s3://b/c", None)
    assert doctor_checks.check_cache(remote, multi_node=True).status == doctor_checks.OK


def test_check_nofile():
    assert doctor_checks.check_nofile(1024, 4096).status == doctor_checks.WARN
    assert doctor_checks.check_nofile(65536, 65536).status == doctor_checks.OK
    assert doctor_checks.check_nofile(resource.RLIM_INFINITY, resource.RLIM_INFINITY).status == doctor_checks.OK


def test_check_efa_on_recorded_fi_info():
    assert doctor_checks.check_efa(None, multi_node=False, device_count=16).status == doctor_checks.SKIP
    assert doctor_checks.check_efa(None, multi_node=True, device_count=16).status == doctor_checks.FAIL
    none = doctor_checks.check_efa(doctor_facts.ToolRun(1, "", fixture("fi_info_no_efa.stderr")), True, 16)
    assert none.status == doctor_checks.FAIL and "-61" in none.found and "security" in none.advice
    one = doctor_checks.check_efa(ok_run("fi_info_hpc6a.txt"), True, device_count=1)
    # the DGRAM endpoint is not a device
    assert one.status == doctor_checks.OK and one.found.startswith("1 EFA device(s)")
    four = doctor_checks.check_efa(ok_run("fi_info_p4d_rdm.txt"), True, device_count=1)
    assert four.status == doctor_checks.OK and four.found.startswith("4 EFA device(s)")
    short = doctor_checks.check_efa(ok_run("fi_info_p4d_rdm.txt"), True, device_count=16)  # trn1.32xlarge wants 8
    assert short.status == doctor_checks.WARN and "8 EFA interfaces" in short.advice


def test_check_memlock():
    assert doctor_checks.check_memlock(65536, multi_node=True).status == doctor_checks.WARN
    assert doctor_checks.check_memlock(resource.RLIM_INFINITY, multi_node=True).status == doctor_checks.OK
    assert doctor_checks.check_memlock(65536, multi_node=False).status == doctor_checks.SKIP


# ----------------------------------------------------------------------------- whole report


def test_run_checks_on_a_healthy_trn1_32xlarge_passes():
    checks = doctor_checks.run_checks(healthy_facts(), PINS, multi_node=True, require_neuron=True)
    assert {c.name: c.status for c in checks if c.status != doctor_checks.OK} == {}
    assert doctor_checks.exit_code(checks) == 0
    assert "Ready" in doctor_report.format_report(checks, PINS)


def test_run_checks_prefers_the_loaded_driver_over_the_package():
    facts = healthy_facts(driver_loaded="2.26.5.0")  # package 2.27.4.0 on disk, old module running
    by_name = {c.name: c for c in doctor_checks.run_checks(facts, PINS)}
    assert by_name["driver"].status == doctor_checks.WARN
    assert by_name["neuron-sdk"].status == doctor_checks.FAIL and "driver 2.26.5.0" in by_name["neuron-sdk"].found


def test_run_checks_on_cpu_machine_downgrades_sdk_failures_to_warnings():
    facts = healthy_facts(neuron_ls=None, dev_nodes=0, driver_loaded=None, dpkg=None,
                          pip={**PINS["framework"], "torch-neuronx": "1.0"})
    checks = doctor_checks.run_checks(facts, PINS)
    by_name = {c.name: c.status for c in checks}
    assert by_name["devices"] == doctor_checks.SKIP and by_name["neuron-sdk"] == doctor_checks.WARN
    assert doctor_checks.exit_code(checks) == 0
    assert "CPU-only machine" in doctor_report.format_report(checks, PINS)
    required = doctor_checks.run_checks(facts, PINS, require_neuron=True)
    assert doctor_checks.exit_code(required) == 1


def test_format_report_lists_every_check_with_status_and_advice():
    checks = doctor_checks.run_checks(healthy_facts(nofile=(1024, 1024)), PINS)
    text = doctor_report.format_report(checks, PINS)
    for c in checks:
        assert re.search(rf"^\s*{c.status}\s+{re.escape(c.name)}\s", text, re.M), c.name
    assert "-> 32 workers with collectives" in text and text.splitlines()[0].startswith("neuron-train doctor")


def test_write_json_report_is_atomic_and_never_overwrites(tmp_path):
    target = tmp_path / "doctor.json"
    report = doctor_report.report_dict(doctor_checks.run_checks(healthy_facts(), PINS), PINS)
    doctor_report.write_json_report(str(target), report)
    assert json.loads(target.read_text())["checks"][0]["name"] == "devices"
    assert [p.name for p in tmp_path.iterdir()] == ["doctor.json"]
    with pytest.raises(UsageError, match="already exists"):
        doctor_report.write_json_report(str(target), report)


# ----------------------------------------------------------------------------- on this machine


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_train", "doctor", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.skipif(any(Path("/dev").glob("neuron[0-9]*")), reason="this machine has Neuron devices")
def test_doctor_on_this_cpu_machine(tmp_path):
    out = tmp_path / "report.json"
    run = doctor("--json", str(out), "--compile-cache", str(tmp_path / "cache"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^\s*SKIP\s+devices\s", run.stdout, re.M) and "CPU-only machine" in run.stdout
    report = json.loads(out.read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["pjrt-device"]["status"] == "OK" and "CPU XLA device" in by_name["pjrt-device"]["found"]
    assert by_name["torch-xla"]["status"] == "OK"
    # The project cache's verdict follows the free space of the disk under tmp_path, measured here.
    free_gib = shutil.disk_usage(tmp_path).free / doctor_facts.GIB
    project = by_name["cache:project"]
    reported = float(re.search(r"([0-9.]+) GiB free", project["found"]).group(1))
    assert reported == pytest.approx(free_gib, abs=0.5)
    assert project["status"] == ("FAIL" if free_gib < 1 else "WARN" if free_gib < 20 else "OK"), project
    assert report["exit_code"] == 0 and report["pinned_neuron_sdk"] == PINS["neuron_sdk"]

    again = doctor("--json", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert json.loads(out.read_text()) == report  # the first report is untouched

    required = doctor("--require-neuron")
    assert required.returncode == 1 and re.search(r"^\s*FAIL\s+devices\s", required.stdout, re.M)


def test_run_checks_treats_the_placeholder_plugin_as_missing():
    facts = healthy_facts(pip={**healthy_facts().pip, "libneuronxla": "1.0"})
    by_name = {c.name: c.status for c in doctor_checks.run_checks(facts, PINS)}
    assert by_name["pjrt-device"] == doctor_checks.FAIL and by_name["neuron-sdk"] == doctor_checks.FAIL
