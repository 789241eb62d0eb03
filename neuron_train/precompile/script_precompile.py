"""`neuron-train precompile [--compile-cache DIR] [--steps N] [--dry-run] -- CMD`: any script's graphs.

The command (`python my_train.py ...`, `torchrun ... my_train.py ...`) runs once as a *graph tour*:
on Neuron under `neuron_parallel_compile` (graph extraction, then a parallel compile into DIR), on
other devices directly, with torch_xla's persistent cache staged privately. The probe
(instrument/probe.py) fast-forwards each process past the first epoch's end to the script's end (its
remaining epochs cut short, instrument/epochs.py), or, with --steps N, ends it once every call site it
has seen is warm and N steps have passed, so a 100-epoch script is not run in full. Every graph the
tour compiled goes into the manifest with its hash, call site, phase and input shapes
(cache_env.record_graphs, the function our own loop's tour uses); a failed tour records nothing and
leaves no staged file behind.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.errors import RunError
from neuron_train.common.fileio import short
from neuron_train.common.neuron_env import neuron_device_present
from neuron_train.graphs.records import Graph
from neuron_train.instrument import probe
from neuron_train.instrument.epochs import EPOCH_ENV, MAX_EPOCH_STEPS
from neuron_train.instrument.script import (
    CompileSummary,
    ScriptRun,
    parse_compile_summary,
    require_ran,
    run_script,
)
from neuron_train.precompile import store
from neuron_train.precompile.cache_env import TourPlan, compile_command, record_graphs
from neuron_train.precompile.coverage import fingerprint, script_config

DEFAULT_STEPS = 5


def script_device() -> str:
    """The device kind a script's processes will get: what our loop records as backend.kind."""
    if neuron_device_present():
        return "NEURON"
    return os.environ.get("PJRT_DEVICE", "CPU").upper()


@dataclass(frozen=True)
class ScriptPlan(TourPlan):
    script: list[str]           # the user's command
    steps: int
    to_epoch_end: bool = False  # no --steps: the tour runs to the first epoch's end (instrument/epochs.py)

    @property
    def real_run(self) -> str:
        return shlex.join(["neuron-train", "check-graphs", "--compile-cache", str(self.cache),
                           "--require-precompiled", "--", *self.script])

    def before_command(self) -> list[str]:
        stop = ("the script's end, fast-forwarded once every call site is warm past the first epoch's end (the "
                "remaining epochs cut to one batch, a Trainer told to stop), when a DataLoader of at most "
                f"{MAX_EPOCH_STEPS} batches feeds the steps; else every call site warm and at least {self.steps} "
                "steps" if self.to_epoch_end else f"every call site warm and at least {self.steps} steps"
                if self.steps else "the command's own end (--steps 0)")
        return [f"tour stops   at {stop}"]

    def after_command(self) -> list[str]:
        return ["  (with neuron-train's graph instrumentation in each Python process)", "then run",
                f"  {self.real_run}"]


def plan_script(script: list[str], *, cache: Path, target: str, steps: int | None, num_parallel: int | None,
                retries: int, retry_failed: bool, env: Mapping[str, str]) -> ScriptPlan:
    """The exact command and environment of a script's precompile (pure: nothing runs). `steps`
    None (no --steps): the tour runs to the first epoch's end, and at least DEFAULT_STEPS steps."""
    run = compile_command(script, cache=cache, target=target, num_parallel=num_parallel, retries=retries,
                          retry_failed=retry_failed, env=env)
    return ScriptPlan(target=target, cache=cache, command=run.command, env=run.env, notes=run.notes,
                      script=list(script), steps=DEFAULT_STEPS if steps is None else steps, to_epoch_end=steps is None)


def execute_script_plan(plan: ScriptPlan, device: str) -> str:
    """Run the tour holding the cache's use lock; record its graphs; returns the report."""
    run_id = uuid.uuid4().hex[:12]
    use = store.CacheUse(plan.cache)  # a prune must not delete entries under a running precompile
    staging = plan.cache / store.STAGING_DIR / f"tour-{run_id}"
    try:
        with tempfile.TemporaryDirectory(prefix="neuron-train-precompile-") as folder:
            extra = {**plan.env, **({probe.STAGING_ENV: str(staging)} if plan.target != "neuron" else {}),
                     **({EPOCH_ENV: "1"} if plan.to_epoch_end else {})}
            run = run_script(plan.command, Path(folder), mode="tour", steps=plan.steps, extra_env=extra)
        summary = parse_compile_summary(run.tail) if plan.target == "neuron" else None
        require_ran(run, f"nothing was recorded in {plan.cache}", stopped_ok=("tour",))
        if summary is not None and summary.failed:
            raise RunError(f"{summary.failed} graph(s) failed to compile (cached as failed): fix the cause, "
                           "then precompile again with --retry-failed")
        return _record(plan, run, run_id, device, summary)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # committed files were moved out; the rest goes
        use.release()


def _record(plan: ScriptPlan, run: ScriptRun, run_id: str, device: str, summary: CompileSummary | None) -> str:
    graphs = run.graphs()
    if not graphs:
        raise RunError(f"{run.line} imported torch_xla but compiled no graph before it ended: "
                       "nothing to precompile")
    config = script_config(plan.script, device=device, env={**os.environ, **plan.env})
    fp = fingerprint(config)
    record_graphs(plan.cache, fp, config, graphs, precompile_id=run_id, tour_steps=run.steps(),
                  shapes=run.input_shapes())
    vouched = 0
    for p in run.probes:
        if p.staging:
            vouched += store.commit_staged(plan.cache, Path(p.staging), fp)
    if plan.target == "neuron":
        vouched += len(store.record_entries(plan.cache, fp))
    return _report(plan, run, fp, graphs, vouched, summary)


def _report(plan: ScriptPlan, run: ScriptRun, fp: str, graphs: list[Graph], vouched: int,
            summary: CompileSummary | None) -> str:
    sites = {g.where or "?" for g in graphs}
    ended = tour_ended(run.stop("tour"), run.probes, run.steps())
    lines = [f"precompiled  {run.line} (configuration {fp})",
             f"graphs       {len(graphs)} recorded in {plan.cache}/{store.MANIFEST}, from {len(sites)} call "
             f"site(s)"]
    for g in graphs:
        lines.append(f"  {g.hash[:12]}  {short(g.where or '?')}  ({g.phase}, step {g.step}, "
                     f"{(g.compile_time_s or 0):.1f} s to compile)")
    lines += [f"tour         {ended}", f"cache        {vouched} cache file(s) vouched for"]
    if summary is not None:
        lines.append(f"compile      {summary.line()}")
    lines.append(f"then run     {plan.real_run}")
    return "\n".join(lines)


def tour_ended(stop: probe.Stop | None, probes: list[probe.ProbeRecord], steps: int) -> str:
    """How the tour ended, and what a stopped tour did not precompile with the --steps that reaches it:
    a tour past the first epoch's end has not seen code that runs once, after the last epoch (the
    final evaluation of transformers' examples: trainer.evaluate() after trainer.train())."""
    forwarded = next((p.fast_forward for p in probes if p.fast_forward), 0)
    if stop is None:
        return (f"fast-forwarded after step {forwarded} (every call site warm past the first epoch's end: the "
                f"remaining epochs cut short), then the command ran to its end after {steps} steps, the code "
                "after its training loop included" if forwarded else
                f"the command ended by itself after {steps} steps")
    epoch = next((p.epoch_steps for p in probes if p.to_epoch_end), None)
    if forwarded:
        return (f"fast-forwarded after step {forwarded}, but the command had not ended {stop.step - forwarded} "
                "steps later (a loop that counts steps, not epochs, or a loader the tour does not cut): stopped; "
                "code after its training loop is not precompiled: --steps 0 runs the command whole")
    if epoch is None:
        return (f"stopped after step {stop.step}: every call site it reached was warm; code that runs later "
                "(an evaluation at an epoch's end) is not precompiled: raise --steps past it, or --steps 0 to "
                "run the command whole")
    length = f" ({epoch} steps an epoch)" if epoch else ""
    reach = (f"--steps 0 runs the command whole, or --steps {epoch} x epochs + {DEFAULT_STEPS} reaches it"
             if epoch else "--steps 0 runs the command whole")
    return (f"stopped after step {stop.step}, past the first epoch's end{length}, every call site warm; code "
            f"that runs once after the last epoch (a final evaluation or save, e.g. trainer.evaluate() after "
            f"trainer.train()) is not precompiled: {reach}")
