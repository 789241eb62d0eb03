"""The training loop's link to the compile cache: records graphs (precompile's graph tour) or
checks a real run against the manifest; which settings make up a run's configuration
(`graph_config`: the fields training/config.py marks `graph=`, plus world size, device and the
compile environment); the precompile command a run names (`precompile_hint`) and the tour's length.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_train.common.errors import RunError
from neuron_train.common.fileio import write_json_atomic
from neuron_train.common.neuron_env import EXTRACT_ENV, compiler_flags
from neuron_train.graphs import Graph, GraphReport, GraphWatch
from neuron_train.precompile import store
from neuron_train.precompile.cache_env import (
    PRECOMPILE_ENV,
    cache_flags,
    check_cache,
    network_fs_warning,
    record_graphs,
    warn,
)
from neuron_train.precompile.coverage import (
    coverage_report,
    covering_hashes,
    explain,
    fingerprint,
    format_coverage,
    graph_library_versions,
    xla_env_setting,
)
from neuron_train.training.config import RunConfig, graph_labels, graph_settings
from neuron_train.training.config_io import config_to_argv

if TYPE_CHECKING:  # device.py imports torch: precompile's command reads tour_steps without it
    from neuron_train.training.device import Backend

RUNTIME_LABELS = {"world_size": "world size"}


def graph_config(cfg: RunConfig, *, world_size: int, num_classes: int, device: str,
                 env: Mapping[str, str], versions: dict[str, str]) -> dict:
    """The settings that determine which graphs a run compiles (plain JSON values): the fields
    config.py marks `graph=`, the number of classes the data gave, and where and how it compiles
    (device, compiler flags, versions, and what torch_xla hashes from the environment)."""
    return {**graph_settings(cfg), "num_classes": num_classes, "world_size": world_size, "device": device,
            "neuron_cc_flags": compiler_flags(env), "versions": dict(sorted(versions.items())),
            **xla_env_setting(env)}


def point_compiler_at_cache(cache: str | None) -> str | None:
    """NEURON_CC_FLAGS --cache_dir for --compile-cache DIR (an S3 URL is refused: `store.open_cache`);
    returns a note about what it overrides. `train` calls it before the device client starts, so the
    runtime and every compiler process it starts inherit it; the hook again (the same value) for the
    commands that build the loop themselves."""
    if not cache:
        return None
    flags, note = cache_flags(os.environ, store.open_cache(cache))
    os.environ["NEURON_CC_FLAGS"] = flags  # read by the Neuron compiler wrapper when it compiles
    return note


def config_labels() -> dict[str, str]:
    return {**graph_labels(), **RUNTIME_LABELS}


class CompileCacheHook:
    """The training loop's link to the compile cache: records graphs (precompile) or checks them.

    Without --compile-cache every method returns at once. Construct it before the first step:
    under the graph tour it points torch_xla's persistent cache at a private staging directory,
    which must happen before anything compiles.
    """

    def __init__(self, cfg: RunConfig, backend: Backend, *, num_classes: int) -> None:
        from neuron_train.common.neuron_env import extracting_graphs

        self.recording = extracting_graphs()
        if os.environ.get(PRECOMPILE_ENV) and not self.recording:
            raise RunError(f"{PRECOMPILE_ENV} is set but {EXTRACT_ENV} is not: the graph-extraction "
                           "switch was lost on the way (a wrapper script or launcher that drops "
                           "environment variables?); refusing to run a full training as a precompile")
        self.dir = store.open_cache(cfg.compile.compile_cache) if cfg.compile.compile_cache else None
        if self.dir is None:
            return
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

    @property
    def _cache(self) -> Path:
        assert self.dir is not None  # the methods below run only once --compile-cache was given
        return self.dir

    def _point_compiler_at_cache(self) -> None:
        self._cache.mkdir(parents=True, exist_ok=True)
        note = point_compiler_at_cache(str(self._cache))  # train did it before the device started; others now
        if self.speaks:
            for message in (note, network_fs_warning(self._cache)):
                if message:
                    warn(message)

    # ----- recording (the graph tour) --------------------------------------------------------
    def _stage_xla_cache(self, backend: Backend) -> None:
        """torch_xla's own persistent cache (non-Neuron devices), staged privately: see store.py."""
        if backend.kind == "NEURON":
            return  # Neuron caches NEFFs itself, in NEURON_CC_FLAGS --cache_dir
        import torch_xla.runtime as xr

        self.staging = self._cache / store.STAGING_DIR / f"{socket.gethostname()}-{os.getpid()}"
        self.staging.mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(self.staging), readonly=False)

    def _record(self, graphs: list[Graph]) -> None:
        record_graphs(self._cache, self.fp, self.config, graphs, precompile_id=self.precompile_id,
                      tour_steps=self.tour_steps)
        if self.staging is not None:
            store.commit_staged(self._cache, self.staging, self.fp)

    # ----- checking (a real run) -------------------------------------------------------------
    def _check_start(self) -> None:
        """Before any compile: refuse damaged entries; with --require-precompiled, a config mismatch."""
        manifest = store.load_manifest(self._cache)
        if self.speaks:  # one process per host: the files are the host's
            missing = check_cache(self._cache, manifest)
            if missing:
                warn(f"{len(missing)} recorded cache file(s) are gone from {self._cache} (e.g. {missing[0].entry}): "
                     "those graphs will compile again")
        record = manifest.configs.get(self.fp)
        if not self.require or (record and not record.pruned_files):
            return
        raise RunError(f"--require-precompiled: this configuration is not precompiled in {self._cache}: "
                       f"{explain(manifest, self.config, str(self._cache), config_labels())}. "
                       f"Precompile it first: {self.hint}")

    def check(self, watch: GraphWatch) -> None:
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
        new = [g for g in watch.summary().graphs if g.hash and g.hash not in self.checked]
        if not new:
            return
        manifest = store.load_manifest(self.dir)
        known = covering_hashes(manifest, self.config)
        for g in new:
            self.checked.add(g.hash)
            if g.hash not in known:
                raise RunError(f"--require-precompiled: graph {g.hash[:12]} ({g.phase}, step "
                               f"{g.step}) is not in {self.dir}/{store.MANIFEST}: "
                               f"{explain(manifest, self.config, str(self.dir), config_labels())}. "
                               f"Precompile: {self.hint}")

    def finish(self, graph_summary: GraphReport, run_dir: Path | None) -> float | None:
        """At the end of the run: record (graph tour) or report coverage; returns the coverage."""
        if self.dir is None:
            return None
        try:
            graphs = graph_summary.graphs
            if self.recording:
                self._record(graphs)
                return None
            report = coverage_report(graphs, store.load_manifest(self.dir), self.config, str(self.dir),
                                     config_labels())
            if self.writes_report:
                print(format_coverage(report), flush=True)
                if run_dir is not None:
                    write_json_atomic(Path(run_dir) / "precompile_coverage.json", report.to_json())
            if self.require and report.missing:
                raise RunError(f"--require-precompiled: {format_coverage(report)}")
            return report.coverage
        finally:
            self.use.release()


def precompile_hint(cfg: RunConfig, cache: Path, world: int) -> str:
    """The precompile command for this run's configuration, as docs/precompile.md documents it: the
    flags the configuration declares (config_to_argv), without the settings of this run alone
    (where it writes, which cache it reads and how strictly, what it resumes; at their defaults,
    config_to_argv leaves them out)."""
    tour = replace(cfg, train=replace(cfg.train, output_dir=None),
                   compile=replace(cfg.compile, compile_cache=None, require_precompiled=False),
                   checkpoint=replace(cfg.checkpoint, resume=None))
    return shlex.join(["neuron-train", "precompile", "--compile-cache", str(cache), "--nproc-per-node", str(world),
                       "--", *config_to_argv(tour)])


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

