"""`neuron-train report`: merge bench results and published reference rows into one report folder.

Writes report.md, report.csv, a self-contained report.html and PNG charts. Rows are grouped by
workload (mode and model; model names compared without case and punctuation, so the Neuron
tables' "Resnet-50" and "resnet50" meet): throughput, price-performance and cost are compared only
between rows measuring the same thing. Every figure says where it came from.

Price-performance is samples per dollar = samples/s x 3600 / (USD per hour x instances); relative
price-performance divides it by the baseline's. Cost per 1M samples = USD per hour / (samples/s x
3600) x 1e6; cost per epoch = epoch samples / (samples/s x 3600) x USD per hour.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import html
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from neuron_train import __version__
from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import write_bytes_atomic
from neuron_train.cost.catalog import Catalog, Price, load_catalog, resolve_prices
from neuron_train.cost.references import ReferenceRow, read_reference_csv
from neuron_train.cost.rows import Group, Row, money
from neuron_train.cost.schema import validate_result

OUTPUT_FILES = ("report.md", "report.csv", "report.html", "throughput.png", "price_performance.png",
                "cost.png")
DEFAULT_BASELINE = "trn1.2xlarge"  # the reference study's baseline
# --- loading -------------------------------------------------------------------------------------

def load_result(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not valid JSON ({str(exc).splitlines()[0]})") from None
    return validate_result(data, str(path))


def check_same_workload(results: list[tuple[Path, dict]]) -> None:
    """All measured results of one mode must measure the same model, image size and dataset."""
    first: dict[str, tuple[Path, tuple]] = {}
    for path, r in results:
        key = (r["model"]["name"], r["model"]["img_size"], r["dataset"]["name"])
        seen_path, seen = first.setdefault(r["mode"], (path, key))
        if key != seen:
            raise UsageError(
                f"{path} measures {key[0]} at {key[1]} px on {key[2]} but {seen_path} measures "
                f"{seen[0]} at {seen[1]} px on {seen[2]} ({r['mode']}): compare one workload per mode")


def _device_text(kind: str) -> str:
    return "CPU (XLA device, not Neuron)" if kind == "CPU" else kind


def measured_row(path: Path, r: dict) -> Row:
    kind = r["device"]["kind"]
    where = f"{r['host'].get('cpu', '?')}, " if kind == "CPU" else ""
    return Row(
        instance_type=r["instance_type"].lower(), mode=r["mode"], model=r["model"]["name"],
        img_size=r["model"]["img_size"], origin="measured", device=_device_text(kind),
        provenance=f"measured here: {path.name} ({where}{r['created_at'][:10]})",
        precision=r["precision"], batch_size=r["batch_size_per_device"], world_size=r["world_size"],
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
    priced = [r for r in group.rows if r.samples_per_dollar]
    if not priced:
        group.baseline_note = "no priced row: relative price-performance not computed"
        return
    for name in [n for n in (wanted, DEFAULT_BASELINE) if n]:
        same = [r for r in priced if r.instance_type == name]
        if same:
            group.baseline = max(same, key=lambda r: r.samples_per_dollar)
            break
    else:
        cheapest = min(r.usd_per_hour for r in priced)
        group.baseline = max((r for r in priced if r.usd_per_hour == cheapest),
                             key=lambda r: r.samples_per_dollar)
        group.baseline_note = (f"{wanted or DEFAULT_BASELINE} not in this workload: baseline is the "
                               "cheapest instance here")
    group.baseline.is_baseline = True
    for r in priced:
        r.relative = r.samples_per_dollar / group.baseline.samples_per_dollar


def _epoch_costs(group: Group, epoch_samples: int | None) -> None:
    sizes = {r.epoch_samples for r in group.rows if r.epoch_samples}
    group.epoch_samples = epoch_samples or (sizes.pop() if len(sizes) == 1 else None)
    if not group.epoch_samples:
        return
    for r in group.rows:
        if r.usd_per_hour and r.samples_per_sec:
            r.usd_per_epoch = group.epoch_samples / (r.samples_per_sec * 3600) * r.usd_per_hour


# --- writing -------------------------------------------------------------------------------------

def _fmt(value: float | None, spec: str = ",.1f", prefix: str = "") -> str:
    return "n/a" if value is None else f"{prefix}{value:{spec}}"


TABLE_HEADER = ("Instance", "Source of the figure", "Device", "Configuration", "Throughput /s (± spread)",
                "Compile s (graphs)", "Price (USD/h)", "Samples per $", "vs baseline", "$ per 1M",
                "$ per epoch", "Note")


def _price_text(row: Row) -> str:
    p = row.price
    if p is None:
        return "no price"
    nodes = f" x {row.nodes}" if row.nodes > 1 else ""
    return f"{money(p.usd_per_hour)}{nodes} {p.kind}, {p.region}, {p.date}"


def table_cells(row: Row) -> list[str]:
    name = row.instance_type + (" (baseline)" if row.is_baseline else "")
    if row.origin == "unsupported":
        return [name, row.provenance, row.device, "", "not supported", "", "", "", "", "", "", row.note]
    spread = f" (± {row.spread:,.1f})" if row.spread else ""
    compiled = (f"{row.compile_time_s:.1f} ({row.graph_count})" if row.compile_time_s is not None
                else "n/a")
    return [name, row.provenance, row.device, row.config_text,
            f"{_fmt(row.samples_per_sec)} {row.unit}{spread}", compiled,
            _price_text(row), _fmt(row.samples_per_dollar, ",.0f"),
            _fmt(row.relative, ".2f") + ("x" if row.relative else ""), money(row.usd_per_million),
            money(row.usd_per_epoch), row.note]


def group_summary(group: Group) -> str:
    ok = [r for r in group.rows if r.samples_per_sec]
    fastest = max(ok, key=lambda r: r.samples_per_sec)
    text = (f"fastest: {fastest.instance_type} ({fastest.samples_per_sec:,.1f} {group.unit}/s, "
            f"{fastest.origin})")
    priced = [r for r in ok if r.samples_per_dollar]
    if priced:
        best = max(priced, key=lambda r: r.samples_per_dollar)
        text += (f"; most {group.unit} per dollar: {best.instance_type} ({best.samples_per_dollar:,.0f} "
                 f"per $, {best.relative:.2f}x the baseline {group.baseline.instance_type})")
    return text


CSV_COLUMNS = ("workload", "instance_type", "origin", "device", "mode", "model", "img_size", "precision",
               "framework", "batch_size_per_device", "world_size", "instances", "samples_per_sec",
               "spread", "unit", "compile_time_s", "graph_count", "usd_per_hour", "price_kind",
               "price_region", "price_date", "price_source", "samples_per_dollar", "relative_to_baseline",
               "baseline_instance", "usd_per_million_samples", "epoch_samples", "usd_per_epoch",
               "provenance", "note")


def write_csv(groups: list[Group]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for g in groups:
        for r in g.rows:
            p = r.price
            writer.writerow([g.title, r.instance_type, r.origin, r.device, r.mode, r.model, r.img_size or "",
                             r.precision, r.framework, r.batch_size or "", r.world_size or "", r.nodes,
                             _num(r.samples_per_sec), _num(r.spread), r.unit, _num(r.compile_time_s),
                             r.graph_count if r.graph_count is not None else "",
                             _num(r.usd_per_hour), p.kind if p else "", p.region if p else "",
                             p.date if p else "", p.source if p else "", _num(r.samples_per_dollar),
                             _num(r.relative), g.baseline.instance_type if g.baseline else "",
                             _num(r.usd_per_million), g.epoch_samples or "", _num(r.usd_per_epoch),
                             r.provenance, r.note])
    return buf.getvalue()


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


@dataclass
class Context:
    """What the report says about where its numbers come from."""

    created: str
    results: list[tuple[Path, dict]]
    references: list[Path]
    prices: list[tuple[str, Price]]
    cpu_measured: bool

    def footer(self) -> str:
        parts = []
        if self.results:
            hosts = sorted({r["host"].get("cpu", "?") for _, r in self.results
                            if r["device"]["kind"] == "CPU"})
            others = sorted({r["device"]["kind"] for _, r in self.results} - {"CPU"})
            cpu = [f"the CPU XLA device of {', '.join(hosts)} (not Neuron hardware)"] if hosts else []
            where = cpu + others
            parts.append(f"Measured here: {len(self.results)} bench file(s) on {' and '.join(where)}")
        if self.references:
            parts.append("Imported: " + ", ".join(p.name for p in self.references)
                         + " (Neuron SDK performance tables)")
        sources = sorted({f"{p.kind} {p.region}, {p.source}" for _, p in self.prices})
        parts.append("Prices: " + ("; ".join(sources) if sources else "none"))
        return " · ".join(parts)


def _load_text(host: dict) -> str:
    load = host.get("load_average_1m")
    return f", load average {load:g} at the end" if load is not None else ""


def provenance_lines(ctx: Context) -> list[str]:
    lines = []
    for path, r in ctx.results:
        v = r["versions"]
        lines.append(f"Measured here: `{path.name}`: {r['mode']} on {r['instance_type']} "
                     f"({r['instance_type_source']}), {_device_text(r['device']['kind'])} x "
                     f"{r['world_size']}, host {r['host'].get('cpu', '?')} ({r['host'].get('cpu_count')} "
                     f"CPUs{_load_text(r['host'])}), {r['created_at']}, torch {v.get('torch', '?')}, "
                     f"torch-xla {v.get('torch-xla', '?')}; command: `{r['command']}`")
    for path in ctx.references:
        lines.append(f"Imported: `{path.name}` (Neuron SDK performance table, published figures, "
                     "not measured here)")
    for name, p in ctx.prices:
        url = f" <{p.url}>" if p.url else ""
        lines.append(f"Price of {name}: ${p.usd_per_hour:g}/h {p.kind}, {p.region}, read {p.date}, "
                     f"{p.source}{url}")
    return lines


CPU_WARNING = ("Rows measured on the CPU XLA device are real measurements of the machine that ran "
               "`neuron-train bench`, not of Neuron hardware: read them as the local baseline of the "
               "workflow, never as Trainium or Inferentia numbers.")
METHOD = ("Throughput is the median over repeats of steady-state samples/s (warm-up steps and "
          "compile time excluded; spread = half the 10th-90th percentile range, or half the range "
          "for fewer than 3 repeats). Samples per $ = samples/s x 3600 / (USD per hour x instances). "
          "vs baseline = samples per $ / the baseline's, within one workload. $ per 1M = USD per hour "
          "/ (samples/s x 3600) x 1e6. $ per epoch = epoch samples / (samples/s x 3600) x USD per hour.")


SWEEP_HEADER = ("Batch per device", "Processes", "Status", "Throughput /s", "Reason")


def sweep_tables(ctx: Context) -> list[tuple[str, list[list[str]]]]:
    """The configurations each `bench --sweep` tried, failures and out-of-memory included."""
    tables = []
    for path, r in ctx.results:
        if r["sweep"]:
            rows = [[str(x.get("batch_size_per_device", "")), str(x.get("world_size", "")),
                     str(x.get("status", "")), _fmt(x.get("samples_per_sec")), x.get("reason", "")]
                    for x in r["sweep"]]
            tables.append((f"{path.name} ({r['mode']} on {r['instance_type']}, "
                           f"{_device_text(r['device']['kind'])})", rows))
    return tables


def report_blocks(groups: list[Group], ctx: Context, charts: dict[str, str]) -> list[tuple[str, object]]:
    """The report as a list of (kind, content) blocks, rendered to Markdown and to HTML alike."""
    blocks: list[tuple[str, object]] = [
        ("h1", "Price-performance report"),
        ("p", f"Generated {ctx.created} by neuron-train {__version__} from {len(ctx.results)} bench "
              f"result(s) and {len(ctx.references)} reference table(s).")]
    if ctx.cpu_measured:
        blocks.append(("warn", CPU_WARNING))
    blocks += [("h2", "Summary"), ("ul", [(g.title, group_summary(g)) for g in groups
                                          if any(r.samples_per_sec for r in g.rows)])]
    for g in groups:
        facts = [f"baseline: {g.baseline.instance_type}" if g.baseline else "no baseline"]
        if g.baseline_note:
            facts.append(g.baseline_note)
        facts.append(f"epoch: {g.epoch_samples:,} {g.unit}" if g.epoch_samples
                     else "epoch size unknown (pass --epoch-samples)")
        blocks += [("h2", g.title), ("p", "; ".join(facts) + "."),
                   ("table", (TABLE_HEADER, [table_cells(r) for r in g.rows]))]
    blocks.append(("h2", "Charts"))
    blocks += [("img", (name, title)) for name, title in charts.items()]
    sweeps = sweep_tables(ctx)
    if sweeps:
        blocks.append(("h2", "Configurations tried (--sweep)"))
        for caption, rows in sweeps:
            blocks += [("p", caption), ("table", (SWEEP_HEADER, rows))]
    blocks += [("h2", "Provenance"), ("ul", [("", line) for line in provenance_lines(ctx)]),
               ("h2", "Method"), ("p", METHOD)]
    return blocks


def render_markdown(blocks: list[tuple[str, object]]) -> str:
    out: list[str] = []
    for kind, content in blocks:
        if kind in ("h1", "h2"):
            out += [f"{'#' * int(kind[1])} {content}", ""]
        elif kind == "p":
            out += [content, ""]
        elif kind == "warn":
            out += [f"> {content}", ""]
        elif kind == "ul":
            out += [f"- **{lead}**: {text}." if lead else f"- {text}" for lead, text in content] + [""]
        elif kind == "table":
            header, rows = content
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows] + [""]
        elif kind == "img":
            out += [f"![{content[1]}]({content[0]})", ""]
    return "\n".join(out)


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0 1.5em}"
        "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
        "th{background:#f0f0f0}.warn{background:#fff4e0;border-left:4px solid #e08a00;padding:0.6em}"
        "img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}")


def render_html(blocks: list[tuple[str, object]], images: dict[str, bytes]) -> str:
    """One self-contained page: the charts are inlined as base64 PNGs, no external file or link."""
    import base64

    e = lambda text: html.escape(str(text).replace("`", ""))  # noqa: E731
    out = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'><title>Price-performance report</title>",
           f"<style>{_CSS}</style></head><body>"]
    for kind, content in blocks:
        if kind in ("h1", "h2", "p"):
            out.append(f"<{kind}>{e(content)}</{kind}>")
        elif kind == "warn":
            out.append(f"<p class='warn'>{e(content)}</p>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li><b>{e(lead)}</b>: {e(text)}.</li>" if lead
                                        else f"<li>{e(text)}</li>" for lead, text in content) + "</ul>")
        elif kind == "table":
            header, rows = content
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                                 for row in rows) + "</table>")
        elif kind == "img":
            data = base64.b64encode(images[content[0]]).decode()
            out.append(f"<figure><img alt='{e(content[1])}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{e(content[1])}</figcaption></figure>")
    out += ["</body></html>", ""]
    return "\n".join(out)


def check_out_dir(out: Path, force: bool) -> None:
    """Never overwrite a user's report silently: refuse when our files are there, unless --force."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    existing = [n for n in OUTPUT_FILES if (out / n).exists()]
    if existing and not force:
        raise UsageError(f"{out} already holds a report ({', '.join(existing)}): choose another "
                         "--out or pass --force to replace it")


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
    results = [(Path(p), load_result(p)) for p in args.results]
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
    out = Path(args.out)
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
    out.mkdir(parents=True, exist_ok=True)  # only now: bad input leaves no empty folder behind
    for name, data in images.items():
        write_bytes_atomic(out / name, data)
    write_bytes_atomic(out / "report.csv", write_csv(groups).encode())
    blocks = report_blocks(groups, ctx, titles)
    write_bytes_atomic(out / "report.md", render_markdown(blocks).encode())
    write_bytes_atomic(out / "report.html", render_html(blocks, images).encode())
    for g in groups:
        if any(r.samples_per_sec for r in g.rows):
            print(f"{g.title}: {group_summary(g)}")
    print(f"report: {len(rows)} row(s) in {len(groups)} workload(s) -> {out}/report.html "
          f"(+ report.md, report.csv, {', '.join(images)})")
    return 0
