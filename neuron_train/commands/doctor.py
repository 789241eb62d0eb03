"""`neuron-train doctor`: check this machine and say what is wrong and what to do.

Two halves on purpose: `facts.gather_facts` runs the tools and records their raw output; every
check in `ops/checks.py` is a pure function over those recorded facts (ops/facts.py gathers them).
This module parses the options and prints the report (ops/report.py writes it).
"""

from __future__ import annotations

import argparse
import sys

from neuron_train.common.cli_parser import add_cache_option
from neuron_train.common.fileio import new_output, refuse_unusable
from neuron_train.ops.checks import exit_code, load_pins, run_checks
from neuron_train.ops.facts import gather_facts
from neuron_train.ops.report import format_report, report_dict, write_json_report


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
