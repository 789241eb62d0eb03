"""The report's comparisons: its rows read from bench results, plan files and published tables
(rows.py builds each), priced from the catalog, grouped by workload (mode and model; model names
compared without case and punctuation, so the Neuron tables' "Resnet-50" and "resnet50" meet) and
compared with a baseline. Throughput, price-performance and cost are compared only between rows
measuring the same thing.

Price-performance is samples per dollar = samples/s x 3600 / (USD per hour x instances); relative
price-performance divides it by the baseline's. Cost per 1M samples = USD per hour / (samples/s x
3600) x 1e6; cost per epoch = epoch samples / (samples/s x 3600) x USD per hour.
"""

from __future__ import annotations

from pathlib import Path

from neuron_train.common.errors import UsageError
from neuron_train.cost.catalog import Catalog
from neuron_train.cost.records import BenchResult
from neuron_train.cost.report.references import read_reference_csv
from neuron_train.cost.report.rows import (
    Group,
    Row,
    imported_row,
    mark_unsupported,
    measured_row,
    priced_rows,
    unsupported_rows,
)
from neuron_train.cost.results import load_results

DEFAULT_BASELINE = "trn1.2xlarge"  # the reference study's baseline


def check_same_workload(results: list[tuple[Path, BenchResult]]) -> None:
    """Results of one mode and model must measure it at the same image size and on the same dataset
    (other models, e.g. a script measured by `bench -- COMMAND`, are groups of their own)."""
    first: dict[tuple[str, str], tuple[Path, tuple]] = {}
    for path, r in results:
        key = (r.model.name, r.model.img_size, r.dataset.name)
        seen_path, seen = first.setdefault((r.mode, key[0]), (path, key))
        if key != seen:
            raise UsageError(
                f"{path} measures {key[0]} at {key[1]} px on {key[2]} but {seen_path} measures "
                f"{seen[0]} at {seen[1]} px on {seen[2]} ({r.mode}): compare one workload per mode")


def collect_rows(result_files: list[str], references: list[str], reference_models: list[str],
                 catalog: Catalog) -> tuple[list[Row], list[tuple[Path, BenchResult]]]:
    """Every row of the inputs (result files, reference tables, the catalog's unsupported types), and
    the results read."""
    seen: dict[Path, str] = {}
    for p in result_files:  # the same file twice would count one measurement twice
        same = seen.setdefault(Path(p).resolve(), p)
        if same != p or result_files.count(p) > 1:
            raise UsageError(f"{p} is given twice{f' (as {same})' if same != p else ''}: give each result file once")
    results = [(Path(p), r) for p in result_files for r in load_results(p)]
    check_same_workload(results)
    rows = [measured_row(path, r) for path, r in results]
    for ref_path in references:
        rows += [imported_row(ref) for ref in read_reference_csv(ref_path, reference_models)]
    rows = mark_unsupported(rows, catalog)
    return rows + unsupported_rows(rows, catalog), results


def price_rows(rows: list[Row], catalog: Catalog) -> None:
    """Each row's price, USD per hour (all its instances), samples per dollar and USD per 1M samples."""
    for row in rows:
        row.price = catalog.price(row.instance_type)
        if row.price is None or not row.samples_per_sec:
            continue
        row.usd_per_hour = row.price.usd_per_hour * row.nodes
        per_hour = row.samples_per_sec * 3600
        row.samples_per_dollar = per_hour / row.usd_per_hour
        row.usd_per_million = row.usd_per_hour / per_hour * 1e6


def build_groups(rows: list[Row], baseline: str | None, epoch_samples: int | None) -> list[Group]:
    """The rows grouped by workload (training first), fastest first, each group with its baseline and
    costs per epoch; a --baseline no priced row has is an error."""
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
