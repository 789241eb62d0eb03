"""`neuron-train doctor`: check this machine and say what is wrong and what to do.

Two halves on purpose: `facts.gather_facts` runs the tools and records their raw output; every
check in `ops/checks.py` is a pure function over those recorded facts (ops/facts.py gathers them).
This module parses the options and prints the report.
"""

from __future__ import annotations

import argparse
import socket
import sys
import textwrap
from dataclasses import asdict

from neuron_train.common.cli_parser import add_cache_option
from neuron_train.common.fileio import new_output, refuse_unusable, write_json_atomic
from neuron_train.ops.checks import FAIL, OK, SKIP, WARN, Check, exit_code, load_pins, run_checks
from neuron_train.ops.facts import gather_facts


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


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--multi-node", action="store_true",
                        help="also check EFA and memlock, and fail on a cache on shared storage")
    parser.add_argument("--require-neuron", action="store_true",
                        help="fail when there is no Neuron device (image builds, cluster prologs)")
    add_cache_option(parser, help="also check this project compile cache (the train/precompile flag)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON (never "
                        "overwrites an existing file)")


def main(args: argparse.Namespace) -> int:
    pins = load_pins()
    if args.json:
        new_output(args.json, "--json")  # refused before the checks run, not after
    if args.compile_cache and "://" not in args.compile_cache:  # a URL has nothing local to check
        refuse_unusable(args.compile_cache, "--compile-cache")
    facts = gather_facts(multi_node=args.multi_node, compile_cache=args.compile_cache)
    checks = run_checks(facts, pins, multi_node=args.multi_node, require_neuron=args.require_neuron)
    print(format_report(checks, pins))
    if args.json:
        write_json_report(args.json, report_dict(checks, pins))
    sys.stdout.flush()
    return exit_code(checks)
