"""Published reference rows: the Neuron SDK performance tables (CSV), as the SDK docs ship them.

Formats accepted (header names as in aws-neuron-sdk `about-neuron/benchmarks/{inf1,inf2,trn1}/*.csv`):
- inference: `Model, Inst. Type, Throughput (inference/sec)` (or `.../second`), `Batch Size`,
  `Latency P50 (ms)`, `Neuron Version`, `Model Data Type`, `Compilation Autocast Data Type`,
  optional `Image Size` (inf2/trn1 tables);
- inf1 inference: `Model, Inst. Type, Avg Throughput (/sec), Batch Size, Neuron Version, Model details`;
- training: `Model, Instance-Type, Training Data-Type, Nodes, Topology, Microbatch, Globalbatch,
  Performance [seq/sec], Neuron Version` (trn1 tables; some headers carry a leading space).
Token-throughput tables (LLM decoders) measure tokens, not samples, and are refused.
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common import reader
from neuron_train.common.errors import UsageError

_INFER_THROUGHPUT = ("Throughput (inference/sec)", "Throughput (inference/second)", "Avg Throughput (/sec)")
_TRAIN_THROUGHPUT = "Performance [seq/sec]"

REFERENCE_LIMIT = 16 * 2**20  # a Neuron SDK performance table is tens of KiB


@dataclass
class ReferenceRow:
    instance_type: str
    instance_note: str          # e.g. "also trn1n.32xlarge"
    mode: str                   # train | infer
    model: str
    img_size: int | None
    precision: str
    batch_size: int | None      # per NeuronCore (inference batch, training micro-batch)
    world_size: int | None      # NeuronCores in data parallel, when the table says
    nodes: int                  # instances the figure needs (priced nodes x hourly rate)
    samples_per_sec: float
    unit: str                   # what one sample is in the source table
    latency_p50_ms: float | None
    framework: str
    neuron_version: str
    source: str                 # file name the row came from


def _num(text: str | None) -> float | None:
    """A finite number from a table cell ('1,955.4' -> 1955.4); None for empty, text, NaN, Infinity."""
    try:
        value = float(str(text).replace(",", "").strip())
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _int(text: str | None) -> int | None:
    value = _num(text)
    return int(value) if value is not None else None


def _throughput(text: str | None) -> float:
    """The samples/s cell; 0.0 when it holds no number (such a row is refused by _row_problem)."""
    return _num(text) or 0.0


def _img_size(text: str | None) -> int | None:
    """'224x224' -> 224; anything else (e.g. '16x224x224' video frames) -> None."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", text or "")
    return int(m.group(1)) if m and m.group(1) == m.group(2) else None


def _topology_cores(text: str | None, nodes: int) -> int | None:
    """'[32xNC(DP)]' -> 32 x nodes (data-parallel NeuronCores)."""
    m = re.search(r"(\d+)\s*x\s*NC", text or "")
    return int(m.group(1)) * nodes if m else None


def _instance(text: str) -> tuple[str, str]:
    names = [n.strip().lower() for n in text.split("/") if n.strip()]
    return names[0], (f"also {', '.join(names[1:])}" if names[1:] else "")


def _infer_row(row: dict, source: str, throughput_col: str) -> ReferenceRow:
    itype, note = _instance(row["Inst. Type"])
    model_type = row.get("Model Data Type") or row.get("Model details") or ""
    autocast = row.get("Compilation Autocast Data Type") or ""
    precision = f"{model_type} (autocast {autocast})" if autocast and autocast != "None" else model_type
    return ReferenceRow(itype, note, "infer", row["Model"].strip(), _img_size(row.get("Image Size")),
                        precision.strip(), _int(row.get("Batch Size")), None, 1,
                        _throughput(row[throughput_col]), "inferences", _num(row.get("Latency P50 (ms)")),
                        (row.get("Framework") or "").strip(), (row.get("Neuron Version") or "").strip(),
                        source)


def _train_row(row: dict, source: str) -> ReferenceRow:
    itype, note = _instance(row["Instance-Type"])
    nodes = _int(row.get("Nodes")) or 1
    return ReferenceRow(itype, note, "train", row["Model"].strip(), None,
                        (row.get("Training Data-Type") or "").strip(), _int(row.get("Microbatch")),
                        _topology_cores(row.get("Topology"), nodes), nodes, _throughput(row[_TRAIN_THROUGHPUT]),
                        "sequences", None, "torch-neuronx " + (row.get(
                            "Pytorch Neuron(torch-neuronx) Version") or "?").strip(),
                        (row.get("Neuron Version") or "").strip(), source)


def _row_problem(ref: ReferenceRow) -> str | None:
    """What makes a parsed row unusable (every figure the report computes with must be sane)."""
    if not ref.samples_per_sec or ref.samples_per_sec <= 0:
        return "throughput is not a positive number"
    if ref.nodes < 1:
        return f"Nodes must be >= 1, got {ref.nodes}"
    for name, value in (("batch size", ref.batch_size), ("image size", ref.img_size), ("world size", ref.world_size),
                        ("latency", ref.latency_p50_ms)):
        if value is not None and value <= 0:
            return f"{name} must be > 0, got {value}"
    return None


def read_reference_csv(path: str | Path, model_filters: list[str] | None = None) -> list[ReferenceRow]:
    """Rows of one Neuron SDK performance CSV; `model_filters` keeps models containing any of them."""
    path = Path(path)
    text = reader.read_text(path, "--reference", limit=REFERENCE_LIMIT)
    try:
        table = csv.DictReader(io.StringIO(text, newline=""))
        header = [h.strip() for h in table.fieldnames or []]
        rows = [{(k or "").strip(): (v or "") for k, v in r.items() if isinstance(v, str) or v is None}
                for r in table]
    except csv.Error as exc:
        raise UsageError(f"{path}: not a readable CSV file ({exc})") from None
    infer_col = next((c for c in _INFER_THROUGHPUT if c in header), None)
    if infer_col and {"Model", "Inst. Type"} <= set(header):
        parse = lambda r: _infer_row(r, path.name, infer_col)  # noqa: E731
    elif {_TRAIN_THROUGHPUT, "Model", "Instance-Type"} <= set(header):
        parse = lambda r: _train_row(r, path.name)  # noqa: E731
    elif any("token" in h.lower() for h in header):
        raise UsageError(f"{path}: a token-throughput table (tokens/s): the report compares samples/s")
    else:
        raise UsageError(f"{path}: not a Neuron SDK performance table (need Model, Inst. Type and "
                         f"'{_INFER_THROUGHPUT[0]}', or Model, Instance-Type and '{_TRAIN_THROUGHPUT}')")
    filters = [f.lower() for f in model_filters or []]
    out = []
    for i, row in enumerate(rows, 2):
        if filters and not any(f in row.get("Model", "").lower() for f in filters):
            continue
        ref = parse(row)
        problem = _row_problem(ref)
        if problem:
            raise UsageError(f"{path}:{i}: {problem}")
        out.append(ref)
    if not out:
        raise UsageError(f"{path}: no rows{' match ' + ', '.join(model_filters) if model_filters else ''}")
    return out
