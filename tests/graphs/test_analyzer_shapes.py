"""Shapes a slice or a loader made, in-process (graphs/explain.py, analyzer.py, loaders.py): a slice on
the device (the user's, or a library's such as timm's CutMix) and a Trainer's dynamic padding, named at
the line to change with the fix that works. Synthetic step windows, as in test_analyzer_rules.py."""

from __future__ import annotations

import pytest

from neuron_train.graphs import causes, hlo_diff, records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.causes import FIXES
from neuron_train.graphs.log import internal_file_predicate, library_namer
from tests.graphs.test_analyzer_rules import SITE_PACKAGES, analyzer_of, through
from tests.graphs.test_graphs import CLEAR, LIBS, STEP, ran, run_site, summary_of_shapes, window


def sliced(rows: int, length: int, at: str, full: int = 32) -> hlo_diff.HloSummary:
    """A graph that cuts an input of `full` tokens to `length` at `at` (no op at all at the full length)."""
    cut = [hlo_diff.Instr("slice", f"s64[{rows},{length}]", op_type="xla__select", where=at)] if length < full else []
    return hlo_diff.HloSummary([hlo_diff.Instr("parameter", f"s64[{rows},{full}]", index=0)], cut,
                               [f"s64[{rows},{length}]"])


def test_a_slice_on_the_device_before_a_compiled_step_counts_every_new_length_from_the_second(tmp_path):
    """pytorch/xla's decoder-only example with a sequence-length warm-up (`data[:, :seq]` on device data,
    then a torch_xla.compile'd step): torch_xla.compile runs the slice as a graph of its own, then the
    step's graph takes its output. Each new length after the first is a recompilation of both, named at
    the slice (not a line inside the step function, not the call), even before either site repeats."""
    script = tmp_path / "decoder.py"
    script.write_text("for step, data in enumerate(loader):\n    seq = 8 * (step + 1)\n"
                      "    inputs = data[:, :seq]\n    step_fn(inputs[:, :-1], inputs[:, 1:])\n")
    cut = f"{script}:3"
    analyzer = analyzer_of()
    for n, length in enumerate((8, 16, 24, 32)):
        step_graph = hlo_diff.HloSummary([hlo_diff.Instr("parameter", f"s64[8,{length}]", index=0)],
                                         [hlo_diff.Instr("dot", "f32[8,50]", where=f"{script}:4")], ["f32[]"])
        analyzer.observe(window(2 * n + 1, *through(f"S{length}", 4, CLEAR), hlo={0: sliced(8, length, cut)}))
        analyzer.observe(window(2 * n + 2, *through(f"G{length}", 4, STEP), hlo={0: step_graph}))
    graphs = analyzer.graphs
    assert [graphs[h].kind for h in ("S8", "G8")] == ["warmup", "warmup"]
    found = [graphs[h] for n in (16, 24, 32) for h in (f"S{n}", f"G{n}")]
    assert [(g.kind, g.cause, g.where) for g in found] == [("recompile", causes.SLICE_SHAPE, cut)] * 6
    assert all(g.fix == FIXES[causes.SLICE_SHAPE] for g in found)
    assert f"the slice at {cut} cut a tensor to another length" in graphs["S16"].detail
    assert analyzer.summary().problems == [
        f"6 recompilations at step 3, 4, 5, 6, 7, ... (train): {causes.SLICE_SHAPE} at {cut}"]


def test_timms_cutmix_on_the_device_is_named_in_timm_with_the_host_side_fix(tmp_path):
    """timm's stock Mixup/CutMix called on device tensors cuts a new box each batch inside
    timm/data/mixup.py: the HLO's first differing op carries timm's line, no user line. Every new box
    counts from the second batch, named at timm's line (then the user's sync that ran it), with the fix
    that works: mix on the host."""
    site = tmp_path / "site"
    mixup = site / "timm" / "data" / "mixup.py"
    mixup.parent.mkdir(parents=True)
    mixup.write_text("\n" * 210 + "x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]\n")
    analyzer = Analyzer(0, internal_file_predicate(("/lib/", f"{site}/")),
                        library_of=library_namer((str(site),), ("torch", "torch_xla")))
    for step, rows in enumerate((11, 8, 13, 11), 1):
        box = hlo_diff.Instr("pad", f"pred[8,3,{rows},16]", op_type="xla__unselect", where=f"{mixup}:211")
        hlo = hlo_diff.HloSummary([hlo_diff.Instr("parameter", "f32[8,3,16,16]", index=0)],
                                  [box, hlo_diff.Instr("dot", "f32[8,10]")], ["f32[]"])
        analyzer.observe(window(step, *ran(f"C{step}", 17), hlo={0: hlo}))
    found = [analyzer.graphs[f"C{n}"] for n in (2, 3, 4)]
    assert analyzer.graphs["C1"].kind == "warmup"
    assert [(g.kind, g.cause, g.where, g.library) for g in found] == [
        ("recompile", causes.SLICE_SHAPE, "/u/t.py:17", "timm/data/mixup.py:211")] * 3
    assert all(g.fix == causes.HOST_MIXUP for g in found)
    assert "on the host, in the data loader" in causes.HOST_MIXUP and "--cutmix" in causes.HOST_MIXUP


@pytest.mark.parametrize("grouped", [False, True])
def test_a_trainers_dynamic_padding_is_named_at_its_collator_with_a_fixed_length_fix(grouped):
    """transformers' Trainer makes the DataLoader (at trainer.train()) with the user's
    DataCollatorWithPadding: each batch is padded to its own longest sample. Named at the user's line
    with the collator's library line (not trainer.py's) and the collator's fix; group_by_length=True
    (the sampler that makes each batch's length differ) is named in the detail."""
    collator = f"{SITE_PACKAGES}/transformers/data/data_collator.py:280"
    loader = records.LoaderOrigin("L1", "/u/t.py:50", batch_size=4, drop_last=False, samples=48,
                                  collate="DataCollatorWithPadding", collate_where=collator,
                                  library="transformers/trainer.py:1098", grouped=grouped)
    analyzer = analyzer_of()
    analyzer.observe(window(1, *ran("A", 50), hlo={0: summary_of_shapes("s64[4,32]")}, loaders=[loader],
                            batches=[records.Batch("L1", ["s64[4,32]", "s64[4,29]"])]))
    run_site(analyzer, "A", start=2)
    analyzer.observe(window(3, *ran("A", 50)))
    [found] = analyzer.observe(window(4, *ran("B", 50), hlo={0: summary_of_shapes("s64[4,29]")}))
    assert (found.cause, found.where, found.library) == (
        causes.NEW_INPUT_SHAPE, "/u/t.py:50", "transformers/data/data_collator.py:280")
    assert 'padding="max_length"' in found.fix and "pad_to_multiple_of" in found.fix
    assert "collate_fn DataCollatorWithPadding" in found.detail
    assert ("the Trainer's group_by_length" in found.detail) == grouped


def test_a_trainers_loader_is_known_by_the_collator_it_wraps_and_its_batchencoding_shapes():
    """The Trainer wraps the user's collator in RemoveColumnsCollator and a tokenizer's collator returns
    a BatchEncoding (a UserDict, not a dict): the loader's collate_fn is the wrapped collator, and the
    batch's tensors are seen, so a new shape is traced to that collator."""
    import torch
    from transformers import BatchEncoding, DataCollatorWithPadding
    from transformers.trainer_utils import RemoveColumnsCollator

    from neuron_train.graphs import loaders

    batch = BatchEncoding({"input_ids": torch.zeros(8, 15, dtype=torch.long), "labels": torch.zeros(8)})
    assert loaders.shapes(batch) == ["s64[8,15]", "f32[8]"]
    padder = DataCollatorWithPadding(tokenizer=None)
    wrapped = RemoveColumnsCollator(padder, signature_columns=["input_ids"])
    made = loaders.origin(torch.utils.data.DataLoader([1, 2], batch_size=2, collate_fn=wrapped), "/u/t.py:50")
    assert made.collate == "DataCollatorWithPadding" and not made.grouped
    from transformers.trainer_pt_utils import LengthGroupedSampler

    grouped = torch.utils.data.BatchSampler(LengthGroupedSampler(2, lengths=[3, 4]), batch_size=2, drop_last=False)
    assert loaders.origin(torch.utils.data.DataLoader([1, 2], batch_sampler=grouped), "/u/t.py:50").grouped
    assert made.collate_where.endswith(
        f"transformers/data/data_collator.py:{type(padder).__call__.__code__.co_firstlineno}")


@pytest.mark.parametrize("library,drop", [
    ("transformers/trainer.py:1051", "TrainingArguments(dataloader_drop_last=True)"),
    ("", "drop_last=True on the DataLoader at /u/t.py:5"),
], ids=["trainer", "torch"])
def test_a_ragged_last_batch_synced_at_a_new_call_site_is_a_recompilation_with_its_arithmetic(library, drop):
    """The Trainer syncs an epoch's last step at its end-of-epoch mark_step (line 20 here), not at the loader's
    next fetch (line 10): 30 samples in batches of 8 end each epoch with a batch of 6, whose graph is new at
    a new call site. Not a late graph: the ragged batch's recompilation, at the loader."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=8, drop_last=False, samples=30, library=library)
    full, ragged = ["s64[8,8]", "s64[8]"], ["s64[6,8]", "s64[6]"]
    run_site(analyzer, "A", "A", "A", loaders=[loader], batches=[records.Batch("L1", full)])
    [graph] = analyzer.observe(window(4, *ran("R", line=20), hlo={0: summary_of_shapes("s64[6]", "s64[6,8]")},
                                      batches=[records.Batch("L1", ragged)]))
    assert (graph.kind, graph.cause, graph.where, graph.library) == ("recompile", causes.NEW_INPUT_SHAPE,
                                                                     "/u/t.py:5", library)
    assert graph.detail == ("a ragged last batch: 30 samples in batches of 8 (drop_last=False) from the DataLoader "
                            "at /u/t.py:5: 3 full batches and a last one of 30 mod 8 = 6; its input s64[8,8] -> "
                            "s64[6,8] traces another step graph, compiled at the epoch's end and run at every "
                            "epoch's end")
    assert graph.fix == (f"{drop} (leaves out the last 6 samples of each epoch), or a dataset that is a "
                         "multiple of 8 (24 or 32 samples), or accept the one extra graph (compiled once, run every "
                         "epoch) and precompile it")


@pytest.mark.parametrize("batches", [
    [["s64[6,8]"]],                # the loader never yielded a full batch of that tensor: no ragged pair
    [["s64[8,8]"], ["s64[8,8]"]],  # it never yielded the ragged one: the new site's input is another tensor
], ids=["only-ragged", "only-full"])
def test_a_new_call_site_without_a_ragged_pair_stays_a_late_graph(batches):
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=8, drop_last=False, samples=30)
    run_site(analyzer, "A", "A", "A", loaders=[loader], batches=[records.Batch("L1", b) for b in batches])
    assert analyzer.observe(window(4, *ran("R", line=20), hlo={0: summary_of_shapes("s64[6,8]")})) == []
    graph = analyzer.graphs["R"]  # not a recompilation: observe returns only those
    assert (graph.kind, graph.cause, graph.where) == ("late", causes.NEW_CALL_SITE, "/u/t.py:20")
