"""What `neuron-train doctor` judges: every check is a pure function over recorded `Facts`, so each
one is unit-tested against recorded outputs of the real tools. Versions are judged against the
pinned Neuron SDK releases in neuron_train/data/neuron_versions.json.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass
from importlib import resources

from neuron_train.common.neuron_env import (
    NETWORK_FS,
)
from neuron_train.ops.facts import (
    APT_COMPONENTS,
    FRAMEWORK,
    GIB,
    PIP_COMPONENTS,
    CacheSpot,
    Facts,
    ToolRun,
    parse_dpkg,
    parse_fi_info,
    parse_neuron_ls,
)

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


USERSPACE = ("aws-neuronx-runtime-lib", "aws-neuronx-collectives", "neuronx-cc", "torch-neuronx",
             "libneuronxla")




RECOMMENDED_NOFILE = 65536  # aws-neuron-sdk training troubleshooting: "Too many open files"


@dataclass(frozen=True)
class Check:
    name: str
    status: str       # OK / WARN / FAIL / SKIP
    found: str        # what the check saw
    advice: str = ""  # what to do about it (empty when nothing)


def load_pins() -> dict:
    """The pinned Neuron SDK (neuron_train/data/neuron_versions.json, shipped as package data)."""
    text = resources.files("neuron_train").joinpath("data/neuron_versions.json").read_text()
    return json.loads(text)


def version_key(version: str) -> tuple[int, ...]:
    """Numeric sort key of '2.31.24.0-9b5179492' or '2.24.8799.0+4a9b2326' (suffixes dropped)."""
    core = normalize_version(version)
    return tuple(int(p) if p.isdigit() else -1 for p in core.split("."))


def normalize_version(version: str) -> str:
    """Drop a Debian revision ('-9b5179492') or a pip local label ('+4a9b2326')."""
    return version.split("+", 1)[0].split("-", 1)[0].strip()


def check_devices(neuron_ls: ToolRun | None, dev_nodes: int, require_neuron: bool) -> Check:
    absent = FAIL if require_neuron else SKIP
    if neuron_ls is None:
        if dev_nodes:
            return Check("devices", WARN, f"{dev_nodes} /dev/neuron* device(s) but no neuron-ls",
                         "install aws-neuronx-tools (the image does), then re-run doctor")
        return Check("devices", absent, "no Neuron device: neuron-ls is not installed and there "
                     "is no /dev/neuron*", _cpu_only_advice(require_neuron))
    if neuron_ls.returncode != 0:
        msg = (neuron_ls.stderr or neuron_ls.stdout).strip().splitlines()
        first = msg[0] if msg else f"exit code {neuron_ls.returncode}"
        if not dev_nodes and not require_neuron:
            return Check("devices", SKIP, f"no Neuron device (neuron-ls: {first})",
                         _cpu_only_advice(False))
        return Check("devices", FAIL, f"neuron-ls failed: {first}",
                     "check the instance type (trn1/inf2), that the driver is loaded "
                     "(lsmod | grep neuron; sudo modprobe neuron) and `dmesg | grep -i neuron`")
    try:
        devices = parse_neuron_ls(neuron_ls.stdout)
    except ValueError as exc:
        return Check("devices", FAIL, f"unreadable neuron-ls --json-output: {exc}",
                     "run `neuron-ls --json-output` by hand; reinstall aws-neuronx-tools")
    if not devices:
        return Check("devices", absent, "neuron-ls lists no Neuron device", _cpu_only_advice(require_neuron))
    return _device_summary(devices)


def _cpu_only_advice(require_neuron: bool) -> str:
    if require_neuron:
        return "this machine must have Neuron devices (--require-neuron): use a trn1/inf2 instance"
    return ("CPU-only machine: neuron-train trains on the CPU XLA device (PJRT_DEVICE=CPU), which "
            "is right for development and tests; use a trn1/inf2 instance for real speed")


def _device_summary(devices: list[dict]) -> Check:
    cores = sum(int(d.get("nc_count", 0)) for d in devices)
    memory = {int(d.get("memory_size", 0)) for d in devices}
    per_device = max(memory) // GIB if memory else 0
    itype = next((d["instance_type"] for d in devices if d.get("instance_type")), None)
    found = (f"{len(devices)} Neuron device(s), {cores} NeuronCore(s), {per_device} GiB per device"
             + (f" ({itype})" if itype else ""))
    if per_device and per_device <= 8:
        # NeuronCore-v1 (Inferentia, inf1): 4 cores and 8 GB per device; no torch-neuronx training.
        return Check("devices", FAIL, found + ": Inferentia (inf1, NeuronCore-v1)",
                     "inf1 runs inference only (torch-neuron tracing); train on trn1 or inf2")
    busy = sorted({(p.get("pid"), p.get("command", "")) for d in devices
                   for p in d.get("neuron_processes") or []}, key=lambda pc: pc[0] or 0)
    if busy:
        who = ", ".join(f"pid {pid} ({cmd or '?'})" for pid, cmd in busy[:3])
        return Check("devices", WARN, f"{found}; in use by {who}",
                     "a NeuronCore serves one process: stop those first or a run fails with "
                     "'NeuronCore(s) not available'")
    if per_device >= 96:
        return Check("devices", WARN, found + ": Trainium2",
                     "this project targets trn1/inf2 (NeuronCore-v2); torch-neuronx 2.9 runs on "
                     "trn2 but its numbers and presets are not tuned for it")
    return Check("devices", OK, found)


def check_driver(loaded: str | None, apt: dict[str, str], has_neuron: bool) -> Check:
    package = apt.get("aws-neuronx-dkms")
    if loaded is None:
        if package and has_neuron:
            return Check("driver", FAIL, f"aws-neuronx-dkms {package} installed but the neuron "
                         "module is not loaded", "sudo modprobe neuron (see dmesg if it fails)")
        if package:
            return Check("driver", SKIP, f"aws-neuronx-dkms {package} installed; module not "
                         "loaded (no Neuron device)")
        status = FAIL if has_neuron else SKIP
        return Check("driver", status, "no Neuron driver (aws-neuronx-dkms) installed",
                     "install the pinned SDK with ami/provision.sh" if has_neuron else "")
    if package and normalize_version(package) != normalize_version(loaded):
        return Check("driver", WARN, f"module {loaded} loaded, package {package} installed",
                     "the upgrade did not reload the driver: stop Neuron processes, then "
                     "`sudo rmmod neuron && sudo modprobe neuron` (or reboot)")
    return Check("driver", OK, f"neuron module {loaded} loaded")


def release_of(component: str, version: str, releases: dict[str, dict[str, str]]) -> set[str]:
    """The SDK releases that ship `component` at `version`."""
    want = normalize_version(version)
    return {sdk for sdk, parts in releases.items() if parts.get(component) == want}


def check_sdk(installed: dict[str, str | None], pins: dict) -> Check:
    """Are driver, runtime, compiler and torch-neuronx one supported release (torch-neuronx 2.9)?"""
    releases, pinned = pins["releases"], pins["neuron_sdk"]
    span = f"{min(releases, key=version_key)}-{max(releases, key=version_key)}"
    present = {c: v for c, v in installed.items() if v}
    if not present:
        return Check("neuron-sdk", SKIP, "no Neuron SDK package installed",
                     f"on a trn1/inf2 machine install SDK {pinned} (ami/provision.sh does)")
    placeholders = [c for c in PIP_COMPONENTS if present.get(c) and not real_neuron_wheel(present[c])]
    if placeholders:
        return Check("neuron-sdk", FAIL, ", ".join(f"{c} {present[c]}" for c in placeholders)
                     + ": the empty placeholder wheels from PyPI",
                     f"pip install the pinned versions from {pins['repositories']['pip']} "
                     "(exact pins keep pip from picking the PyPI placeholders)")
    missing = [c for c in USERSPACE if c not in present]
    if missing:
        return Check("neuron-sdk", FAIL, "missing: " + ", ".join(missing),
                     f"install the whole SDK {pinned} (ami/provision.sh); training needs all of "
                     + ", ".join(USERSPACE))
    matches = {c: release_of(c, v, releases) for c, v in present.items()}
    unknown = [c for c in USERSPACE if not matches[c]]
    if unknown:
        listed = ", ".join(f"{c} {present[c]}" for c in unknown)
        return Check("neuron-sdk", FAIL, f"{listed}: not from a torch-neuronx 2.9 release (SDK {span})",
                     f"PyTorch/XLA training needs torch-neuronx 2.9 (Neuron SDK {span}); "
                     f"install SDK {pinned}")
    common = set.intersection(*(matches[c] for c in USERSPACE))
    if not common:
        listed = "; ".join(f"{c} {present[c]} (SDK {'/'.join(sorted(matches[c]))})" for c in USERSPACE)
        return Check("neuron-sdk", FAIL, f"mixed releases: {listed}",
                     f"install one release: SDK {pinned} is pinned (ami/provision.sh)")
    sdk = max(common, key=version_key)
    found = f"Neuron SDK {sdk}: " + ", ".join(f"{c} {present[c]}" for c in USERSPACE)
    driver_problem = _driver_vs_runtime(present.get("aws-neuronx-dkms"), sdk, releases)
    if driver_problem:
        return Check("neuron-sdk", FAIL, f"{found}; {driver_problem}",
                     f"install aws-neuronx-dkms {releases[sdk]['aws-neuronx-dkms']} or newer")
    tools = present.get("aws-neuronx-tools")
    if tools and not release_of("aws-neuronx-tools", tools, releases):
        return Check("neuron-sdk", WARN, f"{found}; aws-neuronx-tools {tools} is from another release",
                     f"install aws-neuronx-tools {releases[sdk]['aws-neuronx-tools']}")
    if pinned not in common:
        return Check("neuron-sdk", OK, f"{found} (supported; the image pins {pinned})",
                     "compile caches are keyed by the neuronx-cc version: precompile on this SDK")
    return Check("neuron-sdk", OK, f"{found} (pinned)")


def real_neuron_wheel(version: str | None) -> bool:
    """False for the 1.0 / 1.0.post1 placeholders that the public index holds under Neuron's names."""
    if not version:
        return False
    return version_key(version)[0] >= 2


def _driver_vs_runtime(driver: str | None, sdk: str, releases: dict[str, dict[str, str]]) -> str:
    """A newer driver serves older runtimes; an older one may not (runtime 'compatibility id' error)."""
    if not driver:
        return ""
    needed = releases[sdk]["aws-neuronx-dkms"]
    if version_key(driver) < version_key(needed):
        return f"driver {driver} is older than SDK {sdk}'s {needed}"
    return ""


def check_framework(pip: dict[str, str | None], python: str, pins: dict) -> Check:
    want = pins["framework"]
    have = {name: pip.get(name) for name in FRAMEWORK}
    found = ", ".join(f"{n} {v or 'missing'}" for n, v in have.items()) + f", Python {python}"
    if not have["torch"] or not have["torch-xla"]:
        return Check("torch-xla", FAIL, found, "pip install the project (`pip install -e .`): it "
                     f"pins torch {want['torch']}, torch-xla {want['torch-xla']}")
    minor = {n: ".".join(normalize_version(v).split(".")[:2]) for n, v in have.items() if v}
    if minor["torch"] != minor["torch-xla"]:
        return Check("torch-xla", FAIL, found, "torch and torch-xla must share a minor version "
                     "(an undefined-symbol ImportError otherwise): reinstall the pinned pair")
    if minor["torch"] != ".".join(want["torch"].split(".")[:2]):
        return Check("torch-xla", FAIL, found, f"torch-neuronx 2.9 (the last PyTorch/XLA training "
                     f"stack) needs torch {want['torch']}; reinstall the pinned versions")
    if python not in pins["python"]:
        return Check("torch-xla", WARN, found, "torch-neuronx 2.9 wheels exist for Python "
                     + ", ".join(pins["python"]) + " only")
    drift = [n for n in FRAMEWORK if (v := have[n]) and normalize_version(v) != want[n]]
    if drift:
        return Check("torch-xla", WARN, found, "pinned: " + ", ".join(f"{n} {want[n]}" for n in drift))
    return Check("torch-xla", OK, found)


def check_pjrt(pjrt_env: str | None, has_neuron: bool, neuron_plugin: bool, cores: int) -> Check:
    """Which PJRT device a run will use (neuron-train picks NEURON when /dev/neuron* exists)."""
    if has_neuron:
        if pjrt_env == "CPU":
            return Check("pjrt-device", WARN, f"PJRT_DEVICE=CPU on a machine with {cores} NeuronCore(s)",
                         "runs will train on the CPU XLA device: unset PJRT_DEVICE")
        if pjrt_env not in (None, "", "NEURON"):
            return Check("pjrt-device", FAIL, f"PJRT_DEVICE={pjrt_env} on a Neuron machine",
                         "unset PJRT_DEVICE (neuron-train selects NEURON)")
        if not neuron_plugin:
            return Check("pjrt-device", FAIL, "Neuron device present but no Neuron PJRT plugin "
                         "(libneuronxla)", "install the pinned torch-neuronx and libneuronxla")
        return Check("pjrt-device", OK, f"NEURON: runs train on {cores} NeuronCore(s)")
    if pjrt_env == "NEURON":
        return Check("pjrt-device", FAIL, "PJRT_DEVICE=NEURON but no Neuron device",
                     "unset PJRT_DEVICE here, or run on a trn1/inf2 instance")
    return Check("pjrt-device", OK, "CPU: runs train on the CPU XLA device (PJRT_DEVICE=CPU)",
                 "expect CPU speed: fine for development, tests and the bundled digits example")


def check_cache(spot: CacheSpot, multi_node: bool) -> Check:
    name, facts = f"cache:{spot.label}", spot.facts
    if facts is None:
        return Check(name, OK, f"{spot.location} ({spot.source}): remote, no local space used")
    found = (f"{facts.path} (from {spot.source}"
             + ("" if facts.exists else ", created on first use")
             + f"): {facts.fstype} at {facts.mount_point}")
    if facts.free_bytes is not None:
        found += f", {facts.free_bytes / GIB:.1f} GiB free"
    if not facts.writable:
        return Check(name, FAIL, found + ", not writable", "choose a writable local directory")
    if facts.fstype in NETWORK_FS:
        shared = ("a cache on NFS/EFS/FSx shared by several hosts breaks file locking (missing or "
                  "corrupt NEFFs): use one local cache directory per host, e.g. under /var/tmp")
        return Check(name, FAIL if multi_node else WARN, found + ": network file system", shared)
    if facts.free_bytes is not None and facts.free_bytes < GIB:
        return Check(name, FAIL, found, "free disk space or point the cache elsewhere")
    if facts.free_bytes is not None and facts.free_bytes < 20 * GIB:
        return Check(name, WARN, found, "large models compile to many GiB of NEFFs: keep >= 20 GiB free")
    return Check(name, OK, found)


def check_nofile(soft: int, hard: int) -> Check:
    found = f"ulimit -n {soft} (hard {hard})"
    if soft != resource.RLIM_INFINITY and soft < RECOMMENDED_NOFILE:
        return Check("open-files", WARN, found,
                     f"32 workers with collectives can hit 'Too many open files': raise nofile to "
                     f"{RECOMMENDED_NOFILE} in /etc/security/limits.d (the image does) and log in again")
    return Check("open-files", OK, found)


def check_efa(fi_info: ToolRun | None, multi_node: bool, device_count: int) -> Check:
    if not multi_node:
        return Check("efa", SKIP, "single node: EFA not needed", "pass --multi-node on cluster nodes")
    if fi_info is None:
        return Check("efa", FAIL, "fi_info not found: the EFA software is not installed",
                     "install the EFA installer (ami/provision.sh does, signature-checked)")
    rdm = {e.get("domain") for e in parse_fi_info(fi_info.stdout)
           if e.get("provider") == "efa" and e.get("type", "FI_EP_RDM") == "FI_EP_RDM"}
    if fi_info.returncode != 0 or not rdm:
        said = (fi_info.stderr or fi_info.stdout).strip().splitlines()
        return Check("efa", FAIL, "no EFA device: " + (said[0] if said else "fi_info -p efa found none"),
                     "launch trn1.32xlarge/trn1n.32xlarge with EFA network interfaces, in a security "
                     "group that allows all traffic to and from itself")
    names = sorted(d for d in rdm if d)
    shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"
    found = f"{len(rdm)} EFA device(s): {shown}"
    if device_count >= 16 and len(rdm) < 8:
        # trn1.32xlarge has 8 EFA devices, trn1n.32xlarge 16 (Neuron multi-node setup guide).
        return Check("efa", WARN, found, "trn1.32xlarge has 8 EFA interfaces (trn1n 16): attach all "
                     "of them or inter-node bandwidth is cut")
    return Check("efa", OK, found)


def check_memlock(soft: int, multi_node: bool) -> Check:
    if not multi_node:
        return Check("memlock", SKIP, "single node")
    if soft != resource.RLIM_INFINITY:
        return Check("memlock", WARN, f"ulimit -l {soft}", "EFA registers memory: set memlock "
                     "unlimited (the EFA installer's /etc/security/limits.d/01_efa.conf does)")
    return Check("memlock", OK, "ulimit -l unlimited")


def run_checks(facts: Facts, pins: dict, *, multi_node: bool = False,
               require_neuron: bool = False) -> list[Check]:
    apt = parse_dpkg(facts.dpkg.stdout) if facts.dpkg and facts.dpkg.returncode == 0 else {}
    devices = _devices_or_empty(facts.neuron_ls)
    has_neuron = bool(devices) or facts.dev_nodes > 0
    cores = sum(int(d.get("nc_count", 0)) for d in devices)
    installed = {c: apt.get(c) for c in APT_COMPONENTS} | {c: facts.pip.get(c) for c in PIP_COMPONENTS}
    if facts.driver_loaded:
        installed["aws-neuronx-dkms"] = facts.driver_loaded  # what runs, not what is on disk
    checks = [
        check_devices(facts.neuron_ls, facts.dev_nodes, require_neuron),
        check_driver(facts.driver_loaded, apt, has_neuron),
        check_sdk(installed, pins),
        check_framework(facts.pip, facts.python, pins),
        check_pjrt(facts.env.get("PJRT_DEVICE"), has_neuron, real_neuron_wheel(facts.pip.get("libneuronxla")),
                   cores),
        *(check_cache(spot, multi_node) for spot in facts.caches),
        check_nofile(*facts.nofile),
        check_efa(facts.fi_info, multi_node, len(devices)),
        check_memlock(facts.memlock[0], multi_node),
    ]
    if not has_neuron and not require_neuron:
        # Without a device, a missing or broken SDK does not stop anything: CPU runs need none.
        checks = [Check(c.name, WARN, c.found, c.advice) if c.name == "neuron-sdk" and c.status == FAIL
                  else c for c in checks]
    return checks


def _devices_or_empty(neuron_ls: ToolRun | None) -> list[dict]:
    if neuron_ls is None or neuron_ls.returncode != 0:
        return []
    try:
        return parse_neuron_ls(neuron_ls.stdout)
    except ValueError:
        return []


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0

