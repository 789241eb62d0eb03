"""Causes named where the user can act (issue 43): a constant that moved with the LR, an accumulation
remainder, a fallback op called from the user's line, a callback's write, a periodic log.

Synthetic step windows as in test_analyzer_rules.py; each expectation is written out.
"""

from __future__ import annotations

import pytest

from neuron_train.graphs import causes, format_report, hlo_diff, records
from neuron_train.graphs.log import Frame, XlaEvent
from tests.graphs.test_analyzer_rules import SITE_PACKAGES, SYNC, TRAINER, analyzer_of, through
from tests.graphs.test_graphs import ACCESS, LIBS, window


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
    assert [(g.hash, g.cause, g.where) for g in found] == [("B", causes.NEW_CONSTANT, "/u/t.py:16")]
    b = analyzer.graphs["B"]
    assert "set by the StepLR made at /u/t.py:16 (it was exactly 0 or 1 until then" in b.detail
    assert b.fix.startswith("start lr away from exactly 0 and 1 (e.g. 0.999 rather than 1.0")
    assert analyzer.graphs["R"].kind == "late"


EPOCH_END = Frame("_run_epoch", f"{SITE_PACKAGES}/transformers/trainer.py", 1979)  # the epoch's final mark_step


@pytest.mark.parametrize("samples,optimizer_step,cause", [
    (80, True, causes.ACCUMULATION_REMAINDER),  # 10 batches of 8, windows of 3: 3, 3, 3, 1
    (72, True, causes.NEW_CALL_SITE),           # 9 batches: every window has 3
    (80, False, causes.NEW_CALL_SITE),          # no optimizer step in the window: not a training step
])
def test_a_trainers_shorter_last_accumulation_window_names_the_setting_and_the_arithmetic(
        samples, optimizer_step, cause):
    """gradient_accumulation_steps=3 with 10 batches an epoch: the epoch's last window has 1 batch, a
    new step graph at the Trainer's end-of-epoch mark_step, compiled once."""
    analyzer = analyzer_of()
    loader = records.LoaderOrigin("L1", "/u/t.py:122", batch_size=8, drop_last=False, samples=samples,
                                  library="transformers/trainer.py:1100", accumulation=3)
    for step in (1, 2):
        analyzer.observe(window(step, *through("A", 122, SYNC, TRAINER, compiled=step == 1), loaders=[loader],
                                optimizer_steps=[step]))
    extra = {"optimizer_steps": [3]} if optimizer_step else {}
    assert analyzer.observe(window(3, *through("L", 122, SYNC, EPOCH_END), **extra)) == []
    late = analyzer.graphs["L"]
    assert (late.kind, late.cause, late.where, late.library) == (
        "late", cause, "/u/t.py:122", "transformers/trainer.py:1979")
    if cause == causes.ACCUMULATION_REMAINDER:
        assert late.detail == (
            "TrainingArguments(gradient_accumulation_steps=3) with 10 batches an epoch (the DataLoader at "
            "/u/t.py:122: 80 samples, batch_size 8): windows of 3, 3, 3, 1 batches; the epoch's last window "
            "of 1 traces another step graph (compiled once, run at every epoch's end)")
        assert late.fix.startswith("make the batches per epoch a multiple of 3 (9 or 12 batches: 72 or 96 "
                                   "samples), or a gradient_accumulation_steps that divides 10")
        assert "precompile it" in late.fix
        assert "fix: make the batches per epoch a multiple of 3" in format_report(analyzer.summary())


def test_a_fallback_op_that_ran_no_graph_is_named_at_the_users_call_of_it(tmp_path):
    """aten::_unique2 ran on the CPU on a ready input (no graph, no read); the new input's only line is
    torch's own (torch/functional.py): the user's `torch.unique(` call in the script is the line, with
    the op's fixed-length fix, and the fallback op carries it."""
    script = tmp_path / "t.py"
    script.write_text("import torch\n\nfor xb, yb in batches:\n"
                      "    classes, counts = torch.unique(yb, return_counts=True)\n"
                      "    loss = step(xb, counts)\n    torch_xla.sync()\n")
    sync = f"{script}:6"
    analyzer = analyzer_of()
    torch_line = f"{SITE_PACKAGES}/torch/functional.py:946"

    def counts(n: int) -> hlo_diff.HloSummary:
        return hlo_diff.HloSummary([hlo_diff.Instr("parameter", f"s64[{n}]", where=torch_line, index=0)],
                                   [hlo_diff.Instr("add", "f32[]")], ["f32[]"])

    def run(step: int, graph: str, n: int, compiled: bool) -> list[records.Graph]:
        events = [XlaEvent(kind=k, cause="user torch_xla.sync", graph_hash=graph,
                                   frames=[SYNC, Frame("<module>", str(script), 6)])
                  for k in (("compile", "execute") if compiled else ("execute",))]
        return analyzer.observe(window(step, *events, hlo={0: counts(n)} if compiled else {},
                                       fallbacks={"aten::_unique2": 1}))

    run(1, "A", 3, True)
    run(2, "A", 3, False)
    [new] = run(3, "B", 2, True)
    assert (new.cause, new.where, new.library) == (causes.DATA_DEPENDENT, f"{script}:4", "")
    assert new.fix == causes.FALLBACK_FIXES["aten::_unique2"] and sync != new.where
    assert analyzer.summary().fallback_ops["aten::_unique2"].where == [f"{script}:4"]


def test_a_dropout_p_written_to_exactly_0_by_a_callback_is_named_at_the_write():
    """A TrainerCallback anneals every nn.Dropout.p to 0: torch leaves the dropout out of the step's
    graph (its ops traced inside torch, no user line in the diff); the hooks saw the write reach 0, so
    the recompilation is named at the write, with a fix that ends the anneal above 0."""
    analyzer = analyzer_of()
    torch_line = f"{SITE_PACKAGES}/torch/nn/functional.py:1422"
    with_dropout = hlo_diff.HloSummary([hlo_diff.Instr("parameter", "f32[8]", index=0)], [
        hlo_diff.Instr("rng-bit-generator", "u32[8]", where=torch_line), hlo_diff.Instr("multiply", "f32[8]")],
        ["f32[8]"])
    without = hlo_diff.HloSummary(with_dropout.params, [hlo_diff.Instr("multiply", "f32[8]")], ["f32[8]"])
    for step in (1, 2):
        analyzer.observe(window(step, *through("A", 139, SYNC, TRAINER, compiled=step == 1), hlo={0: with_dropout}))
    write = records.ScalarChange(-1, "p", 0.0, "/u/t.py:84", "", module="Dropout")
    [new] = analyzer.observe(window(3, *through("B", 139, SYNC, TRAINER), hlo={0: without}, scalars=[write]))
    assert (new.cause, new.where, new.library) == (causes.NEW_CONSTANT, "/u/t.py:84", "")
    assert "Dropout.p = 0.0 written at /u/t.py:84: it reached exactly 0 or 1" in new.detail
    assert new.fix.startswith("keep Dropout.p away from exactly 0 and 1 where it is written: end an anneal just "
                              "above 0 (p = max(1e-6, ...))")


LOG_READ = Frame("nested_xla_mesh_reduce", f"{SITE_PACKAGES}/transformers/trainer_pt_utils.py", 194)


@pytest.mark.parametrize("logging_steps,fails,problem", [
    # 16 optimizer steps, one sync each; the site warms at step 2, so optimizer steps 3-16 are steady (14);
    # logs at every N-th from step 4 on, each reading in its step and in 2 syncs of its own (mesh_reduce)
    (2, True, "in 7 of 14 optimizer steps after warm-up: the Trainer's loss log, "
              "TrainingArguments(logging_steps=2)"),
    (4, False, ""),   # 4 of 14 optimizer steps (by syncs: 12 of 22, which once failed it)
])
def test_the_trainers_loss_log_names_logging_steps_and_fails_only_at_every_second_step(
        logging_steps, fails, problem):
    analyzer = analyzer_of()
    loader = records.LoaderOrigin("L1", "/u/t.py:140", batch_size=8, drop_last=True, samples=128,
                                  library="transformers/trainer.py:1100", logging_steps=logging_steps)
    step = 0
    for n in range(1, 17):
        step += 1
        logs = n > 2 and n % logging_steps == 0
        reads = through("R", 140, LOG_READ, cause=ACCESS, compiled=step == 4) if logs else []
        analyzer.observe(window(step, *reads, *through("A", 140, SYNC, TRAINER, compiled=step == 1),
                                optimizer_steps=[n], loaders=[loader] if n == 1 else []))
        for _ in range(2 if logs else 0):
            step += 1
            analyzer.observe(window(step, *through("R", 140, LOG_READ, cause=ACCESS, compiled=False),
                                    *through("M", 140, SYNC, LOG_READ, compiled=step == 5)))
    summary = analyzer.summary()
    [log] = [h for h in summary.host_syncs if h.library == "transformers/trainer_pt_utils.py:194"]
    assert log.fix.startswith(f"TrainingArguments(logging_steps={logging_steps}) makes the Trainer read the loss "
                              f"(.item()) every {logging_steps} optimizer steps")
    assert log.every_step == fails and log.logging_steps == logging_steps
    assert log.to_json()["logging_steps"] == logging_steps
    assert all(h.logging_steps == 0 and "logging_steps" not in h.to_json() for h in summary.host_syncs if h is not log)
    assert summary.problems == ([
        "host access before sync: a tensor value read at transformers/trainer_pt_utils.py:194, from /u/t.py:140 "
        f"runs a graph before the step's sync {problem}"] if fails else [])


def slice_at(start: int) -> hlo_diff.HloSummary:
    """A step graph that slices rows [start:start+5] of a device-resident corpus (parsed HLO text)."""
    return hlo_diff.summarize_hlo(
        "ENTRY %main {\n"
        "  %p0.1 = s64[40,8]{1,0} parameter(0)\n"
        f"  %slice.2 = s64[5,8]{{1,0}} slice(%p0.1), slice={{[{start}:{start + 5}], [0:8]}}, "
        'metadata={op_type="xla__select" source_file="/u/t.py" source_line=18}\n'
        "  ROOT %add.3 = s64[5,8]{1,0} add(%slice.2, %slice.2)\n}\n")


def test_graphs_that_differ_only_in_a_slices_bounds_are_a_slice_offset_at_the_slice():
    why = hlo_diff.explain(slice_at(10), slice_at(15), LIBS)
    assert (why.cause, why.where) == (causes.SLICE_OFFSET, "/u/t.py:18")
    assert why.detail == ("2 ops in both; slice s64[5,8] of the same tensor at {[10:15], [0:8]} -> "
                          "{[15:20], [0:8]}: its offset is baked into the graph, a new graph per offset")
    assert hlo_diff.explain(slice_at(10), slice_at(10), LIBS).cause == causes.UNKNOWN
    assert "check-graphs" not in causes.FIXES[causes.UNKNOWN]  # never sends the user back to the checker


@pytest.mark.parametrize("log_compiles,kind", [
    (True, "late"),        # the log's own graph in between: the fetch's smaller graph is still the read's
    (False, "recompile"),  # a window that compiled nothing in between: the read is over
])
def test_the_rest_of_a_step_a_log_read_split_is_the_reads_while_graphs_keep_compiling(log_compiles, kind):
    """The Trainer logs at optimizer step 4: the read runs part of the step (step 3), its mesh_reduce
    compiles a graph of its own (step 4), then the batch fetch's sync runs the rest of the step, a
    smaller graph at a warm site (step 5): one cause, the read's, not a recompilation."""
    analyzer = analyzer_of()
    for step in (1, 2):
        analyzer.observe(window(step, *through("A", 142, SYNC, TRAINER, compiled=step == 1)))
    analyzer.observe(window(3, *through("R", 142, LOG_READ, cause=ACCESS)))
    analyzer.observe(window(4, *through("M", 142, SYNC, LOG_READ, compiled=log_compiles)))
    found = analyzer.observe(window(5, *through("S", 142, SYNC, TRAINER)))
    s = analyzer.graphs["S"]
    assert (s.kind, [g.hash for g in found]) == (kind, [] if kind == "late" else ["S"])
    if kind == "late":
        assert (s.cause, s.where, s.library) == (
            causes.HOST_ACCESS, "/u/t.py:142", "transformers/trainer_pt_utils.py:194")


def fsdp_step(barriers: int, inputs: int) -> hlo_diff.HloSummary:
    """A training step of torch_xla FSDP: `inputs` graph inputs, gathers behind `barriers` barriers."""
    return hlo_diff.HloSummary([hlo_diff.Instr("parameter", f"f32[{n + 1}]", index=n) for n in range(inputs)],
                               [hlo_diff.Instr("opt-barrier", "(f32[8])", op_type="xla::optimization_barrier")]
                               * barriers + [hlo_diff.Instr("convolution", "f32[8,8,6,6]")], ["f32[]"])


def test_fsdps_first_training_step_after_an_evaluation_is_named_as_such_not_as_the_evaluations_read():
    """The evaluation's forward left the full parameters gathered: the next training step has more inputs
    and fewer optimization barriers, compiled once. Named at the training sync with what changed and
    that precompile covers it, not as a split by the evaluation's `.item()` in the same window."""
    analyzer = analyzer_of()
    for step in (1, 2):
        analyzer.observe(window(step, *through("A", 22, SYNC, compiled=step == 1), hlo={0: fsdp_step(27, 8)}))
    found = analyzer.observe(window(3, *through("R", 27, cause=ACCESS), *through("B", 22, SYNC),
                                    hlo={2: fsdp_step(18, 12)}))
    assert [(g.hash, g.kind, g.cause, g.where, g.library) for g in found] == [
        ("B", "recompile", causes.FSDP_AFTER_EVAL, "/u/t.py:22", "")]
    assert found[0].detail.startswith("8 -> 12 inputs, ")
    assert found[0].fix == causes.FIXES[causes.FSDP_AFTER_EVAL] and "precompile covers it" in found[0].fix
