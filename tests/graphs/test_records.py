"""The checker's typed records (graphs/records.py, graphs/findings.py): the JSON users read is written
from them byte for byte as before they were records, and no module outside the record modules reads
a record's field as a raw string key.

`known_report_json()` drives the analyzer and the merge through every record with a fixed input (host
reads seen by the hooks and by the log, a read torch_xla refused, a CPU fallback op, dynamo's
recompilations, graph breaks and its limit, two processes); `fixtures/graphs/known_report.json` is
what the dict-based code (commit cca685c) wrote from the same input.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

from neuron_train.graphs import records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.log import Frame, XlaEvent
from neuron_train.instrument import proc
from neuron_train.instrument.runner import merge_records
from tests.conftest import ROOT
from tests.graphs.test_graphs import ACCESS, LIBS, sync_event, window

KNOWN = ROOT / "tests" / "fixtures" / "graphs" / "known_report.json"
LOOP = ROOT / "tests" / "fixtures" / "graphs" / "dynamo_loop.py"  # writes g["lr"] at its LR_WRITE line
MASK = Frame("_ignore_bidirectional_mask_sdpa", "/lib/site-packages/transformers/masking_utils.py", 369)


def _library_of(path: str) -> str:
    return path.split("/site-packages/", 1)[1] if "/site-packages/" in path else ""


def _process(pid: int) -> records.GraphReport:
    """One process's record after six steps: every finding the analyzer reports."""
    analyzer = Analyzer(0, LIBS, library_of=_library_of)
    guard = records.DynamoNote("recompile", "step (torch/optim/sgd.py:105)", "5/1: lr == 0.5", "/u/t.py:7",
                               "accelerate/optimizer.py:170")
    broke = records.DynamoNote("graph_break", "forward (/u/m.py:3)", "Tensor.item", "/u/m.py:9")
    limit = records.DynamoNote("limit", "step (torch/optim/sgd.py:105)", "recompile_limit (8) reached", "/u/t.py:7")
    written = records.DynamoNote("recompile", "step (torch/optim/sgd.py:105)",
                                 "5/1: self.param_groups[0]['lr'] == 0.09", f"{LOOP}:58", "torch/optim/sgd.py:105")
    for step in range(1, 7):
        new = step == 1
        events = [sync_event("compile", "A", 10)] if new else []
        events += [sync_event("execute", "A", 10)]
        if step == 4:  # a new graph at the warm site, made by dynamo's recompilation: reported with it
            events += [sync_event("compile", "B", 10), sync_event("execute", "B", 10)]
        read: list[XlaEvent] = [XlaEvent(kind=k, cause=ACCESS, graph_hash="R",
                                         frames=[MASK, Frame("main", "/u/t.py", 12)])
                                for k in (("compile", "execute") if new else ("execute",))]
        extra: dict = {"reads": [records.HostRead("item", "/u/t.py:20", "train"),
                                 records.HostRead("bool", "/u/t.py:12", "train",
                                                  library="transformers/masking_utils.py:369",
                                                  answer=step % 2 == 0, function=MASK.function),
                                 *([records.HostRead("fallback", "/u/t.py:40", "train")] if step >= 3 else [])],
                       "fallbacks": {"aten::nonzero": 2} if step >= 3 else {},
                       "dynamo": [broke] + ([guard] if step in (2, 4) else []) + ([limit] if step == 5 else [])
                                  + ([written] if step == 3 else [])}
        if step == 6:
            extra["refused"] = [records.Refused(records.HostRead("item", "/u/t.py:30", "train"), "not allowed")]
        analyzer.observe(window(step, *read, *events, compile_times=[0.5] * len(
            [e for e in read + events if e.kind == "compile"]), **extra))
    report = analyzer.summary()
    report.pid, report.argv, report.rank, report.local_rank = pid, ["t.py"], str(pid - 100), str(pid - 100)
    return report


def known_report_json() -> tuple[str, str]:
    """(one process's record, the merged report) as check-graphs writes them (run from the tree's root:
    the report names a line under the current folder relative to it)."""
    first, second = _process(100), _process(101)
    record = json.dumps(first.to_json(), indent=2, default=str)
    # the merge reads what each process wrote, as check-graphs does
    read = [records.GraphReport.from_json(json.loads(json.dumps(r.to_json(), default=str))) for r in (first, second)]
    merged = merge_records(read, ["python", "t.py"], proc.Ended(1, tail=["boom"]), 0, None)
    text = record, json.dumps(merged.to_json(), indent=2, default=str)
    return text[0].replace(str(ROOT), "<ROOT>"), text[1].replace(str(ROOT), "<ROOT>")  # the same in any checkout


def test_the_written_reports_are_byte_identical_to_the_dict_based_ones(monkeypatch):
    monkeypatch.chdir(ROOT)
    record, merged = known_report_json()
    assert json.loads(KNOWN.read_text()) == {"record": record, "merged": merged}


if __name__ == "__main__":  # writes the fixture from this tree (run once on the dict-based code)
    os.chdir(ROOT)
    KNOWN.write_text(json.dumps(dict(zip(("record", "merged"), known_report_json(), strict=True)), indent=1) + "\n")


# ----- no raw keys of a record outside its module's (de)serialisation ------------------------------------
def record_types() -> list[type]:
    from neuron_train.cost import records as cost
    from neuron_train.cost.plan import model as plan_model
    from neuron_train.graphs import findings
    from neuron_train.instrument import marker, probe, script, steps
    from neuron_train.precompile import coverage, listing
    from neuron_train.training import summary

    return [cost.BenchResult, cost.Device, cost.Stat, cost.ModelFacts, cost.DatasetFacts, cost.CompileFacts,
            cost.Host, cost.SweepRow, cost.EstimateBlock,
            findings.HostSync, findings.FallbackOp, findings.DynamoEntry, findings.ProcessSummary,
            records.LineReads, records.ScalarChange, records.HostRead, records.ErrorNote, records.DynamoNote,
            records.Graph,
            records.CommandRun, records.GraphReport, marker.Started, probe.ProbeRecord, probe.Stop,
            steps.StepWindow, coverage.CoverageReport, coverage.MissingGraph, script.CompileSummary,
            listing.CacheListing, listing.ConfigListing, summary.RunSummary, plan_model.WorkloadFigures]


# The modules that write and read these records: there, and only in `to_json` / `from_json`, the
# written keys are spelled out.
RECORD_MODULES = ("graphs/records.py", "graphs/findings.py", "instrument/marker.py", "instrument/probe.py",
                  "instrument/script.py", "precompile/coverage.py", "precompile/listing.py", "training/summary.py",
                  "cost/records.py", "cost/plan/model.py")
SERIALISERS = ("to_json", "from_json")
ANY = None  # every field name
# Keys of other formats that are spelled like a record's field: where, which names, and why.
OTHER_FORMATS: dict[tuple[str, frozenset[str] | None], str] = {
    ("cost/schema.py", ANY): "a bench result's check, on the parsed JSON, before it is a record "
                             "(cost/records.py's BenchResult.from_json calls it)",
    ("training/checkpoint.py", frozenset({"config", "model", "world_size", "batch_size", "step", "name",
                                          "img_size", "python"})):
        "a checkpoint's metadata and saved RNG states (its own format: training/checkpoint_format.py)",
    ("training/checkpoint_format.py", frozenset({"config", "model", "world_size", "params", "python"})):
        "a checkpoint's metadata and torch's optimizer state dict",
    ("training/zero1.py", frozenset({"params", "kind", "rank", "world_size"})):
        "torch's optimizer param_groups and ZeRO-1's shard metadata",
    ("training/optim.py", frozenset({"params", "step"})): "torch's optimizer param_groups and state",
    ("training/flat_optim.py", frozenset({"params", "step"})): "torch's optimizer param_groups and state",
    ("training/captured_update.py", frozenset({"params", "step"})): "torch's optimizer param_groups and state",
    ("training/device.py", frozenset({"params"})): "torch's optimizer param_groups",
    ("instrument/probe.py", frozenset({"params"})): "torch's optimizer param_groups",
    ("training/models.py", frozenset({"model"})): "timm's pretrained config and checkpoints",
    ("training/metrics.py", frozenset({"step", "kind"})): "a metrics.jsonl record",
    ("training/config.py", frozenset({"graph"})): "a config field's metadata (opt(graph=...))",
    ("training/profiler.py", frozenset({"reason", "bottleneck", "compile"})):
        "profile.json's bottleneck and torch_xla's metric totals",
    ("training/loop.py", frozenset({"bottleneck"})): "profile.json's bottleneck, copied into summary.json",
    ("training/loop.py", frozenset({"eval_accuracy", "eval_loss", "eval_ema_accuracy", "eval_ema_loss"})):
        "the evaluator's figures (training/evaluator.py), named as summary.json names them",
    ("precompile/coverage.py", frozenset({"where", "input_shapes"})):
        "a manifest graph's free-form details (GraphRecord.extra)",
    ("precompile/coverage.py", frozenset({"versions"})): "a manifest's library versions (precompile/manifest.py)",
    ("precompile/listing.py", frozenset({"model", "batch_size", "precision", "world_size", "device", "img_size"})):
        "a precompiled run's configuration (the manifest's JSON dict)",
    ("ops/checks.py", frozenset({"pid", "command", "instance_type"})):
        "neuron-ls --json-output's processes and devices",
    ("ops/checks.py", frozenset({"python"})): "the torch-neuronx pins (ops/facts.py)",
    ("instrument/script.py", frozenset({"status"})):
        "neuron_parallel_compile's summary JSON (its compilation_report entries)",
    ("cost/catalog.py", frozenset({"source", "kind", "name", "instance_type"})):
        "instances.yaml and a --prices file, catalog's own formats",
    ("cost/plan/data.py", frozenset({"source"})): "instances.yaml's plan_hardware chips (plan/data.py's _chip)",
    ("cost/bench/measure.py", frozenset({"cores_total"})):
        "a measurement's device facts (Measurement.device_info), made a Device by bench/result.py",
    ("cost/bench/percore.py", frozenset({"samples_per_sec", "step_time_ms"})):
        "a core worker's JSON line (bench/core_worker.py)",
    ("cost/plan/result.py", frozenset({"parameters", "num_classes"})):
        "the counted details plan/measure.py returns with a workload (free-form, written as plan.json's details)",
    ("commands/plan.py", frozenset({"train_samples"})): "the same counted details",
}


def raw_keys(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, key, enclosing function) of every `x["key"]`, `x.get("key")`, `.pop`, `.setdefault` of a name."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and node.func.attr in ("get", "pop", "setdefault") and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if isinstance(key, str) and key in names:
            found.append((node.lineno, key, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "")
    return found


def violations(package: Path, names: set[str]) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for line, key, function in raw_keys(path.read_text(), names):
            if rel in RECORD_MODULES and function in SERIALISERS:
                continue
            if any(rel.startswith(where) and (keys is ANY or key in keys) for where, keys in OTHER_FORMATS):
                continue
            out.append(f"neuron_train/{rel}:{line}: [{key!r}]")
    return out


def test_no_record_field_is_read_as_a_raw_string_key_outside_its_serialisation():
    names = {f.name for t in record_types() for f in dataclasses.fields(t)}
    found = violations(ROOT / "neuron_train", names)
    assert not found, ("a record's field read as a dict key (use the record's attribute; a key of another "
                       "format goes into OTHER_FORMATS with why):\n" + "\n".join(found))


def test_the_raw_key_scan_finds_a_planted_read(tmp_path):
    """The scan sees each spelling, in any module, and allows only a record module's serialisers."""
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "report.py").write_text(
        'def f(h, d):\n    return h["executes_graph"], d.get("library"), d.pop("graph", None)\n')
    (tmp_path / "graphs" / "records.py").write_text(
        'def to_json(h):\n    return h["executes_graph"]\ndef other(h):\n    return h.setdefault("where", 1)\n')
    assert violations(tmp_path, {"executes_graph", "library", "graph", "where"}) == [
        "neuron_train/graphs/records.py:4: ['where']", "neuron_train/graphs/report.py:2: ['executes_graph']",
        "neuron_train/graphs/report.py:2: ['library']", "neuron_train/graphs/report.py:2: ['graph']"]
