"""`neuron-train report`: merge bench results and published reference rows into one report folder.

Writes report.md, report.csv, a self-contained report.html and PNG charts into one folder, whole
(cost/report/folder.py): every input number is checked first, every file is built in memory, and the
folder is published at once, so a failure never leaves a half-written or mixed report. Rows are
grouped by workload and compared only within it (cost/report/compare.py, which also gives the formulas);
every figure says where it came from (cost/report/rows.py, render.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
from pathlib import Path

from neuron_train.common.errors import UsageError
from neuron_train.cost.catalog import load_catalog, resolve_prices
from neuron_train.cost.report.compare import DEFAULT_BASELINE, build_groups, collect_rows, price_rows
from neuron_train.cost.report.folder import check_out_dir, write_report
from neuron_train.cost.report.render import Context, group_summary


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Merge bench result files (and published reference rows) into a "
                          "price-performance report: report.md, report.csv, report.html, PNG charts.")
    parser.add_argument("results", nargs="*", metavar="RESULT.json", help="files written by bench")
    parser.add_argument("--reference", action="append", default=[], metavar="NEURON_PERF.csv",
                        help="a Neuron SDK performance table to import (repeatable)")
    parser.add_argument("--reference-model", action="append", default=[], metavar="TEXT",
                        help="import only reference rows whose model contains TEXT (repeatable)")
    parser.add_argument("--prices", metavar="FILE|live",
                        help="override/extend the catalog prices with FILE (YAML/JSON/CSV), or fetch "
                             "current prices from the AWS Price List API ('live', needs credentials)")
    parser.add_argument("--spot", action="store_true", help="with --prices live: use spot prices")
    parser.add_argument("--region", default=None,
                        help="region for --prices live (default: AWS_REGION, else us-east-1)")
    parser.add_argument("--baseline", metavar="TYPE",
                        help=f"instance type others are compared to (default: {DEFAULT_BASELINE} "
                             "when present, else the cheapest instance of each workload)")
    parser.add_argument("--epoch-samples", type=int, metavar="N",
                        help="samples in one epoch for the cost per epoch (default: the dataset "
                             "size recorded in the result files)")
    parser.add_argument("--out", required=True, metavar="DIR", help="report folder")
    parser.add_argument("--force", action="store_true", help="replace an existing report in DIR")


def main(args: argparse.Namespace) -> int:
    if not args.results and not args.reference:
        raise UsageError("give at least one RESULT.json or --reference table")
    if args.epoch_samples is not None and args.epoch_samples < 1:
        raise UsageError(f"--epoch-samples must be >= 1, got {args.epoch_samples}")
    out = Path(args.out).absolute()  # the folder is renamed into place: "." must have a name
    check_out_dir(out, args.force)
    catalog = load_catalog()
    rows, results = collect_rows(args.results, args.reference, args.reference_model, catalog)
    region = (args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
              or "us-east-1")
    catalog = resolve_prices(catalog, args.prices, sorted({r.instance_type for r in rows}), region,
                             args.spot)
    baseline = args.baseline.lower() if args.baseline else None
    price_rows(rows, catalog)
    groups = build_groups(rows, baseline, args.epoch_samples)
    priced = sorted({(r.instance_type, r.price) for r in rows if r.price}, key=lambda t: t[0])
    ctx = Context(dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), results,
                  [Path(p) for p in args.reference], priced,
                  any(r.device.kind == "CPU" for _, r in results))
    images = write_report(out, groups, ctx)
    for g in groups:
        if any(r.samples_per_sec for r in g.rows):
            print(f"{g.title}: {group_summary(g)}")
    print(f"report: {len(rows)} row(s) in {len(groups)} workload(s) -> {out}/report.html "
          f"(+ report.md, report.csv, {', '.join(images)})")
    return 0
