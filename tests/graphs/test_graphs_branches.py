"""Graphs that a Python branch or a slice makes: named at the branch or the slice, with a fix that fits,
and every new slice-made shape counted (graphs/source.py, explain.py, analyzer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_train.graphs import causes, hlo_diff, records, source
from neuron_train.graphs.analyzer import Analyzer
from tests.graphs.test_graphs import LIBS, check_script, line_of, ran, window

CASES = [  # script, cause, label, recompilations, words of the fix
    ("stochastic_depth.py", causes.PYTHON_BRANCH, "BRANCH", 1, "torch.where"),
    ("accum_remainder.py", causes.PYTHON_BRANCH, "BRANCH", 1, "accumulation remainder"),
    ("seq_warmup.py", causes.SLICE_SHAPE, "SLICE", 3, "pad to one fixed length"),
    # the slice's graph and the step's graph it feeds, at 16, 24 and 32 tokens: not a line of step_fn
    ("seq_warmup_compiled.py", causes.SLICE_SHAPE, "SLICE", 6, "pad to one fixed length"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,cause,label,count,fix", CASES, ids=[c[0] for c in CASES])
def test_branch_and_slice_graphs_are_named_at_their_line(tmp_path, script, cause, label, count, fix):
    code, report, output = check_script(tmp_path, script)
    assert code == 1, output
    found = report["recompiles"]
    assert [(g["cause"], g["where"]) for g in found] == [(cause, line_of(script, label))] * count, output
    assert all(fix in g["fix"] for g in found)
    assert "drop_last" not in output and "pad to fixed lengths" not in output
    assert f"{cause} at tests/fixtures/graphs/{script}:" in output


SOURCE = '''\
def forward(self, x, seq):
    x = self.stem(x)
    if self.training and random.random() < self.drop:
        return self.head(x)
    x = x + self.block(x)
    if self.log:
        x = x[:, :seq]
    y = x[:, :seq]
    z = x[:, :8] + x[:-1]
    return self.head(y + z)


for i, batch in enumerate(loader):
    loss = step(batch)
    if (i + 1) % 4 == 0:
        opt.step()
        sync()
'''


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "user.py"
    path.write_text(SOURCE)
    return str(path)


def test_the_branch_is_the_if_around_the_line_or_an_early_exit_before_it_or_around_the_sync(script):
    assert source.branch_at(f"{script}:4") == f"{script}:3"    # inside the `if`
    assert source.branch_at(f"{script}:5") == f"{script}:3"    # after an `if` that returns
    assert source.branch_at(f"{script}:8") == ""               # after an `if` both paths leave through
    assert source.branch_at(f"{script}:14", f"{script}:17") == f"{script}:15"  # the sync is in the `if`
    assert source.branch_at(f"{script}:14") == ""
    assert source.branch_at(f"{script}:2", f"{script}:17") == ""  # the line is outside that loop
    assert source.branch_at(f"{script}:999") == source.branch_at("<string>:1") == ""


LOOPS = '''\
for i, batch in enumerate(loader):
    if batch is None:
        continue
    loss = step(batch)
while True:
    loss = step(batch)
    if (i + 1) % 4 == 0:
        opt.step()
        if i > warmup:
            sync()
'''


def test_a_line_after_an_if_that_continues_names_that_if_and_nested_ifs_around_the_sync_the_inner_one(tmp_path):
    """Issue 31's surviving mutants: the `if` whose body continues chose whether the step ran at all;
    of two nested `if`s holding the sync, the inner one decides how many iterations one graph holds."""
    path = tmp_path / "loops.py"
    path.write_text(LOOPS)
    assert source.branch_at(f"{path}:4") == f"{path}:2"
    assert source.branch_at(f"{path}:6", f"{path}:10") == f"{path}:9"


def test_a_guard_on_an_optimizer_value_the_script_writes_is_named_at_the_write(tmp_path):
    """Issue 30 case 4: dynamo's guard `self.param_groups[0]['lr'] == 0.09` traced to the user's
    `g["lr"] = ...`; a guard on anything else, or a key the script never writes, keeps its line."""
    from neuron_train.graphs.explain import guarded_write
    from neuron_train.graphs.findings import DynamoEntry

    def noted(reason: str, library: str) -> DynamoEntry:
        return DynamoEntry("recompile", "step", reason, f"{path}:4", library, 5, "train", True, 1, "", "old")

    path = tmp_path / "train.py"
    path.write_text("for g in opt.param_groups:\n    g['momentum'] = 0.9\n    g[\"lr\"] = lr\nloss = step(x)\n")
    note = noted("5/1: self.param_groups[0]['lr'] == 0.09", "torch/optim")
    guarded_write(note)
    assert (note.where, note.library) == (f"{path}:3", "") and 'g["lr"].fill_(value)' in note.fix
    for reason in ("5/1: self.param_groups[0]['weight_decay'] == 0.1", "5/1: L['x'].size()[0] == 8"):
        kept = noted(reason, "")
        guarded_write(kept)
        assert (kept.where, kept.fix) == (f"{path}:4", "old")


def test_a_slice_with_a_computed_length_is_told_from_a_fixed_one(script):
    assert source.slice_at(f"{script}:8")
    assert not source.slice_at(f"{script}:9") and not source.slice_at(f"{script}:2")
    assert not source.slice_at(f"{script}:999") and not source.slice_at("/nonexistent.py:1")


def shapes_at(where: str, *shapes: str) -> hlo_diff.HloSummary:
    params = [hlo_diff.Instr("parameter", s, where=where, index=i) for i, s in enumerate(shapes)]
    return hlo_diff.HloSummary(params, [hlo_diff.Instr("add", "f32[]")])


@pytest.mark.parametrize("line,recompiled,cause", [
    (8, "BCD", causes.SLICE_SHAPE),     # the slice made each shape: every new one counts
    (14, "D", causes.NEW_INPUT_SHAPE),  # no slice there: warm after three graphs, as before
])
def test_every_shape_a_slice_makes_counts_during_the_warm_up(script, line, recompiled, cause):
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    found = []
    for step, (graph, seq) in enumerate(zip("ABCD", (8, 16, 24, 32), strict=True), 1):
        found += analyzer.observe(window(step, *ran(graph), hlo={0: shapes_at(f"{script}:{line}", f"s64[4,{seq}]")}))
    assert "".join(g.hash for g in found) == recompiled
    assert {(g.cause, g.where) for g in found} == {(cause, f"{script}:{line}")}


def test_a_ragged_last_batch_through_a_slice_is_named_at_its_loader(script):
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=4, drop_last=False, samples=14)
    for step, graph in enumerate("AA", 1):
        analyzer.observe(window(step, *ran(graph), hlo={0: shapes_at(f"{script}:8", "s64[4,8]")}, loaders=[loader]))
    [ragged] = analyzer.observe(window(3, *ran("R"), hlo={0: shapes_at(f"{script}:8", "s64[2,8]")},
                                       batches=[records.Batch("L1", ["s64[2,8]"])]))
    assert (ragged.cause, ragged.where) == (causes.NEW_INPUT_SHAPE, "/u/t.py:5")


@pytest.mark.parametrize("extra,cause,line", [
    (1, causes.PYTHON_BRANCH, 6),     # other ops: the `if` around the line chose them
    (0, causes.SLICE_SHAPE, 7),       # the same ops with another length at a computed slice: the slice
])
def test_a_branch_is_named_only_when_the_ops_differ(script, extra, cause, line):
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    sliced = [hlo_diff.Instr("slice", "f32[4,8]", op_type="xla__select", where=f"{script}:7")]
    new = [hlo_diff.Instr("slice", "f32[4,16]", where=f"{script}:7")] + [hlo_diff.Instr("add", "f32[]")] * extra
    for step, (graph, instrs) in enumerate([("A", sliced), ("A", sliced), ("B", new)], 1):
        found = analyzer.observe(window(step, *ran(graph), hlo={0: hlo_diff.HloSummary([], instrs)}))
    [graph] = found
    assert (graph.cause, graph.where) == (cause, f"{script}:{line}")
