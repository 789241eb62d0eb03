"""The checker's classification rules, in-process (graphs/analyzer.py, docs/graphs.md "The rule").

Synthetic step windows, as in test_graphs.py: each test states a rule a user relies on and checks
the whole outcome (kind, cause, line, library line, fix, step), so that breaking the rule fails it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from neuron_train.graphs import causes, hlo_diff, records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.causes import FIXES
from neuron_train.graphs.log import Frame, XlaEvent, library_namer
from tests.graphs.test_graphs import ACCESS, LIBS, ran, run_site, sync_event, window
from tests.graphs.test_library_fixes import library_fix

SITE_PACKAGES = "/lib/site"  # under LIBS: not the user's code
LIBRARY_OF = library_namer((SITE_PACKAGES,), ("torch", "torch_xla"))
SYNC = Frame("sync", "/lib/torch_xla/torch_xla.py", 87)
TRAINER = Frame("training_step", f"{SITE_PACKAGES}/transformers/trainer.py", 2000)
ENCODER = "_ignore_bidirectional_mask_sdpa"  # the masking_utils function an encoder's (BERT's) mask is read in
MASK = Frame(ENCODER, f"{SITE_PACKAGES}/transformers/masking_utils.py", 369)
BOOL = Frame("__bool__", f"{SITE_PACKAGES}/torch/_tensor.py", 1)
DYNAMO = Frame("__call__", f"{SITE_PACKAGES}/torch/_dynamo/eval_frame.py", 600)
MASK_FIX = library_fix("transformers/masking_utils.py", causes.VALUE_BRANCH, ENCODER, padded=False)


def through(graph: str, line: int, *library: Frame, cause: str = "user torch_xla.sync",
            compiled: bool = True) -> list[XlaEvent]:
    """A run of `graph` from the user's `line` through `library` frames (innermost first); compiled
    there first when `compiled`."""
    frames = [*library, Frame("main", "/u/t.py", line)]
    kinds = ("compile", "execute") if compiled else ("execute",)
    return [XlaEvent(kind=k, cause=cause, graph_hash=graph, frames=frames) for k in kinds]


def analyzer_of(warmup_steps: int = 0, **kw) -> Analyzer:
    return Analyzer(warmup_steps, LIBS, library_of=LIBRARY_OF, **kw)


def test_a_warmup_graph_is_recorded_with_its_step_compile_time_call_site_and_no_fix():
    analyzer = analyzer_of()
    compiled = replace(sync_event("compile", "A", 10), inputs=5, outputs=7)
    no_frames = XlaEvent(kind="compile", cause="user torch_xla.sync", graph_hash="N")
    analyzer.observe(window(1, compiled, sync_event("execute", "A", 10), no_frames, compile_times=[0.5, 0.25]))
    assert analyzer.graphs["A"] == records.Graph(
        hash="A", phase="train", step=1, compile_time_s=0.5, kind="warmup", cause=causes.WARMUP, detail="",
        where="/u/t.py:10", trigger="sync", site=["/u/t.py:10"], inputs=5, outputs=7, library="", fix="")
    # torch_xla logged no Python frame: no line is made up
    assert (analyzer.graphs["N"].where, analyzer.graphs["N"].site,
            analyzer.graphs["N"].compile_time_s) == ("", [], 0.25)
    assert analyzer.summary().source == "pt_xla_debug"


def test_the_same_sync_line_in_another_phase_is_another_call_site():
    """One helper syncs for training and evaluation: the first eval graph is late, not a recompilation
    of the warm training site."""
    analyzer = analyzer_of()
    run_site(analyzer, "A", "A")
    assert analyzer.observe(window(3, *ran("E"), phase="eval")) == []
    e = analyzer.graphs["E"]
    assert (e.kind, e.cause, e.phase, e.step, e.fix) == (
        "late", causes.NEW_CALL_SITE, "eval", 3, FIXES[causes.NEW_CALL_SITE])


@pytest.mark.parametrize("warmup_steps,kind,cause", [
    (2, "late", causes.NEW_CALL_SITE),   # the step after the last is past --warmup-steps 2
    (3, "warmup", causes.WARMUP),        # ... and still inside --warmup-steps 3
])
def test_a_graph_compiled_after_the_last_step_end_is_judged_as_the_next_step(warmup_steps, kind, cause):
    """The summary's trailing window (a final evaluation after the loop's last step end) is labelled
    with the last step and judged as the step after it; a site first seen within --warmup-steps is
    warm-up, even when another site is already warm."""
    analyzer = analyzer_of(warmup_steps)
    run_site(analyzer, "A", "A")
    tail = replace(window(0, *ran("E", 20), phase="eval"), step=None, is_step=False)
    assert analyzer.observe(tail) == []
    final = analyzer.graphs["E"]
    assert (final.kind, final.cause, final.step) == (kind, cause, 2)
    assert analyzer.summary().steps == 2


@pytest.mark.parametrize("ended", [False, True])
def test_a_graph_counts_the_steps_that_ended_before_it_whether_or_not_its_own_step_ended(ended):
    """--require-precompiled records a stop while the program goes on: the sync that compiled the
    graph may or may not have ended its step by then (step label 3, or the last step's 2). Either
    way two steps had ended before it, and a tour of 3 steps reaches it (script_check's hint)."""
    analyzer = analyzer_of()
    run_site(analyzer, "A", "A")
    last = window(3, *ran("E", 20), phase="eval")
    analyzer.observe(last if ended else replace(last, step=None, is_step=False))
    assert (analyzer.graphs["E"].step, analyzer.graphs["E"].after_steps) == (3 if ended else 2, 2)
    assert analyzer.graphs["A"].after_steps == 0  # compiled in step 1: no step had ended


def test_a_graph_compiled_before_the_watch_began_warms_its_own_site_when_run_again_elsewhere():
    """A watch started mid-run sees only executions of the step's graph G: the throughput clock
    running G again warms the training site (not whichever site ran first), so its next new graph
    is a recompilation."""
    analyzer = analyzer_of()
    clock = Frame("wait", "/u/clock.py", 34)
    analyzer.observe(window(1, sync_event("execute", "P", 30), sync_event("execute", "G", 10)))
    assert analyzer.observe(window(2, sync_event("execute", "G", 50, inner=clock))) == []
    [new] = analyzer.observe(window(3, *ran("H")))
    assert (new.hash, new.kind, new.step, new.where) == ("H", "recompile", 3, "/u/t.py:10")


def test_a_read_before_the_sync_in_every_steady_step_fails_counted_over_the_steps_after_warmup():
    """A read that only the log shows (no hook saw it), made inside a library: named at the user's
    line with the library line, and counted in the steps after warm-up only (steps 1-2 warm up)."""
    analyzer = analyzer_of()
    for step in range(1, 7):
        read = through("R", 12, BOOL, MASK, cause=ACCESS, compiled=step == 1)
        analyzer.observe(window(step, *read, *through("A", 10, SYNC, compiled=step == 1)))
    summary = analyzer.summary()
    [entry] = summary.host_syncs
    assert (entry.where, entry.library, entry.cause, entry.steps, entry.executes_graph,
            entry.every_step) == ("/u/t.py:12", "transformers/masking_utils.py:369", causes.HOST_ACCESS,
                                     [3, 4, 5, 6], True, True)
    assert summary.problems == [
        "host access before sync: a tensor value read at transformers/masking_utils.py:369, from /u/t.py:12 "
        "runs a graph before the step's sync in 4 of 4 steps after warm-up"]


def test_a_library_read_that_splits_the_step_is_reported_at_the_read_with_the_librarys_fix():
    """transformers' masking_utils asks `padding_mask.all()` first at step 3: its own graph and the
    Trainer's step graph without that part are one finding, named at the read with the library's fix."""
    analyzer = analyzer_of()
    run = [through("A", 10, SYNC, TRAINER), through("A", 10, SYNC, TRAINER, compiled=False)]
    for step, events in enumerate(run, 1):
        analyzer.observe(window(step, *events))
    hooked = records.HostRead("bool", "/u/t.py:12", "train", library="transformers/masking_utils.py:369",
                              function=ENCODER)
    split = window(3, *through("R", 12, BOOL, MASK, cause=ACCESS), *through("B", 10, SYNC, TRAINER), reads=[hooked])
    assert analyzer.observe(split) == []
    read, step = analyzer.graphs["R"], analyzer.graphs["B"]
    assert (read.kind, read.cause, read.where, read.library, read.trigger, read.fix) == (
        "late", causes.VALUE_BRANCH, "/u/t.py:12", "transformers/masking_utils.py:369", "host access", MASK_FIX)
    assert (step.kind, step.cause, step.where, step.library, step.trigger, step.fix) == (
        "late", causes.VALUE_BRANCH, "/u/t.py:12", "transformers/masking_utils.py:369", "sync", MASK_FIX)
    assert step.detail == "the step's graph changed because the read at /u/t.py:12 ran part of it first"
    assert analyzer.graphs["A"].library == "transformers/trainer.py:2000"


def test_a_late_graph_run_by_a_sync_keeps_its_own_library_line_next_to_a_read_on_the_same_user_line():
    """`trainer.train()` is the user's line of everything the Trainer does: the first evaluation's
    graph is named at the evaluation loop's sync, not at a `.item()` the Trainer's logging made in the
    same window (that read is a host sync of its own)."""
    analyzer = analyzer_of()
    analyzer.observe(window(1, *through("A", 30, SYNC, TRAINER)))
    analyzer.observe(window(2, *through("A", 30, SYNC, TRAINER, compiled=False)))
    evaluate = Frame("evaluation_loop", f"{SITE_PACKAGES}/transformers/trainer.py", 4300)
    logged = records.HostRead("item", "/u/t.py:30", "train", library="transformers/trainer.py:2500")
    assert analyzer.observe(window(3, *through("E", 30, SYNC, evaluate), reads=[logged], phase="eval")) == []
    e = analyzer.graphs["E"]
    assert (e.kind, e.cause, e.where, e.library, e.fix) == (
        "late", causes.NEW_CALL_SITE, "/u/t.py:30", "transformers/trainer.py:4300", FIXES[causes.NEW_CALL_SITE])
    assert [(h.where, h.library) for h in analyzer.summary().host_syncs] == [
        ("/u/t.py:30", "transformers/trainer.py:2500")]


CAUSAL_FIX = library_fix("transformers/masking_utils.py", causes.VALUE_BRANCH, "_ignore_causal_mask_sdpa")
PACKED_FIX = library_fix("transformers/masking_utils.py", causes.VALUE_BRANCH, "find_packed_sequence_indices")


@pytest.mark.parametrize("function,answer,fix", [
    (ENCODER, True, MASK_FIX),          # nothing padded: leave attention_mask out, nothing to read
    (ENCODER, False, library_fix("transformers/masking_utils.py", causes.VALUE_BRANCH, ENCODER, padded=True)),
    ("_ignore_causal_mask_sdpa", True, CAUSAL_FIX),   # a causal model: eager attention, the mask kept,
    ("_ignore_causal_mask_sdpa", False, CAUSAL_FIX),  # padded or not
    ("find_packed_sequence_indices", True, PACKED_FIX),  # a causal model without a mask: pass one, eager
    ("sdpa_mask", True, FIXES[causes.VALUE_BRANCH]),  # a read the table has no tested fix for
], ids=["encoder", "encoder-padded", "causal", "causal-padded", "causal-no-mask", "unknown-function"])
def test_the_masking_read_fix_fits_the_function_that_read_and_the_batches_it_read(function, answer, fix):
    """`padding_mask.all()` answered False: the batches are padded to a fixed length, so dropping
    attention_mask is wrong; the fix then is a prepared 4D mask (read as is). A causal model's read
    (with sdpa attention, or without a mask) goes with eager attention: leaving the mask out moves it.
    The same fix in the split step's graph, the read's own graph and the host-sync entry alike."""
    analyzer = analyzer_of()
    for step in (1, 2):
        analyzer.observe(window(step, *through("A", 10, SYNC, TRAINER, compiled=step == 1)))
    for step in range(3, 8):
        read = records.HostRead("bool", "/u/t.py:12", "train", library="transformers/masking_utils.py:369",
                                answer=answer, function=function)
        new = step == 3
        analyzer.observe(window(step, *through("R", 12, BOOL, MASK, cause=ACCESS, compiled=new),
                                *through("B", 10, SYNC, TRAINER, compiled=new), reads=[read]))
    assert analyzer.graphs["R"].fix == analyzer.graphs["B"].fix == fix
    [entry] = analyzer.summary().host_syncs
    assert entry.fix == fix and entry.library == "transformers/masking_utils.py:369"
    if not answer or function != ENCODER:
        assert "leave `attention_mask` out" not in fix
    if not answer and function == ENCODER:
        assert "keep `attention_mask`" in fix and "4D mask" in fix


def test_a_recompilation_run_by_a_library_names_the_users_line_and_the_library_line():
    analyzer = analyzer_of()
    analyzer.observe(window(1, *through("A", 10, SYNC, TRAINER)))
    analyzer.observe(window(2, *through("A", 10, SYNC, TRAINER, compiled=False)))
    [new] = analyzer.observe(window(3, *through("B", 10, SYNC, TRAINER)))
    assert (new.kind, new.cause, new.where, new.library, new.step, new.fix) == (
        "recompile", causes.UNKNOWN, "/u/t.py:10", "transformers/trainer.py:2000", 3, FIXES[causes.UNKNOWN])


def test_a_dynamo_recompilation_names_its_guard_and_the_next_graph_of_it_is_the_same_finding():
    """torch.compile recompiles forward for a new batch size at step 3: its new graph takes dynamo's
    failed guard as cause; the graph compiled right after (step 4) is the same bug, one line; a new
    graph two steps later is a recompilation of its own."""
    analyzer = analyzer_of()
    guard = "tensor 'x' size mismatch at index 0. expected 8, actual 6"
    note = records.DynamoNote("recompile", "forward (/u/model.py:20)", guard, "/u/t.py:7")
    analyzer.observe(window(1, *through("base-graph-1", 10, DYNAMO)))
    analyzer.observe(window(2, *through("base-graph-1", 10, DYNAMO, compiled=False)))
    [first] = analyzer.observe(window(3, *through("dynamo-first-graph", 10, DYNAMO), dynamo=[note]))
    [second] = analyzer.observe(window(4, *through("dynamo-second-graph", 10, DYNAMO)))
    [own] = analyzer.observe(window(5, *through("later-graph", 10, DYNAMO)))
    why = f"dynamo recompiled forward (/u/model.py:20): {guard}"
    assert (first.kind, first.cause, first.where, first.trigger, first.detail, first.fix) == (
        "recompile", causes.NEW_INPUT_SHAPE, "/u/t.py:7", "dynamo", why, FIXES[causes.NEW_INPUT_SHAPE])
    assert (second.kind, second.cause, second.where, second.fix, second.detail) == (
        "recompile", causes.NEW_INPUT_SHAPE, "/u/t.py:7", FIXES[causes.NEW_INPUT_SHAPE],
        f"the same recompilation as graph dynamo-first at step 3: {why}")
    assert (own.kind, own.cause, own.where, own.step) == ("recompile", causes.UNKNOWN, "/u/t.py:10", 5)


def grows(rows: int, at: str) -> hlo_diff.HloSummary:
    """A graph that concatenates a batch onto its input (`preds = torch.cat([preds, logits])`)."""
    return hlo_diff.HloSummary([hlo_diff.Instr("parameter", f"f32[{rows}]", index=0)],
                               [hlo_diff.Instr("concatenate", f"f32[{rows + 8}]", where=at)], [f"f32[{rows + 8}]"])


def test_an_evaluation_that_grows_a_tensor_recompiles_at_every_longer_one_even_at_a_late_site():
    """The HF Trainer's eval loop, first run once training is steady: its first graph is late, the
    next (the predictions concatenated again, longer) a recompilation named at the user's line with
    the library's concatenation and the library's fix."""
    analyzer = analyzer_of()
    run_site(analyzer, "A", "A")
    evaluate = Frame("evaluation_loop", f"{SITE_PACKAGES}/transformers/trainer.py", 4300)
    cat = f"{SITE_PACKAGES}/transformers/trainer_pt_utils.py:120"
    assert analyzer.observe(window(3, *through("E1", 20, SYNC, evaluate), hlo={0: grows(8, cat)}, phase="eval")) == []
    [longer] = analyzer.observe(window(4, *through("E2", 20, SYNC, evaluate), hlo={0: grows(16, cat)}, phase="eval"))
    assert (analyzer.graphs["E1"].kind, analyzer.graphs["E1"].cause) == ("late", causes.NEW_CALL_SITE)
    assert (longer.hash, longer.cause, longer.where, longer.library, longer.fix) == (
        "E2", causes.GROWING_CONCAT, "/u/t.py:20", "transformers/trainer_pt_utils.py:120",
        library_fix("transformers/trainer_pt_utils.py", causes.GROWING_CONCAT))


def test_a_tensor_grown_within_the_warmup_steps_is_warmup_and_every_longer_one_after_them_counts():
    analyzer = analyzer_of(2)
    found = []
    for step, rows in enumerate((8, 16, 24), 1):
        found += analyzer.observe(window(step, *ran(f"G{rows}"), hlo={0: grows(rows, "/u/t.py:15")}))
    assert [analyzer.graphs[g].kind for g in ("G8", "G16", "G24")] == ["warmup", "warmup", "recompile"]
    assert [(g.hash, g.cause, g.where) for g in found] == [("G24", causes.GROWING_CONCAT, "/u/t.py:15")]


def test_in_level_1_mode_every_graph_after_the_warmup_steps_counts():
    """PT_XLA_DEBUG_LEVEL=1 logs compiles, not executions: nothing tells a warm site, so the first
    --warmup-steps steps are warm-up, then a site's new graph is a recompilation and a new site's
    graph late; host reads count from then on."""
    analyzer = analyzer_of(2, executions_logged=False)
    compiled = [[sync_event("compile", "A", 10)], [sync_event("compile", "B", 10)],
                [sync_event("compile", "C", 10), sync_event("compile", "E", 20)]]
    found = [analyzer.observe(window(step, *events, reads=[records.HostRead("item", "/u/t.py:11", "train")]))
             for step, events in enumerate(compiled, 1)]
    assert [[g.hash for g in f] for f in found] == [[], [], ["C"]]
    kinds = {h: (g.kind, g.cause, g.fix) for h, g in analyzer.graphs.items()}
    assert kinds == {"A": ("warmup", causes.WARMUP, ""), "B": ("warmup", causes.WARMUP, ""),
                     "C": ("recompile", causes.UNKNOWN, FIXES[causes.UNKNOWN]),
                     "E": ("late", causes.NEW_CALL_SITE, FIXES[causes.NEW_CALL_SITE])}
    assert [h.steps for h in analyzer.summary().host_syncs] == [[3]]


def test_in_level_1_mode_a_compile_the_log_missed_counts_too():
    analyzer = analyzer_of(1, executions_logged=False)
    assert analyzer.observe(window(1, unlogged_compiles=1, compile_times=[0.4])) == []
    [missed] = analyzer.observe(window(2, unlogged_compiles=1, compile_times=[0.6]))
    assert (missed.hash, missed.kind, missed.cause, missed.step, missed.compile_time_s) == (
        "", "recompile", causes.UNKNOWN, 2, 0.6)
    summary = analyzer.summary()
    assert [g.kind for g in summary.graphs] == ["warmup", "recompile"] and summary.source == "counters"


def test_in_level_1_mode_a_read_the_hooks_missed_still_takes_the_split_step_graph():
    """No execution logged and no hook record of the read: its compile alone names the read, and
    the step graph it split is late at the read's line, once."""
    analyzer = analyzer_of(1, executions_logged=False)
    analyzer.observe(window(1, sync_event("compile", "A", 10)))
    read = sync_event("compile", "R", 12, cause=ACCESS, inner=BOOL)
    assert analyzer.observe(window(2, read, sync_event("compile", "B", 10))) == []
    r, b = analyzer.graphs["R"], analyzer.graphs["B"]
    assert (r.kind, r.cause, r.where, r.trigger, r.library, r.fix) == (
        "late", causes.HOST_ACCESS, "/u/t.py:12", "host access", "", FIXES[causes.HOST_ACCESS])
    assert (b.kind, b.cause, b.where, b.trigger, b.library, b.fix) == (
        "late", causes.HOST_ACCESS, "/u/t.py:12", "sync", "", FIXES[causes.HOST_ACCESS])
    assert b.detail == "the step's graph changed because the read at /u/t.py:12 ran part of it first"


def test_line_tracing_is_wanted_during_the_warmup_and_for_a_few_steps_after_a_new_graph():
    """IR-debug lines cost tracing time: on until the run is steady and for 3 steps after a later new
    graph (step 5's recompilation), off in between and after (graphs/recorder.py)."""
    analyzer = analyzer_of()
    wanted = [analyzer.tracing_lines_wanted(3)]
    for step, graph in enumerate("AAAABBBB", 1):
        run_site(analyzer, graph, start=step)
        wanted.append(analyzer.tracing_lines_wanted(3))
    assert wanted == [True, True, True, True, False, True, True, True, False]


@pytest.mark.parametrize("optimizer_steps", [6, 30])
def test_a_read_in_every_optimizer_step_fails_though_the_script_syncs_three_times_per_optimizer_step(
        optimizer_steps):
    """A Trainer syncs more than once per optimizer step: a callback's `.item()` on a fresh device
    value at each optimizer step's end is in a third of the syncs but in every optimizer step. A step is
    what the script repeats; the verdict is the same for a short and a long run. An occasional read
    (an evaluation's, once) stays a report."""
    analyzer = analyzer_of()
    step = 0
    for n in range(1, optimizer_steps + 1):
        for micro in range(3):
            step += 1
            events = [*through("A", 10, SYNC, TRAINER, compiled=step == 1)]
            extra: dict = {}
            if micro == 2:
                events += through("R", 40, cause=ACCESS, compiled=n == 1)
                extra["optimizer_steps"] = [n]
            if n == optimizer_steps and micro == 0:
                events += through("E", 50, cause=ACCESS, compiled=True)
            analyzer.observe(window(step, *events, **extra))
    summary = analyzer.summary()
    entries = {h.where: h for h in summary.host_syncs}
    assert entries["/u/t.py:40"].every_step and entries["/u/t.py:40"].executes_graph
    assert not entries["/u/t.py:50"].every_step
    # the site warms in step 2 (its graph runs again): optimizer step 1, at step 3, is already steady
    assert analyzer.steady_optimizer_steps == optimizer_steps
    assert summary.problems == [
        f"host access before sync: a tensor value read at /u/t.py:40 runs a graph before the step's sync in "
        f"{optimizer_steps} of {optimizer_steps} optimizer steps after warm-up"]


def program(ops: int) -> hlo_diff.HloSummary:
    """A graph of `ops` instructions (a step's ops repeated: what a loop that never syncs runs)."""
    return hlo_diff.HloSummary([hlo_diff.Instr("parameter", "f32[8]", index=0)],
                               [hlo_diff.Instr("add", "f32[8]", where="/u/t.py:12")] * ops, ["f32[]"])


@pytest.mark.parametrize("sizes,grown", [
    ((100, 200, 300, 400), ["G3", "G4"]),  # every step's graph holds all steps before it
    ((315, 1044, 1898), ["G3"]),           # timm's train.py: a first optimizer step's ops, then a later one's
    ((100, 120, 120, 100), []),            # a first optimizer step and others: no steady growth
    ((100, 101, 102, 103), []),            # a length or an op more: not a step's worth
    ((19, 31, 43, 55), []),                # eager ops left pending after a fall-back: not a whole step
    ((3, 663, 861, 861), []),              # ZeRO-1's set-up graph, a first optimizer step, a steady one
    ((3, 200, 861), []),                   # ... growth that is not the same step's ops again
])
def test_a_read_site_whose_graph_grows_step_over_step_is_a_loop_without_a_sync(sizes, grown):
    """timm's train.py on XLA: `loss.item()` each step runs the pending graph, which holds every
    earlier step's update. Growth in three consecutive steps is its own cause, named at the optimizer
    step where the sync goes, with the ops by step; before it shows, the first graphs are warm-up."""
    analyzer = analyzer_of(optimizer_where="/u/t.py:30")
    found = []
    for step, ops in enumerate(sizes, 1):
        found += analyzer.observe(window(step, *through(f"G{step}", 33, cause=ACCESS), hlo={0: program(ops)},
                                         optimizer_steps=[step]))
    assert [g.hash for g in found if g.cause == causes.GROWING_GRAPH] == grown
    if grown:
        first = analyzer.graphs["G3"]
        assert (first.kind, first.where, first.fix) == ("recompile", "/u/t.py:30", FIXES[causes.GROWING_GRAPH])
        assert first.detail.startswith("ops by step: 1: {}, 2: {}, 3: {};".format(*sizes))
        assert analyzer.graphs["G2"].kind == "warmup"
        assert "torch_xla.sync()" in first.fix and "MpDeviceLoader" in first.fix

