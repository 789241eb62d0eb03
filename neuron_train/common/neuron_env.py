"""Facts about the Neuron environment that several products read: whether a device is present,
whether this process is neuron_parallel_compile's graph extraction, where the compiler caches, what
NEURON_CC_FLAGS holds, which file system a path lives on, and installed library versions.

Pure functions of their arguments (or of os.environ / the file system where named); no torch import.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

EXTRACT_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"   # neuron_parallel_compile's graph-extraction switch
DEFAULT_NEURON_CACHE = "/var/tmp/neuron-compile-cache"  # the compiler's default when nothing is set
NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "9p", "fuse.s3fs", "fuse.mountpoint-s3")
# Flags of the compiler wrapper that choose the cache, not the graph (they do not change a NEFF).
WRAPPER_FLAGS = ("--cache_dir", "--retry_failed_compilation", "--no_cache", "--log_level")
_WRAPPER_FLAGS_WITH_VALUE = ("--cache_dir", "--log_level")


def neuron_device_present() -> bool:
    return any(Path("/dev").glob("neuron[0-9]*"))


def default_pjrt_device(env: Mapping[str, str] | None = None) -> str:
    """The PJRT device a run uses: PJRT_DEVICE if set, else NEURON when a Neuron device is present,
    else CPU (the CPU XLA device)."""
    env = os.environ if env is None else env
    return env.get("PJRT_DEVICE") or ("NEURON" if neuron_device_present() else "CPU")


def extracting_graphs(env: Mapping[str, str] | None = None) -> bool:
    """True under neuron_parallel_compile's extraction run: outputs are garbage, keep no results."""
    env = os.environ if env is None else env
    return env.get(EXTRACT_ENV, "") not in ("", "0")


def cc_flag_tokens(env: Mapping[str, str]) -> list[str]:
    """NEURON_CC_FLAGS split as the shell would (as whitespace-separated words if unbalanced)."""
    flags = env.get("NEURON_CC_FLAGS", "")
    try:
        return shlex.split(flags)
    except ValueError:
        return flags.split()


def compiler_flags(env: Mapping[str, str]) -> str:
    """NEURON_CC_FLAGS without the cache wrapper's own flags (they do not change graphs)."""
    kept, skip_value = [], False
    for tok in cc_flag_tokens(env):
        if skip_value:
            skip_value = False
            continue
        name = tok.split("=", 1)[0]
        if name in WRAPPER_FLAGS:
            skip_value = "=" not in tok and name in _WRAPPER_FLAGS_WITH_VALUE
            continue
        kept.append(tok)
    return " ".join(kept)


# What torch_xla 2.9 hashes from the environment into every graph it compiles (runtime/env_hash.cc):
# the XLA flags of these variables, split at spaces, "--xla" words only, dump flags left out,
# sorted; and these variables' raw values (XLA_HLO_DEBUG / XLA_IR_DEBUG: what profiling guides set).
XLA_HASHED_FLAG_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
XLA_HASHED_RAW_VARS = ("TPU_MEGACORE", "XLA_HLO_DEBUG", "XLA_IR_DEBUG")
_XLA_UNHASHED_FLAGS = frozenset(f"--xla_{name}" for name in (
    "dump_compress_protos", "dump_module_metadata", "dump_max_hlo_modules", "dump_include_timestamp",
    "dump_hlo_pass_re", "dump_hlo_module_re", "dump_hlo_snapshots", "dump_fusion_visualization",
    "dump_hlo_as_url", "dump_hlo_as_proto", "dump_hlo_as_text", "dump_hlo_as_long_text", "dump_hlo_as_html",
    "dump_hlo_as_dot", "dump_to", "force_host_platform_device_count", "dump_disable_metadata",
    "dump_hlo_pipeline_re", "tpu_sdc_checker_streamz_metric", "tpu_sdc_checker_enable_sdc_event_callbacks"))


def xla_hashed_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment torch_xla puts into every graph hash, as it reads it (unset and empty are the
    same to it; an unset variable is left out). Two runs whose values differ compile other graphs."""
    out = {}
    for name in XLA_HASHED_FLAG_VARS:
        words = [w for w in env.get(name, "").split(" ")  # torch_xla splits at ' ' only, not tabs
                 if w.startswith("--xla") and w.split("=", 1)[0] not in _XLA_UNHASHED_FLAGS]
        if words:
            out[name] = " ".join(sorted(words))
    out.update({name: env[name] for name in XLA_HASHED_RAW_VARS if env.get(name)})
    return out


def neuron_cache_location(env: Mapping[str, str]) -> tuple[str, str]:
    """Where the Neuron compiler caches NEFFs, and which setting says so.

    NEURON_CC_FLAGS --cache_dir overrides NEURON_COMPILE_CACHE_URL, which overrides the default.
    """
    tokens = cc_flag_tokens(env)
    for i, tok in enumerate(tokens):
        if tok.startswith("--cache_dir="):
            return tok.split("=", 1)[1], "NEURON_CC_FLAGS --cache_dir"
        if tok == "--cache_dir" and i + 1 < len(tokens):
            return tokens[i + 1], "NEURON_CC_FLAGS --cache_dir"
    if env.get("NEURON_COMPILE_CACHE_URL"):
        return env["NEURON_COMPILE_CACHE_URL"], "NEURON_COMPILE_CACHE_URL"
    return DEFAULT_NEURON_CACHE, "Neuron default"


def dist_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of the distributions in `names` (absent ones left out)."""
    return {name: v for name in names if (v := dist_version(name))}


@dataclass
class PathFacts:
    path: str
    exists: bool
    writable: bool
    free_bytes: int | None
    mount_point: str
    fstype: str


def mount_of(path: str, mounts_text: str) -> tuple[str, str]:
    """(mount point, fs type) holding `path`, from /proc/mounts text (longest matching prefix)."""
    best = ("/", "unknown")
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, parts[2])
    return best


def path_facts(path: str, mounts_text: str) -> PathFacts:
    p = Path(path).expanduser().absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the cache dir is created on first use: measure where it will live
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    point, fstype = mount_of(str(probe.resolve()), mounts_text)
    return PathFacts(str(p), p.exists(), os.access(probe, os.W_OK), free, point, fstype)
