"""What the compile cache's users agree on: the compiler flags that point at it, the variable that
marks a precompile run, how a graph tour fills it (`compile_command`) and the one printer of a
precompile's plan (`format_plan`, for our loop's tour and any script's), recording a graph tour into
the manifest, and the one check a cache passes before anything compiles into it (training's cache
hook, check-graphs --compile-cache, precompile).
"""

from __future__ import annotations

import shlex
import socket
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.neuron_env import NETWORK_FS, neuron_cache_location, path_facts
from neuron_train.graphs.records import Graph
from neuron_train.instrument.script import RETRIES_ENV
from neuron_train.precompile import store
from neuron_train.precompile.coverage import GRAPH_DETAILS
from neuron_train.precompile.maintenance import Finding, check_files
from neuron_train.precompile.manifest import ConfigRecord, GraphRecord, Manifest

PRECOMPILE_ENV = "NEURON_TRAIN_PRECOMPILE"   # set by precompile to its run id; the loop records under it


def cache_flags(env: Mapping[str, str], cache: Path) -> tuple[str, str | None]:
    """NEURON_CC_FLAGS pointing the Neuron compiler at `cache`, and a note about what it overrides.

    A --cache_dir elsewhere is an error: the compiler would write and look up NEFFs in a different
    directory than the one the manifest describes.
    """
    location, source = neuron_cache_location(env)
    flags = env.get("NEURON_CC_FLAGS", "")
    if source == "NEURON_CC_FLAGS --cache_dir":
        if location.startswith("s3://") or Path(location).resolve() != cache.resolve():
            raise UsageError(f"NEURON_CC_FLAGS has --cache_dir={location} but the compile cache is {cache}: "
                             "the compiler would use another cache than the manifest; drop one of them")
        return flags, None
    note = None
    if source == "NEURON_COMPILE_CACHE_URL":
        note = f"NEURON_COMPILE_CACHE_URL={location} is overridden by --cache_dir={cache.resolve()}"
    return f"{flags} --cache_dir={cache.resolve()}".strip(), note


@dataclass(frozen=True)
class CompileCommand:
    command: list[str]          # what runs
    env: dict[str, str]         # set on top of the current environment
    notes: list[str]


def compile_command(tour: list[str], *, cache: Path, target: str, num_parallel: int | None, retries: int,
                    retry_failed: bool, env: Mapping[str, str]) -> CompileCommand:
    """How a graph tour fills `cache` (pure: nothing runs): under neuron_parallel_compile on Neuron
    (it extracts the graphs, then compiles them in parallel), the tour itself elsewhere. The one
    plan builder of `precompile`, for our loop's tour and for any script."""
    flags, note = cache_flags(env, cache)
    if retry_failed:
        flags += " --retry_failed_compilation"  # a wrapper flag (Neuron Persistent Cache docs)
    changes = {"NEURON_CC_FLAGS": flags}
    notes = [n for n in (note,) if n]
    if target == "neuron":
        command = ["neuron_parallel_compile", *(["--num_parallel", str(num_parallel)] if num_parallel else []),
                   *tour]
        changes[RETRIES_ENV] = str(retries)
    else:
        command = list(tour)
        if num_parallel:
            notes.append("--num-parallel only applies to neuron_parallel_compile (Neuron)")
    return CompileCommand(command, changes, notes)


@dataclass(frozen=True)
class TourPlan(ABC):
    """What a precompile will run (pure: nothing has run): our loop's tour (loop_precompile.LoopPlan)
    or any script's (script_precompile.ScriptPlan), printed by `format_plan`."""

    target: str                 # 'neuron' (under neuron_parallel_compile) or 'cpu' (the tour directly)
    cache: Path
    command: list[str]          # what runs
    env: dict[str, str]         # set on top of the current environment
    notes: list[str]

    @abstractmethod
    def before_command(self) -> list[str]:
        """The plan's lines between the cache and the command."""

    @abstractmethod
    def after_command(self) -> list[str]:
        """The plan's lines after the command: what to run once it is done."""


def format_plan(plan: TourPlan) -> str:
    """A precompile's plan as `precompile` prints it (and `--dry-run` only prints)."""
    how = (" (neuron_parallel_compile: extract graphs, then compile them in parallel)" if plan.target == "neuron"
           else " (graph tour on this device; no neuron_parallel_compile)")
    env_words = [f"{k}={v}" for k, v in plan.env.items()]
    lines = [f"target       {plan.target}{how}", f"cache        {plan.cache}", *plan.before_command(),
             "command", f"  {shlex.join(['env', *env_words, *plan.command])}", *plan.after_command(),
             *(f"note         {n}" for n in plan.notes)]
    return "\n".join(lines)


def network_fs_warning(cache: Path, mounts: str | None = None) -> str | None:
    """A warning when the cache sits on a network file system (file locks unreliable across hosts).

    `mounts` is /proc/mounts' text (read when not given).
    """
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    facts = path_facts(str(cache), mounts)
    if facts.fstype not in NETWORK_FS:
        return None
    return (f"{cache} is on {facts.fstype} ({facts.mount_point}): several hosts sharing one cache on "
            "NFS/EFS/FSx do not see each other's file locks and can corrupt entries; use one cache "
            "directory per host (e.g. --compile-cache /var/tmp/neuron-train-cache) and move it with "
            "`neuron-train cache pack/unpack`")


def warn(message: str) -> None:
    print(f"neuron-train: warning: {message}", file=sys.stderr, flush=True)


def record_graphs(cache: Path, fp: str, config: dict, graphs: Sequence[Graph], *, precompile_id: str | None,
                  tour_steps: int, shapes: Mapping[str, list[str]] | None = None) -> None:
    """Add a graph tour's graphs to the manifest under configuration `fp` (our loop's tour and any
    script's precompile both record through here): hash, phase, step, compile time, and the details
    coverage compares later (call site, kind, input `shapes` by hash) when the tour knew them."""
    now = store.utc_now()

    def add(manifest: Manifest) -> None:
        record = manifest.configs.setdefault(fp, ConfigRecord(config=config, created=now))
        for g in graphs:
            if g.hash:
                details = {"where": g.where, "site": g.site, "kind": g.kind, "input_shapes": (shapes or {}).get(g.hash)}
                record.graphs.setdefault(g.hash, GraphRecord(
                    phase=g.phase, step=g.step, compile_time_s=g.compile_time_s,
                    extra={k: details[k] for k in GRAPH_DETAILS if details[k]}))
        unidentified = sum(1 for g in graphs if not g.hash)
        record.unidentified_graphs = max(record.unidentified_graphs, unidentified)
        if precompile_id and precompile_id not in record.precompile_ids:
            record.precompile_ids.append(precompile_id)
        record.updated, record.host, record.tour_steps = now, socket.gethostname(), tour_steps
        record.pruned_files, record.pruned_at = 0, None  # precompiled again: its entries are rebuilt

    store.update_manifest(cache, add)


def check_cache(cache: Path, manifest: Manifest, *, retry_failed: bool = False) -> list[Finding]:
    """Before anything compiles into `cache`: refuse damaged entries (the compiler would trust them),
    warn about failed compiles it would not retry. Returns the recorded files that are gone."""
    findings = check_files(cache, manifest.files)
    corrupt = [f for f in findings if f.problem == "corrupt"]
    if corrupt:
        raise RunError(f"compile cache {cache} has {len(corrupt)} damaged file(s), e.g. {corrupt[0].entry}: "
                       f"{corrupt[0].detail}; it will not be used: run `neuron-train cache verify "
                       f"--compile-cache {cache} --quarantine`, then precompile again")
    failed = [e for e in store.scan(cache) if e.state == store.FAILED]
    if failed and not retry_failed:
        warn(f"{len(failed)} graph(s) in {cache} are cached as failed compiles and will not be retried "
             f"(e.g. {failed[0].path}): precompile with --retry-failed")
    return [f for f in findings if f.problem == "missing"]
