"""Running a command with the checker armed in each of its Python processes, and merging the
processes' records into one report (check-graphs; precompile's script runs use the same)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from neuron_train.graphs.process import ENV_DIR, ENV_WARMUP, RECORD_PREFIX

REPORT_FORMAT = "neuron-train/graph-report/v1"
DEFAULT_WARMUP = 0  # --warmup-steps: the per-call-site rule alone (analyzer.py)
_INSTRUMENT_DIR = Path(__file__).resolve().parent / "_instrument"
TAIL_LINES = 15  # a failed command's last stderr lines kept for the report


class RunExtension(Protocol):
    """What another product adds to a check-graphs run (e.g. precompile coverage): cli.py hands it
    over as `args.extension`, so the checker never imports it."""

    def env(self, folder: Path) -> dict[str, str]:
        """Variables to set for the command (`folder` is where its processes write records)."""

    def finish(self, folder: Path, records: list[dict], exit_code: int) -> tuple[str, bool]:
        """After the command: the text to print below the report, and whether it passed."""


def run_command(command: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run `command`; its stderr passes through as it comes. Returns the exit code and its last
    stderr lines (a failed command's own error, for the report). OSError: it could not start."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    for raw in proc.stderr:
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()
        tail.append(raw.decode("utf-8", "replace").rstrip())
    return proc.wait(), list(tail)


def last_error(tail: list[str]) -> str:
    """The command's own last words: its last non-blank stderr line that is not the checker's."""
    lines = [ln.strip() for ln in tail if ln.strip() and not ln.startswith("neuron-train")]
    return lines[-1] if lines else ""


def instrumented_env(folder: Path, warmup_steps: int) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV_DIR] = str(folder)
    env[ENV_WARMUP] = str(warmup_steps)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_INSTRUMENT_DIR), env.get("PYTHONPATH")) if p)
    return env


def load_records(folder: Path) -> list[dict]:
    """Each instrumented process's summary, written at its exit."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob(RECORD_PREFIX + "*.json"))]


def merge_records(records: list[dict], command: list[str], exit_code: int, warmup_steps: int,
                  max_graphs: int | None, tail: list[str] | None = None) -> dict:
    """One report over all processes: graphs by hash, host syncs by line, counts summed; a failed
    command's last stderr lines (`tail`) are its own error, reported as such."""
    merged_graphs: dict[str, dict] = {}
    host: dict[str, dict] = {}
    fallback: dict[str, dict] = {}
    problems: list[str] = []
    for n, record in enumerate(records):
        for g in record["graphs"]:
            key = g["hash"] or f"{n}:{g['step']}:{len(merged_graphs)}"
            if key in merged_graphs:
                merged_graphs[key]["executions"] += g["executions"]
            else:
                merged_graphs[key] = dict(g)
        for h in record["host_syncs"]:
            _merge_host(host, h)
        for op, f in record["fallback_ops"].items():
            _merge_fallback(fallback, op, f)
        problems += [p for p in record["problems"] if p not in problems]
    all_graphs = list(merged_graphs.values())
    if not records:
        problems.append("no process of the command imported torch_xla: nothing was checked")
    if max_graphs is not None and len(all_graphs) > max_graphs:
        problems.append(f"{len(all_graphs)} distinct graphs compiled, more than --max-graphs {max_graphs}")
    if exit_code != 0:
        error = last_error(tail or [])
        problems.append(f"the command exited with code {exit_code}" + (f": {error}" if error else ""))
    return {
        "format": REPORT_FORMAT, "command": command, "exit_code": exit_code,
        "command_tail": list(tail or []) if exit_code != 0 else [],
        "warmup_steps": warmup_steps, "max_graphs": max_graphs,
        "steps": max((r["steps"] for r in records), default=0),
        "distinct_graphs": len(all_graphs),
        "compile_count": sum(r["compile_count"] for r in records),
        "compile_time_s": sum(r["compile_time_s"] for r in records),
        "graphs": all_graphs,
        "late_graphs": [g for g in all_graphs if g["kind"] == "late"],
        "recompiles": [g for g in all_graphs if g["kind"] == "recompile"],
        "host_syncs": list(host.values()), "fallback_ops": fallback,
        "dynamo": [d for r in records for d in r.get("dynamo", [])],
        "processes": [{k: r.get(k) for k in ("pid", "rank", "local_rank", "argv", "steps", "compile_count",
                                             "distinct_graphs", "source", "stable")} for r in records],
        "problems": problems, "stable": not problems,
    }


def _merge_host(host: dict[str, dict], h: dict) -> None:
    entry = host.get(h["where"])
    if entry is None:
        host[h["where"]] = dict(h, steps=list(h["steps"]))
        return
    entry["count"] += h["count"]
    entry["executes_graph"] |= h["executes_graph"]
    entry["every_step"] |= h["every_step"]
    entry["steps"] += [s for s in h["steps"] if s not in entry["steps"]][:10 - len(entry["steps"])]


def _merge_fallback(fallback: dict[str, dict], op: str, f: dict) -> None:
    entry = fallback.setdefault(op, {"count": 0, "first_step": f["first_step"], "where": []})
    entry["count"] += f["count"]
    entry["where"] += [w for w in f["where"] if w not in entry["where"]]
