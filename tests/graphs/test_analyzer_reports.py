"""What the checker reports, in-process (graphs/analyzer.py): the problems lines (one per cause and
line), torch.compile's recompilations, fall-backs to eager and graph breaks, the graphs compiled with
no hash, and the report's own fields. Synthetic step windows fed to `Analyzer.observe`, as a
recorder feeds them (docs/graphs.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from neuron_train.graphs import causes, log, records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.causes import (
    DYNAMO_EAGER,
    DYNAMO_RECOMPILE,
    FIXES,
    GRAPH_BREAK,
    NEW_INPUT_SHAPE,
    UNKNOWN,
    WARMUP,
)
from neuron_train.graphs.findings import DynamoEntry
from neuron_train.graphs.log import Frame
from neuron_train.graphs.records import DynamoNote, Graph
from neuron_train.instrument import proc
from neuron_train.instrument.runner import merge_records
from tests.graphs.test_graphs import ACCESS, LIBS, ran, run_site, sync_event, window
from tests.graphs.test_library_fixes import library_fix

SGD = "step (torch/optim/sgd.py:105)"          # an optimizer step torch.compile compiled (dynamo.py's name)
FORWARD = "forward (/u/model.py:20)"           # a user's compiled function
TORCH_OPTIM_FIX = library_fix("torch/optim/", DYNAMO_RECOMPILE)
LIMIT = "torch._dynamo.config.recompile_limit (8) reached"
NAMER = log.library_namer(("/lib/",), mechanism=("torch", "torch_xla"))
TRAINER = Frame("training_step", "/lib/transformers/trainer.py", 99)
EAGER_WHY = ("no hash: compiled by torch_xla's eager mode, which compiles and runs each op (or small group of "
             "ops) as its own graph outside torch_xla.compile and writes no PT_XLA_DEBUG record of it; "
             "precompile coverage is unknown for such a run")
REFUSED_WHY = ("no hash: torch_xla compiled it for the read at /u/t.py:9 and then refused to run it "
               "(torch_xla.compile(full_graph=True)), without logging it")
COUNTED_WHY = ("no hash: torch_xla counted this compile but wrote no PT_XLA_DEBUG record of it (the process "
               "set up the checker after its first graph, or failed while compiling)")


def noted(analyzer: Analyzer, step: int, *notes: DynamoNote, **extra) -> list[Graph]:
    """A compiled call at line 10 that ran graph "g" (no new XLA graph) while dynamo noted `notes`."""
    events = [sync_event("execute", "g", 10)] if "g" in analyzer.graphs else ran("g")
    return analyzer.observe(window(step, *events, dynamo=list(notes), **extra))


def entry(note: DynamoNote, step: int, defect: bool, cause: str, fix: str, count: int = 1, phase: str = "train"):
    """A dynamo entry of the report (docs/graphs.md, "dynamo")."""
    return DynamoEntry(note.kind, note.function, note.reason, note.where, note.library, step, phase, defect, count,
                       cause, fix)


# ----- torch.compile: dynamo's notes ----------------------------------------------------------------
@pytest.mark.parametrize("n,count,steps", [
    (1, "once", "3"), (2, "2 times", "3, 4"), (5, "5 times", "3, 4, 5, 6, 7"), (6, "6 times", "3, 4, 5, 6, 7, ...")])
def test_dynamo_recompilations_past_the_warm_up_are_one_problem_line_naming_the_last_reason_and_the_line(
        n, count, steps):
    """A scheduler changing a float LR: dynamo recompiles the optimizer step every step. One line for the
    function at the user's line: how often, its first 5 steps, dynamo's latest reason, the library line."""
    analyzer = Analyzer(0, LIBS)
    notes = [DynamoNote("recompile", SGD, f"self.param_groups[0]['lr'] == 0.0{step}", "/u/t.py:7",
                        "accelerate/optimizer.py:170") for step in range(3, 3 + n)]
    assert noted(analyzer, 1) == [] and noted(analyzer, 2) == []
    for step, note in enumerate(notes, 3):
        assert noted(analyzer, step, note) == []  # no new XLA graph: the problem is dynamo's own
    summary = analyzer.summary()
    assert summary.problems == [f"dynamo recompilation of {SGD} {count}, at step {steps} (train): "
                                f"{notes[-1].reason} at accelerate/optimizer.py:170, from /u/t.py:7"]
    assert summary.dynamo == [entry(note, step, True, DYNAMO_RECOMPILE, TORCH_OPTIM_FIX)
                              for step, note in enumerate(notes, 3)]
    assert not summary.stable


def test_the_fall_back_to_eager_is_a_defect_even_in_the_warm_up_and_a_line_of_its_own():
    analyzer = Analyzer(0, LIBS)
    state = DynamoNote("recompile", SGD, "5/0: len(self.state) == 0", "/u/t.py:7")
    limit = DynamoNote("limit", SGD, LIMIT, "/u/t.py:7")
    lr = DynamoNote("recompile", SGD, "5/1: self.param_groups[0]['lr'] == 0.09", "/u/t.py:7")
    other = DynamoNote("recompile", FORWARD, "L['x'] == 3", "/u/t.py:7")
    noted(analyzer, 1, state, limit)
    noted(analyzer, 2)
    noted(analyzer, 3, lr, other)
    summary = analyzer.summary()
    assert summary.dynamo == [entry(state, 1, False, DYNAMO_RECOMPILE, TORCH_OPTIM_FIX),
                              entry(limit, 1, True, DYNAMO_EAGER, FIXES[DYNAMO_EAGER]),
                              entry(lr, 3, True, DYNAMO_RECOMPILE, TORCH_OPTIM_FIX),
                              entry(other, 3, True, DYNAMO_RECOMPILE, FIXES[DYNAMO_RECOMPILE])]
    assert summary.problems == [f"dynamo fell back to eager of {SGD} once, at step 1 (train): {LIMIT} at /u/t.py:7",
                                f"dynamo recompilation of {SGD} once, at step 3 (train): {lr.reason} at /u/t.py:7",
                                f"dynamo recompilation of {FORWARD} once, at step 3 (train): L['x'] == 3 at /u/t.py:7"]


def test_a_graph_break_is_counted_at_its_line_with_its_reason_never_a_defect():
    """`loss.backward()` breaks every compiled step: one entry per line and reason, counted."""
    analyzer = Analyzer(0, LIBS)
    backward = DynamoNote("graph_break", "step (/u/t.py)", "Unsupported Tensor.backward() call", "/u/t.py:5")
    item = DynamoNote("graph_break", "step (/u/t.py)", "Tensor.item", "/u/t.py:5")
    elsewhere = DynamoNote("graph_break", "step (/u/t.py)", "Unsupported Tensor.backward() call", "/u/t.py:6")
    lr = DynamoNote("recompile", SGD, "lr == 0.5", "/u/t.py:7")
    for step in range(1, 4):
        noted(analyzer, step, backward)
    noted(analyzer, 4, backward, item, elsewhere, lr)  # a known break first: the notes after it still count
    summary = analyzer.summary()
    assert summary.dynamo == [entry(backward, 1, False, GRAPH_BREAK, FIXES[GRAPH_BREAK], count=4),
                              entry(item, 4, False, GRAPH_BREAK, FIXES[GRAPH_BREAK]),
                              entry(elsewhere, 4, False, GRAPH_BREAK, FIXES[GRAPH_BREAK]),
                              entry(lr, 4, True, DYNAMO_RECOMPILE, TORCH_OPTIM_FIX)]
    assert summary.problems == [f"dynamo recompilation of {SGD} once, at step 4 (train): lr == 0.5 at /u/t.py:7"]


def test_a_phases_first_window_and_an_optimizers_first_two_steps_are_the_dynamo_warm_up():
    """The first evaluation recompiles once (a graph break's resume function guards on the phase's
    flag), the next one may not; an optimizer's second step may (its state appears), its third not."""
    analyzer = Analyzer(0, LIBS)
    run_site(analyzer, "g", "g", "g", "g")
    guard = DynamoNote("recompile", FORWARD, "___check_obj_id(L['self'].training)", "/u/t.py:20")
    for step, phase, optimizer_steps in ((5, "eval", []), (6, "eval", []), (7, "train", [2]), (8, "train", [3])):
        events = ran("e", 20) if "e" not in analyzer.graphs else [sync_event("execute", "e", 20)]
        analyzer.observe(window(step, *events, phase=phase, optimizer_steps=optimizer_steps, dynamo=[guard]))
    assert [(d.step, d.phase, d.defect) for d in analyzer.summary().dynamo] == [
        (5, "eval", False), (6, "eval", True), (7, "train", False), (8, "train", True)]


def test_a_dynamo_recompilation_in_the_warm_up_never_names_the_cause_of_a_new_xla_graph():
    """The optimizer's state appears at step 2 (dynamo's warm-up) while a warm call site compiles a new
    graph: that graph is explained as any other, and dynamo's note stays a warm-up note."""
    analyzer = Analyzer(0, LIBS)
    analyzer.observe(window(1, *ran("A")))
    state = DynamoNote("recompile", SGD, "5/0: len(self.state) == 0", "/u/t.py:7")
    [graph] = analyzer.observe(window(2, sync_event("execute", "A", 10), *ran("B"), dynamo=[state]))
    assert (graph.hash, graph.cause, graph.where) == ("B", UNKNOWN, "/u/t.py:10")
    summary = analyzer.summary()
    assert summary.dynamo == [entry(state, 2, False, DYNAMO_RECOMPILE, TORCH_OPTIM_FIX)]
    assert summary.problems == ["recompilation at step 2 (train): unknown at /u/t.py:10"]


@pytest.mark.parametrize("function,where,library,line,fix", [
    (SGD, "/u/t.py:7", "", "/u/t.py:7", TORCH_OPTIM_FIX),   # the compiled function's library names the fix
    (SGD, "/u/t.py:7", "accelerate/optimizer.py:170", "accelerate/optimizer.py:170, from /u/t.py:7",
     FIXES[DYNAMO_RECOMPILE]),                               # the library line below the user's wins
    (FORWARD, "", "", "/u/t.py:10", FIXES[DYNAMO_RECOMPILE]),  # no user line noted: the sync's line
], ids=["optimizer", "library-line", "no-line"])
def test_a_new_graph_made_by_a_dynamo_recompilation_carries_dynamos_reason(function, where, library, line, fix):
    """One bug, one line: the graph is the recompilation, with dynamo's failed guard as its detail; the
    dynamo entry points at the graph and makes no line of its own."""
    analyzer = Analyzer(0, LIBS)
    run_site(analyzer, "A", "A")
    note = DynamoNote("recompile", function, "L['scale'] == 3", where, library)
    [graph] = analyzer.observe(window(3, *ran("B"), dynamo=[note]))
    assert (graph.hash, graph.kind, graph.cause) == ("B", "recompile", DYNAMO_RECOMPILE)
    assert (graph.where, graph.library, graph.fix) == (where or "/u/t.py:10", library, fix)
    assert graph.detail == f"dynamo recompiled {function}: L['scale'] == 3"
    summary = analyzer.summary()
    assert summary.dynamo == [replace(entry(note, 3, True, DYNAMO_RECOMPILE, TORCH_OPTIM_FIX if function == SGD
                                            else FIXES[DYNAMO_RECOMPILE]), graph="B")]
    assert summary.problems == [f"recompilation at step 3 (train): {DYNAMO_RECOMPILE} at {line}"]


SIZE = "tensor 'L['x']' size mismatch at index 0. expected 8, actual 6"


@pytest.mark.parametrize("library,fix", [
    ("", FIXES[NEW_INPUT_SHAPE]),
    ("accelerate/data_loader.py:562", library_fix("accelerate/", NEW_INPUT_SHAPE)),  # prepared by accelerate
], ids=["torch", "accelerate"])
def test_a_ragged_last_batch_under_torch_compile_is_named_at_its_dataloader(library, fix):
    """30 samples in batches of 8: dynamo's size guard fails on the last batch of 6, fetched from the
    loader made at line 5. That line is the one to fix (drop_last=True), with the sizes that prove it."""
    analyzer = Analyzer(0, LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=8, drop_last=False, samples=30, library=library)
    run_site(analyzer, "A", "A", loaders=[loader])
    note = DynamoNote("recompile", FORWARD, SIZE, "/u/t.py:7")
    [graph] = analyzer.observe(window(3, *ran("B"), batches=[records.Batch("L1", ["f32[6,4]"])], dynamo=[note]))
    assert (graph.cause, graph.where, graph.library, graph.fix) == (NEW_INPUT_SHAPE, "/u/t.py:5", library, fix)
    assert graph.detail == (f"dynamo recompiled {FORWARD}: {SIZE}; the batches come from the DataLoader at "
                            "/u/t.py:5 (batch_size 8, drop_last=False, 30 samples: each pass ends with a batch of 6)")
    where = f"{library}, from /u/t.py:5" if library else "/u/t.py:5"
    assert analyzer.summary().problems == [f"recompilation at step 3 (train): {NEW_INPUT_SHAPE} at {where}"]


def test_a_size_guard_with_no_ragged_loader_is_a_new_input_shape_at_the_users_line():
    """The Trainer's compiled training step sees another batch shape, no loader's last batch explains it:
    the user's line, and the fix for the library whose function dynamo compiled."""
    analyzer = Analyzer(0, LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=8, drop_last=False, samples=32)  # no ragged batch
    run_site(analyzer, "A", "A", loaders=[loader])
    function = "training_step (transformers/trainer.py:3700)"
    note = DynamoNote("recompile", function, SIZE, "/u/t.py:7")
    [graph] = analyzer.observe(window(3, *ran("B"), batches=[records.Batch("L1", ["f32[6,4]"])], dynamo=[note]))
    assert (graph.cause, graph.where, graph.library) == (NEW_INPUT_SHAPE, "/u/t.py:7", "")
    assert graph.detail == f"dynamo recompiled {function}: {SIZE}"
    assert graph.fix == library_fix("transformers/trainer.py", NEW_INPUT_SHAPE)


# ----- the problems lines of the lazy path ----------------------------------------------------------
@pytest.mark.parametrize("n,count,steps", [
    (1, "recompilation", "3"), (2, "2 recompilations", "3, 4"), (5, "5 recompilations", "3, 4, 5, 6, 7"),
    (6, "6 recompilations", "3, 4, 5, 6, 7, ...")])
def test_a_recompilation_every_step_is_one_problem_line_listing_its_first_5_steps(n, count, steps):
    """A new graph every step, run by the Trainer's line 99 below the user's line 10: one line."""
    analyzer = Analyzer(0, LIBS, library_of=NAMER)
    for step, graph in enumerate("AA" + "BCDEFGH"[:n], 1):
        events = ran(graph, inner=TRAINER) if graph not in analyzer.graphs else [
            sync_event("execute", graph, 10, inner=TRAINER)]
        analyzer.observe(window(step, *events, phase="eval"))
    summary = analyzer.summary()
    assert [g.step for g in summary.recompiles] == list(range(3, 3 + n))
    assert summary.problems == [f"{count} at step {steps} (eval): {UNKNOWN} at transformers/trainer.py:99, "
                                "from /u/t.py:10"]


# ----- graphs with no hash --------------------------------------------------------------------------
@pytest.mark.parametrize("extra,why", [
    ({"eager": True}, EAGER_WHY),
    ({"refused": [records.Refused(records.HostRead("item", "/u/t.py:9", "train"), "Unexpected execution")]},
     REFUSED_WHY),
    ({}, COUNTED_WHY),
], ids=["eager", "refused", "counted"])
def test_a_compile_with_no_log_record_says_why_it_has_no_hash(extra, why):
    """Two compiles the counters saw and the log did not, in the warm-up, then one in a new phase once
    the run is steady: each a graph of its own, with its compile time, 'late' for the new phase."""
    analyzer = Analyzer(0, LIBS)
    analyzer.observe(window(1, *ran("A"), unlogged_compiles=2, compile_times=[0.5, 0.25, 0.125], **extra))
    analyzer.observe(window(2, sync_event("execute", "A", 10)))  # the call site is warm: the run is steady
    analyzer.observe(window(3, sync_event("execute", "A", 10), unlogged_compiles=1, compile_times=[2.0],
                            phase="eval", **extra))
    blind = dict(hash="", trigger="", where="", site=[], inputs=-1, outputs=-1, detail=why, executions=0)
    summary = analyzer.summary()
    assert summary.graphs[1:] == [
        Graph(phase="train", step=1, compile_time_s=0.25, kind="warmup", cause=WARMUP, **blind),
        Graph(phase="train", step=1, compile_time_s=0.125, kind="warmup", cause=WARMUP, **blind),
        Graph(phase="eval", step=3, compile_time_s=2.0, kind="late", cause=UNKNOWN, after_steps=2, **blind)]


def test_without_logged_executions_a_second_unlogged_compile_is_a_recompilation():
    """The cheap mode (compiles counted, nothing logged): past --warmup-steps, a phase's first graph is
    late and its next one a recompilation; the report says its graphs come from the counters."""
    analyzer = Analyzer(1, LIBS, executions_logged=False)
    found = [analyzer.observe(window(step, unlogged_compiles=1, phase=phase))
             for step, phase in ((1, "train"), (2, "train"), (3, "eval"))]
    assert [[g.kind for g in f] for f in found] == [[], ["recompile"], []]
    summary = analyzer.summary()
    assert [(g.kind, g.cause, g.step, g.phase) for g in summary.graphs] == [
        ("warmup", WARMUP, 1, "train"), ("recompile", UNKNOWN, 2, "train"), ("late", UNKNOWN, 3, "eval")]
    assert summary.problems == [f"recompilation at step 2 (train): {UNKNOWN} at ?"]
    assert (summary.source, summary.warmup_steps, summary.steps) == ("counters", 1, 3)


# ----- the report's own fields ----------------------------------------------------------------------
def test_the_report_counts_executions_host_reads_and_the_graph_budget():
    """A `.item()` before the sync in every step: a graph of its own each step, a problem once the run
    is steady (in steps 3-4 of the steady 3-5), with its scalar reads; a graph compiled, never run, ran 0 times."""
    analyzer = Analyzer(1, LIBS)
    item = records.HostRead("item", "/u/t.py:12", "train")
    for step in range(1, 5):
        events = [*ran("R", 12, cause=ACCESS), *ran("A")] if step == 1 else [
            sync_event("execute", "R", 12, cause=ACCESS), sync_event("execute", "A", 10)]
        analyzer.observe(window(step, *events, reads=[item], scalar_reads=1))
    analyzer.observe(window(5, sync_event("compile", "C", 10)))  # compiled, never run
    summary = analyzer.summary(max_graphs=3)
    assert [(g.hash, g.executions) for g in summary.graphs] == [("R", 4), ("A", 4), ("C", 0)]
    assert summary.problems == [
        f"recompilation at step 5 (train): {UNKNOWN} at /u/t.py:10",
        f"{causes.HOST_ACCESS}: .item() at /u/t.py:12 runs a graph before the step's sync in 2 of 3 steps "
        "after warm-up"]
    assert (summary.scalar_reads_after_warmup, summary.warmup_steps, summary.source) == (2, 1, "pt_xla_debug")
    assert analyzer.summary(max_graphs=2).problems[2:] == ["3 distinct graphs compiled, more than --max-graphs 2"]


def test_a_run_that_compiled_nothing_is_stable_and_reads_the_log():
    summary = Analyzer(0, LIBS).summary(max_graphs=0)
    assert (summary.problems, summary.graphs, summary.source, summary.stable) == ([], [], "pt_xla_debug", True)


def test_the_first_count_includes_dynamos_recompilations_that_made_no_graph_of_their_own():
    """Issue 30 case 9: "recompilations: 0" above a dynamo section listing 8 is a headline nobody can
    trust. Those that made a new XLA graph are counted once, among the graphs."""
    from neuron_train.graphs.report import recompile_headline

    def note(graph: str = "", defect: bool = True, kind: str = "recompile") -> DynamoEntry:
        return DynamoEntry(kind, "f", "", "", "", 3, "train", defect, 1, "", graph=graph or None)

    report = records.GraphReport(warmup_steps=0, steps=12, graphs=[], host_syncs=[], fallback_ops={},
                                 dynamo=[note(), note(), note(defect=False), note("G"), note(kind="limit")],
                                 problems=[], source="pt_xla_debug")
    assert recompile_headline(report).startswith("recompilations: 2 (0 new graphs at warm call sites, 2 torch.compile")
    report.dynamo = []
    assert recompile_headline(report) == "recompilations (new graphs at warm call sites): 0"


def test_a_known_error_the_run_ended_with_is_a_typed_note_named_at_its_line_with_its_fix():
    """The hooks' excepthook notes an error it knows (torch_xla under inference_mode, dynamo refusing
    mark_dynamic) as its cause and the user's line; the problem line is written from the cause table."""
    analyzer = Analyzer(0, LIBS)
    analyzer.notes += [records.ErrorNote(causes.INFERENCE_MODE, "/u/t.py:40"),
                       records.ErrorNote(causes.MARK_DYNAMIC, "")]
    assert analyzer.summary().problems == [
        "torch.inference_mode() at /u/t.py:40 on an XLA device: torch_xla cannot run this model under it (Cannot "
        "set version_counter for inference tensor); fix: use torch.no_grad() there",
        "torch._dynamo.mark_dynamic at an unknown line: torch_xla compiles one graph per shape, so dynamo "
        "specialized the marked dimension and refused the mark (ConstraintViolationError); fix: remove "
        "mark_dynamic there and give every batch one shape (drop_last=True, or pad/bucket to fixed sizes)"]


def test_a_known_error_reaches_the_report_and_its_merge_as_a_record_once():
    """The report carries each known error as its record (JSON "errors", only when there is one), read back
    as one, and a merge of two processes that ended with the same error keeps it once, as its problem."""
    analyzer = Analyzer(0, LIBS)
    analyzer.notes.append(records.ErrorNote(causes.MARK_DYNAMIC, "/u/t.py:9"))
    written = analyzer.summary().to_json()
    assert written["errors"] == [{"cause": causes.MARK_DYNAMIC, "where": "/u/t.py:9"}]
    assert "errors" not in Analyzer(0, LIBS).summary().to_json()
    read = records.GraphReport.from_json(written)
    merged = merge_records([read, records.GraphReport.from_json(written)], ["t"], proc.Ended(0), 0, None)
    assert merged.errors == [records.ErrorNote(causes.MARK_DYNAMIC, "/u/t.py:9")] and len(merged.problems) == 1
    assert records.GraphReport.from_json(merged.to_json()).errors == merged.errors
