"""Run any PyTorch/XLA command with the graph checker and the probe armed in each of its processes.

One runner for `neuron-train precompile -- CMD` (mode "tour"), `check-graphs --compile-cache DIR
-- CMD` (mode "check") and `bench -- CMD` (mode "bench"): the checker's instrumentation
(start.py) writes each process's graphs (`record.<pid>.json`), the probe (probe.py) its step
windows and why it stopped (`probe.<pid>.json`). A command that fails, never imports torch_xla,
or stops for another reason than the one asked for is one clear error.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from neuron_train.common.errors import RunError, UsageError
from neuron_train.graphs.records import Graph, GraphReport
from neuron_train.instrument import probe, proc
from neuron_train.instrument import runner as graph_runner
from neuron_train.instrument.marker import started

TAIL_LINES = 4000
RETRIES_ENV = "NEURON_PARALLEL_COMPILE_MAX_RETRIES"


@dataclass
class ScriptRun:
    command: list[str]
    exit_code: int
    records: list[GraphReport]  # the graph checker's, one per process that imported torch_xla
    probes: list[probe.ProbeRecord]  # the probe's, one per process that imported torch_xla
    tail: str                # the command's last output lines
    how: str = ""            # how it ended: "exit code N", "killed by SIGKILL"
    started: int = 0         # its processes that imported torch_xla (with a record or not)
    interrupted: int | None = None  # the signal (SIGINT/SIGTERM) to us that ended it early

    def stop(self, reason: str) -> probe.Stop | None:
        """The first process that stopped for `reason` ('tour', 'bench', 'uncovered')."""
        return next((p.stop for p in self.probes if p.stop is not None and p.stop.reason == reason), None)

    def graphs(self) -> list[Graph]:
        """Every graph compiled, once per hash (processes compile the same graphs), with the phase a
        script's tour saw it in."""
        seen: dict[str, Graph] = {}
        for record in self.records:
            for g in record.graphs:
                if g.hash and g.hash not in seen:
                    seen[g.hash] = replace(g, phase=script_phase(g))
        return list(seen.values())

    def unhashed(self) -> list[Graph]:
        """The graphs compiled without a hash (eager mode's per-op graphs), every process's."""
        return [g for r in self.records for g in r.graphs if not g.hash]

    def input_shapes(self) -> dict[str, list[str]]:
        """Each graph's input shapes by hash (from the dumped HLO), as the first process saw them."""
        shapes: dict[str, list[str]] = {}
        for record in self.records:
            for h, s in record.input_shapes.items():
                shapes.setdefault(h, s)
        return shapes

    def steps(self) -> int:
        return max((len(p.windows) for p in self.probes), default=0)

    @property
    def line(self) -> str:
        return shlex.join(self.command)


def script_phase(graph: Graph) -> str:
    """Where in a script's run a graph came from: its call site's first step(s) (optimizer state,
    an accumulator's first batch), its steady step (ran again), a late call site, a recompilation."""
    if graph.kind in ("late", "recompile"):
        return graph.kind
    return "steady" if graph.executions > 1 else "first step"


def checked_command(command: list[str], usage: str) -> list[str]:
    """The command after `--`, refused (exit 2) when missing or not runnable."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError(f"no command given: {usage}")
    if shutil.which(command[0]) is None:
        raise UsageError(f"command not found: {command[0]} (give the program to run, e.g. `python my_train.py`)")
    return command


def stream(command: list[str], env: dict[str, str], echo: bool = True) -> proc.Ended:
    """Run `command` (proc.py: its own process group, ended with us), echoing its output as it
    comes; returns how it ended, with the output's tail."""
    try:
        return proc.run(command, env, stdout_too=True, tail_lines=TAIL_LINES, echo=echo)
    except FileNotFoundError:
        hint = (": it comes with torch-neuronx; activate the venv that has it (/opt/neuron-train/venv on our "
                "image, /opt/aws_neuronx_venv_pytorch_2_9 on the Ubuntu 24.04 Neuron DLAMIs)"
                if command[0] == "neuron_parallel_compile" else "")
        raise RunError(f"{command[0]} not found on PATH{hint}") from None
    except OSError as exc:  # not executable, a directory, ...
        raise UsageError(f"cannot run {command[0]}: {exc.strerror or exc}") from None


def probe_vars(mode: str, steps: int = 0) -> dict[str, str]:
    """Variables that arm the probe in `mode` on top of the checker's instrumentation."""
    return {probe.MODE_ENV: mode, probe.STEPS_ENV: str(steps)}


def load_probes(folder: Path) -> list[probe.ProbeRecord]:
    return [probe.ProbeRecord.from_json(json.loads(p.read_text()))
            for p in sorted(folder.glob(f"{probe.PROBE_PREFIX}*.json"))]


def run_script(command: list[str], folder: Path, *, mode: str, steps: int,
               extra_env: dict[str, str] | None = None, echo: bool = True) -> ScriptRun:
    """Run `command` instrumented; records and probes are read from `folder` (a fresh directory).
    Bench runs the probe alone (no checker: no debug log or HLO dump on the measured steps)."""
    env = {**graph_runner.instrumented_env(folder, graph_runner.DEFAULT_WARMUP), **probe_vars(mode, steps),
           **(extra_env or {})}
    ended = stream(command, env, echo)
    return ScriptRun(command, ended.code, graph_runner.load_records(folder), load_probes(folder),
                     "\n".join(ended.tail), ended.status(), len(started(folder)), ended.interrupted)


def require_ran(run: ScriptRun, what: str, stopped_ok: tuple[str, ...]) -> None:
    """Refuse a run that never reached torch_xla, or failed without being stopped by us."""
    stopped = any(run.stop(r) for r in stopped_ok)
    if run.exit_code != 0 and not stopped:
        where = f" at step {run.steps()}" if run.probes else ""
        error = graph_runner.command_error(run.tail.splitlines()) or "(no output)"
        raise RunError(f"{run.line} failed ({run.how or f'exit code {run.exit_code}'}){where}: {error}; {what}")
    if not run.records and not run.probes and run.started:
        raise RunError(f"{run.line} ended ({run.how}), but none of its {run.started} process(es) that imported "
                       "torch_xla wrote its records (os._exit, or killed by a signal)")
    if not run.records and not run.probes:
        raise RunError(f"{run.line} never imported torch_xla (no process of it ran an XLA graph): "
                       "give a PyTorch/XLA training command, e.g. `python my_train.py`")


@dataclass
class CompileSummary:
    """neuron_parallel_compile's closing summary (None: a total it did not print)."""

    graphs: int | None = None
    compiled: int | None = None
    failed: int | None = None
    failed_graphs: list[str] = field(default_factory=list)   # their paths

    def line(self) -> str:
        """`neuron_parallel_compile: 2 graphs, 2 compiled, 0 failed`."""
        def said(n: int | None) -> str:
            return "?" if n is None else str(n)
        return (f"neuron_parallel_compile: {said(self.graphs)} graphs, {said(self.compiled)} compiled, "
                f"{said(self.failed)} failed")


def parse_compile_summary(log: str) -> CompileSummary | None:
    """neuron_parallel_compile's closing summary: totals and the graphs that failed to compile."""
    def total(pattern: str) -> int | None:
        found = re.findall(pattern, log)
        return int(found[-1]) if found else None

    graphs, compiled, failed = (total(rf"Total {what}: (\d+)")
                                for what in ("graphs", "successful compilations", "failed compilations"))
    report = _summary_json(log)
    if graphs is None and compiled is None and failed is None and not report:
        return None
    return CompileSummary(graphs, compiled, failed,
                          sorted(path for path, r in report.get("compilation_report", {}).items()
                                 if not r.get("status")))


def _summary_json(log: str) -> dict:
    """The JSON object printed after '||NEURON_PARALLEL_COMPILE||: {', one 'INFO:' line per line."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith("||NEURON_PARALLEL_COMPILE||: {")]
    if not starts:
        return {}
    body, depth = ["{"], 1
    for line in lines[starts[-1] + 1:]:
        text = re.sub(r"^\s*INFO:\s?", "", line)
        body.append(text)
        depth += text.count("{") - text.count("}")
        if depth <= 0:
            break
    try:
        data = json.loads("\n".join(body))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}
