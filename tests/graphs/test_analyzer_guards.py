"""Guards of the checker's rules (graphs/analyzer.py) that each killed a mutant which survived the rest
of the suite (issue 22; docs/measurements.md lists the mutant, the break and the test): a graph
repeating at a second site warms that site, and a late graph made by a host read names the read.
Pure and fast; each fails with its guard removed.
"""

from __future__ import annotations

from neuron_train.graphs import causes, records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.log import Frame
from tests.graphs.test_graphs import ACCESS, LIBS, ran, run_site, sync_event, window

# ----- the checker (M01, M04) ---------------------------------------------------------------------


def test_a_graph_repeating_at_a_second_site_warms_that_site():
    """M01. Graph A is compiled at line 10, then flushed twice by a sync at line 20 (a clock, an
    eval): line 20 has run a graph again, so it is warm and a new graph there is a recompilation."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A")
    for step in (3, 4):
        assert analyzer.observe(window(step, sync_event("execute", "A", 20))) == []
    [new] = analyzer.observe(window(5, *ran("B", 20)))
    assert (new.hash, new.kind) == ("B", "recompile")


def test_a_late_graph_made_by_a_host_read_names_the_read():
    """M04. A site first seen once the run is steady, whose graph a value branch compiled: a late
    graph whose cause is the read, not "new call site"."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A")
    branch = Frame("__bool__", "/lib/torch/_tensor.py", 1)  # `if loss > x:` first run at step 3
    read = window(3, *ran("R", 12, cause=ACCESS, inner=branch), sync_event("execute", "A", 10),
                  reads=[records.HostRead("bool", "/u/t.py:12", "train")])
    analyzer.observe(read)
    late = analyzer.graphs["R"]
    assert late.kind == "late" and late.where == "/u/t.py:12"
    assert late.cause == causes.VALUE_BRANCH != causes.NEW_CALL_SITE
