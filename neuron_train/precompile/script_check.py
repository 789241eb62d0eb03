"""`neuron-train check-graphs --compile-cache DIR [--require-precompiled] -- COMMAND`: coverage of a
script's real run by what `neuron-train precompile -- COMMAND` put into DIR.

commands/check_graphs.py builds a `CoverageCheck` when --compile-cache is given. Before the command
runs the cache is checked (a manifest that is missing, damaged, or describes files this cache does not
hold is refused) and the graph hashes it covers for this compile environment are known; the
command then runs with NEURON_CC_FLAGS pointing the compiler at DIR. Afterwards every graph the
command compiled is compared with the manifest (coverage.coverage_report: hash, call site, and what
differs from the nearest precompiled graph of the same line). With --require-precompiled the probe
(instrument/probe.py: CompileWatch) stops the command as the first uncovered graph's compile starts.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import short
from neuron_train.graphs.records import Graph, GraphReport
from neuron_train.instrument import probe
from neuron_train.instrument.script import ScriptRun, load_probes, probe_vars
from neuron_train.precompile import store
from neuron_train.precompile.cache_env import cache_flags, check_cache
from neuron_train.precompile.coverage import (
    coverage_report,
    covering_hashes,
    explain,
    format_coverage,
    nearest_graph,
    script_config,
)
from neuron_train.precompile.script_precompile import script_device


class CoverageCheck:
    """A check-graphs run's coverage check: `env` before the command runs, `finish` after it."""

    def __init__(self, cache_dir: str, command: list[str], require: bool):
        self.cache, self.command, self.require = store.open_cache(cache_dir).absolute(), command, require
        self.hint = self._precompile_command()
        if not store.has_manifest(self.cache):
            raise UsageError(f"{self.cache} holds no {store.MANIFEST}: it is not a precompiled cache; "
                             f"fill it first: {self.hint}")
        self.manifest = store.load_manifest(self.cache)  # RunError when damaged
        self._check_files()
        self.config = script_config(command, device=script_device(), env=os.environ)
        self.covered = covering_hashes(self.manifest, self.config)
        if require and not self.covered:
            raise RunError(f"--require-precompiled: nothing in {self.cache} was precompiled for this compile "
                           f"environment ({explain(self.manifest, self.config, str(self.cache))}); "
                           f"precompile first: {self.hint}")
        self.use = store.CacheUse(self.cache)  # a prune must not delete entries under this run

    def _check_files(self) -> None:
        missing = check_cache(self.cache, self.manifest)
        if self.manifest.files and len(missing) == len(self.manifest.files):
            raise RunError(f"{self.cache}/{store.MANIFEST} vouches for {len(missing)} cache file(s) that are "
                           f"not in {self.cache} (e.g. {missing[0].entry}): a manifest copied from another "
                           f"cache, or an emptied cache; precompile into it again: {self.hint}")

    def _precompile_command(self, steps: int | None = None) -> str:
        """The precompile command for this run's command line (a tour of `steps` when given)."""
        tour = [] if steps is None else ["--steps", str(steps)]
        return shlex.join(["neuron-train", "precompile", "--compile-cache", str(self.cache), *tour,
                           "--", *self.command])

    def env(self, folder: Path) -> dict[str, str]:
        flags, _ = cache_flags(os.environ, self.cache)
        env = {**probe_vars("check"), "NEURON_CC_FLAGS": flags}  # the compiler reads and writes DIR
        if self.require:
            covered = folder / "covered.json"
            covered.write_text(json.dumps(sorted(self.covered)))
            env[probe.COVERED_ENV] = str(covered)
        return env

    def finish(self, folder: Path, records: list[GraphReport], exit_code: int) -> tuple[str, bool]:
        try:
            run = ScriptRun(self.command, exit_code, records, load_probes(folder), "")
            graphs, shapes = run.graphs(), run.input_shapes()
            # graphs without a hash (eager mode's per-op graphs) make the coverage unknown, never 100%
            report = coverage_report(graphs + run.unhashed(), self.manifest, self.config, str(self.cache),
                                     shapes=shapes)
            lines = ["", "== precompile coverage ==", format_coverage(report)]
            stop = run.stop("uncovered")
            if stop:
                lines.append(self._stopped(stop, graphs, shapes))
            elif report.missing:
                lines.append(f"precompile what was missed: {self.hint}")
            return "\n".join(lines), not (self.require and (stop or report.missing))
        finally:
            self.use.release()

    def _stopped(self, stop: probe.Stop, graphs: list[Graph], shapes: dict[str, list[str]]) -> str:
        graph = next((g for g in graphs if g.hash == stop.graph), None)
        where = graph.where if graph else stop.where
        difference = nearest_graph(where or "", shapes.get(stop.graph), self.manifest, self.config)[1]
        unfinished = stop.compiles_finished < stop.compiles_started
        when = (f"{stop.seconds_into_compile or 0.0:.2f} s after its compile started, before it finished" if unfinished
                else "right after its compile")
        hint = self.hint
        if graph and graph.after_steps and difference.startswith("no precompiled graph comes from"):
            # The tour stopped before it. Counted from the steps that had ended, not the step label: the
            # stop is recorded while the program goes on, and the sync that compiled it may end its step.
            steps = graph.after_steps + 1
            hint = self._precompile_command(steps=steps)
            difference += f" (it compiled after step {graph.after_steps}: a tour of {steps} steps reaches it)"
        return (f"--require-precompiled stopped {shlex.join(self.command)} at graph {stop.graph[:12]} from "
                f"{short(stop.where or '?')} {when}" + (f": {difference}" if difference else "")
                + f". Precompile it: {hint}")
