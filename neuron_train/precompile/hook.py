"""The training loop's link to the compile cache: records graphs (precompile's graph tour) or
checks a real run against the manifest. Also the environment both sides agree on.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import is_s3, write_json_atomic
from neuron_train.common.neuron_env import EXTRACT_ENV, NETWORK_FS, neuron_cache_location, path_facts
from neuron_train.precompile import store
from neuron_train.precompile.coverage import (
    GRAPH_DETAILS,
    coverage_report,
    covering_hashes,
    explain,
    fingerprint,
    format_coverage,
    graph_config,
    graph_library_versions,
)
from neuron_train.precompile.maintenance import check_files
from neuron_train.precompile.manifest import ConfigRecord, GraphRecord, Manifest
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import config_to_argv

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


class CompileCacheHook:
    """The training loop's link to the compile cache: records graphs (precompile) or checks them.

    Without --compile-cache every method returns at once. Construct it before the first step:
    under the graph tour it points torch_xla's persistent cache at a private staging directory,
    which must happen before anything compiles.
    """

    def __init__(self, cfg: RunConfig, backend, *, num_classes: int):
        from neuron_train.common.neuron_env import extracting_graphs

        self.recording = extracting_graphs()
        if os.environ.get(PRECOMPILE_ENV) and not self.recording:
            raise RunError(f"{PRECOMPILE_ENV} is set but {EXTRACT_ENV} is not: the graph-extraction "
                           "switch was lost on the way (a wrapper script or launcher that drops "
                           "environment variables?); refusing to run a full training as a precompile")
        self.dir = Path(cfg.compile.compile_cache) if cfg.compile.compile_cache else None
        if self.dir is None:
            return
        if is_s3(str(self.dir)):
            raise UsageError("--compile-cache must be a local directory (move caches to and from S3 "
                             "with `neuron-train cache pack/unpack`)")
        self.precompile_id = os.environ.get(PRECOMPILE_ENV)
        self.require = cfg.compile.require_precompiled and not self.recording
        self.speaks = backend.local_rank == 0  # one process per host checks files and prints
        self.writes_report = backend.is_main
        self.config = graph_config(cfg, world_size=backend.world_size, num_classes=num_classes,
                                   device=backend.kind, env=os.environ, versions=graph_library_versions())
        self.fp = fingerprint(self.config)
        self.hint = precompile_hint(cfg, self.dir, backend.world_size)
        self.tour_steps = tour_steps(cfg)
        self.checked: set[str] = set()   # graph hashes already compared with the manifest
        self.compiles_seen = 0
        self.staging: Path | None = None
        self._point_compiler_at_cache()
        self.use = store.CacheUse(self.dir)  # prune must wait until this run ends
        if self.recording:
            self._stage_xla_cache(backend)
        else:
            self._check_start()

    def _point_compiler_at_cache(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        flags, note = cache_flags(os.environ, self.dir)
        os.environ["NEURON_CC_FLAGS"] = flags  # read by the Neuron compiler wrapper when it compiles
        if self.speaks:
            for message in (note, network_fs_warning(self.dir)):
                if message:
                    warn(message)

    # ----- recording (the graph tour) --------------------------------------------------------
    def _stage_xla_cache(self, backend) -> None:
        """torch_xla's own persistent cache (non-Neuron devices), staged privately: see store.py."""
        if backend.kind == "NEURON":
            return  # Neuron caches NEFFs itself, in NEURON_CC_FLAGS --cache_dir
        import torch_xla.runtime as xr

        self.staging = self.dir / store.STAGING_DIR / f"{socket.gethostname()}-{os.getpid()}"
        self.staging.mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(self.staging), readonly=False)

    def _record(self, graphs: list[dict]) -> None:
        record_graphs(self.dir, self.fp, self.config, graphs, precompile_id=self.precompile_id,
                      tour_steps=self.tour_steps)
        if self.staging is not None:
            store.commit_staged(self.dir, self.staging, self.fp)

    # ----- checking (a real run) -------------------------------------------------------------
    def _check_start(self) -> None:
        """Before any compile: refuse damaged entries; with --require-precompiled, a config mismatch."""
        manifest = store.load_manifest(self.dir)
        if self.speaks:
            findings = check_files(self.dir, manifest.files)
            corrupt = [f for f in findings if f.problem == "corrupt"]
            if corrupt:
                raise RunError(f"compile cache {self.dir} has {len(corrupt)} damaged file(s), e.g. "
                               f"{corrupt[0].entry}: {corrupt[0].detail}; it will not be used: run `neuron-train cache "
                               f"verify --compile-cache {self.dir} --quarantine`, then precompile again")
            missing = [f for f in findings if f.problem == "missing"]
            failed = [e for e in store.scan(self.dir) if e.state == store.FAILED]
            if missing:
                warn(f"{len(missing)} recorded cache file(s) are gone from {self.dir} (e.g. {missing[0].entry}): "
                     "those graphs will compile again")
            if failed:
                warn(f"{len(failed)} graph(s) in {self.dir} are cached as FAILED compiles and will not be "
                     f"retried (e.g. {failed[0].path}): precompile with --retry-failed")
        record = manifest.configs.get(self.fp)
        if not self.require or (record and not record.pruned_files):
            return
        raise RunError(f"--require-precompiled: this configuration is not precompiled in {self.dir}: "
                       f"{explain(manifest, self.config, str(self.dir))}. Precompile it first: {self.hint}")

    def check(self, watch) -> None:
        """Step closure: with --require-precompiled, stop at the first graph the manifest lacks.

        Only looks when the compile counter moved: GraphWatch.summary() reads the debug log, and
        most steps compile nothing.
        """
        if self.dir is None or not self.require:
            return
        import torch_xla.debug.metrics as met

        compiles = met.counter_value("UncachedCompile") or 0
        if compiles == self.compiles_seen:
            return
        self.compiles_seen = compiles
        new = [g for g in watch.summary()["graphs"] if g.get("hash") and g["hash"] not in self.checked]
        if not new:
            return
        manifest = store.load_manifest(self.dir)
        known = covering_hashes(manifest, self.config)
        for g in new:
            self.checked.add(g["hash"])
            if g["hash"] not in known:
                raise RunError(f"--require-precompiled: graph {g['hash'][:12]} ({g.get('phase')}, step "
                               f"{g.get('step')}) is not in {self.dir}/{store.MANIFEST}: "
                               f"{explain(manifest, self.config, str(self.dir))}. Precompile: {self.hint}")

    def finish(self, graph_summary: dict, run_dir: Path | None) -> float | None:
        """At the end of the run: record (graph tour) or report coverage; returns the coverage."""
        if self.dir is None:
            return None
        try:
            graphs = graph_summary["graphs"]
            if self.recording:
                self._record(graphs)
                return None
            report = coverage_report(graphs, store.load_manifest(self.dir), self.config, str(self.dir))
            if self.writes_report:
                print(format_coverage(report), flush=True)
                if run_dir is not None:
                    write_json_atomic(Path(run_dir) / "precompile_coverage.json", report)
            if self.require and report["missing"]:
                raise RunError(f"--require-precompiled: {format_coverage(report)}")
            return report["coverage"]
        finally:
            self.use.release()


def record_graphs(cache: Path, fp: str, config: dict, graphs: list[dict], *, precompile_id: str | None,
                  tour_steps: int) -> None:
    """Add a graph tour's graphs to the manifest under configuration `fp` (our loop's tour and any
    script's precompile both record through here): hash, phase, step, compile time, and the details
    coverage compares later (call site, kind, input shapes) when the tour knew them."""
    now = store.utc_now()

    def add(manifest: Manifest) -> None:
        record = manifest.configs.setdefault(fp, ConfigRecord(config=config, created=now))
        for g in graphs:
            if g.get("hash"):
                record.graphs.setdefault(g["hash"], GraphRecord(
                    phase=g.get("phase"), step=g.get("step"), compile_time_s=g.get("compile_time_s"),
                    extra={k: g[k] for k in GRAPH_DETAILS if g.get(k)}))
        unidentified = sum(1 for g in graphs if not g.get("hash"))
        record.unidentified_graphs = max(record.unidentified_graphs, unidentified)
        if precompile_id and precompile_id not in record.precompile_ids:
            record.precompile_ids.append(precompile_id)
        record.updated, record.host, record.tour_steps = now, socket.gethostname(), tour_steps
        record.pruned_files, record.pruned_at = 0, None  # precompiled again: its entries are rebuilt

    store.update_manifest(cache, add)


def precompile_hint(cfg: RunConfig, cache: Path, world: int) -> str:
    """The precompile command for this run's configuration (its flags, minus the run-only ones)."""
    run_only = ("--output-dir", "--compile-cache", "--require-precompiled", "--no-require-precompiled",
                "--resume")
    argv, flags = config_to_argv(cfg), []
    i = 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if argv[i] not in run_only:
            flags += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    return shlex.join(["scripts/precompile.sh", "--compile-cache", str(cache), "--nproc-per-node", str(world),
                       "--", *flags])


def tour_steps(cfg: RunConfig) -> int:
    """Train steps the graph tour needs to reach every step-dependent graph variant of the run.

    Step 0 (optimizer state created) and a steady step; past the graph warm-up; and with sifting,
    full-batch steps before --sift-delay and sifted ones after it. Eval and checkpoint graphs are
    reached at the tour's last step (loop.py).
    """
    steps = max(cfg.train.precompile_steps, cfg.compile.graph_warmup_steps + 1)
    if cfg.sift.sift != "off":
        steps = max(steps, cfg.sift.sift_delay + 2)
    return steps

