"""The doctor's report over its checks: the text a person reads and the JSON a pipeline keeps."""

from __future__ import annotations

import socket
import textwrap
from dataclasses import asdict

from neuron_train.common.fileio import new_output, write_json_atomic
from neuron_train.ops.checks import FAIL, OK, SKIP, WARN, Check, exit_code


def format_report(checks: list[Check], pins: dict) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, SKIP)}
    width = max(len(c.name) for c in checks)
    lines = [f"neuron-train doctor (pinned Neuron SDK {pins['neuron_sdk']}): "
             + ", ".join(f"{n} {s}" for s, n in counts.items())]
    for c in checks:
        lines.append(f"  {c.status:<4}  {c.name:<{width}}  {c.found}")
        if c.advice:
            indent = " " * (width + 10)
            lines += textwrap.wrap(c.advice, 100, initial_indent=indent + "-> ",
                                   subsequent_indent=indent + "   ")
    lines.append(_verdict(checks))
    return "\n".join(lines)


def _verdict(checks: list[Check]) -> str:
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        return f"FAIL: fix {', '.join(failed)} before training here."
    if any(c.name == "devices" and c.status == SKIP for c in checks):
        return ("CPU-only machine: `neuron-train train` will run on the CPU XLA device; every "
                "command works, at CPU speed.")
    return "Ready: `neuron-train train` will run on the Neuron device."


def report_dict(checks: list[Check], pins: dict) -> dict:
    return {"tool": "neuron-train doctor", "host": socket.gethostname(),
            "pinned_neuron_sdk": pins["neuron_sdk"], "exit_code": exit_code(checks),
            "checks": [asdict(c) for c in checks]}


def write_json_report(path: str, report: dict) -> None:
    """Write atomically; never replace an existing file (a previous report may be someone's record)."""
    write_json_atomic(new_output(path, "--json"), report)
