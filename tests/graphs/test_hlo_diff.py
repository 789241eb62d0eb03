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


def test_the_constant_that_became_an_input_is_a_python_scalars_not_one_inside_an_op():
    """timm's Mixup leaves a batch unmixed (a mixing factor of exactly 1, a Python scalar baked in by
    mixup_target at timm/data/mixup.py:33); the next, mixed, batch's graph is traced without lines and has
    the factor as inputs. Of the graph's two constants 1, the one that left is timm's prim::Constant,
    not the 1 inside the user's mean (which only comes later in the graph's order)."""
    lib = "/site-packages/timm/data/mixup.py:33"
    scalar = [hlo_diff.Instr("parameter", "f32[]", index=1)]
    old = hlo_diff.HloSummary(PARAM, [hlo_diff.Instr("constant", "f32[]", "prim__Constant", "1", lib),
                                      hlo_diff.Instr("constant", "f32[]", "aten__mean", "1", "train.py:34")])
    new = hlo_diff.HloSummary(PARAM + scalar * 2, [hlo_diff.Instr("constant", "f32[]", value="1")])
    found = hlo_diff.explain(old, new, is_internal=lambda file: file.startswith("/site-packages/"))
    assert (found.cause, found.where, found.library) == (hlo_diff.NEW_CONSTANT, "", lib)
    assert found.detail.startswith("the constant 1 became 2 scalar input(s)")
