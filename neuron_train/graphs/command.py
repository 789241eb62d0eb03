"""`neuron-train check-graphs [options] -- COMMAND [ARGS...]`: is a PyTorch/XLA run graph-stable?

Runs COMMAND (any Python program using torch_xla: ours, a user's script, torchrun) with the
graph checker armed in each of its Python processes (a `sitecustomize` put first on PYTHONPATH),
then merges the processes' reports. Exit 0: graph-stable; 1: not (or the command failed); 2: usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from neuron_train.common.errors import UsageError
from neuron_train.graphs import core

REPORT_FORMAT = "neuron-train/graph-report/v1"
_INSTRUMENT_DIR = Path(__file__).resolve().parent / "_instrument"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.usage = "neuron-train check-graphs [--warmup-steps N] [--max-graphs K] [--json FILE] -- COMMAND [ARGS...]"
    parser.add_argument("--warmup-steps", type=int, default=2, metavar="N",
                        help="steps allowed to compile new graphs (default 2: AdamW compiles its first "
                             "step apart). In a script a step is a torch_xla.sync()/xm.mark_step() "
                             "that ran a graph; in neuron-train's own loop, an optimizer step")
    parser.add_argument("--max-graphs", type=int, default=None, metavar="K",
                        help="also fail when more than K distinct graphs are compiled")
    parser.add_argument("--json", metavar="FILE", help="write the full report as JSON (docs/graphs.md)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to check, after --")


def main(args: argparse.Namespace) -> int:
    command = _command(args)
    json_path = _json_path(args.json)
    with tempfile.TemporaryDirectory(prefix="neuron-train-check-graphs-") as folder:
        try:
            code = subprocess.call(command, env=instrumented_env(Path(folder), args.warmup_steps))
        except OSError as exc:  # not executable, a directory, ...
            raise UsageError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
        records = load_records(Path(folder))
    report = merge_records(records, command, code, args.warmup_steps, args.max_graphs)
    print("\n== neuron-train check-graphs ==", flush=True)
    print(core.format_report(report), flush=True)
    if json_path is not None:
        _write_atomic(json_path, json.dumps(report, indent=2, default=str))
    return 0 if report["stable"] else 1


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no command given: neuron-train check-graphs [options] -- COMMAND [ARGS...]")
    if args.warmup_steps < 0:
        raise UsageError("--warmup-steps must be >= 0")
    if args.max_graphs is not None and args.max_graphs < 1:
        raise UsageError("--max-graphs must be >= 1")
    if shutil.which(command[0]) is None:
        raise UsageError(f"command not found: {command[0]}")
    return command


def _json_path(value: str | None) -> Path | None:
    """Checked before the run: a report never replaces an existing file."""
    if value is None:
        return None
    path = Path(value)
    if path.exists():
        raise UsageError(f"{path} already exists: remove it or choose another --json file")
    if not path.parent.is_dir():
        raise UsageError(f"--json: folder {path.parent} does not exist")
    return path


def instrumented_env(folder: Path, warmup_steps: int) -> dict[str, str]:
    env = dict(os.environ)
    env[core.ENV_DIR] = str(folder)
    env[core.ENV_WARMUP] = str(warmup_steps)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_INSTRUMENT_DIR), env.get("PYTHONPATH")) if p)
    return env


def load_records(folder: Path) -> list[dict]:
    """Each instrumented process's summary, written at its exit."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob(core.RECORD_PREFIX + "*.json"))]


def merge_records(records: list[dict], command: list[str], exit_code: int, warmup_steps: int,
                  max_graphs: int | None) -> dict:
    """One report over all processes: graphs by hash, host syncs by line, counts summed."""
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
        problems.append(f"the command exited with code {exit_code}")
    return {
        "format": REPORT_FORMAT, "command": command, "exit_code": exit_code,
        "warmup_steps": warmup_steps, "max_graphs": max_graphs,
        "steps": max((r["steps"] for r in records), default=0),
        "distinct_graphs": len(all_graphs),
        "compile_count": sum(r["compile_count"] for r in records),
        "compile_time_s": sum(r["compile_time_s"] for r in records),
        "graphs": all_graphs,
        "late_graphs": [g for g in all_graphs if g["kind"] == "late"],
        "recompiles": [g for g in all_graphs if g["kind"] == "recompile"],
        "host_syncs": list(host.values()), "fallback_ops": fallback,
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
