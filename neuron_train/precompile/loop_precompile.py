"""`neuron-train precompile [options] -- TRAIN_ARGS`: neuron-train's own loop as the graph tour.

The loop runs in "graph tour" mode (NEURON_EXTRACT_GRAPHS_ONLY, set by neuron_parallel_compile on
Neuron and by us elsewhere): a few train steps, one eval batch, no checkpoints or metrics written. It
records the settings that determine its graphs and each graph's fingerprint and phase
(cache_env.record_graphs, through training/cache_hook.py). A later `train --compile-cache DIR` reports
its coverage and, with `--require-precompiled`, refuses a configuration that was not precompiled.
The tour's and the real run's arguments come from the command, which reads the run's configuration
(this package never imports `training`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.errors import RunError
from neuron_train.common.neuron_env import EXTRACT_ENV
from neuron_train.instrument.script import CompileSummary, parse_compile_summary, stream
from neuron_train.precompile import store
from neuron_train.precompile.cache_env import PRECOMPILE_ENV, TourPlan, compile_command
from neuron_train.precompile.listing import describe_config
from neuron_train.precompile.manifest import Manifest

RUN_PY = Path(__file__).resolve().parent.parent / "run.py"


@dataclass(frozen=True)
class LoopPlan(TourPlan):
    real_run: list[str]         # the training command to run afterwards

    def before_command(self) -> list[str]:
        return ["environment", *(f"  {shlex.quote(f'{k}={v}')}" for k, v in self.env.items())]

    def after_command(self) -> list[str]:
        return ["then train with",
                f"  NEURON_CC_FLAGS={shlex.quote(self.env['NEURON_CC_FLAGS'])} {shlex.join(self.real_run)}"]


def launcher(world: int) -> list[str]:
    """How the training processes start: one Python process, or torchrun for several."""
    if world == 1:
        return [sys.executable, str(RUN_PY)]
    torchrun = shutil.which("torchrun")
    start = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return [*start, "--standalone", f"--nproc_per_node={world}", str(RUN_PY)]  # one node, a free port


def plan_loop(train_args: list[str], *, tour_args: list[str], real_args: list[str], cache: Path, target: str,
              world: int, num_parallel: int | None, retries: int, retry_failed: bool, env: Mapping[str, str],
              run_id: str) -> LoopPlan:
    """The exact commands and environment of our loop's precompile (pure: nothing runs): the tour is
    TRAIN_ARGS + `tour_args`, the real run afterwards TRAIN_ARGS + `real_args`."""
    run = compile_command([*launcher(world), *train_args, *tour_args], cache=cache, target=target,
                          num_parallel=num_parallel, retries=retries, retry_failed=retry_failed, env=env)
    changes = {**run.env, PRECOMPILE_ENV: run_id}
    if target != "neuron":
        changes[EXTRACT_ENV] = "1"  # we play neuron_parallel_compile's extraction role
    return LoopPlan(target=target, cache=cache, command=run.command, env=changes, notes=run.notes,
                    real_run=[*launcher(world), *train_args, *real_args])


def execute_loop_plan(plan: LoopPlan) -> tuple[str, CompileSummary | None]:
    """Run the plan holding the cache's use lock; returns (the report, neuron_parallel_compile's summary)."""
    run_id = plan.env[PRECOMPILE_ENV]
    use = store.CacheUse(plan.cache)  # a prune must not delete entries under a running precompile
    try:
        ended = stream(plan.command, {**os.environ, **plan.env})
        code, log = ended.code, "\n".join(ended.tail)
        summary = parse_compile_summary(log) if plan.target == "neuron" else None
        if code != 0:
            failed = f"; {summary.failed} graph(s) failed to compile" if summary and summary.failed else ""
            raise RunError(f"the precompile run failed (exit code {code}{failed}); its output is above")
        manifest = store.load_manifest(plan.cache)
        fps = [fp for fp, r in manifest.configs.items() if run_id in r.precompile_ids]
        added = store.record_entries(plan.cache, fps[0]) if fps and plan.target == "neuron" else []
        return _report(store.load_manifest(plan.cache), run_id, plan.cache, added, summary), summary
    finally:
        use.release()


def _report(manifest: Manifest, run_id: str, cache: Path, added: list[str], summary: CompileSummary | None) -> str:
    """What the precompile produced, read from the manifest the graph tour recorded."""
    found = [(fp, r) for fp, r in manifest.configs.items() if run_id in r.precompile_ids]
    if not found:
        raise RunError(f"the precompile run recorded nothing in {cache}/{store.MANIFEST}: --compile-cache or "
                       f"{EXTRACT_ENV} did not reach neuron_train (a wrapper that drops arguments or "
                       "environment variables?)")
    lines = []
    for fp, record in found:
        phases: dict[str, int] = {}
        for g in record.graphs.values():
            phases[str(g.phase)] = phases.get(str(g.phase), 0) + 1
        seconds = sum(g.compile_time_s or 0.0 for g in record.graphs.values())
        lines.append(f"precompiled  {describe_config(record.config)} (configuration {fp})")
        by_phase = ", ".join(f"{n} {p}" for p, n in sorted(phases.items()))
        lines.append(f"graphs       {len(record.graphs)} recorded" + (f" ({by_phase})" if by_phase else "")
                     + (f", {seconds:.1f} s of compiling in the tour" if seconds else ""))
        if record.unidentified_graphs:
            lines.append(f"warning      {record.unidentified_graphs} graph(s) had no fingerprint: "
                         "coverage cannot be checked for them")
    xla_new = sum(1 for r in manifest.files.values() if r.recorded_by in {fp for fp, _ in found})
    lines.append(f"cache        {cache}: {len(added)} Neuron entries recorded, {xla_new} files vouched for")
    if summary is not None:
        lines.append(f"compile      {summary.line()}")
        for path in summary.failed_graphs[:5]:
            lines.append(f"  failed     {path}")
    return "\n".join(lines)
