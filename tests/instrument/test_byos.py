"""Bring your own script (issue 14): precompile, coverage and bench for any PyTorch/XLA command.

The pure parts (the stop rule, steady-state figures, per-graph differences) and bad input (one
clear line, exit 2 usage / 1 failed run, nothing half-written in the cache). The same commands on
real third-party scripts: tests/instrument/test_byos_corpus.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train.common.errors import RunError
from neuron_train.cost.bench import script_bench
from neuron_train.cost.script_figures import figures
from neuron_train.instrument.probe import ProbeRecord
from neuron_train.instrument.script import ScriptRun
from neuron_train.instrument.steps import StepWindow, fold
from neuron_train.precompile import coverage, store
from neuron_train.precompile.manifest import ConfigRecord, FileRecord, GraphRecord, Manifest
from tests.conftest import cpu_env, graph


def nt(cwd: Path, *argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_train", *argv], env=cpu_env(AWS_EC2_METADATA_DISABLED="true"),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def windows(*spec: tuple[str, int], dt: float = 0.1) -> list[StepWindow]:
    """Step windows from (call site, graphs compiled) pairs, `dt` seconds apart."""
    return [StepWindow(i + 1, i * dt, site, compiled, [32, 784]) for i, (site, compiled) in enumerate(spec)]


# ----- the stop rule and the steady state (pure) --------------------------------------------------
def test_tour_waits_for_every_call_site_to_run_twice_without_compiling():
    # AdamW-like step: its first two windows compile (state created at step 1), then it is steady.
    sites = fold(windows(("step", 1), ("step", 1), ("step", 0)))
    assert not sites.tour_complete(steps=2)
    sites = fold(windows(("step", 1), ("step", 1), ("step", 0), ("step", 0)))
    assert sites.tour_complete(steps=2) and not sites.tour_complete(steps=5)
    # A site that compiles at every visit is never warm: the tour runs on (to the script's end).
    assert not fold(windows(*[("step", 1)] * 10)).tour_complete(steps=2)


def test_a_call_site_seen_once_holds_the_tour_until_it_could_recur():
    setup = [("setup", 1)]                                  # seen once at the start: never holds
    assert fold(windows(*setup, *[("step", 0)] * 3)).tour_complete(steps=3)
    # An evaluation at the end of a 4-step epoch (window 4): held until window 8, when a second
    # epoch's evaluation would have come.
    epoch = [("step", 1), ("step", 0), ("step", 0), ("step", 0)]
    seen = windows(*epoch, ("eval", 1), ("step", 0), ("step", 0))
    assert not fold(seen).tour_complete(steps=2)
    assert fold(windows(*epoch, ("eval", 1), *[("step", 0)] * 4)).tour_complete(steps=2)


def test_steady_intervals_leave_out_warm_up_compiles_and_other_call_sites():
    ws = windows(("step", 1), ("step", 0), ("step", 0), ("step", 0), ("eval", 1), ("step", 0), ("step", 1),
                 ("step", 0), ("step", 0), ("step", 0))
    site, state = fold(ws).main_site()
    # An interval counts between two windows of the step's site that both compiled nothing: 1 follows
    # a compile, 4 is the evaluation, 5 follows it, 6 compiles, 7 follows that compile.
    assert site == "step" and [i for i, _ in state.steady] == [2, 3, 8, 9]
    assert all(abs(sec - 0.1) < 1e-9 for _, sec in state.steady)
    assert fold(ws).stop_reason("bench", 4) == "bench" and fold(ws).stop_reason("bench", 5) is None


def probe_record(intervals: list[float], batch: list[int] | None) -> ProbeRecord:
    t, ws = 0.0, []
    for i, dt in enumerate([1.0, 0.5, 0.5, *intervals]):
        t += dt
        ws.append(StepWindow(i + 1, t, "train.py:51", int(i == 0), batch))
    return ProbeRecord(1, "bench", 4, ws, parameters=1234, device="CPU", compiles=1, compile_time_s=2.5)


def test_bench_figures_come_from_the_steady_intervals_and_the_batch_copied_each_step():
    run = ScriptRun(["python", "train.py"], 0, [], [probe_record([0.02, 0.04, 0.03, 0.03], [16, 3, 32, 32])], "")
    f = figures(run, None)
    # steady: every interval between two windows that compiled nothing (not the first, after the compile)
    assert f.samples_per_step == 16 and f.batch_source == "input batch"
    assert f.measured_steps == 5 and f.step_time_ms == pytest.approx(30.0)
    assert f.samples_per_sec == pytest.approx(16 * 5 / (0.5 + 0.02 + 0.04 + 0.03 + 0.03))
    assert f.compile_time_s == 2.5 and f.graph_count == 1 and f.warmup_steps == 1
    workload = script_bench.script_workload(run.command, f, name=None, train_samples=None)
    assert (workload.model, workload.img_size, workload.num_classes) == ("train.py", 32, None)
    assert figures(run, 64).samples_per_step == 64  # --samples-per-step wins


def test_bench_refuses_a_run_it_cannot_measure():
    few = ScriptRun(["python", "t.py"], 0, [], [probe_record([0.1], [8, 4])], "")
    with pytest.raises(RunError, match="only 2 steady step"):
        figures(few, None)
    on_device = ScriptRun(["python", "t.py"], 0, [], [probe_record([0.1] * 5, None)], "")
    with pytest.raises(RunError, match="--samples-per-step"):
        figures(on_device, None)


# ----- per-graph coverage (pure) --------------------------------------------------------------------
def script_manifest(config: dict, graphs: dict[str, dict]) -> Manifest:
    fp = coverage.fingerprint(config)
    return Manifest(configs={fp: ConfigRecord(config=config, graphs={
        h: GraphRecord(phase="steady", step=1, extra=extra) for h, extra in graphs.items()})})


def test_a_missing_graph_is_compared_with_the_precompiled_graph_of_its_line():
    config = coverage.script_config(["python", "train.py"], device="CPU", env={})
    first = ["f32[10]", "f32[32,784]", "s64[32]"]          # the first step (no optimizer state yet)
    steady = [*first, "f32[10]"]
    manifest = script_manifest(config, {"g1": {"where": "/a/train.py:51", "input_shapes": first},
                                        "g2": {"where": "/a/train.py:51", "input_shapes": steady},
                                        "e1": {"where": "/a/train.py:70", "input_shapes": ["f32[3]"]}})
    here = [graph("n1", "first step", 1, "/b/train.py:51"), graph("g2", "steady", 2, "/a/train.py:51"),
            graph("n3", "late", 40, "/a/train.py:99")]
    shapes = {"n1": ["f32[10]", "f32[16,784]", "s64[16]"], "g2": steady, "n3": ["f32[3]"]}
    report = coverage.coverage_report(here, manifest, config, "cc", shapes=shapes)
    assert (report.covered, report.graphs) == (1, 3)
    by_hash = {m.hash: m for m in report.missing}
    assert by_hash["n1"].nearest == "g1"  # same line (moved folder), same number of inputs
    assert by_hash["n1"].difference == ("input 1: f32[16,784] here, f32[32,784] in the manifest; "
                                           "input 2: s64[16] here, s64[32] in the manifest")
    assert "never reached that line" in by_hash["n3"].difference
    assert report.explanation.startswith("this command line was precompiled, but the script compiled "
                                            "other graphs at lines its tour reached")
    text = coverage.format_coverage(report)
    assert text.startswith("precompile coverage 33% (1/3 graphs in cc/manifest.json)")
    assert "not precompiled: n1 at /b/train.py:51 (first step, step 1): input 1: f32[16,784] here" in text


def test_a_graph_without_a_hash_makes_coverage_unknown_never_100_percent():
    """Eager mode's per-op compiles have no hash: the graphs with one all being covered is not 100%."""
    config = coverage.script_config(["python", "train.py"], device="CPU", env={})
    manifest = script_manifest(config, {"g1": {"where": "/a/train.py:51", "input_shapes": ["f32[3]"]}})
    here = [graph("g1", "main", 1, "/a/train.py:51"), graph("", "main", 1)]
    report = coverage.coverage_report(here, manifest, config, "cc")
    assert report.coverage is None and report.unidentified == 1
    assert coverage.format_coverage(report) == ("precompile coverage unknown: 1 graph(s) compiled without a "
                                                "fingerprint (graph hashes unavailable); of the 1 with one, "
                                                "1 in cc/manifest.json")


def test_another_command_line_is_named_option_by_option():
    here = coverage.script_config(["python", "t.py", "--batch_size", "16", "--fake_data"], device="CPU", env={})
    there = coverage.script_config(["python", "t.py", "--batch_size", "32"], device="CPU", env={})
    manifest = script_manifest(there, {"g": {"where": "t.py:1"}})
    assert coverage.explain(manifest, here, "cc") == (
        f"--batch_size 16 here, 32 in the manifest; --fake_data given here, not given in the manifest "
        f"(compared with precompiled configuration {coverage.fingerprint(there)})")


# ----- bad input: one line, exit 2 (usage) or 1 (failed run), nothing half-written -------------------
def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("neuron-train")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("argv, code, words", [
    (["precompile", "--cache-dir", "cc", "--", "no-such-program", "x.py"], 2, "command not found: no-such-program"),
    (["precompile", "--nproc-per-node", "2", "--", "python", "x.py"], 2, "a COMMAND starts its own processes"),
    (["precompile", "--steps", "3", "--", "--precompile-steps", "2"], 2, "keep one"),
    (["check-graphs", "--require-precompiled", "--", "python", "x.py"], 2, "needs --compile-cache DIR"),
    (["check-graphs", "--compile-cache", "empty", "--", "python", "x.py"], 2, "holds no manifest.json"),
    (["bench", "--output", "r.json", "--"], 2, "no command given"),
    (["bench", "--output", "r.json"], 2, "--mode train|infer is required"),
    (["bench", "--output", "r.json", "--model", "vit-nano", "--", "python", "x.py"], 2, "drop them"),
    (["bench", "--output", "r.json", "--nproc", "2", "--", "python", "x.py"], 2, "starts its own"),
])
def test_usage_errors_are_one_line(tmp_path, argv, code, words):
    (tmp_path / "empty").mkdir()
    proc = nt(tmp_path, *argv)
    assert proc.returncode == code and words in one_line_error(proc)
    assert not (tmp_path / "cc").exists() and not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_steps_is_the_same_flag_for_our_loop_and_for_a_script(tmp_path):
    loop = nt(tmp_path, "precompile", "--dry-run", "--steps", "3", "--cache-dir", "cc", "--", "--model", "vit-nano")
    assert loop.returncode == 0 and "--precompile-steps 3" in loop.stdout, loop.stderr
    script = nt(tmp_path, "precompile", "--dry-run", "--steps", "0", "--cache-dir", "cc", "--", "python", "t.py")
    assert script.returncode == 0 and "tour stops   at the command's own end (--steps 0)" in script.stdout
    assert not (tmp_path / "cc").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_a_manifest_from_another_cache_is_refused_before_the_command_runs(tmp_path):
    cache = tmp_path / "copied"
    record = FileRecord(sha256="0" * 64, size=10, recorded="2026-01-01T00:00:00Z", recorded_by="abc")

    def add(m: Manifest) -> None:
        m.configs["abc"] = ConfigRecord(config=coverage.script_config(["python", "t.py"], device="CPU", env={}),
                                        graphs={"h": GraphRecord(phase="steady")})
        m.files["xla/123"] = record

    store.update_manifest(cache, add)
    before = (cache / store.MANIFEST).read_bytes()
    proc = nt(tmp_path, "check-graphs", "--compile-cache", str(cache), "--", sys.executable, "-c",
              "open('ran', 'w')")
    assert proc.returncode == 1
    assert "copied from another cache" in one_line_error(proc)
    assert not (tmp_path / "ran").exists() and (cache / store.MANIFEST).read_bytes() == before


@pytest.mark.slow
def test_a_command_that_never_touches_torch_xla_records_nothing(tmp_path):
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--", sys.executable, "-c", "print('hello')")
    assert proc.returncode == 1 and "never imported torch_xla" in one_line_error(proc)
    assert not (tmp_path / "cc" / store.MANIFEST).exists()
    proc = nt(tmp_path, "bench", "--output", "r.json", "--", sys.executable, "-c", "print('hello')")
    assert proc.returncode == 1 and "never imported torch_xla" in one_line_error(proc)
    assert not (tmp_path / "r.json").exists()


CRASHING = """
import torch, torch_xla
dev = torch_xla.device()
w = torch.zeros(4, device=dev)
for step in range(100):
    w = w + torch.ones(4, device=dev) * step
    torch_xla.sync()
    if step == 3:
        raise RuntimeError("the data file is truncated at record 4")
"""


@pytest.mark.slow
def test_a_script_that_crashes_mid_tour_leaves_the_cache_untouched(tmp_path):
    (tmp_path / "crash.py").write_text(CRASHING)
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--steps", "50", "--", sys.executable, "crash.py")
    line = one_line_error(proc)
    assert proc.returncode == 1
    assert "failed (exit code 1) at step 4" in line and "the data file is truncated at record 4" in line
    assert "nothing was recorded" in line
    cache = tmp_path / "cc"
    assert not (cache / store.MANIFEST).exists()
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".neuron_train")]


def test_the_stop_ends_the_processes_below_it_deepest_first():
    from neuron_train.instrument.proc import descendants

    parents = {10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 99}
    assert descendants(10, parents) == [11, 12, 13]
    assert descendants(13, parents) == []
