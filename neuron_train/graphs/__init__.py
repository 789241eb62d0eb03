"""The graph-stability checker: which graphs an XLA program compiles, when, why, and from which line.

Modules: `log` parses torch_xla's PT_XLA_DEBUG analysis blocks, `hlo_diff` compares two graphs'
HLO, `hooks` hooks a process (syncs, host reads, optimizer scalars), `core` classifies step windows
and records a process, `command` is `neuron-train check-graphs`, `_instrument/` is the start-up
hook check-graphs puts on a command's PYTHONPATH.

May import: `neuron_train.common`. Never `training`, `precompile` or `cost`. The training loop uses
only `GraphWatch` and `prepare_process` from here.
"""

from neuron_train.graphs.core import GraphWatch, assert_graph_stable, format_report, prepare_process

__all__ = ["GraphWatch", "assert_graph_stable", "format_report", "prepare_process"]
