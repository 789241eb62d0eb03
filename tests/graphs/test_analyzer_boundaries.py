"""The edges of the checker's rules (graphs/hostsync.py, graphs/analyzer.py), each pinned by a written
out expectation: a read in exactly half the steps, the warm-up's last step, growth in steps that are
not consecutive, torch.compile's frames. Each test fails when its rule's comparison moves by one.
"""

from __future__ import annotations

import pytest

from neuron_train.graphs import causes
from neuron_train.graphs.log import Frame, XlaEvent
from tests.graphs.test_analyzer_rules import DYNAMO, SYNC, analyzer_of, program, through
from tests.graphs.test_graphs import ACCESS, window


def test_a_read_before_the_sync_in_exactly_half_the_steps_fails():
    """docs/graphs.md: a failure "in at least half of the steps after warm-up". The site warms at
    step 2; steps 3-6 are steady and the read is in steps 3 and 5: 2 of 4."""
    analyzer = analyzer_of()
    for step in range(1, 7):
        events = through("A", 10, SYNC, compiled=step == 1)
        if step in (3, 5):
            events = through("R", 12, cause=ACCESS, compiled=step == 3) + events
        analyzer.observe(window(step, *events))
    [entry] = analyzer.summary().host_syncs
    assert (entry.steps, entry.every_step) == ([3, 5], True)
    assert analyzer.summary().problems == [
        "host access before sync: a tensor value read at /u/t.py:12 runs a graph before the step's sync "
        "in 2 of 4 steps after warm-up"]


def test_a_read_in_fewer_than_half_the_steps_is_reported_only():
    """The same run with the read in step 3 only: 1 of 4, reported, the verdict passes."""
    analyzer = analyzer_of()
    for step in range(1, 7):
        events = through("A", 10, SYNC, compiled=step == 1)
        if step == 3:
            events = through("R", 12, cause=ACCESS) + events
        analyzer.observe(window(step, *events))
    [entry] = analyzer.summary().host_syncs
    assert (entry.steps, entry.every_step, analyzer.summary().problems) == ([3], False, [])


@pytest.mark.parametrize("syncs_per_optimizer_step,steady_syncs,steady_optimizer_steps,problem", [
    # --warmup-steps 3, 8 steps, an optimizer step in each: steps 4-8 are steady (5 of them)
    (1, 5, 5, "in 5 of 5 steps after warm-up"),
    # --warmup-steps 3, 12 syncs, an optimizer step at every second one (steps 2, 4, ... 12): steady
    # syncs 4-12 (9), steady optimizer steps those at syncs 4, 6, 8, 10, 12 (5); the read is in those 5
    (2, 9, 5, "in 5 of 5 optimizer steps after warm-up"),
])
def test_the_warmup_steps_last_step_and_its_optimizer_step_are_not_counted_as_steady(
        syncs_per_optimizer_step, steady_syncs, steady_optimizer_steps, problem):
    analyzer = analyzer_of(3)
    total = 8 if syncs_per_optimizer_step == 1 else 12
    for step in range(1, total + 1):
        events = through("A", 10, SYNC, compiled=step == 1)
        extra: dict = {}
        if step % syncs_per_optimizer_step == 0:
            events = through("R", 12, cause=ACCESS, compiled=step == syncs_per_optimizer_step) + events
            extra["optimizer_steps"] = [step // syncs_per_optimizer_step]
        analyzer.observe(window(step, *events, **extra))
    assert (analyzer.steady_steps, analyzer.steady_optimizer_steps) == (steady_syncs, steady_optimizer_steps)
    assert analyzer.summary().problems == [
        f"host access before sync: a tensor value read at /u/t.py:12 runs a graph before the step's sync {problem}"]


def test_optimizer_steps_before_the_run_is_steady_are_left_out_of_the_count():
    """No --warmup-steps: the site warms in step 2 (its graph runs again), so steps 1 and 2 and their
    optimizer steps are warm-up; steps 3-6 are 4 steady steps and 4 steady optimizer steps."""
    analyzer = analyzer_of()
    for step in range(1, 7):
        analyzer.observe(window(step, *through("A", 10, SYNC, compiled=step == 1), optimizer_steps=[step]))
    assert (analyzer.steady_steps, analyzer.steady_optimizer_steps) == (4, 4)


def test_growth_in_steps_that_are_not_consecutive_is_no_loop_without_a_sync():
    """An evaluation every other step whose graph grows (100, 200, 300 ops at steps 3, 5, 7): not a
    missing sync, which grows the graph in every step."""
    analyzer = analyzer_of(optimizer_where="/u/t.py:30")
    found = []
    for step in range(1, 8):
        events = through("A", 10, SYNC, compiled=step == 1)
        hlo = {}
        if step in (3, 5, 7):
            events = through(f"E{step}", 33, cause=ACCESS) + events
            hlo = {0: program(100 * (step - 1) // 2)}
        found += analyzer.observe(window(step, *events, hlo=hlo))
    assert [g.cause for g in found if g.cause == causes.GROWING_GRAPH] == []


def test_growth_in_three_consecutive_steps_is_a_loop_without_a_sync():
    """The counterpart: the same sizes at steps 3, 4, 5."""
    analyzer = analyzer_of(optimizer_where="/u/t.py:30")
    found = []
    for step in range(1, 6):
        events = through("A", 10, SYNC, compiled=step == 1)
        hlo = {}
        if step >= 3:
            events = through(f"E{step}", 33, cause=ACCESS) + events
            hlo = {0: program(100 * (step - 2))}
        found += analyzer.observe(window(step, *events, hlo=hlo))
    assert [(g.hash, g.cause) for g in found] == [("E5", causes.GROWING_GRAPH)]


def test_a_dynamo_graph_is_named_at_the_compiled_call_only_when_every_logged_frame_is_inside_torch():
    """torch.compile's graphs log few frames: when all end inside torch the user's compiled call is the
    line; when one of them is the user's, that line is."""
    analyzer = analyzer_of()
    inside = XlaEvent(kind="compile", cause="dynamo", graph_hash="D1", frames=[DYNAMO, SYNC])
    mine = XlaEvent(kind="compile", cause="dynamo", graph_hash="D2",
                    frames=[DYNAMO, Frame("forward", "/u/model.py", 20)])
    analyzer.observe(window(1, inside, mine, compiled_at="/u/t.py:7"))
    assert (analyzer.graphs["D1"].where, analyzer.graphs["D2"].where) == ("/u/t.py:7", "/u/model.py:20")
