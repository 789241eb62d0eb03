"""The graph-stability checker: `neuron-train check-graphs`, GraphWatch and assert_graph_stable.

Each script under tests/fixtures/graphs/ plants one problem; a `# <- LABEL` comment marks the
line the report must name. Parsers are tested on outputs recorded from torch_xla 2.9 on CPU
(tests/fixtures/graphs/recorded/, see record.py there).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest

from neuron_train.graphs import causes, format_report, hlo_diff, log, process, records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.log import Frame, XlaEvent, internal_file_predicate, parse_debug_log
from neuron_train.instrument.proc import Ended
from neuron_train.instrument.runner import merge_records
from tests.conftest import FAST, NANO, ROOT, RUN_PY, cpu_env

FIXTURES = ROOT / "tests" / "fixtures" / "graphs"
RECORDED = FIXTURES / "recorded"
# The machine the recorded outputs come from kept its libraries here.
RECORDED_LIBS = internal_file_predicate(("/root/.pyenv/versions/3.11.7/lib/python3.11/",))


def check_graphs(tmp_path: Path, *command: str, options: tuple[str, ...] = (),
                 timeout: int = 600) -> tuple[int, dict, str]:
    """Run `neuron-train check-graphs OPTIONS --json FILE -- COMMAND`: exit code, report, output."""
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "check-graphs", *options,
                           "--json", str(report), "--", *command],
                          env=cpu_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert report.exists(), output
    return proc.returncode, json.loads(report.read_text()), output


def check_script(tmp_path: Path, name: str, *args: str, options: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    return check_graphs(tmp_path, sys.executable, str(FIXTURES / name), *args, options=options)


def line_of(name: str, label: str) -> str:
    """`path:line` of the line carrying `# <- LABEL` in a fixture script."""
    path = FIXTURES / name
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <- {label}"):
            return f"{path}:{n}"
    raise AssertionError(f"no line labelled {label} in {name}")


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> tuple[int, dict, str]:
    return check_script(tmp_path_factory.mktemp("clean"), "clean.py")


# ----- the command on planted scripts ---------------------------------------------------------
@pytest.mark.slow  # clean_run: check-graphs on a script, in a subprocess
def test_clean_script_is_stable(clean_run):
    code, report, output = clean_run
    assert code == 0, output
    assert report["stable"] and report["problems"] == []
    assert report["distinct_graphs"] == 1 and report["steps"] == 8
    assert report["recompiles"] == [] and report["late_graphs"] == [] and report["host_syncs"] == []
    assert report["graphs"][0]["kind"] == "warmup" and report["graphs"][0]["step"] == 1
    assert "verdict: graph-stable" in output


RECOMPILES = [
    ("ragged_batch.py", causes.NEW_INPUT_SHAPE, "LOADER", "f32[8,4] -> f32[6,4]"),
    ("nonzero.py", causes.DATA_DEPENDENT, "NONZERO", "aten::nonzero ran on the CPU"),
    ("masked_index.py", causes.DATA_DEPENDENT, "MASK", "aten::nonzero ran on the CPU"),
    ("slice_length.py", causes.SLICE_SHAPE, "SLICE", "slice (xla::select) f32[8,4] -> f32[8,5]"),
    ("lr_special_scalar.py", causes.NEW_CONSTANT, "STEP", "['lr'] = 1.0"),
    ("eval_batch_size.py", causes.NEW_INPUT_SHAPE, "EVAL_LOADER", "f32[6,4] -> f32[4,4]"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,cause,label,detail", RECOMPILES, ids=[r[0] for r in RECOMPILES])
def test_recompilation_is_reported_with_cause_and_line(tmp_path, script, cause, label, detail):
    code, report, output = check_script(tmp_path, script)
    assert code == 1, output
    assert not report["stable"]
    first = report["recompiles"][0]
    assert (first["cause"], first["where"]) == (cause, line_of(script, label)), output
    assert detail in first["detail"]
    assert first["step"] > report["warmup_steps"] and first["hash"]
    assert f"{cause} at tests/fixtures/graphs/{script}:" in output  # the text report names it too


HOST_SYNCS = [
    ("item_before_sync.py", causes.HOST_ACCESS, "ITEM", ".item()"),
    ("if_on_tensor.py", causes.VALUE_BRANCH, "IF", "Python if/bool() on a tensor"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,cause,label,what", HOST_SYNCS, ids=[h[0] for h in HOST_SYNCS])
def test_host_read_before_the_sync_is_reported_with_line(tmp_path, script, cause, label, what):
    """The extra graph compiles during warm-up; after it, it runs again every step."""
    code, report, output = check_script(tmp_path, script)
    assert code == 1, output
    assert report["recompiles"] == []
    [sync] = report["host_syncs"]
    assert (sync["cause"], sync["where"], sync["what"]) == (cause, line_of(script, label), what)
    assert sync["executes_graph"] and sync["every_step"] and sync["count"] == 4
    assert any(p.startswith(cause) for p in report["problems"])


@pytest.mark.slow
def test_a_host_read_kind_planted_in_the_cause_table_alone_is_reported_with_its_cause_and_fix(tmp_path):
    """The script adds a cause with a read kind on Tensor.__index__ to the table (nothing else: no hook, sink,
    recorder or window change); its read before the sync is named as that kind, cause and fix."""
    code, report, output = check_script(tmp_path, "planted_read_kind.py")
    assert code == 1, output
    [sync] = report["host_syncs"]
    assert (sync["kind"], sync["what"], sync["cause"], sync["fix"], sync["where"]) == (
        "index", "a tensor used as an index", "planted cause", "planted fix", line_of("planted_read_kind.py", "INDEX"))
    assert sync["executes_graph"] and sync["every_step"] and sync["count"] == 4
    assert report["problems"] == ["planted cause: a tensor used as an index at tests/fixtures/graphs/"
                                  "planted_read_kind.py:19 runs a graph before the step's sync in 4 of 4 steps "
                                  "after warm-up"], output


@pytest.mark.slow
@pytest.mark.parametrize("how", ["import", "importlib", "lazy"])
def test_a_process_that_looks_for_torch_xla_first_is_checked(tmp_path, how):
    """find_spec("torch_xla") first (transformers, accelerate), then import it in one of three ways."""
    code, report, output = check_script(tmp_path, "find_spec_first.py", how)
    assert code == 1 and "nothing was checked" not in output, output
    [ragged] = report["recompiles"]
    assert (ragged["cause"], ragged["where"]) == (causes.NEW_INPUT_SHAPE, line_of("find_spec_first.py", "LOADER"))


@pytest.mark.slow
def test_late_graph_is_kept_apart_from_recompilation(tmp_path):
    """The first evaluation is a late graph; its ragged last batch is a recompilation."""
    _, report, _ = check_script(tmp_path, "eval_batch_size.py")
    [late] = report["late_graphs"]
    assert late["cause"] == causes.NEW_CALL_SITE and late["where"] == line_of("eval_batch_size.py", "EVAL_SYNC")
    [ragged] = report["recompiles"]  # the ragged last eval batch, apart from the late graph
    assert ragged["hash"] != late["hash"] and ragged["cause"] == causes.NEW_INPUT_SHAPE
    assert ragged["where"] == line_of("eval_batch_size.py", "EVAL_LOADER")
    reads = [h for h in report["host_syncs"] if not h["executes_graph"]]
    assert reads and reads[0]["cause"] == causes.HOST_READ and not reads[0]["every_step"]


@pytest.mark.slow
def test_warmup_and_max_graphs(tmp_path):
    """lr_special_scalar compiles 2 graphs by step 4: inside a warm-up of 8 it is stable..."""
    code, report, output = check_script(tmp_path, "lr_special_scalar.py",
                                        options=("--warmup-steps", "8", "--max-graphs", "2"))
    assert code == 0 and report["stable"] and report["distinct_graphs"] == 2, output
    # ...unless it may compile only one graph.
    code, report, output = check_script(tmp_path, "lr_special_scalar.py",
                                        options=("--warmup-steps", "8", "--max-graphs", "1"))
    assert code == 1, output
    assert report["problems"] == ["2 distinct graphs compiled, more than --max-graphs 1"]


@pytest.mark.slow
def test_torchrun_processes_are_merged(tmp_path):
    code, report, output = check_graphs(
        tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(FIXTURES / "ragged_batch.py"))
    assert code == 1, output
    assert sorted(p["rank"] for p in report["processes"]) == ["0", "1"]
    assert all(p["steps"] == 6 and p["source"] == "pt_xla_debug" for p in report["processes"])
    assert report["distinct_graphs"] == 2 and report["compile_count"] == 4  # both ranks compiled both
    assert sum(g["executions"] for g in report["graphs"]) == 12  # 6 steps in each rank
    [recompile] = report["recompiles"]
    assert recompile["where"] == line_of("ragged_batch.py", "LOADER")


@pytest.mark.slow
def test_failing_command_is_not_stable(tmp_path):
    code, report, output = check_graphs(tmp_path, sys.executable, "-c",
                                        "import torch_xla; raise SystemExit(3)")
    assert code == 1, output
    assert "the command exited with code 3" in report["problems"]


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    ([], "no command given"),
    (["--", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
    (["--warmup-steps", "-1", "--", "true"], "--warmup-steps must be >= 0"),
    (["--max-graphs", "0", "--", "true"], "--max-graphs must be >= 1"),
])
def test_usage_errors(args, message):
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "check-graphs", *args],
                          env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_json_report_never_replaces_a_file(tmp_path):
    existing = tmp_path / "report.json"
    existing.write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "check-graphs", "--json", str(existing),
                           "--", "true"], env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert existing.read_text() == "keep me"


@pytest.mark.slow  # clean_run: check-graphs on a script, in a subprocess
def test_report_format(clean_run):
    """The fields docs/graphs.md documents."""
    _, report, _ = clean_run
    assert report["format"] == "neuron-train/graph-report/v1"
    assert {"command", "exit_code", "warmup_steps", "max_graphs", "steps", "distinct_graphs",
            "compile_count", "compile_time_s", "graphs", "late_graphs", "recompiles", "host_syncs",
            "fallback_ops", "processes", "problems", "stable"} <= set(report)
    assert {"hash", "phase", "step", "compile_time_s", "kind", "cause", "detail", "where", "trigger",
            "site", "inputs", "outputs", "executions"} <= set(report["graphs"][0])
    assert report["graphs"][0]["executions"] == 8
    [process] = report["processes"]
    assert process["steps"] == 8 and process["source"] == "pt_xla_debug"


# ----- the in-process API ---------------------------------------------------------------------
def run_watch(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(FIXTURES / "watch_api.py"), mode], env=cpu_env(),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_graph_watch_summary_and_hash_stability(clean_run):
    proc = run_watch("summary")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["stable"] and summary["compile_count"] == 2 and summary["compile_time_s"] > 0
    train, evaluation = summary["graphs"]
    assert (train["phase"], train["kind"], train["step"]) == ("train", "warmup", 0)
    assert (evaluation["phase"], evaluation["kind"]) == ("eval", "late")
    assert evaluation["where"] == line_of("watch_api.py", "EVAL_SYNC")
    # The same program and shapes in another process (clean.py under check-graphs): the same hash.
    assert train["hash"] == clean_run[1]["graphs"][0]["hash"]


@pytest.mark.parametrize("device,user_flags,emitters", [
    ("CPU", "", True),
    ("NEURON", "", False),                                    # only XLA's CPU backend has the flag
    ("CPU", "--xla_cpu_use_fusion_emitters=true", False),     # the user's own choice stands
])
def test_the_checkers_dump_on_cpu_takes_the_classic_emitters_out_of_torch_xlas_hash(device, user_flags, emitters):
    """torch_xla splits XLA_FLAGS at spaces and leaves `--xla_dump_to=...` out of every graph hash: the
    emitter flag rides in the dump flag's word, after a tab (XLA splits there too). The hashes that
    result are compared in test_graph_watch_summary_and_hash_stability."""
    words = process.dump_flags(Path("/d"), user_flags, {"PJRT_DEVICE": device})
    assert words.split("\t")[0] == "--xla_dump_to=/d" and " " not in words
    assert (process.CPU_EMITTERS in words) is emitters


@pytest.mark.slow
def test_graph_watch_fails_at_the_first_recompilation():
    proc = run_watch("fail")
    assert proc.returncode == 1
    assert (f"recompilation after warm-up at step 2 (train): {causes.NEW_INPUT_SHAPE} at "
            f"{line_of('watch_api.py', 'TRAIN_LOADER')}") in proc.stderr


@pytest.mark.slow
def test_assert_graph_stable_in_a_users_test():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           str(FIXTURES / "user_step_check.py")], env=cpu_env(), capture_output=True,
                          text=True, timeout=300, cwd=FIXTURES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    line = line_of("user_step_check.py", "USER_BATCH").rpartition("/")[2]  # printed relative to cwd
    assert f"step 4 (test): {causes.NEW_INPUT_SHAPE} at {line}" in proc.stdout


# ----- parsers, on recorded torch_xla output --------------------------------------------------
def test_parse_debug_log_recorded():
    text = (RECORDED / "item_before_sync.pt_xla_debug.txt").read_text()
    events, used = parse_debug_log(text)
    assert used == len(text)
    assert [e.kind for e in events[:4]] == ["compile", "execute", "compile", "execute"]
    first = events[0]
    assert first.host_access and first.graph_hash == "5e07b8595c6e03e933594e97f7e16a49"
    assert (first.inputs, first.outputs) == (4, 1)
    assert first.frames == [Frame("<module>", "/tmp/g3/exp2.py", 19)]
    assert not events[2].host_access and events[2].cause == "user torch_xla.sync"
    assert sum(e.kind == "compile" for e in events) == 2 and len(events) == 14


def test_parse_debug_log_leaves_an_unfinished_block():
    text = (RECORDED / "item_before_sync.pt_xla_debug.txt").read_text()
    cut = text.index("Graph Hash: 5ca419c5")  # inside the third block
    events, used = parse_debug_log(text[:cut])
    assert len(events) == 2 and text[used:].lstrip().startswith("Compilation Analysis: ====")


def hlo(name: str) -> hlo_diff.HloSummary:
    return hlo_diff.summarize_hlo((RECORDED / name).read_text())


def test_hlo_new_input_shape():
    why = hlo_diff.explain(hlo("ragged_batch8.hlo.txt"), hlo("ragged_batch6.hlo.txt"), RECORDED_LIBS)
    assert why.cause == hlo_diff.NEW_INPUT_SHAPE
    assert why.detail == "input 0: s64[8] -> s64[6], input 3: f32[8,4] -> f32[6,4]"
    assert why.where == "/tmp/g3/rec_ragged.py:9"  # where the batch was put on the device


def test_hlo_lines_come_from_the_warmup_graph():
    """After the warm-up the checker traces without lines: the older graph's instructions give them."""
    text = (RECORDED / "lr_one_width5.hlo.txt").read_text()
    no_lines = hlo_diff.summarize_hlo(re.sub(r' source_file="[^"]*" source_line=\d+', "", text))
    assert all(not i.where for i in no_lines.instrs)
    why = hlo_diff.explain(hlo("lr_one_width4.hlo.txt"), no_lines, RECORDED_LIBS)
    assert why.cause == hlo_diff.GRAPH_STRUCTURE and why.where == "/tmp/g3/exp3.py:12"
    text = (RECORDED / "ragged_batch6.hlo.txt").read_text()
    no_lines = hlo_diff.summarize_hlo(re.sub(r' source_file="[^"]*" source_line=\d+', "", text))
    why = hlo_diff.explain(hlo("ragged_batch8.hlo.txt"), no_lines, RECORDED_LIBS)
    assert why.cause == hlo_diff.NEW_INPUT_SHAPE and why.where == "/tmp/g3/rec_ragged.py:9"


def test_hlo_special_scalar_constant():
    why = hlo_diff.explain(hlo("lr_third_width4.hlo.txt"), hlo("lr_one_width4.hlo.txt"), RECORDED_LIBS)
    assert why.cause == hlo_diff.NEW_CONSTANT
    assert "became the constant -1" in why.detail
    assert why.where == ""  # made inside torch/optim/sgd.py: the optimizer hook names the line
    back = hlo_diff.explain(hlo("lr_one_width4.hlo.txt"), hlo("lr_third_width4.hlo.txt"), RECORDED_LIBS)
    assert back.cause == hlo_diff.NEW_CONSTANT and "left the special values" in back.detail


def test_hlo_structure_change():
    why = hlo_diff.explain(hlo("lr_one_width4.hlo.txt"), hlo("lr_one_width5.hlo.txt"), RECORDED_LIBS)
    assert why.cause == hlo_diff.GRAPH_STRUCTURE
    assert why.where == "/tmp/g3/exp3.py:12" and "f32[8,5]" in why.detail


def test_hlo_same_graph_is_unknown():
    same = hlo("ragged_batch8.hlo.txt")
    assert hlo_diff.explain(same, same, RECORDED_LIBS).cause == hlo_diff.UNKNOWN


# ----- classification (pure) ------------------------------------------------------------------
LIBS = internal_file_predicate(("/lib/",))
SYNC = Frame("sync", "/lib/torch_xla/torch_xla.py", 87)
CLEAR, STEP = (Frame("_compile", "/lib/torch_xla/torch_xla.py", 182),
               Frame("_compile", "/lib/torch_xla/torch_xla.py", 214))
ACCESS = "most likely user code trying to access tensor value before torch_xla.sync"


NOTED = ("reads", "scalars", "loaders", "batches", "refused", "dynamo")  # lists of what the hooks note


def window(step: int, *events: XlaEvent, phase: str = "train", optimizer_steps: Iterable[int] = (),
           **extra) -> records.Window:
    """A window with the hooks' records given by kind (`reads=[...]`, `scalars=[...]`, ...)."""
    noted = [note for key in NOTED for note in extra.pop(key, [])] + [records.OptimizerStep(n) for n in optimizer_steps]
    fields = dict(unlogged_compiles=0, compile_times=[], hlo={}, fallbacks={}, scalar_reads=0)
    return records.Window(step=step, is_step=True, events=[(e, phase) for e in events], phase=phase, noted=noted,
                          **{**fields, **extra})


def sync_event(kind: str, graph_hash: str, line: int, cause: str = "user torch_xla.sync",
               inner: Frame = SYNC) -> XlaEvent:
    return XlaEvent(kind=kind, cause=cause, graph_hash=graph_hash, frames=[inner, Frame("main", "/u/t.py", line)])


def ran(graph_hash: str, line: int = 10, **kw) -> list[XlaEvent]:
    """A sync at `line` that compiled `graph_hash` and ran it."""
    return [sync_event("compile", graph_hash, line, **kw), sync_event("execute", graph_hash, line, **kw)]


def run_site(analyzer: Analyzer, *graphs: str, start: int = 1, **extra) -> list[records.Graph]:
    """One step per graph at the same sync line; compiles a graph the first time it runs."""
    found = []
    for step, graph in enumerate(graphs, start):
        events = ran(graph) if graph not in analyzer.graphs else [sync_event("execute", graph, 10)]
        found += analyzer.observe(window(step, *events, **extra))
    return found


@pytest.mark.parametrize("graphs,recompiled", [
    ("AB" + "B" * 4, ""),        # the first optimizer step (state created), then the steady step
    ("ABAB" + "AB" * 3, ""),     # two graphs in turn: no new compile once both ran
    ("A" * 5 + "R" + "A" * 5 + "R", "R"),  # a ragged last batch: once per epoch, compiled once
    ("AABC", "BC"),              # warm after the first repeat: every later new graph counts
    ("ABCDE", "DE"),             # a new graph every step never repeats: warm after three
])
def test_a_call_site_is_warm_once_it_runs_a_graph_again(graphs, recompiled):
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    found = run_site(analyzer, *graphs)
    assert "".join(g.hash for g in found) == recompiled
    assert all(analyzer.graphs[g].kind == "warmup" for g in graphs[:2])


def test_a_graph_run_again_by_another_sync_warms_its_own_site():
    """Our loop's throughput clock flushes step 2's graph with its own sync: the training site is
    warm all the same, and the LR reaching exactly 1.0 at step 3 is a recompilation."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "B")
    clock = Frame("wait", "/u/clock.py", 34)
    assert analyzer.observe(window(3, sync_event("execute", "B", 50, inner=clock))) == []
    assert [g.hash for g in run_site(analyzer, "C", start=4)] == ["C"]


def test_graphs_of_an_optimizers_first_two_steps_are_warmup():
    """Gradient accumulation: micro-step F, F again (warm), then the optimizer's first two steps."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    assert run_site(analyzer, "F", "F") == []
    assert run_site(analyzer, "O", start=3, optimizer_steps=[1]) == []
    assert run_site(analyzer, "P", start=4, optimizer_steps=[2]) == []
    [late] = run_site(analyzer, "Q", start=5, optimizer_steps=[3])
    assert late.hash == "Q" and late.kind == "recompile"


def test_warmup_steps_count_every_early_graph():
    analyzer = Analyzer(warmup_steps=3, is_internal=LIBS)
    assert run_site(analyzer, "A", "A", "B") == []  # B: a warm site, but inside --warmup-steps 3
    assert [g.hash for g in run_site(analyzer, "C", start=4)] == ["C"]


def test_a_site_first_seen_when_steady_compiles_late_graphs():
    """An eval loop's accumulator (`correct = 0; correct += ...`): two graphs, neither a defect."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A")
    for step, graph in ((3, "E"), (4, "F"), (5, "F")):
        events = ran(graph, 20) if graph not in analyzer.graphs else [sync_event("execute", graph, 20)]
        assert analyzer.observe(window(step, *events, phase="eval")) == []
    assert [analyzer.graphs[g].kind for g in "AEF"] == ["warmup", "late", "late"]
    assert analyzer.graphs["E"].cause == causes.NEW_CALL_SITE and analyzer.summary().stable


def test_library_frames_tell_two_syncs_on_one_line_apart():
    """torch_xla.compile syncs twice per call (pending work, then the step), both on the user's line."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    for n in range(1, 5):
        assert analyzer.observe(window(n, *ran("S", inner=CLEAR), *ran("G", inner=STEP))) == []
    assert len(analyzer.sites) == 2 and all(site.warm for site in analyzer.sites.values())


def test_a_read_that_splits_the_step_is_reported_once():
    """`if loss > x:` first runs at step 3: its own graph, and a step graph without the forward."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A")
    read = window(3, *ran("R", 12, cause=ACCESS, inner=Frame("__bool__", "/lib/torch/_tensor.py", 1)),
                  *ran("B"), reads=[records.HostRead("bool", "/u/t.py:12", "train")])
    assert analyzer.observe(read) == []
    split = analyzer.graphs["B"]
    assert (split.kind, split.cause, split.where) == ("late", causes.VALUE_BRANCH, "/u/t.py:12")


def test_reads_in_a_step_closure_are_not_host_syncs():
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    closure = Frame("_run_step_closures", "/lib/torch_xla/core/xla_model.py", 1027)
    for n in range(1, 5):
        events = [sync_event("execute", "A", 10), sync_event("execute", "N", 30, cause=ACCESS, inner=closure)]
        analyzer.observe(window(n, *events))
    assert analyzer.summary().host_syncs == []


def summary_of_shapes(*shapes: str, outputs: tuple[str, ...] = ()) -> hlo_diff.HloSummary:
    params = [hlo_diff.Instr("parameter", s, index=i) for i, s in enumerate(shapes)]
    return hlo_diff.HloSummary(params, [hlo_diff.Instr("add", "f32[]")], list(outputs))


def test_a_new_batch_shape_names_its_dataloader_and_the_shapes_by_step():
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=48, drop_last=False, samples=1280)
    full, ragged = summary_of_shapes("f32[48,784]"), summary_of_shapes("f32[32,784]")
    analyzer.observe(window(1, *ran("A"), hlo={0: full}, loaders=[loader],
                            batches=[records.Batch("L1", ["f32[48,784]"]), records.Batch("L1", ["f32[32,784]"])]))
    run_site(analyzer, "A", "A", start=2)
    [recompile] = analyzer.observe(window(4, *ran("R"), hlo={0: ragged}))
    assert (recompile.cause, recompile.where) == (causes.NEW_INPUT_SHAPE, "/u/t.py:5")
    assert "DataLoader at /u/t.py:5 (batch_size 48, drop_last=False, 1280 samples: each pass ends " \
           "with a batch of 32)" in recompile.detail
    assert recompile.detail.endswith("input 0 by step: 1-3 f32[48,784], 4 f32[32,784]")


def test_a_collate_fn_is_named_for_the_shape_it_makes():
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    loader = records.LoaderOrigin("L1", "/u/t.py:5", batch_size=4, drop_last=False, samples=48,
                                  collate="pad", collate_where="/u/t.py:2")
    analyzer.observe(window(1, *ran("A"), hlo={0: summary_of_shapes("s64[4,32]")}, loaders=[loader],
                            batches=[records.Batch("L1", ["s64[4,32]", "s64[4,29]"])]))
    run_site(analyzer, "A", start=2)
    [recompile] = analyzer.observe(window(3, *ran("B"), hlo={0: summary_of_shapes("s64[4,29]")}))
    assert recompile.where == "/u/t.py:2" and "collate_fn pad (/u/t.py:2)" in recompile.detail


def test_an_input_made_by_a_graph_just_recompiled_follows_its_cause():
    """A slice before torch_xla.compile's step: the slice's graph changes, then the step's input."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    s8, s16 = (summary_of_shapes("s64[4,32]", outputs=("s64[4,8]",)),
               summary_of_shapes("s64[4,32]", outputs=("s64[4,16]",)))
    for n, (s, g, hlo_s, hlo_g) in enumerate([("S", "G", s8, summary_of_shapes("s64[4,8]"))] * 2 +
                                             [("T", "H", s16, summary_of_shapes("s64[4,16]"))]):
        analyzer.observe(window(2 * n + 1, *ran(s, inner=CLEAR), hlo={0: hlo_s}))
        analyzer.observe(window(2 * n + 2, *ran(g, inner=STEP), hlo={0: hlo_g}))
    slice_graph, step_graph = analyzer.graphs["T"], analyzer.graphs["H"]
    assert slice_graph.kind == step_graph.kind == "recompile"
    assert (step_graph.cause, step_graph.where) == (slice_graph.cause, slice_graph.where)
    assert len(analyzer.summary().problems) == 1


def test_an_unlogged_compile_says_why_it_has_no_hash():
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    refused = records.Refused(records.HostRead("item", "/u/t.py:9", "main"), "Unexpected execution ...")
    w = window(1, *ran("A"), refused=[refused])
    w.unlogged_compiles = 1
    analyzer.observe(w)
    summary = analyzer.summary()
    [blind] = [g for g in summary.graphs if not g.hash]
    assert blind.detail.startswith("no hash: torch_xla compiled it for the read at /u/t.py:9")
    assert "no hash: torch_xla compiled it" in format_report(summary)
    [problem] = summary.problems
    assert problem.startswith(f"{causes.HOST_ACCESS}: .item() at /u/t.py:9 inside torch_xla.compile")


def test_a_failed_commands_last_line_is_its_error():
    from neuron_train.instrument.runner import command_error

    tail = ["Traceback (most recent call last):", '  File "t.py", line 3', "ValueError: bad", "",
            "neuron-train check-graphs: note"]
    assert command_error(tail) == "ValueError: bad" and command_error([]) == ""


def test_uncaught_errors_are_printed_without_the_checkers_frames():
    from neuron_train.graphs import hooks
    from neuron_train.graphs.frames import HERE

    ours = compile("def through(f):\n    return f()\n", HERE + "stand_in.py", "exec")  # a frame "in" graphs/
    space: dict = {}
    exec(ours, space)

    def user():
        raise ValueError("the user's own error")

    try:
        space["through"](user)
    except ValueError as exc:
        tb = hooks._strip(exc, exc.__traceback__)
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert files and not any(f.startswith(HERE) for f in files) and files[-1] == __file__


def test_hooks_import_no_analyzer_or_recorder():
    """The recorder hands itself to the hooks: they never import it (or the analyzer) back."""
    import ast

    for name in ("hooks", "loaders", "frames"):
        tree = ast.parse((ROOT / "neuron_train" / "graphs" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m.endswith((".analyzer", ".recorder", ".api", ".explain"))}, name


def test_analyzer_late_graph_then_recompilation():
    analyzer = Analyzer(warmup_steps=1, is_internal=LIBS)
    assert analyzer.observe(window(1, sync_event("compile", "a", 10), sync_event("execute", "a", 10))) == []
    assert analyzer.observe(window(2, sync_event("execute", "a", 10))) == []
    late = analyzer.observe(window(3, sync_event("compile", "e", 20), sync_event("execute", "e", 20),
                                   phase="eval"))
    assert late == [] and analyzer.graphs["e"].kind == "late"
    [again] = analyzer.observe(window(4, sync_event("compile", "b", 10)))
    assert (again.kind, again.cause, again.where) == ("recompile", causes.UNKNOWN, "/u/t.py:10")
    summary = analyzer.summary()
    assert not summary.stable and len(summary.graphs) == 3


# ----- our own loop ---------------------------------------------------------------------------
@pytest.mark.slow
def test_our_multi_epoch_run_is_graph_stable(tmp_path):
    """Train + periodic eval + checkpoints + LR schedule + logging every step, 3 epochs, with the
    in-process --check-graphs on as well."""
    code, report, output = check_graphs(
        tmp_path, sys.executable, str(RUN_PY), *NANO, *FAST, "--dataset", "synthetic",
        "--synthetic-size", "192", "--batch-size", "32", "--epochs", "3", "--eval-every", "10",
        "--checkpoint-every", "15", "--log-every", "1", "--schedule", "cosine",
        "--check-graphs", "--output-dir", str(tmp_path / "run"))
    assert code == 0, output
    assert report["stable"] and report["recompiles"] == [] and report["steps"] == 18
    assert {g["phase"] for g in report["late_graphs"]} <= {"eval"}
    # every train graph is a warm-up one, all from the first two steps (the default dynamo-full path:
    # 8, forward, backward and update captured apart; lazy: 2), the eval graph the only late one;
    # docs/guide.md section 4 states these 9
    train = [g for g in report["graphs"] if g["phase"] == "train"]
    assert {g["kind"] for g in train} == {"warmup"} and max(g["step"] for g in train) <= 1, train
    assert report["distinct_graphs"] <= 9, report["graphs"]
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_dynamo_recompilations_after_the_warmup_and_the_recompile_limit_are_defects():
    """An optimizer's state appearing (step 2) is warm-up; an LR guard failing later is a defect, and
    so is dynamo giving up; graph breaks are listed, never a failure."""
    analyzer = Analyzer(0, LIBS)
    note = records.DynamoNote
    lr = "5/2: self.param_groups[0]['lr'] == 0.081"
    for step, notes in enumerate([[note("graph_break", "step (/u/t.py)", "Unsupported Tensor.backward() call",
                                        "/u/t.py:5")],
                                  [note("recompile", "step (torch/optim/sgd.py:105)", "5/0: len(self.state) == 0",
                                        "/u/t.py:7")],
                                  [note("recompile", "step (torch/optim/sgd.py:105)", lr, "/u/t.py:7")],
                                  [note("limit", "step (torch/optim/sgd.py:105)", "recompile_limit (8) reached",
                                        "/u/t.py:7")]], 1):
        analyzer.observe(window(step, *ran("g", 10) if step == 1 else [sync_event("execute", "g", 10)],
                                dynamo=notes))
    summary = analyzer.summary()
    assert [(d.cause, d.defect) for d in summary.dynamo] == [
        (causes.GRAPH_BREAK, False), (causes.DYNAMO_RECOMPILE, False), (causes.DYNAMO_RECOMPILE, True),
        (causes.DYNAMO_EAGER, True)]
    assert summary.problems == [
        f"dynamo recompilation of step (torch/optim/sgd.py:105) once, at step 3 (train): {lr} at /u/t.py:7",
        "dynamo fell back to eager of step (torch/optim/sgd.py:105) once, at step 4 (train): "
        "recompile_limit (8) reached at /u/t.py:7"]
    assert "lr=torch.tensor" in summary.dynamo[2].fix


PROCESS_KEYS = ["pid", "argv", "rank", "local_rank", "warmup_steps", "steps", "distinct_graphs", "graphs",
                "late_graphs", "recompiles", "host_syncs", "scalar_reads_after_warmup", "fallback_ops", "dynamo",
                "source", "problems", "stable", "compile_count", "compile_time_s", "input_shapes"]
REPORT_KEYS = ["format", "command", "exit_code", "killed_by", "interrupted_by", "command_tail", "warmup_steps",
               "max_graphs", "steps", "distinct_graphs", "compile_count", "compile_time_s", "graphs", "late_graphs",
               "recompiles", "host_syncs", "fallback_ops", "dynamo", "processes", "problems", "stable"]


def test_the_report_is_merged_once_typed_and_keeps_its_json_shape():
    """Two processes' records: written and read back unchanged, merged into one report whose JSON has
    the keys docs/graphs.md lists (check-graphs --json, graphs.json)."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A", "A")
    analyzer.observe(window(4, *ran("B")))  # a recompilation at the warm site
    one = replace(analyzer.summary(), pid=1, argv=["t.py"], rank="0", local_rank="0", input_shapes={"A": ["f32[2]"]})
    two = replace(one, pid=2, rank="1")
    written = json.loads(json.dumps(one.to_json()))
    assert list(written) == PROCESS_KEYS and records.GraphReport.from_json(written) == one
    merged = merge_records([one, two], ["python", "t.py"], Ended(1, tail=["ValueError: boom"]), 0, None)
    on_disk = json.loads(json.dumps(merged.to_json()))
    assert list(on_disk) == REPORT_KEYS and records.GraphReport.from_json(on_disk) == merged
    assert on_disk["distinct_graphs"] == 2 and on_disk["graphs"][0]["executions"] == 2 * one.graphs[0].executions
    assert [g["hash"] for g in on_disk["recompiles"]] == ["B"] and [p["pid"] for p in on_disk["processes"]] == [1, 2]
    assert not merged.stable and "the command exited with code 1: ValueError: boom" in merged.problems


def test_a_library_frame_is_named_package_relative_below_the_users_line():
    name = log.library_namer(("/lib/",), mechanism=("torch",))
    frames = [Frame("__bool__", "/lib/torch/_tensor.py", 1), Frame("mask", "/lib/transformers/masking_utils.py", 369),
              Frame("train", "/u/t.py", 56), Frame("run", "/lib/other/x.py", 3)]
    assert log.library_frame(frames, LIBS, name) == "transformers/masking_utils.py:369"
    assert log.library_frame(frames[2:], LIBS, name) == ""  # the user's own line comes first
    assert causes.fix_for(causes.VALUE_BRANCH, "transformers/masking_utils.py:369",
                           function="_ignore_bidirectional_mask_sdpa").startswith("transformers asks")
    assert causes.fix_for(causes.VALUE_BRANCH, "") == causes.FIXES[causes.VALUE_BRANCH]


def test_a_one_file_mechanism_module_names_nothing():
    """torch_xla 2.9 wraps xm.mark_step in typing_extensions' @deprecated: its wrapper line is not
    a library line a user can act on (it named the late graphs of aws-neuron-samples' eval)."""
    name = log.library_namer(("/lib/",), mechanism=("torch", "typing_extensions"))
    frames = [Frame("wrapper", "/lib/typing_extensions.py", 3140), Frame("eval", "/u/eval.py", 77)]
    assert name("/lib/typing_extensions.py") == "" and log.library_frame(frames, LIBS, name) == ""
    assert name("/lib/transformers.py") == "transformers.py"


# ----- the checker's own costs -----------------------------------------------------------------

def test_a_line_without_a_bracket_or_colon_is_no_slice_and_its_file_is_not_parsed(tmp_path, monkeypatch):
    from neuron_train.graphs import source

    script = tmp_path / "m.py"
    script.write_text("x = y[:, :n]\nz = f(x)\n")
    assert source.slice_at(f"{script}:1")
    monkeypatch.setattr(source, "_computed_slice_lines", lambda path: pytest.fail(f"parsed {path}"))
    assert not source.slice_at(f"{script}:2")
