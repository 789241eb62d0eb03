"""The graph-stability checker: which graphs an XLA program compiles, when, why, and from which line.

Modules: `log` parses torch_xla's PT_XLA_DEBUG analysis blocks, `hlo_diff` compares two graphs'
HLO, `hooks` / `loaders` / `frames` hook into a process (syncs, host reads, optimizer scalars, data
loaders, call sites; `sink` is the recorder as they see it), `causes` the table of causes, `records` the typed
records (`Graph`, and `GraphReport`: the report, turned into JSON only when written), `findings` the
report's host syncs, fallback ops, dynamo entries and processes, `process` sets a process up,
`recorder` reads one process's sources into step windows, `analyzer` classifies them (pure),
`explain` names a recompilation's cause and line, `hostsync` the host syncs, `report` formats a
report, `api` is GraphWatch and assert_graph_stable. Running another command with the checker armed
is neuron_train/instrument/; `neuron-train check-graphs` is neuron_train/commands/check_graphs.py.

May import: `neuron_train.common` only (tests/test_architecture.py). The training loop uses only
`GraphWatch`, `prepare_process` and the report's records (`Graph`, `GraphReport`) from here.
"""

from neuron_train.graphs.api import GraphWatch, assert_graph_stable
from neuron_train.graphs.process import prepare_process
from neuron_train.graphs.records import Graph, GraphReport
from neuron_train.graphs.report import format_report

__all__ = ["Graph", "GraphReport", "GraphWatch", "assert_graph_stable", "format_report", "prepare_process"]
