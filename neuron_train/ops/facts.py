"""What `neuron-train doctor` gathers: it runs the tools (neuron-ls, dpkg-query, fi_info) and reads
/sys, /proc and the environment, recording their raw output as `Facts` (the impure half), and
parses those outputs (pure). Nothing here initialises the Neuron runtime: on a busy machine that
would grab NeuronCores.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from neuron_train.common.neuron_env import (
    PathFacts,
    dist_version,
    neuron_cache_location,
    path_facts,
)

GIB = 1024**3


NEURON_BIN = "/opt/aws/neuron/bin"


EFA_BIN = "/opt/amazon/efa/bin"


DRIVER_VERSION_FILE = "/sys/module/neuron/version"  # the version of the neuron module actually loaded


APT_COMPONENTS = ("aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives",
                  "aws-neuronx-tools")


PIP_COMPONENTS = ("neuronx-cc", "torch-neuronx", "libneuronxla")


FRAMEWORK = ("torch", "torch-xla", "torchvision")
TOOL_TIMEOUT_S = 30


@dataclass(frozen=True)
class ToolRun:
    """The recorded result of one external command."""

    returncode: int
    stdout: str
    stderr: str = ""


@dataclass(frozen=True)
class CacheSpot:
    """One compile-cache location a run will use."""

    label: str                  # 'neuron' (the compiler's cache) or 'project' (--compile-cache)
    source: str                 # the setting that names it
    location: str               # a path or a URL
    facts: PathFacts | None     # None for a URL (s3://...): nothing local to measure


@dataclass(frozen=True)
class Facts:
    neuron_ls: ToolRun | None          # None: neuron-ls not installed
    dev_nodes: int                     # number of /dev/neuron* character devices
    driver_loaded: str | None          # /sys/module/neuron/version (the module actually loaded)
    dpkg: ToolRun | None               # dpkg-query over aws-neuronx-*; None: not a Debian system
    pip: dict[str, str | None]         # distribution -> version (None: not installed)
    env: dict[str, str]                # the environment variables the checks read
    python: str
    nofile: tuple[int, int]
    memlock: tuple[int, int]
    fi_info: ToolRun | None = None     # gathered only with --multi-node
    caches: list[CacheSpot] = field(default_factory=list)


def parse_neuron_ls(stdout: str) -> list[dict]:
    """`neuron-ls --json-output`: a JSON array, one object per Neuron device."""
    devices = json.loads(stdout) if stdout.strip() else []
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise ValueError("expected a JSON array of device objects")
    return devices


def parse_dpkg(stdout: str) -> dict[str, str]:
    """`dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n'`: installed ('ii') packages."""
    installed = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "ii":
            installed[parts[1]] = parts[2]
    return installed


def parse_fi_info(stdout: str) -> list[dict[str, str]]:
    """`fi_info -p efa`: blocks starting at 'provider:' with indented 'key: value' lines."""
    entries: list[dict[str, str]] = []
    for line in stdout.splitlines():
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        if key == "provider":
            entries.append({})
        if entries:
            entries[-1][key] = value.strip()
    return entries


def _run(argv: list[str]) -> ToolRun:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return ToolRun(124, "", f"{argv[0]} timed out after {TOOL_TIMEOUT_S} s")
    except OSError as exc:
        return ToolRun(127, "", str(exc))
    return ToolRun(p.returncode, p.stdout, p.stderr)


def _tool(name: str, fallback_dir: str) -> str | None:
    """PATH first; then the SDK's install dir, which non-login shells (systemd, SLURM) lack on PATH."""
    found = shutil.which(name)
    candidate = Path(fallback_dir) / name
    return found or (str(candidate) if candidate.is_file() else None)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def gather_facts(*, multi_node: bool, compile_cache: str | None,
                 driver_version_file: str = DRIVER_VERSION_FILE) -> Facts:
    neuron_ls_bin = _tool("neuron-ls", NEURON_BIN)
    dpkg = _run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Package} ${Version}\\n",
                 "aws-neuronx-*"]) if shutil.which("dpkg-query") else None
    fi_info_bin = _tool("fi_info", EFA_BIN) if multi_node else None
    fi_info = _run([fi_info_bin, "-p", "efa"]) if fi_info_bin else None
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("NEURON_", "PJRT_", "FI_", "XLA_"))}
    mounts = _read("/proc/mounts") or ""
    neuron_cache, neuron_source = neuron_cache_location(env)
    spots = [("neuron", neuron_source, neuron_cache)]
    if compile_cache:
        spots.append(("project", "--compile-cache", compile_cache))
    caches = [CacheSpot(label, source, loc, None if "://" in loc else path_facts(loc, mounts))
              for label, source, loc in spots]
    return Facts(
        neuron_ls=_run([neuron_ls_bin, "--json-output"]) if neuron_ls_bin else None,
        dev_nodes=len(list(Path("/dev").glob("neuron[0-9]*"))),
        driver_loaded=_read(driver_version_file),
        dpkg=dpkg,
        pip={name: dist_version(name) for name in (*FRAMEWORK, *PIP_COMPONENTS)},
        env=env,
        python=".".join(platform.python_version_tuple()[:2]),
        nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
        memlock=resource.getrlimit(resource.RLIMIT_MEMLOCK),
        fi_info=fi_info,
        caches=caches,
    )

