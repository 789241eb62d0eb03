"""`neuron-train report`: merge bench results and published reference rows into one report folder.

Writes report.md, report.csv, a self-contained report.html and PNG charts into one folder, whole:
every input number is checked first, every file is built in memory, and the folder is published
at once (common.fileio.publish_folder), so a failure never leaves a half-written or mixed report. Rows are grouped by
workload (mode and model; model names compared without case and punctuation, so the Neuron
tables' "Resnet-50" and "resnet50" meet): throughput, price-performance and cost are compared only
between rows measuring the same thing. Every figure says where it came from.

Price-performance is samples per dollar = samples/s x 3600 / (USD per hour x instances); relative
price-performance divides it by the baseline's. Cost per 1M samples = USD per hour / (samples/s x
3600) x 1e6; cost per epoch = epoch samples / (samples/s x 3600) x USD per hour.
"""

from __future__ import annotations

import argparse
import datetime as dt
import errno
import os
from pathlib import Path

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import publish_folder, recover_folder, refuse_unusable
from neuron_train.cost.catalog import Catalog, load_catalog, resolve_prices
from neuron_train.cost.plan_result import ESTIMATED, load_results
from neuron_train.cost.references import ReferenceRow, read_reference_csv
from neuron_train.cost.render import (
    Context,
    group_summary,
    render_html,
    render_markdown,
    report_blocks,
    write_csv,
)
from neuron_train.cost.rows import Group, Row, device_text, precision_text, priced_rows

OUTPUT_FILES = ("report.md", "report.csv", "report.html", "throughput.png", "price_performance.png",
                "cost.png")
DEFAULT_BASELINE = "trn1.2xlarge"  # the reference study's baseline
# --- loading -------------------------------------------------------------------------------------

def check_same_workload(results: list[tuple[Path, dict]]) -> None:
    """Results of one mode and model must measure it at the same image size and on the same dataset
    (other models, e.g. a script measured by `bench -- COMMAND`, are groups of their own)."""
    first: dict[tuple[str, str], tuple[Path, tuple]] = {}
    for path, r in results:
        key = (r["model"]["name"], r["model"]["img_size"], r["dataset"]["name"])
        seen_path, seen = first.setdefault((r["mode"], key[0]), (path, key))
        if key != seen:
            raise UsageError(
                f"{path} measures {key[0]} at {key[1]} px on {key[2]} but {seen_path} measures "
                f"{seen[0]} at {seen[1]} px on {seen[2]} ({r['mode']}): compare one workload per mode")


def estimated_row(path: Path, r: dict) -> Row:
    """An estimate of `neuron-train plan`: labelled as such wherever it is shown."""
    e = r["estimate"]
    return Row(
        instance_type=r["instance_type"].lower(), mode=r["mode"], model=r["model"]["name"],
        img_size=r["model"]["img_size"], origin=ESTIMATED, device="Neuron (ESTIMATE from a CPU run)",
        provenance=f"estimated: {path.name} (neuron-train plan, {r['created_at'][:10]}; {e['calibration']})",
        precision=r["precision"], batch_size=r["batch_size_per_device"], world_size=r["world_size"],
        samples_per_sec=r["samples_per_sec"]["median"], spread=r["samples_per_sec"]["spread"],
        epoch_samples=r["dataset"]["train_samples"],
        note=f"ESTIMATE, not measured: bottleneck {e['bottleneck_text']}; band {e['band'][0]:,.1f}-"
             f"{e['band'][1]:,.1f}")


def measured_row(path: Path, r: dict) -> Row:
    if r.get("source") == ESTIMATED:
        return estimated_row(path, r)
    device = r["device"]
    where = f"{r['host'].get('cpu', '?')}, " if device["kind"] == "CPU" else ""
    how = f"measured with {device['harness']}" if device.get("harness") else "measured here"
    return Row(
        instance_type=r["instance_type"].lower(), mode=r["mode"], model=r["model"]["name"],
        img_size=r["model"]["img_size"], origin="measured", device=device_text(device),
        provenance=f"{how}: {path.name} ({where}{r['created_at'][:10]})",
        precision=precision_text(r["precision"], device.get("compiler_args")),
        batch_size=r["batch_size_per_device"], world_size=r["world_size"],
        samples_per_sec=r["samples_per_sec"]["median"], spread=r["samples_per_sec"]["spread"],
        compile_time_s=r["compile"]["time_s"], graph_count=r["compile"]["graph_count"],
        epoch_samples=r["dataset"]["train_samples"],
        note=f"{r['repeats']} repeat(s) of {r['measured_steps']} steps after {r['warmup_steps']} "
             "warm-up steps")


def imported_row(ref: ReferenceRow) -> Row:
    note = "; ".join(n for n in (ref.instance_note, f"latency p50 {ref.latency_p50_ms:g} ms"
                                 if ref.latency_p50_ms else "") if n)
    return Row(
        instance_type=ref.instance_type, mode=ref.mode, model=ref.model, img_size=ref.img_size,
        origin="imported", device="Neuron (published)",
        provenance=f"imported: {ref.source} (Neuron SDK {ref.neuron_version or '?'} performance table)",
        precision=ref.precision, framework=ref.framework, batch_size=ref.batch_size,
        world_size=ref.world_size, nodes=ref.nodes,
        samples_per_sec=ref.samples_per_sec, unit=ref.unit, note=note)


def unsupported_rows(rows: list[Row], catalog: Catalog) -> list[Row]:
    """inf1 (and any type that cannot train) gets a row with the reason in each training workload."""
    train_workloads = {r.workload: r for r in rows if r.mode == "train"}
    out = []
    for itype in sorted({r.instance_type for r in rows}):
        spec = catalog.get(itype)
        if spec is None or spec.can_train:
            continue
        for key, example in train_workloads.items():
            if not any(r.instance_type == itype and r.workload == key for r in rows):
                out.append(Row(itype, "train", example.model, example.img_size, "unsupported",
                               spec.accelerator, "instance catalog", note=spec.train_note))
    return out


def mark_unsupported(rows: list[Row], catalog: Catalog) -> list[Row]:
    """A training row on a type that cannot train keeps its place but loses its figures."""
    for row in rows:
        spec = catalog.get(row.instance_type)
        if row.mode == "train" and spec is not None and not spec.can_train:
            row.note = f"{spec.train_note} (the file's figures are not used)"
            row.origin, row.samples_per_sec, row.spread = "unsupported", None, None
    return rows


# --- prices and comparisons ----------------------------------------------------------------------

def price_rows(rows: list[Row], catalog: Catalog) -> None:
    for row in rows:
        row.price = catalog.price(row.instance_type)
        if row.price is None or not row.samples_per_sec:
            continue
        row.usd_per_hour = row.price.usd_per_hour * row.nodes
        per_hour = row.samples_per_sec * 3600
        row.samples_per_dollar = per_hour / row.usd_per_hour
        row.usd_per_million = row.usd_per_hour / per_hour * 1e6


def build_groups(rows: list[Row], baseline: str | None, epoch_samples: int | None) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for row in rows:
        groups.setdefault(row.workload, Group(row.mode, row.model)).rows.append(row)
    if baseline and not any(r.instance_type == baseline and r.samples_per_dollar for r in rows):
        priced = sorted({r.instance_type for r in rows if r.samples_per_dollar})
        raise UsageError(f"--baseline {baseline}: no priced row of that type (priced: "
                         f"{', '.join(priced) or 'none'})")
    ordered = sorted(groups.values(), key=lambda g: (g.mode != "train", g.model.lower()))
    for group in ordered:
        group.rows.sort(key=lambda r: (r.origin == "unsupported", -(r.samples_per_sec or 0)))
        _choose_baseline(group, baseline)
        _epoch_costs(group, epoch_samples)
    return ordered


def _choose_baseline(group: Group, wanted: str | None) -> None:
    priced = priced_rows(group.rows)
    if not priced:
        group.baseline_note = "no priced row: relative price-performance not computed"
        return
    for name in [n for n in (wanted, DEFAULT_BASELINE) if n]:
        same = [p for p in priced if p.row.instance_type == name]
        if same:
            baseline = max(same, key=lambda p: p.per_dollar)
            break
    else:
        cheapest = min(p.per_hour for p in priced)
        baseline = max((p for p in priced if p.per_hour == cheapest), key=lambda p: p.per_dollar)
        group.baseline_note = (f"{wanted or DEFAULT_BASELINE} not in this workload: baseline is the "
                               "cheapest instance here")
    group.baseline = baseline.row
    baseline.row.is_baseline = True
    for p in priced:
        p.row.relative = p.per_dollar / baseline.per_dollar


def _epoch_costs(group: Group, epoch_samples: int | None) -> None:
    sizes = {r.epoch_samples for r in group.rows if r.epoch_samples}
    group.epoch_samples = epoch_samples or (sizes.pop() if len(sizes) == 1 else None)
    if not group.epoch_samples:
        return
    for r in group.rows:
        if r.usd_per_hour and r.samples_per_sec:
            r.usd_per_epoch = group.epoch_samples / (r.samples_per_sec * 3600) * r.usd_per_hour


def check_out_dir(out: Path, force: bool) -> None:
    """Before any work: the report folder can be created or replaced, and nothing else is in it.

    A report is published whole (built beside the folder, then swapped in), so the folder must hold
    nothing but a previous report, which is replaced only with --force. Leftovers of a killed
    report run are cleaned first and never block a new one.
    """
    refuse_unusable(out, "--out", but=errno.ENOTDIR)  # under a file: said below, naming the file
    recover_folder(out)
    if out.is_symlink():
        raise UsageError(f"--out {out} is a symbolic link: give the folder it points to")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [n for n in present if n not in OUTPUT_FILES]
    if foreign:
        raise UsageError(f"--out {out} holds files that are not part of a report ({', '.join(foreign[:3])}): "
                         "a report folder is replaced whole; choose another --out")
    if present and not force:
        raise UsageError(f"{out} already holds a report ({', '.join(present)}): choose another "
                         "--out or pass --force to replace it")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: folder {parent} is not writable: choose another location")


# --- the command ---------------------------------------------------------------------------------

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


def collect_rows(args: argparse.Namespace, catalog: Catalog) -> tuple[list[Row], list[tuple[Path, dict]]]:
    seen: dict[Path, str] = {}
    for p in args.results:  # the same file twice would count one measurement twice
        same = seen.setdefault(Path(p).resolve(), p)
        if same != p or args.results.count(p) > 1:
            raise UsageError(f"{p} is given twice{f' (as {same})' if same != p else ''}: give each result file once")
    results = [(Path(p), r) for p in args.results for r in load_results(p)]
    check_same_workload(results)
    rows = [measured_row(path, r) for path, r in results]
    for ref_path in args.reference:
        rows += [imported_row(ref) for ref in read_reference_csv(ref_path, args.reference_model)]
    rows = mark_unsupported(rows, catalog)
    return rows + unsupported_rows(rows, catalog), results


def main(args: argparse.Namespace) -> int:
    if not args.results and not args.reference:
        raise UsageError("give at least one RESULT.json or --reference table")
    if args.epoch_samples is not None and args.epoch_samples < 1:
        raise UsageError(f"--epoch-samples must be >= 1, got {args.epoch_samples}")
    out = Path(args.out).absolute()  # the folder is renamed into place: "." must have a name
    check_out_dir(out, args.force)
    catalog = load_catalog()
    rows, results = collect_rows(args, catalog)
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
                  any(r["device"]["kind"] == "CPU" for _, r in results))

    from neuron_train.cost.charts import render_charts

    images, titles = render_charts(groups, ctx.footer())
    blocks = report_blocks(groups, ctx, titles)
    # Every file is complete in memory before the folder is touched; it is then published whole.
    publish_folder(out, {**images, "report.csv": write_csv(groups).encode(),
                         "report.md": render_markdown(blocks).encode(),
                         "report.html": render_html(blocks, images).encode()})
    for g in groups:
        if any(r.samples_per_sec for r in g.rows):
            print(f"{g.title}: {group_summary(g)}")
    print(f"report: {len(rows)} row(s) in {len(groups)} workload(s) -> {out}/report.html "
          f"(+ report.md, report.csv, {', '.join(images)})")
    return 0
