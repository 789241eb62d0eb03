"""The graph-stability checker: which graphs an XLA program compiles, when, why, and from which line.

Modules: `log` parses torch_xla's PT_XLA_DEBUG analysis blocks, `hlo_diff` compares two graphs'
HLO, `hooks` hooks a process (syncs, host reads, optimizer scalars), `records` holds the causes and
typed records, `process` sets a process up, `recorder` reads one process's sources into step
windows, `analyzer` classifies them (pure), `report` formats a report, `api` is GraphWatch and
assert_graph_stable, `runner` runs a command instrumented and merges its processes' records,
`command` is `neuron-train check-graphs`, `_instrument/` is the start-up hook check-graphs puts on
a command's PYTHONPATH.

May import: `neuron_train.common`. Never `training`, `precompile` or `cost`. The training loop uses
only `GraphWatch` and `prepare_process` from here.
"""

from neuron_train.graphs.api import GraphWatch, assert_graph_stable
from neuron_train.graphs.process import prepare_process
from neuron_train.graphs.report import format_report

__all__ = ["GraphWatch", "assert_graph_stable", "format_report", "prepare_process"]
