"""Precompile coverage (precompile/coverage.py), in-process: the promises a user reads off its lines.

Whether a run's graphs were precompiled (100%, less, or unknown, never 100% without hashes), and
when not, what differs: the settings or the command line option by option, the library versions,
and per graph the nearest precompiled graph of the same line and its input-shape changes. The
subprocess runs of the same machinery: tests/precompile/test_precompile.py and tests/instrument/test_byos.py.
"""

from __future__ import annotations

import json

import pytest

from neuron_train.precompile import coverage
from neuron_train.precompile.manifest import ConfigRecord, GraphRecord, Manifest
from neuron_train.training.cache_hook import config_labels
from tests.conftest import graph
from tests.instrument.test_byos import script_manifest
from tests.precompile.test_precompile import config, manifest_with

A, B, C = "a" * 16, "b" * 16, "c" * 16   # graph hashes: the lines show their first 12 characters


def script(*argv: str, device: str = "CPU", env: dict | None = None) -> dict:
    return coverage.script_config(["python", *argv], device=device, env=env or {})


def nearest(shapes: list[str] | None, graphs: dict[str, dict], where: str = "/w/train.py:51"):
    """The nearest precompiled graph of `where` for a graph with input `shapes`, and what differs."""
    conf = script("train.py")
    return coverage.nearest_graph(where, shapes, script_manifest(conf, graphs), conf)


# ----- the coverage figure and its lines -------------------------------------------------------------
def test_a_run_the_manifest_covers_is_100_percent_and_its_record_says_so():
    conf = config()
    m = manifest_with((conf, [A, B, C]))
    report = coverage.coverage_report([graph(A, "train", 0), graph(B, "train", 1), graph(A, "train", 2)],
                                      m, conf, "cc")
    # precompile_coverage.json as written before the report was a record, keys in their order
    assert json.dumps(report.to_json()) == json.dumps({
        "cache_dir": "cc", "fingerprint": coverage.fingerprint(conf), "precompiled": True, "graphs": 2,
        "covered": 2, "coverage": 1.0, "unidentified": 0, "missing": [], "unused": [C], "config": conf,
        "explanation": ""})
    assert coverage.format_coverage(report) == "precompile coverage 100% (2/2 graphs in cc/manifest.json)"


def test_a_run_that_compiled_no_graph_is_covered():
    report = coverage.coverage_report([], manifest_with(), config(), "cc")
    assert (report.coverage, report.precompiled, report.unused) == (1.0, False, [])
    assert coverage.format_coverage(report) == "precompile coverage 100% (0/0 graphs in cc/manifest.json)"
    nothing = coverage.coverage_report([graph(A)], manifest_with(), config(), "cc")
    assert (nothing.coverage, nothing.explanation) == (0.0, "nothing was precompiled into cc")


def test_graphs_without_a_hash_make_coverage_unknown_never_100_percent():
    conf = config()
    report = coverage.coverage_report([graph(""), graph("", "eval", 3)], manifest_with((conf, [A])), conf, "cc")
    assert (report.coverage, report.unidentified, report.graphs) == (None, 2, 0)
    assert coverage.format_coverage(report) == ("precompile coverage unknown: 2 graph(s) compiled without a "
                                                "fingerprint (graph hashes unavailable)")


def test_each_graph_not_precompiled_gets_a_line_with_when_and_where(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    here, there = config(train={"batch_size": 64}), config()
    m = manifest_with((there, [A]))
    run = [graph(A), graph(B, "train", 0, f"{tmp_path}/train.py:12"), graph(C, "", None)]
    report = coverage.coverage_report(run, m, here, "cc", config_labels())
    assert (report.precompiled, report.unused, report.covered) == (False, [], 1)
    assert [g.hash for g in report.missing] == [B, C]
    assert coverage.format_coverage(report).splitlines() == [
        f"precompile coverage 33% (1/3 graphs in cc/manifest.json): 2 graph(s) not precompiled, first "
        f"{B[:12]} (train, step 0): batch size 64 here, 32 in the manifest (compared with precompiled "
        f"configuration {coverage.fingerprint(there)})",
        f"  not precompiled: {B[:12]} at train.py:12 (train, step 0)",
        f"  not precompiled: {C[:12]} at ? (before the first step ended)"]


def test_the_settings_are_named_with_their_labels():
    here, there = config(optim={"zero1": True}, train={"grad_accum": 2}), config()
    report = coverage.coverage_report([graph(B)], manifest_with((there, [A])), here, "cc", config_labels())
    assert report.explanation == ("ZeRO-1 on here, off in the manifest; gradient accumulation 2 here, 1 in the "
                                  "manifest (compared with precompiled configuration "
                                  f"{coverage.fingerprint(there)})")
    assert coverage.differences(there, here, config_labels())[0] == "ZeRO-1 off here, on in the manifest"


# ----- why graphs are missing -------------------------------------------------------------------------
def test_a_graph_the_tour_missed_names_the_flag_that_reaches_it():
    conf = config()
    assert coverage.explain(manifest_with((conf, [A])), conf, "cc") == (
        "this configuration was precompiled, but the precompile run did not reach these graphs (a code path "
        "its graph tour missed): raise --precompile-steps and precompile again")
    line = script("t.py")
    assert coverage.explain(script_manifest(line, {A: {}}), line, "cc") == (
        "this configuration was precompiled, but the precompile run did not reach these graphs (a code path "
        "its graph tour missed): raise --steps and precompile again")


def test_a_pruned_configuration_says_when_and_how_to_repair_it():
    conf = config()
    m = manifest_with((conf, [A]))
    record = m.configs[coverage.fingerprint(conf)]
    record.pruned_files, record.pruned_at = 2, "2026-11-21T06:00:00Z"
    assert coverage.explain(m, conf, "cc") == ("this configuration was precompiled, but 2 of its cache files were "
                                              "pruned on 2026-11-21T06:00:00Z: precompile it again")


def test_a_script_is_compared_with_scripts_only():
    loop, here, there = config(), script("t.py", "--batch_size", "16"), script("t.py", "--batch_size", "32")
    assert coverage.explain(Manifest(), here, "cc") == "nothing was precompiled into cc"
    assert coverage.explain(manifest_with((loop, [A])), here, "cc") == "nothing of this kind was precompiled into cc"
    both = manifest_with((loop, [A]), (there, [B]))
    assert coverage.explain(both, here, "cc") == ("--batch_size 16 here, 32 in the manifest (compared with "
                                                 f"precompiled configuration {coverage.fingerprint(there)})")


def test_a_precompiled_command_line_whose_script_changed_says_so():
    conf = script("train.py")
    m = script_manifest(conf, {A: {"where": "/w/train.py:51", "input_shapes": ["f32[32]"]}})
    report = coverage.coverage_report([graph(B, "steady", 2, "/w/train.py:51")], m, conf, "cc",
                                      shapes={B: ["f32[16]"]})
    assert report.explanation == ("this command line was precompiled, but the script compiled other graphs at "
                                     "lines its tour reached (the script or its data changed since: see each graph)")
    assert report.to_json()["missing"] == [{"hash": B, "phase": "steady", "step": 2, "cause": graph(B).cause,
                                  "where": "/w/train.py:51", "nearest": A,
                                  "difference": "input 0: f32[16] here, f32[32] in the manifest"}]
    # Another command line: its options are named, not a changed script (though its graphs have a nearest).
    other = coverage.coverage_report([graph(B, "steady", 2, "/w/train.py:51")], m, script("train.py", "-v"), "cc")
    assert other.missing[0].nearest == A and other.explanation == (
        "-v given here, not given in the manifest (compared with precompiled configuration "
        f"{coverage.fingerprint(conf)})")
    # A line the tour never reached is not a changed script: the tour missed it.
    unreached = coverage.coverage_report([graph(B, "late", 40, "/w/train.py:99")], m, conf, "cc")
    assert unreached.explanation.startswith("this configuration was precompiled, but the precompile run did not")


# ----- what differs between two configurations ------------------------------------------------------
def test_the_compile_environment_of_a_script_is_part_of_its_configuration(monkeypatch):
    monkeypatch.setattr(coverage, "graph_library_versions", lambda: {"torch-xla": "2.8.0", "torch": "2.9.0"})
    there = script("t.py")
    m = script_manifest(there, {A: {}})
    monkeypatch.setattr(coverage, "graph_library_versions", lambda: {"torch": "2.9.0", "torch-xla": "2.9.0"})
    here = script("t.py", device="NEURON", env={"NEURON_CC_FLAGS": "-O2 --cache_dir=/x"})
    report = coverage.coverage_report([graph(A)], m, here, "cc")
    assert report.coverage == 0.0   # another device, flags or version: another cache entry
    assert coverage.differences(here, there) == ["device NEURON here, CPU in the manifest",
                                                 "NEURON_CC_FLAGS -O2 here, (none) in the manifest",
                                                 "torch-xla 2.9.0 here, 2.8.0 in the manifest"]
    assert coverage.fingerprint(here) != coverage.fingerprint(script("t.py", device="NEURON", env={}))


def test_a_library_on_one_side_only_is_named():
    assert coverage.differences({"versions": {"timm": "1.0"}}, {}) == ["timm 1.0 here, (none) in the manifest"]
    assert coverage.differences({}, {"versions": {"timm": "1.0"}}) == ["timm (none) here, 1.0 in the manifest"]


def test_every_difference_is_named_also_next_to_a_command_line():
    here = {"device": "NEURON", "script": "python t.py --lr 1", "sift": True}
    there = {"device": "CPU", "script": "python t.py --lr 2", "sift": False}
    assert coverage.differences(here, there) == ["device NEURON here, CPU in the manifest",
                                                 "--lr 1 here, 2 in the manifest", "sift on here, off in the manifest"]


def test_the_fingerprint_ignores_the_order_of_settings_and_changes_with_any_value():
    fp = coverage.fingerprint({"a": 1, "b": {"c": 2, "d": 3}})
    assert fp == coverage.fingerprint({"b": {"d": 3, "c": 2}, "a": 1})
    assert fp != coverage.fingerprint({"a": 1, "b": {"c": 2, "d": 4}})
    assert len(fp) == 16 and int(fp, 16) >= 0   # manifests on disk are keyed by these 16 hex digits


# ----- a command line, option by option --------------------------------------------------------------
@pytest.mark.parametrize("here, there, named", [
    ("python t.py --batch_size=16", "python t.py --batch_size 32", ["--batch_size 16 here, 32 in the manifest"]),
    ("python t.py --fake_data --batch_size 16", "python t.py --fake_data --batch_size 32",
     ["--batch_size 16 here, 32 in the manifest"]),
    ("python t.py --name 'my run'", "python t.py --name 'my run' -v", ["-v not given here, given in the manifest"]),
    ("python t.py --name 'my run'", "python t.py --name run", ["--name my run here, run in the manifest"]),
    ("python3 a.py --bs 16", "python b.py --bs 32",
     ["command python3 a.py here, python b.py in the manifest", "--bs 16 here, 32 in the manifest"]),
    ("python t.py - --bs 8", "python t.py --bs 8", ["command python t.py - here, python t.py in the manifest"]),
    ("python t.py --a 1 --b 2", "python t.py --b 2 --a 1", ["the same command with its options in another order"]),
    ("python t.py --a 1", "python t.py --a 1", []),
    ("python t.py --lr -0.1 --bs 8", "python t.py --lr -0.2 --bs 8", ["--lr -0.1 here, -0.2 in the manifest"]),
    ("python t.py --shift -3 --wd 1e-4", "python t.py --shift -3 --wd -1e-4",
     ["--wd 1e-4 here, -1e-4 in the manifest"]),
    ("python t.py --input -", "python t.py --input data.txt", ["--input - here, data.txt in the manifest"]),
])
def test_a_command_line_is_compared_option_by_option(here, there, named):
    assert coverage.command_differences(here, there) == named


# ----- per graph: the nearest precompiled graph of the same line ----------------------------------------
def test_of_two_graphs_of_a_line_the_one_with_fewer_differing_shapes_is_named():
    far = {"where": "/w/train.py:51", "input_shapes": ["f32[16]", "f32[32,784]", "s64[32]"]}
    near = {"where": "/old/train.py:51", "input_shapes": ["f32[10]", "f32[32,784]", "s64[16]"]}
    other_line = {"where": "/w/train.py:70", "input_shapes": ["f32[10]", "f32[16,784]", "s64[16]"]}
    assert nearest(["f32[10]", "f32[16,784]", "s64[16]"], {A: far, B: near, C: other_line}) == (
        B, "input 1: f32[16,784] here, f32[32,784] in the manifest")


def test_another_number_of_inputs_names_the_inputs_on_each_side():
    far = {"where": "/w/train.py:51", "input_shapes": ["f32[10]", "f32[99]"]}
    near = {"where": "/w/train.py:51", "input_shapes": ["f32[10]", "f32[32,784]", "s64[32]", "f32[10]"]}
    assert nearest(["f32[10]", "f32[32,784]", "s64[32]"], {A: far, B: near}) == (
        B, "3 inputs here, 4 in the manifest (none here, f32[10] in the manifest)")
    assert nearest(["f32[3]", "f32[10]", "f32[99]"], {A: far})[1] == (
        "3 inputs here, 2 in the manifest (f32[3] here, none in the manifest)")
    here = ["f32[1]", "f32[2]", "f32[3]"]           # both precompiled graphs hold all its inputs, and more
    assert nearest(here, {A: {"where": "/w/train.py:51", "input_shapes": [*here, "f32[4]", "f32[5]", "f32[6]"]},
                          B: {"where": "/w/train.py:51", "input_shapes": [*here, "f32[4]"]}}) == (
        B, "3 inputs here, 4 in the manifest (none here, f32[4] in the manifest)")
    assert nearest(["f32[3]", "f32[4]", "f32[5]"], {A: {"where": "/w/train.py:51", "input_shapes": ["f32[1]"]}})[1] == (
        "3 inputs here, 1 in the manifest (f32[3], f32[4], f32[5] here, f32[1] in the manifest)")
    assert nearest(["f32[3]"], {A: far})[1] == (
        "1 inputs here, 2 in the manifest (f32[3] here, f32[10], f32[99] in the manifest)")


def test_more_than_three_shape_changes_are_cut_to_three():
    there = {"where": "/w/train.py:51", "input_shapes": ["f32[1]", "f32[2]", "f32[3]", "f32[4]", "f32[5]"]}
    assert nearest(["f32[6]", "f32[7]", "f32[8]", "f32[9]", "f32[5]"], {A: there})[1] == (
        "input 0: f32[6] here, f32[1] in the manifest; input 1: f32[7] here, f32[2] in the manifest; "
        "input 2: f32[8] here, f32[3] in the manifest (+1 more)")
    assert nearest(["f32[6]", "f32[7]", "f32[8]", "f32[4]", "f32[5]"], {A: there})[1].endswith(
        "input 2: f32[8] here, f32[3] in the manifest")


def test_the_same_shapes_point_at_a_constant_or_the_program():
    assert nearest(["f32[3]"], {A: {"where": "/w/train.py:51", "input_shapes": ["f32[3]"]}}) == (
        A, f"same input shapes as {A[:12]} of the same line: a constant or the program differs (a Python "
        "scalar 0 or 1, a branch, a loop length)")


def test_shapes_not_recorded_are_said_so_and_recorded_shapes_are_preferred():
    unknown = f"differs from {A[:12]} of the same line (input shapes not recorded)"
    for bad in (None, "f32[3]", ["f32[3]", 3]):      # absent, or not a list of strings: unknown
        assert nearest(["f32[3]"], {A: {"where": "/w/train.py:51", "input_shapes": bad}}) == (A, unknown)
    assert nearest(None, {A: {"where": "/w/train.py:51", "input_shapes": ["f32[3]"]}}) == (A, unknown)
    recorded = {"where": "/w/train.py:51", "input_shapes": ["f32[4]", "f32[5]"]}
    assert nearest(["f32[3]"], {A: {"where": "/w/train.py:51"}, B: recorded})[0] == B


def test_a_line_the_precompile_never_reached_is_named(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    graphs = {A: {"where": f"{tmp_path}/train.py:51"}, B: {"where": 7}, C: {"where": ""}}
    assert nearest(["f32[3]"], graphs, f"{tmp_path}/eval.py:51") == (
        None, "no precompiled graph comes from eval.py:51: the precompile run never reached that line")
    assert nearest(["f32[3]"], graphs, "") == (None, "")            # a graph without a call site
    assert nearest(["f32[3]"], {A: {"input_shapes": ["f32[3]"]}}) == (None, "")  # no call sites recorded


def test_graphs_of_another_compile_environment_are_not_compared():
    here, there = script("train.py"), script("train.py", device="NEURON")
    m = script_manifest(there, {A: {"where": "/w/train.py:51", "input_shapes": ["f32[3]"]}})
    assert coverage.nearest_graph("/w/train.py:51", ["f32[3]"], m, here) == (None, "")
    m.configs[coverage.fingerprint(here)] = ConfigRecord(config=here, graphs={
        B: GraphRecord(extra={"where": "/w/train.py:70", "input_shapes": ["f32[3]"]})})
    assert coverage.nearest_graph("/w/train.py:51", ["f32[3]"], m, here)[0] is None
