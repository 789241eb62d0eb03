"""graphs/hlo_diff.py: the structure rule when one graph is longer than the other (in-process, pure)."""

from __future__ import annotations

import pytest

from neuron_train.graphs import hlo_diff

PARAM = [hlo_diff.Instr("parameter", "f32[4]", index=0)]
ADD = hlo_diff.Instr("add", "f32[4]", where="train.py:10")
MUL = hlo_diff.Instr("multiply", "f32[4]", where="train.py:11")


@pytest.mark.parametrize("old, new, detail", [
    ([ADD], [ADD, MUL], "1 -> 2 ops; +1 ops from multiply f32[4]"),   # the new graph's extra op
    ([ADD, MUL], [ADD], "2 -> 1 ops; -1 ops from multiply f32[4]"),   # the old graph's extra op
])
def test_a_graph_longer_than_the_other_is_named_by_its_first_extra_op(old, new, detail):
    found = hlo_diff.explain(hlo_diff.HloSummary(PARAM, old), hlo_diff.HloSummary(PARAM, new),
                             is_internal=lambda where: False)
    assert (found.cause, found.detail, found.where) == (hlo_diff.GRAPH_STRUCTURE, detail, "train.py:11")
