"""Every fix the checker prints for a library's line is applied and shown to work (issue 43 item 8).

The tests are parametrized over the tables themselves (each cause's library fixes and fallback-op
fixes in graphs/causes.py): for each entry, check-graphs runs a fixture made of registry packages
(transformers, accelerate, timm: tiny random configs, local data, no download) that the entry's
finding appears in, with the entry's fix printed; then the same fixture with that fix applied, and
the finding is gone (no finding at that library file at all: a read moved to another line of it
counts as not fixed). A new entry without a case here fails the fast guard below, and its slow test.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from neuron_train.graphs.causes import (
    DATA_DEPENDENT,
    DYNAMO_RECOMPILE,
    FALLBACK_FIXES,
    GROWING_CONCAT,
    LIBRARY_FIXES,
    NEW_CONSTANT,
    NEW_INPUT_SHAPE,
    SLICE_SHAPE,
    VALUE_BRANCH,
    LibraryFix,
)
from tests.conftest import ROOT
from tests.graphs.test_graphs import FIXTURES, check_graphs

SCRIPTS = ROOT / "tests" / "fixtures" / "scripts"
HF, ACCELERATE = SCRIPTS / "hf_trainer.py", SCRIPTS / "accelerate_loop.py"
MASKING = "transformers/masking_utils.py"
ENCODER, CAUSAL = "_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa"
PACKED = "find_packed_sequence_indices"


def library_fix(library: str, cause: str, function: str = "", padded: bool | None = None) -> str:
    """The fix of the table's entry with these fields (read from the table, not matched by its rule)."""
    [entry] = [e for c, e in LIBRARY_FIXES
               if (e.library, c, e.function, e.padded) == (library, cause, function, padded)]
    return entry.fix


@dataclass(frozen=True)
class Case:
    script: Path
    before: tuple[str, ...]   # the script's arguments: the finding
    after: tuple[str, ...]    # the same with the printed fix applied
    stable: bool = True       # with the fix applied nothing else is left either


Key = tuple[str, str, str, "bool | None"]
CASES: dict[Key, Case] = {
    # BERT (an encoder), sdpa: unpadded batches; padded ones (zeros in the mask)
    (MASKING, VALUE_BRANCH, ENCODER, False): Case(HF, ("--drop-last",), ("--drop-last", "--no-mask")),
    (MASKING, VALUE_BRANCH, ENCODER, True): Case(HF, ("--padded", "--drop-last"),
                                                 ("--padded", "--drop-last", "--mask-4d")),
    # a causal Llama, sdpa, with a mask: leaving it out moves the read (PACKED's case), eager with the mask does not
    (MASKING, VALUE_BRANCH, CAUSAL, None): Case(HF, ("--causal", "--drop-last"),
                                                ("--causal", "--drop-last", "--attn", "eager")),
    (MASKING, VALUE_BRANCH, PACKED, None): Case(HF, ("--causal", "--no-mask", "--drop-last"),
                                                ("--causal", "--drop-last", "--attn", "eager")),
    # with the mask (its read left: its own entry); without it the ragged batch's graph is a late graph at the
    # Trainer's end-of-epoch sync, reported as a new call site that precompile covers
    ("transformers/trainer.py", NEW_INPUT_SHAPE, "", None): Case(
        HF, ("--samples", "30"), ("--samples", "30", "--drop-last"), stable=False),
    ("transformers/trainer_pt_utils.py", GROWING_CONCAT, "", None): Case(
        HF, ("--no-mask", "--epochs", "1", "--eval", "--metrics", "--eval-samples", "32"),
        ("--no-mask", "--epochs", "1", "--eval", "--metrics", "--eval-samples", "32",
         "--arg", "eval_accumulation_steps=1")),
    # padding="max_length" pads with zeros in the mask: the masking read of padded batches is left (its own entry)
    ("transformers/data/data_collator.py", NEW_INPUT_SHAPE, "", None): Case(
        HF, ("--drop-last", "--samples", "40", "--dynamic-padding"),
        ("--drop-last", "--samples", "40", "--dynamic-padding", "max_length"), stable=False),
    ("accelerate/", NEW_INPUT_SHAPE, "", None): Case(ACCELERATE, ("--samples", "30"),
                                                    ("--samples", "30", "--drop-last")),
    ("timm/data/mixup.py", SLICE_SHAPE, "", None): Case(FIXTURES / "timm_mixup.py", (), ("--host",)),
    # an unmixed batch (prob=0.5) first: its mixing factor of exactly 1 is a constant of the target's mixing
    ("timm/data/mixup.py", NEW_CONSTANT, "", None): Case(FIXTURES / "timm_mixup.py", (), ("--host",)),
    ("torch/optim/", DYNAMO_RECOMPILE, "", None): Case(FIXTURES / "dynamo_loop.py", ("exponential_lr",),
                                                      ("tensor_lr",)),
}
FALLBACK_CASES = {"aten::_unique2": Case(FIXTURES / "unique_counts.py", (), ("--fixed",))}


def key(cause: str, entry: LibraryFix) -> Key:
    return entry.library, cause, entry.function, entry.padded


def test_every_library_fix_has_a_case_that_applies_it():
    """A table entry without a case here is a fix nobody has seen work: add its case (or drop the entry)."""
    assert sorted(str(key(*item)) for item in LIBRARY_FIXES) == sorted(map(str, CASES))
    assert sorted(FALLBACK_FIXES) == sorted(FALLBACK_CASES)


def findings(report: dict) -> list[dict]:
    """What the report asks the user to act on: new graphs after warm-up, reads that run a graph before
    the step's sync, dynamo's defects."""
    return [*report["recompiles"], *report["late_graphs"], *[h for h in report["host_syncs"] if h["executes_graph"]],
            *[d for d in report["dynamo"] if d["defect"]]]


def run(tmp_path: Path, case: Case, args: tuple[str, ...]) -> tuple[int, dict, str]:
    out = ("--output-dir", str(tmp_path / f"out-{len(args)}")) if case.script == HF else ()
    return check_graphs(tmp_path, sys.executable, str(case.script), *args, *out)


@pytest.mark.slow
@pytest.mark.parametrize("cause,entry", LIBRARY_FIXES, ids=[f"{e.library}|{c}|{e.function}|{e.padded}"
                                                         for c, e in LIBRARY_FIXES])
def test_a_library_fix_applied_to_its_fixture_removes_its_finding(tmp_path, cause, entry):
    case = CASES[key(cause, entry)]
    code, report, output = run(tmp_path, case, case.before)
    assert code == 1, output
    printed = [f for f in findings(report) if f["fix"] == entry.fix]
    # timm's Mixup has one fix for two causes (a box's slice, an unmixed batch's constant): each its entry's
    assert any(f["cause"] == cause for f in printed), output
    assert all((f["cause"], f["fix"]) in {(c, e.fix) for c, e in LIBRARY_FIXES} for f in printed), output
    file = entry.library.partition(":")[0]
    code, report, output = run(tmp_path, case, case.after)
    left = [f for f in findings(report) if f["fix"] == entry.fix or f.get("library", "").startswith(file)]
    assert not left, output
    assert code == 0 or not case.stable, output


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(FALLBACK_FIXES))
def test_a_fallback_ops_fix_applied_to_its_fixture_removes_its_finding(tmp_path, op):
    case = FALLBACK_CASES[op]
    code, report, output = run(tmp_path, case, case.before)
    assert code == 1 and op in report["fallback_ops"], output
    assert [f for f in findings(report) if f["fix"] == FALLBACK_FIXES[op] and f["cause"] == DATA_DEPENDENT], output
    code, report, output = run(tmp_path, case, case.after)
    assert code == 0 and op not in report["fallback_ops"] and not findings(report), output
