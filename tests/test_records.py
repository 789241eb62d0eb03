"""The checker's typed records (graphs/records.py, graphs/findings.py): the JSON users read is written
from them byte for byte as before they were records, and no module outside the record modules reads
a record's field as a raw string key.

`known_report_json()` drives the analyzer and the merge through every record with a fixed input (host
reads seen by the hooks and by the log, a read torch_xla refused, a CPU fallback op, dynamo's
recompilations, graph breaks and its limit, two processes); `fixtures/graphs/known_report.json` is
what the dict-based code (commit cca685c) wrote from the same input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from test_graphs import ACCESS, LIBS, sync_event, window

from neuron_train.graphs import records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.log import Frame, XlaEvent
from neuron_train.instrument import proc
from neuron_train.instrument.runner import merge_records

ROOT = Path(__file__).resolve().parents[1]
KNOWN = ROOT / "tests" / "fixtures" / "graphs" / "known_report.json"
LOOP = ROOT / "tests" / "fixtures" / "graphs" / "dynamo_loop.py"  # writes g["lr"] at its LR_WRITE line
MASK = Frame("_ignore_causal_mask_sdpa", "/lib/site-packages/transformers/masking_utils.py", 369)


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
        read: list[XlaEvent] = [XlaEvent(kind=k, cause=ACCESS, graph_hash="R", frames=[MASK, Frame("main", "/u/t.py", 12)])
                for k in (("compile", "execute") if new else ("execute",))]
        extra: dict = {"reads": [records.HostRead("item", "/u/t.py:20", "train"),
                                 records.HostRead("bool", "/u/t.py:12", "train", library="transformers/masking_utils.py:369",
                                                  answer=step % 2 == 0),
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
