"""The report's text: table cells, CSV, provenance and method, the block list both renderings share,
and its Markdown and self-contained HTML renderings (charts are in charts.py).
"""

from __future__ import annotations

import csv
import html
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from neuron_train import __version__
from neuron_train.cost.catalog import Price, money
from neuron_train.cost.records import BenchResult, Host
from neuron_train.cost.report.rows import Group, Row, device_text, priced_rows


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
    ok = [(r, r.samples_per_sec) for r in group.rows if r.samples_per_sec]
    fastest, speed = max(ok, key=lambda pair: pair[1])
    text = f"fastest: {fastest.instance_type} ({speed:,.1f} {group.unit}/s, {fastest.origin})"
    priced = priced_rows(r for r, _ in ok)
    if priced:
        best = max(priced, key=lambda p: p.per_dollar)
        # cast: a group with a priced row has a baseline (compare.build_groups chose it)
        baseline = cast(Row, group.baseline)
        text += (f"; most {group.unit} per dollar: {best.row.instance_type} ({best.per_dollar:,.0f} "
                 f"per $, {best.row.relative:.2f}x the baseline {baseline.instance_type})")
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
            writer.writerow([_cell(c) for c in [g.title, r.instance_type, r.origin, r.device, r.mode, r.model,
                             r.img_size or "", r.precision, r.framework, r.batch_size or "", r.world_size or "",
                             r.nodes,
                             _num(r.samples_per_sec), _num(r.spread), r.unit, _num(r.compile_time_s),
                             r.graph_count if r.graph_count is not None else "",
                             _num(r.usd_per_hour), p.kind if p else "", p.region if p else "",
                             p.date if p else "", p.source if p else "", _num(r.samples_per_dollar),
                             _num(r.relative), g.baseline.instance_type if g.baseline else "",
                             _num(r.usd_per_million), g.epoch_samples or "", _num(r.usd_per_epoch),
                             r.provenance, r.note]])
    return buf.getvalue()


def _cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text: one starting with = + - @ (or a tab or CR) would be a
    formula (a model or host name is the user's text), so it gets a leading apostrophe."""
    return f"'{value}" if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


@dataclass
class Context:
    """What the report says about where its numbers come from."""

    created: str
    results: list[tuple[Path, BenchResult]]
    references: list[Path]
    prices: list[tuple[str, Price]]
    cpu_measured: bool

    def footer(self) -> str:
        parts = []
        measured = [r for _, r in self.results if not r.estimated]
        if measured:
            hosts = sorted({r.host.cpu_shown for r in measured if r.device.kind == "CPU"})
            others = sorted({r.device.kind for r in measured} - {"CPU"})
            cpu = [f"the CPU XLA device of {', '.join(hosts)} (not Neuron hardware)"] if hosts else []
            where = cpu + others
            parts.append(f"Measured here: {len(measured)} bench file(s) on {' and '.join(where)}")
        if len(measured) < len(self.results):
            parts.append(f"ESTIMATED (not measured): {len(self.results) - len(measured)} row(s) by "
                         "neuron-train plan")
        if self.references:
            parts.append("Imported: " + ", ".join(p.name for p in self.references)
                         + " (Neuron SDK performance tables)")
        sources = sorted({f"{p.kind} {p.region}, {p.source}" for _, p in self.prices})
        parts.append("Prices: " + ("; ".join(sources) if sources else "none"))
        return " · ".join(parts)


def _load_text(host: Host) -> str:
    load = host.load_average_1m
    return f", load average {load:g} at the end" if load is not None else ""


def _stack_text(versions: dict) -> str:
    """torch and the framework that ran it (torch-xla / torch-neuronx, or inf1's torch-neuron)."""
    names = [n for n in ("torch-xla", "torch-neuronx", "torch-neuron") if n in versions] or ["torch-xla"]
    return ", ".join(f"{n} {versions.get(n, '?')}" for n in ("torch", *names))


def provenance_lines(ctx: Context) -> list[str]:
    lines = []
    for path, r in ctx.results:
        if r.estimate is not None:
            lines.append(f"ESTIMATED, not measured: `{path.name}`: {r.mode} on {r.instance_type} by "
                         f"neuron-train plan, {r.created_at}; {r.estimate.calibration}; "
                         f"bottleneck {r.estimate.bottleneck_text}")
            continue
        lines.append(f"Measured here: `{path.name}`: {r.mode} on {r.instance_type} "
                     f"({r.instance_type_source}), {device_text(r.device)} x "
                     f"{r.world_size}, host {r.host.cpu_shown} ({r.host.cpu_count} "
                     f"CPUs{_load_text(r.host)}), {r.created_at}, {_stack_text(r.versions)}; "
                     f"command: `{r.command}`")
    for path in ctx.references:
        lines.append(f"Imported: `{path.name}` (Neuron SDK performance table, published figures, "
                     "not measured here)")
    for name, p in ctx.prices:
        url = f" <{p.url}>" if p.url else ""
        lines.append(f"Price of {name}: ${p.usd_per_hour:g}/h {p.kind}, {p.region}, read {p.date}, "
                     f"{p.source}{url}")
    return lines


OFF_FACTOR = 2.0   # an estimate this many times from a measurement of the same type is named


def estimates_off(ctx: Context) -> list[str]:
    """One line per plan estimate more than OFF_FACTOR x from a measurement of the same workload on the
    same instance type (both ways), naming both files."""
    def key(r: BenchResult) -> tuple:
        return r.mode, r.instance_type.lower(), r.model.name.lower()
    measured = {key(r): (path, r) for path, r in ctx.results if not r.estimated}
    lines = []
    for path, r in ctx.results:
        m = measured.get(key(r)) if r.estimated else None
        if m is None:
            continue
        est, real = r.samples_per_sec.median, m[1].samples_per_sec.median
        if real > 0 and est > 0 and max(est / real, real / est) > OFF_FACTOR:
            lines.append(f"ESTIMATE OFF: `{path.name}` estimated {r.mode} of {r.model.name} on "
                         f"{r.instance_type} at {est:,.1f}/s, {est / real:.2g}x the {real:,.1f}/s measured in "
                         f"`{m[0].name}`: trust the measurement; re-plan with --calibrate {m[0].name}")
    return lines


CPU_WARNING = ("Rows measured on the CPU XLA device are real measurements of the machine that ran "
               "`neuron-train bench`, not of Neuron hardware: read them as the local baseline of the "
               "workflow, never as Trainium or Inferentia numbers.")
ESTIMATE_WARNING = ("Rows whose origin is `estimated` are ESTIMATES by `neuron-train plan` (a CPU run and "
                    "published Neuron rows, docs/plan.md), not measurements: each says its error band and "
                    "bottleneck in its note. Bench one instance type to check them.")
METHOD = ("Throughput is the median over repeats of steady-state samples/s (warm-up steps and "
          "compile time excluded; spread = half the 10th-90th percentile range, or half the range "
          "for fewer than 3 repeats). Samples per $ = samples/s x 3600 / (USD per hour x instances). "
          "vs baseline = samples per $ / the baseline's, within one workload. $ per 1M = USD per hour "
          "/ (samples/s x 3600) x 1e6. $ per epoch = epoch samples / (samples/s x 3600) x USD per hour.")


@dataclass(frozen=True)
class Heading:
    level: int                  # 1 or 2
    text: str


@dataclass(frozen=True)
class Para:
    text: str
    warn: bool = False          # a warning, set apart


@dataclass(frozen=True)
class Bullets:
    items: list[tuple[str, str]]   # (lead, text); an empty lead: the text alone


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    name: str                   # the chart's file name
    title: str


Block = Heading | Para | Bullets | Table | Image


SWEEP_HEADER = ("Batch per device", "Processes", "Status", "Throughput /s", "Reason")


def sweep_tables(ctx: Context) -> list[tuple[str, list[list[str]]]]:
    """The configurations each `bench --sweep` tried, failures and out-of-memory included."""
    tables = []
    for path, r in ctx.results:
        if r.sweep:
            rows = [[str(x.batch_size_per_device), str(x.world_size), x.status, _fmt(x.samples_per_sec), x.reason]
                    for x in r.sweep]
            tables.append((f"{path.name} ({r.mode} on {r.instance_type}, {device_text(r.device)})", rows))
    return tables


def report_blocks(groups: list[Group], ctx: Context, charts: dict[str, str]) -> list[Block]:
    """The report as a list of blocks, rendered to Markdown and to HTML alike."""
    estimated = sum(r.estimated for _, r in ctx.results)   # never counted as bench results
    blocks: list[Block] = [
        Heading(1, "Price-performance report"),
        Para(f"Generated {ctx.created} by neuron-train {__version__} from {len(ctx.results) - estimated} bench "
             f"result(s), {estimated} plan estimate(s) and {len(ctx.references)} reference table(s)."
             if estimated else f"Generated {ctx.created} by neuron-train {__version__} from {len(ctx.results)} "
             f"bench result(s) and {len(ctx.references)} reference table(s).")]
    if ctx.cpu_measured:
        blocks.append(Para(CPU_WARNING, warn=True))
    if estimated:
        blocks.append(Para(ESTIMATE_WARNING, warn=True))
        blocks += [Para(line, warn=True) for line in estimates_off(ctx)]
    blocks += [Heading(2, "Summary"), Bullets([(g.title, group_summary(g)) for g in groups
                                               if any(r.samples_per_sec for r in g.rows)])]
    for g in groups:
        facts = [f"baseline: {g.baseline.instance_type}" if g.baseline else "no baseline"]
        if g.baseline_note:
            facts.append(g.baseline_note)
        facts.append(f"epoch: {g.epoch_samples:,} {g.unit}" if g.epoch_samples
                     else "epoch size unknown (pass --epoch-samples)")
        blocks += [Heading(2, g.title), Para("; ".join(facts) + "."),
                   Table(TABLE_HEADER, [table_cells(r) for r in g.rows])]
    blocks.append(Heading(2, "Charts"))
    blocks += [Image(name, title) for name, title in charts.items()]
    sweeps = sweep_tables(ctx)
    if sweeps:
        blocks.append(Heading(2, "Configurations tried (--sweep)"))
        for caption, rows in sweeps:
            blocks += [Para(caption), Table(SWEEP_HEADER, rows)]
    blocks += [Heading(2, "Provenance"), Bullets([("", line) for line in provenance_lines(ctx)]),
               Heading(2, "Method"), Para(METHOD)]
    return blocks


def render_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out += [f"{'#' * b.level} {_md(b.text)}", ""]
        elif isinstance(b, Para):
            out += [f"> {_md(b.text)}" if b.warn else _md(b.text), ""]
        elif isinstance(b, Bullets):
            out += [f"- **{_md(lead)}**: {_md(text)}." if lead else f"- {_md(text)}" for lead, text in b.items] + [""]
        elif isinstance(b, Table):
            out += ["| " + " | ".join(b.header) + " |", "|" + "---|" * len(b.header)]
            out += ["| " + " | ".join(_md(c).replace("|", "/") for c in row) + " |" for row in b.rows] + [""]
        else:
            out += [f"![{b.title}]({b.name})", ""]
    return "\n".join(out)


_LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")


def _md(text: object) -> str:
    """Text from the inputs (model names, host names) as Markdown shows it: never raw HTML, a link or
    an image (`[x](url)`, `![x](url)` in a name: the brackets are escaped), nor a line of its own (a
    newline in a name ended the table row or the heading)."""
    flat = _LINE_BREAKS.sub(" ", str(text))
    return html.escape(flat, quote=False).replace("[", "\\[").replace("]", "\\]")


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0 1.5em}"
        "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
        "th{background:#f0f0f0}.warn{background:#fff4e0;border-left:4px solid #e08a00;padding:0.6em}"
        "img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}")


def render_html(blocks: list[Block], images: dict[str, bytes]) -> str:
    """One self-contained page: the charts are inlined as base64 PNGs, no external file or link."""
    import base64

    e = lambda text: html.escape(str(text).replace("`", ""))  # noqa: E731
    out = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'><title>Price-performance report</title>",
           f"<style>{_CSS}</style></head><body>"]
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f"<p class='warn'>{e(b.text)}</p>" if b.warn else f"<p>{e(b.text)}</p>")
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li><b>{e(lead)}</b>: {e(text)}.</li>" if lead
                                        else f"<li>{e(text)}</li>" for lead, text in b.items) + "</ul>")
        elif isinstance(b, Table):
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in b.header) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                                 for row in b.rows) + "</table>")
        else:
            data = base64.b64encode(images[b.name]).decode()
            out.append(f"<figure><img alt='{e(b.title)}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{e(b.title)}</figcaption></figure>")
    out += ["</body></html>", ""]
    return "\n".join(out)
