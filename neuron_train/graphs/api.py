"""The in-process API: GraphWatch (our training loop) and assert_graph_stable (a user's test)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from neuron_train.common.errors import RunError
from neuron_train.graphs import hooks
from neuron_train.graphs.causes import own_fix
from neuron_train.graphs.process import debug_env_kept, prepare_process
from neuron_train.graphs.recorder import Recorder, process_recorder
from neuron_train.graphs.records import Graph, GraphReport
from neuron_train.graphs.report import format_report


class GraphWatch:
    """What our training loop calls: phases, step ends, and a summary of the graphs it compiled."""

    def __init__(self, warmup_steps: int, fail_on_recompile: bool = False):
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        self.fail_on_recompile = fail_on_recompile
        self._rec = process_recorder(warmup_steps, check=fail_on_recompile)
        self._rec.take_over_steps()  # the loop's optimizer steps, not every sync, are the steps

    def phase(self, name: str) -> None:
        """Label graphs compiled from now on ('train', 'eval', 'checkpoint', ...)."""
        self._rec.phase(name)

    def step_end(self, step: int) -> None:
        """Call right after each optimizer step's sync, on the main thread."""
        found = self._rec.step_end(step)
        if found and self.fail_on_recompile:
            raise RunError(describe_recompile(found[0]))

    def summary(self) -> GraphReport:
        return self._rec.summary()


def describe_recompile(graph: Graph) -> str:
    return (f"recompilation after warm-up at step {graph.step} ({graph.phase}): {graph.cause} "
            f"at {graph.where or 'an unknown line'}" + (f" [{graph.detail}]" if graph.detail else "")
            + f"; fix: {own_fix(graph.cause)}")


def assert_graph_stable(step_fn: Callable[..., object], steps: int = 8, warmup: int = 2,
                        max_graphs: int | None = None) -> GraphReport:
    """Run `step_fn(step)` `steps` times, syncing after each, and fail unless the graphs settle.

    For pytest: `assert_graph_stable(lambda i: train_step(batches[i]), steps=6)`. Raises
    AssertionError with the report when a graph is compiled after `warmup` steps, a host read runs
    a graph before the sync every step, or more than `max_graphs` graphs are compiled. For causes and
    lines, call `prepare_process()` before any XLA work (e.g. at the top of conftest.py).
    """
    import torch_xla

    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}) to see the steady state")
    takes_step = bool(inspect.signature(step_fn).parameters)
    with debug_env_kept():
        recorder = Recorder(prepare_process(check=True), warmup, phase="test")
        undo = hooks.install(recorder)
        try:
            for i in range(steps):
                step_fn(i) if takes_step else step_fn()
                torch_xla.sync()
                recorder.step_end(i + 1)
        finally:
            undo()
    report = recorder.summary(max_graphs)
    recorder.close()
    if not report.stable:
        raise AssertionError("the step is not graph-stable:\n" + format_report(report))
    return report
