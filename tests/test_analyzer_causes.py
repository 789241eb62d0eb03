"""Causes named where the user can act (issue 43): a constant that moved with the LR, an accumulation
remainder, a fallback op called from the user's line, a callback's write, a periodic log.

Synthetic step windows as in test_analyzer_rules.py; each expectation is written out.
"""

from __future__ import annotations

from test_analyzer_rules import SYNC, analyzer_of, through
from test_graphs import ACCESS, window

from neuron_train.graphs import hlo_diff, records


def update(lr_input: bool) -> hlo_diff.HloSummary:
    """SGD's update: `p - lr * grad` with lr a scalar input, or lr=1.0 baked in as the constant -1."""
    params = [hlo_diff.Instr("parameter", "f32[8]", index=0), hlo_diff.Instr("parameter", "f32[8]", index=1)]
    if lr_input:
        return hlo_diff.HloSummary([*params, hlo_diff.Instr("parameter", "f32[]", index=2)],
                                   [hlo_diff.Instr("multiply", "f32[8]")], ["f32[8]"])
    return hlo_diff.HloSummary(params, [hlo_diff.Instr("constant", "f32[]", value="-1"),
                                        hlo_diff.Instr("multiply", "f32[8]")], ["f32[8]"])


def test_an_lr_that_leaves_exactly_1_is_a_recompilation_from_a_constant_not_the_evaluations_read():
    """lr=1.0 with a StepLR: epoch 2's first step has lr 0.7 as data, a new step graph. The
    evaluation's `.item()` before it (no sync, same window) is no split of the step: the recompilation
    is named at the scheduler with a fix that starts the LR away from 1."""
    analyzer = analyzer_of()
    for step in (1, 2):
        analyzer.observe(window(step, *through("A", 24, SYNC, compiled=step == 1), hlo={0: update(False)}))
    moved = records.ScalarChange(0, "lr", 0.7, "/u/t.py:16", "StepLR")
    found = analyzer.observe(window(3, *through("R", 28, cause=ACCESS), *through("B", 24, SYNC),
                                    hlo={2: update(True)}, scalars=[moved]))
    assert [(g.hash, g.cause, g.where) for g in found] == [("B", records.NEW_CONSTANT, "/u/t.py:16")]
    b = analyzer.graphs["B"]
    assert "set by the StepLR made at /u/t.py:16 (it was exactly 0 or 1 until then" in b.detail
    assert b.fix.startswith("start lr away from exactly 0 and 1 (e.g. 0.999 rather than 1.0")
    assert analyzer.graphs["R"].kind == "late"
