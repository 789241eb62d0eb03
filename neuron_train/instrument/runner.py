"""Running a command with the checker armed in each of its Python processes, and merging the
processes' records into one report (check-graphs; precompile's script runs use the same)."""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

from neuron_train.graphs.findings import FallbackOp, HostSync, ProcessSummary
from neuron_train.graphs.process import ENV_DIR, ENV_WARMUP, PARTIAL_PREFIX, RECORD_PREFIX
from neuron_train.graphs.records import CommandRun, ErrorNote, Graph, GraphReport
from neuron_train.instrument import proc
from neuron_train.instrument.marker import Started

DEFAULT_WARMUP = 0  # --warmup-steps: the per-call-site rule alone (analyzer.py)
_INSTRUMENT_DIR = Path(__file__).resolve().parent / "_startup"
TAIL_LINES = 15  # a failed command's last stderr lines kept for the report
ERROR_LINES = 300  # read for its error (torchrun's banner alone is ~20 lines below the child's error)


def run_command(command: list[str], env: dict[str, str]) -> proc.Ended:
    """Run `command` (proc.py: its own process group, ended with us); its stderr passes through as
    it comes. OSError: it could not start."""
    return proc.run(command, env, stdout_too=False, tail_lines=ERROR_LINES)


# A line that ends a Python traceback: "NameError: ...", "torch.x.SomeError", "KeyboardInterrupt".
_RAISED = re.compile(r"^([A-Za-z_][\w.]*)(:.*)?$")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")  # torch.distributed's per-rank prefix
_LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")  # torchrun's own, about its children


def command_error(tail: list[str]) -> str:
    """The command's own error: the last traceback's closing line that is not a launcher's (torchrun
    re-raises a child's failure as its ChildFailedError banner, below the child's own error), else
    its last non-blank stderr line that is not ours."""
    raised, in_traceback = [], False
    for line in (_RANK_PREFIX.sub("", ln.rstrip()) for ln in tail):
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            in_traceback = False
            match = _RAISED.match(line)
            if match and not match.group(1).endswith(_LAUNCHER_ERRORS):
                raised.append(line.strip())
    if raised:
        return raised[-1][:300]
    lines = [ln.strip() for ln in tail if ln.strip() and not ln.startswith("neuron-train")]
    return lines[-1][:300] if lines else ""


def instrumented_env(folder: Path, warmup_steps: int) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV_DIR] = str(folder)
    env[ENV_WARMUP] = str(warmup_steps)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_INSTRUMENT_DIR), env.get("PYTHONPATH")) if p)
    return env


def load_records(folder: Path) -> list[GraphReport]:
    """Each instrumented process's summary, written at its exit; for a process that never reached its
    exit (killed in a long compile), the one it wrote during the run, which says so in its problems."""
    final = [GraphReport.from_json(json.loads(p.read_text())) for p in sorted(folder.glob(RECORD_PREFIX + "*.json"))]
    ended = {r.pid for r in final}
    partial = [GraphReport.from_json(json.loads(p.read_text())) for p in sorted(folder.glob(PARTIAL_PREFIX + "*.json"))]
    return final + [r for r in partial if r.pid not in ended]


def merge_records(records: list[GraphReport], command: list[str], ended: proc.Ended, warmup_steps: int,
                  max_graphs: int | None, started: list[Started] | None = None) -> GraphReport:
    """One report over all processes: graphs by hash, host syncs by line, counts summed; a failed
    command's own error (from its last stderr lines) is reported as such, and so is a process that
    imported torch_xla but never wrote its record (`started`: start.py's markers)."""
    merged_graphs: dict[str, Graph] = {}
    host: dict[str, HostSync] = {}
    fallback: dict[str, FallbackOp] = {}
    problems: list[str] = []
    errors: list[ErrorNote] = []  # each known error once, as its problem line is
    for n, record in enumerate(records):
        for g in record.graphs:
            key = g.hash or f"{n}:{g.step}:{len(merged_graphs)}"
            if key in merged_graphs:
                merged_graphs[key].executions += g.executions
            else:
                merged_graphs[key] = replace(g)
        for h in record.host_syncs:
            _merge_host(host, h)
        for op, f in record.fallback_ops.items():
            _merge_fallback(fallback, op, f)
        problems += [p for p in record.problems if p not in problems]
        errors += [e for e in record.errors if e not in errors]
    all_graphs = list(merged_graphs.values())
    problems += _run_problems(records, started or [], ended)
    if max_graphs is not None and len(all_graphs) > max_graphs:
        problems.append(f"{len(all_graphs)} distinct graphs compiled, more than --max-graphs {max_graphs}")
    failed = ended.code != 0 or ended.interrupted is not None
    run = CommandRun(command=command, exit_code=ended.code, killed_by=signal_name(ended.signal),
                     interrupted_by=signal_name(ended.interrupted),
                     command_tail=ended.tail[-TAIL_LINES:] if failed else [], max_graphs=max_graphs,
                     processes=[ProcessSummary(r.pid, r.rank, r.local_rank, r.argv, r.steps, r.compile_count,
                                               len(r.graphs), r.source, r.stable) for r in records])
    return GraphReport(warmup_steps=warmup_steps, steps=max((r.steps for r in records), default=0),
                       graphs=all_graphs, host_syncs=list(host.values()), fallback_ops=fallback,
                       dynamo=[d for r in records for d in r.dynamo], problems=problems,
                       compile_count=sum(r.compile_count for r in records),
                       compile_time_s=sum(r.compile_time_s for r in records), run=run, errors=errors)


def signal_name(signum: int | None) -> str | None:
    return signal.Signals(signum).name if signum else None


def _run_problems(records: list[GraphReport], started: list[Started], ended: proc.Ended) -> list[str]:
    """What the run itself lost: an interruption, processes without a record, the command's failure."""
    problems = []
    if ended.interrupted is not None:
        problems.append(f"interrupted by {signal_name(ended.interrupted)}: the command was ended; "
                        "this report covers what ran until then")
    written = {r.pid for r in records}
    lost = [s for s in started if s.pid not in written]
    for s in lost[:3]:
        problems.append(f"process {s.pid} ({' '.join(s.argv)[:80]}) imported torch_xla but ended without "
                        f"writing its record (os._exit, or killed by a signal): its graphs are not in this report")
    if not records and not started:
        problems.append(f"the command {ended.how()} before any of its processes imported torch_xla: nothing "
                        "was checked" if ended.signal else
                        "no process of the command imported torch_xla: nothing was checked")
    if ended.code != 0:
        error = command_error(ended.tail)
        problems.append(f"the command {ended.how()}" + (f": {error}" if error else ""))
    return problems


def _merge_host(host: dict[str, HostSync], h: HostSync) -> None:
    entry = host.get(h.where)
    if entry is None:
        host[h.where] = replace(h, steps=list(h.steps))
        return
    entry.count += h.count
    entry.executes_graph |= h.executes_graph
    entry.every_step |= h.every_step
    entry.steps += [s for s in h.steps if s not in entry.steps][:10 - len(entry.steps)]


def _merge_fallback(fallback: dict[str, FallbackOp], op: str, f: FallbackOp) -> None:
    entry = fallback.setdefault(op, FallbackOp(0, f.first_step))
    entry.count += f.count
    entry.where += [w for w in f.where if w not in entry.where]
