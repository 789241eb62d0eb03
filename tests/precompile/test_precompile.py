"""Precompile and coverage: the graph manifest, the coverage check, the neuron_parallel_compile contract.

Pure functions are tested directly. The end-to-end tests precompile a tiny configuration on the CPU
XLA device (the graph tour) and train it for real against the manifest. neuron_parallel_compile itself
is Neuron-only: its contract is tested through a stand-in (tests/fixtures/precompile/bin, which says
so), its output through the real summary recorded in the Neuron docs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train.common import neuron_env
from neuron_train.common.errors import UsageError
from neuron_train.instrument.script import CompileSummary, parse_compile_summary
from neuron_train.precompile import cache_env, coverage, store
from neuron_train.precompile.manifest import ConfigRecord, GraphRecord, Manifest
from neuron_train.training import cache_hook
from neuron_train.training.config_io import build_config
from tests.conftest import FAST, NANO, ROOT, RUN_PY, cpu_env, graph, run_train, summary_of

FIXTURES = ROOT / "tests" / "fixtures" / "precompile"
STANDIN_BIN = FIXTURES / "bin"
# A tiny run: 3 steps, evaluated at the end. Its graph tour: the same 3 steps and one eval batch.
TRAIN = [*NANO, *FAST, "--max-steps", "3", "--eval-every", "100"]


def precompile(*args: str, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "neuron_train", "precompile", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(cmd, env=env or cpu_env(), capture_output=True, text=True, timeout=1200)


def config(**sections) -> dict:
    cfg = build_config(sections)
    return cache_hook.graph_config(cfg, world_size=1, num_classes=10, device="CPU", env={},
                           versions={"torch": "2.9.0", "torch-xla": "2.9.0"})


def manifest_with(*configs_and_hashes: tuple[dict, list[str]]) -> Manifest:
    m = Manifest()
    for conf, hashes in configs_and_hashes:
        m.configs[coverage.fingerprint(conf)] = ConfigRecord(config=conf, graphs={
            h: GraphRecord(phase="train", step=0) for h in hashes})
    return m


# ----------------------------------------------------------------------------- pure functions


def test_differences_name_the_setting_that_changed():
    here = config(train={"batch_size": 64, "precision": "bf16-autocast"})
    there = config(train={"batch_size": 32})
    assert coverage.differences(here, there) == ["batch size 64 here, 32 in the manifest",
                                           "precision bf16-autocast here, fp32 in the manifest"]
    # Data-only settings do not make another configuration.
    assert coverage.fingerprint(config(optim={"lr": 0.01})) == coverage.fingerprint(config(optim={"lr": 0.002}))
    assert coverage.fingerprint(config(data={"num_workers": 0})) == coverage.fingerprint(config())


def test_versions_and_compiler_flags_are_part_of_a_configuration():
    base = config()
    other = dict(base, versions={"torch": "2.9.0", "torch-xla": "2.8.0"}, neuron_cc_flags="--model-type=cnn-training")
    assert coverage.differences(other, base) == [
        "NEURON_CC_FLAGS --model-type=cnn-training here, (none) in the manifest",
        "torch-xla 2.8.0 here, 2.9.0 in the manifest"]


def test_the_environment_torch_xla_hashes_is_read_as_it_reads_it():
    """runtime/env_hash.cc (torch-xla 2.9): XLA_FLAGS' "--xla" words split at spaces, sorted, dump flags
    out; XLA_HLO_DEBUG / XLA_IR_DEBUG / TPU_MEGACORE raw; unset and empty alike."""
    env = {"XLA_FLAGS": "--xla_b=1  --xla_dump_to=/tmp/d --xla_a=2 --xla_dump_hlo_as_text -v",
           "XLA_HLO_DEBUG": "1", "XLA_IR_DEBUG": "", "PATH": "/bin"}
    assert neuron_env.xla_hashed_env(env) == {"XLA_FLAGS": "--xla_a=2 --xla_b=1", "XLA_HLO_DEBUG": "1"}
    # The checker's own dump joins a CPU flag to --xla_dump_to by a tab: one dump word to torch_xla.
    assert neuron_env.xla_hashed_env({"XLA_FLAGS": "--xla_dump_to=/t\t--xla_cpu_use_fusion_emitters=false"}) == {}
    assert neuron_env.xla_hashed_env({}) == {}


def hashed_config(env: dict) -> dict:
    return cache_hook.graph_config(build_config(), world_size=1, num_classes=10, device="CPU", env=env,
                                   versions={"torch": "2.9.0", "torch-xla": "2.9.0"})


def test_a_profiled_run_is_another_configuration_and_says_which_variable():
    plain, profiled = hashed_config({}), hashed_config({"XLA_HLO_DEBUG": "1", "XLA_IR_DEBUG": "1"})
    assert "xla_env" not in plain  # nothing set: the fingerprints of existing caches stay as they were
    assert coverage.fingerprint(plain) != coverage.fingerprint(profiled)
    assert coverage.differences(profiled, plain) == [
        "XLA_HLO_DEBUG=1 here, unset in the precompile run: set the same for both "
        "(torch_xla hashes it into every graph)",
        "XLA_IR_DEBUG=1 here, unset in the precompile run: set the same for both "
        "(torch_xla hashes it into every graph)"]
    flagged = hashed_config({"XLA_FLAGS": "--xla_foo=1"})
    assert coverage.differences(plain, flagged) == [
        "XLA_FLAGS unset here, --xla_foo=1 in the precompile run: set the same for both (torch_xla hashes it into "
        "every graph)"]
    # A graph precompiled without the variables covers nothing of the profiled run, and the reason names them.
    report = coverage.coverage_report([graph("h0", "train", 0)], manifest_with((plain, ["h0"])), profiled, "cc")
    assert report.coverage == 0.0 and report.explanation.startswith("XLA_HLO_DEBUG=1 here, unset in the precompile run")
    script = coverage.script_config(["python", "t.py"], device="CPU", env={"XLA_IR_DEBUG": "1"})
    assert script["xla_env"] == {"XLA_IR_DEBUG": "1"}


def test_compiler_flags_drop_the_cache_wrappers_own_flags():
    env = {"NEURON_CC_FLAGS": "--model-type=transformer --cache_dir=/var/tmp/x --retry_failed_compilation "
                              "--log_level INFO -O1"}
    assert neuron_env.compiler_flags(env) == "--model-type=transformer -O1"


def test_cache_flags_point_the_compiler_at_the_cache(tmp_path):
    flags, note = cache_env.cache_flags({"NEURON_CC_FLAGS": "-O1"}, tmp_path)
    assert flags == f"-O1 --cache_dir={tmp_path.resolve()}" and note is None
    _, note = cache_env.cache_flags({"NEURON_COMPILE_CACHE_URL": "/var/tmp/other"}, tmp_path)
    assert "overridden" in note
    same, _ = cache_env.cache_flags({"NEURON_CC_FLAGS": f"--cache_dir={tmp_path}"}, tmp_path)
    assert same == f"--cache_dir={tmp_path}"
    with pytest.raises(UsageError, match="another cache"):
        cache_env.cache_flags({"NEURON_CC_FLAGS": "--cache_dir=/var/tmp/neuron-compile-cache"}, tmp_path)


def test_train_points_the_compiler_at_the_cache_before_the_device_client_starts(tmp_path, monkeypatch, capsys):
    """NEURON_CC_FLAGS --cache_dir is in the environment when the device client starts (the runtime and
    the compiler processes it starts inherit it), not only once the loop is built after it."""
    from neuron_train import graphs
    from neuron_train.commands import train
    from neuron_train.common.cli_parser import CommandParser
    from neuron_train.training import device

    class Started(Exception):
        pass

    seen = {}

    def init_backend():  # STAND-IN for the device client's start: records what it would inherit
        seen["flags"] = os.environ.get("NEURON_CC_FLAGS")
        raise Started

    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items() if k != "NEURON_CC_FLAGS"},
                                        "NEURON_COMPILE_CACHE_URL": "/var/tmp/elsewhere"})
    monkeypatch.setattr(device, "init_backend", init_backend)
    monkeypatch.setattr(graphs, "prepare_process", lambda check: None)  # its debug files: not this test's
    parser = CommandParser(prog="neuron-train train")
    train.configure_parser(parser)
    cache = tmp_path / "cache"
    with pytest.raises(Started):
        train.main(parser.parse_args([*TRAIN, "--compile-cache", str(cache), "--output-dir", str(tmp_path / "run")]))
    assert seen["flags"] == f"--cache_dir={cache.resolve()}"
    assert "NEURON_COMPILE_CACHE_URL=/var/tmp/elsewhere is overridden" in capsys.readouterr().err  # said once


def test_coverage_full_partial_and_explained():
    a = config()
    m = manifest_with((a, ["h0", "h1", "heval"]))
    graphs = [graph("h0", "train", 0), graph("h1", "train", 1),
              graph("heval", "eval", 3)]
    full = coverage.coverage_report(graphs, m, a, "cc")
    assert full.coverage == 1.0 and full.missing == [] and full.precompiled
    b = config(train={"batch_size": 64})
    part = coverage.coverage_report([graph("x0", "train", 0), *graphs[2:]], m, b, "cc")
    assert part.coverage == 0.5 and [g.hash for g in part.missing] == ["x0"]
    assert part.explanation.startswith("batch size 64 here, 32 in the manifest")
    assert "50%" in coverage.format_coverage(part) and "batch size 64 here" in coverage.format_coverage(part)
    # Same configuration, a graph the tour never reached: said so, not blamed on a setting.
    late = coverage.coverage_report([*graphs, graph("h9", "train", 40)], m, a, "cc")
    assert "did not reach" in late.explanation


def test_a_graph_precompiled_for_other_compiler_flags_does_not_count():
    a = config()
    flagged = dict(a, neuron_cc_flags="-O2")
    m = manifest_with((flagged, ["h0"]))
    report = coverage.coverage_report([graph("h0", "train", 0)], m, a, "cc")
    assert report.coverage == 0.0 and "NEURON_CC_FLAGS (none) here, -O2 in the manifest" in report.explanation


def test_a_pruned_configuration_no_longer_counts_as_precompiled():
    a = config()
    m = manifest_with((a, ["h0"]))
    record = m.configs[coverage.fingerprint(a)]
    record.pruned_files, record.pruned_at = 2, "2026-11-21T06:00:00Z"
    report = coverage.coverage_report([graph("h0", "train", 0)], m, a, "cc")
    assert report.coverage == 0.0 and "2 of its cache files were pruned" in report.explanation


def test_coverage_without_fingerprints_is_unknown_not_perfect():
    report = coverage.coverage_report([graph("", "train", 0)], manifest_with(), config(), "cc")
    assert report.coverage is None and "unknown" in coverage.format_coverage(report)


def test_tour_steps_reach_every_step_dependent_variant():
    assert cache_hook.tour_steps(build_config({"train": {"precompile_steps": 2}})) == 3  # past the graph warm-up
    sifted = build_config({"sift": {"sift": "topk", "sift_delay": 10}})
    assert cache_hook.tour_steps(sifted) == 12  # full-batch steps before the delay, sifted ones after


def test_parse_the_real_compilation_summary():
    log = (FIXTURES / "neuron_parallel_compile_summary.log").read_text()
    assert parse_compile_summary(log) == CompileSummary(graphs=2, compiled=2, failed=0, failed_graphs=[])
    assert parse_compile_summary("no summary here") is None


def test_network_file_systems_are_flagged(tmp_path):
    nfs = f"fs-1.efs.us-east-1.amazonaws.com:/ {tmp_path} nfs4 rw,relatime 0 0\n"
    assert "one cache directory per host" in cache_env.network_fs_warning(tmp_path / "cache", nfs)
    local = f"/dev/nvme0n1p1 {tmp_path} ext4 rw 0 0\n"
    assert cache_env.network_fs_warning(tmp_path / "cache", local) is None


def test_precompile_hint_is_the_documented_command_and_parses_back_to_the_runs_config(tmp_path):
    """Value flags, on/off flags and paths with spaces: the hint, parsed by precompile's own options and
    its TRAIN_ARGS by train's, is the run's configuration without its run-only settings."""
    from dataclasses import replace

    from neuron_train.commands import precompile as precompile_command
    from neuron_train.common.cli_parser import CommandParser
    from neuron_train.training.config_io import config_from_train_args

    images, cache = tmp_path / "my images", tmp_path / "the cache"
    for split in ("train", "val"):
        (images / split / "cat").mkdir(parents=True)
    cfg = build_config({"model": {"name": "vit-nano"}, "data": {"dataset": "folder", "data_dir": str(images)},
                        "train": {"batch_size": 64, "precision": "bf16-autocast",
                                  "output_dir": str(tmp_path / "a run")},
                        "optim": {"lr": 0.02, "zero1": True}, "log": {"tensorboard": False},
                        "checkpoint": {"resume": "latest"},
                        "compile": {"compile_cache": str(cache), "require_precompiled": True}})
    hint = cache_hook.precompile_hint(cfg, cache, 2)
    words = shlex.split(hint)
    assert words[:2] == ["neuron-train", "precompile"]
    parser = CommandParser(prog="neuron-train precompile")
    precompile_command.configure_parser(parser)
    args = parser.parse_args(words[2:])
    assert (args.compile_cache, args.nproc_per_node) == (str(cache), 2)
    assert {"--no-tensorboard", "--zero1", str(images)} <= set(args.train_args)
    tour = config_from_train_args(args.train_args, prog="neuron-train precompile [options] --")
    run_only = replace(cfg, train=replace(cfg.train, output_dir=None), checkpoint=replace(cfg.checkpoint, resume=None),
                       compile=replace(cfg.compile, compile_cache=None, require_precompiled=False))
    assert tour == run_only
    assert cache_hook.graph_config(tour, world_size=2, num_classes=1, device="CPU", env={}, versions={}) == \
        cache_hook.graph_config(cfg, world_size=2, num_classes=1, device="CPU", env={}, versions={})


# ----------------------------------------------------------------------------- the command line


def command_line(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return shlex.split(lines[lines.index("command") + 1])


@pytest.mark.slow
def test_dry_run_prints_the_neuron_parallel_compile_command(tmp_path):
    cache = tmp_path / "cc"
    proc = precompile("--dry-run", "--target", "neuron", "--num-parallel", "8", "--nproc-per-node", "2",
                      "--cache-dir", str(cache), "--", "--model", "vit-digits", "--batch-size", "64",
                      "--precision", "bf16-autocast")
    assert proc.returncode == 0, proc.stderr
    argv = command_line(proc.stdout)
    env = dict(w.split("=", 1) for w in argv[1:4])
    assert argv[0] == "env" and env["NEURON_CC_FLAGS"] == f"--cache_dir={cache}"
    assert env["NEURON_PARALLEL_COMPILE_MAX_RETRIES"] == "1" and env["NEURON_TRAIN_PRECOMPILE"]
    rest = argv[4:]
    assert rest[:3] == ["neuron_parallel_compile", "--num_parallel", "8"]
    launcher = rest[3:rest.index(str(RUN_PY))]
    assert launcher[-1] == "--nproc_per_node=2" and ("torchrun" in launcher[0]
                                                     or launcher[1:3] == ["-m", "torch.distributed.run"])
    assert "--standalone" in launcher  # one node: a free rendezvous port, never a collision on 29500
    assert rest[rest.index(str(RUN_PY)) + 1:] == ["--model", "vit-digits", "--batch-size", "64", "--precision",
                                                  "bf16-autocast", "--compile-cache", str(cache)]
    assert "NEURON_EXTRACT_GRAPHS_ONLY" not in proc.stdout  # neuron_parallel_compile sets it itself
    assert "--require-precompiled" in proc.stdout.split("then train with")[1]
    assert not cache.exists()  # a dry run touches nothing


def test_dry_run_through_the_script_with_retry_failed(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts" / "precompile.sh"), "--dry-run", "--target", "cpu", "--retry-failed",
                           "--cache-dir", str(tmp_path / "cc"), "--", "--batch-size", "16"],
                          capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    argv = command_line(proc.stdout)
    assert f"NEURON_CC_FLAGS=--cache_dir={tmp_path / 'cc'} --retry_failed_compilation" in argv
    assert "NEURON_EXTRACT_GRAPHS_ONLY=1" in argv and "neuron_parallel_compile" not in argv
    assert subprocess.run(["shellcheck", str(ROOT / "scripts" / "precompile.sh")]).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("args,env,message", [
    (["--cache-dir", "/tmp/a", "--", "--compile-cache", "/tmp/b"], {}, "differ"),
    (["--", "--batch-size", "0"], {}, "--batch-size must be >= 1"),
    (["--nproc-per-node", "0", "--"], {}, "--nproc-per-node must be >= 1"),
    (["--cache-dir", "s3://bucket/cache", "--"], {}, "must be a local folder"),
    (["--cache-dir", "/tmp/a", "--"], {"NEURON_CC_FLAGS": "--cache_dir=/var/tmp/neuron-compile-cache"},
     "another cache"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, message):
    proc = precompile("--dry-run", *args, env=cpu_env(**env))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- end to end (CPU)


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory) -> Path:
    """Two precompiles of two configurations running at the same time into one cache."""
    cache = tmp_path_factory.mktemp("shared") / "cache"
    a = precompile("--target", "cpu", "--cache-dir", str(cache), "--", *TRAIN, wait=False)
    b = precompile("--target", "cpu", "--cache-dir", str(cache), "--", *TRAIN, "--grad-accum", "2", wait=False)
    for p in (a, b):
        out, err = p.communicate(timeout=1200)
        assert p.returncode == 0, out[-3000:] + err[-3000:]
        assert "precompiled  vit-nano 32px, batch 32" in out
    return cache


@pytest.mark.slow
def test_concurrent_precompiles_leave_a_valid_cache(precompiled):
    m = store.load_manifest(precompiled)
    assert len(m.configs) == 2
    for record in m.configs.values():
        phases = {g.phase for g in record.graphs.values()}
        assert {"train", "eval"} <= phases, record.graphs
        assert record.unidentified_graphs == 0
    assert m.files and all(r.recorded_by in m.configs for r in m.files.values())
    proc = subprocess.run([sys.executable, "-m", "neuron_train", "cache", "verify", "--cache-dir", str(precompiled)],
                          capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list((precompiled / store.STAGING_DIR).glob("*"))  # staging emptied into xla/


@pytest.mark.slow
def test_the_same_configuration_is_fully_covered(precompiled, tmp_path):
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, "--compile-cache", str(precompiled), "--require-precompiled")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s = summary_of(out)
    report = json.loads((out / "precompile_coverage.json").read_text())
    assert s["precompile_coverage"] == 1.0 and report["missing"] == [] and report["graphs"] >= 2, report
    assert "precompile coverage 100%" in proc.stdout


@pytest.mark.slow
def test_a_changed_batch_size_reports_the_missing_graphs_and_why(precompiled, tmp_path):
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, "--batch-size", "16", "--compile-cache", str(precompiled))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "precompile_coverage.json").read_text())
    assert summary_of(out)["precompile_coverage"] < 1.0 and report["missing"], report
    assert {g["phase"] for g in report["missing"]} >= {"train"}
    assert report["explanation"].startswith("batch size 16 here, 32 in the manifest"), report["explanation"]
    assert "batch size 16 here, 32 in the manifest" in proc.stdout


@pytest.mark.slow
def test_require_precompiled_stops_a_changed_precision_before_training(precompiled, tmp_path):
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, "--precision", "bf16-autocast", "--compile-cache", str(precompiled),
                     "--require-precompiled")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "precision bf16-autocast here, fp32 in the manifest" in proc.stderr
    assert "Precompile it first: neuron-train precompile --compile-cache" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "summary.json").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_require_precompiled_refuses_a_profiled_run_of_an_unprofiled_precompile(precompiled, tmp_path):
    """Neuron's profiler guides set XLA_HLO_DEBUG / XLA_IR_DEBUG; torch_xla hashes them into every graph."""
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, "--compile-cache", str(precompiled), "--require-precompiled",
                     env=cpu_env(XLA_HLO_DEBUG="1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "XLA_HLO_DEBUG=1 here, unset in the precompile run: set the same for both" in proc.stderr
    assert "raise --precompile-steps" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()  # refused before the first step


@pytest.mark.slow
def test_require_precompiled_refuses_world_2_on_a_cache_prewarmed_at_world_1(precompiled, tmp_path):
    """What an image pre-warmed without its process count would do to a 2-process run: refuse, saying why."""
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, "--compile-cache", str(precompiled), "--require-precompiled", nproc=2)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "world size 2 here, 1 in the manifest" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "--nproc-per-node 2" in proc.stderr + proc.stdout  # the precompile command to run
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_damaged_entry_is_never_used_silently(precompiled, tmp_path):
    cache = tmp_path / "copy"
    shutil.copytree(precompiled, cache)
    victim = sorted((cache / "xla").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    proc = run_train(tmp_path / "run", *TRAIN, "--compile-cache", str(cache))
    assert proc.returncode == 1 and "damaged" in proc.stderr and "--quarantine" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_neuron_parallel_compile_contract_through_a_stand_in(tmp_path):
    cache, record = tmp_path / "cc", tmp_path / "standin.json"
    env = cpu_env(PATH=f"{STANDIN_BIN}{os.pathsep}{os.environ['PATH']}", STANDIN_RECORD=str(record))
    proc = precompile("--target", "neuron", "--num-parallel", "2", "--cache-dir", str(cache), "--", *TRAIN, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(record.read_text())
    assert seen["options"] == {"--num_parallel": "2"}
    assert seen["command"][:2] == [sys.executable, str(RUN_PY)]
    assert seen["command"][2:] == [*TRAIN, "--compile-cache", str(cache)]
    assert seen["env"]["NEURON_CC_FLAGS"] == f"--cache_dir={cache}"
    assert seen["env"]["NEURON_PARALLEL_COMPILE_MAX_RETRIES"] == "1"
    assert "NEURON_EXTRACT_GRAPHS_ONLY" not in seen["env"]  # the tool's job, not ours
    assert "neuron_parallel_compile: 2 graphs, 2 compiled, 0 failed" in proc.stdout  # relayed summary
    m = store.load_manifest(cache)
    (record_,) = m.configs.values()
    assert seen["env"]["NEURON_TRAIN_PRECOMPILE"] in record_.precompile_ids and record_.graphs


@pytest.mark.slow
def test_a_lost_extraction_switch_is_refused_not_trained(tmp_path):
    env = cpu_env(PATH=f"{STANDIN_BIN}{os.pathsep}{os.environ['PATH']}", STANDIN_DROP_EXTRACT="1")
    proc = precompile("--target", "neuron", "--cache-dir", str(tmp_path / "cc"), "--", *TRAIN,
                      "--output-dir", str(tmp_path / "run"), env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "graph-extraction switch was lost" in proc.stdout + proc.stderr
    assert store.load_manifest(tmp_path / "cc").configs == {}


@pytest.mark.neuron
def test_precompile_then_train_on_neuron_compiles_nothing_new(tmp_path):
    """On a trn1/inf2 host: the real run after a real neuron_parallel_compile is fully covered."""
    cache = tmp_path / "cc"
    proc = precompile("--cache-dir", str(cache), "--", *TRAIN, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(e.state == store.COMPILED for e in store.scan(cache))
    out = tmp_path / "run"
    env = dict(os.environ, NEURON_CC_FLAGS=f"--cache_dir={cache}")
    run = subprocess.run([sys.executable, str(RUN_PY), "--output-dir", str(out), *TRAIN, "--compile-cache",
                          str(cache), "--require-precompiled"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert summary_of(out)["precompile_coverage"] == 1.0


@pytest.mark.slow
def test_require_precompiled_stops_at_the_first_graph_the_tour_missed(precompiled, tmp_path):
    """Same configuration, but the manifest lacks the train step's last graph (a tour that stopped short).
    Dropped from both configurations: a graph the --grad-accum 2 tour also compiled covers this one too
    (coverage.covering_hashes), and the captured step's 1 / accum reaches its backward as data."""
    cache = tmp_path / "copy"
    shutil.copytree(precompiled, cache)
    fp = next(fp for fp, r in store.load_manifest(cache).configs.items() if r.config["grad_accum"] == 1)
    dropped: list[int | None] = []

    def drop_last_train_graph(m):
        graphs = m.configs[fp].graphs
        last = [h for h, g in graphs.items() if g.phase == "train"][-1]
        dropped.append(graphs[last].step)
        for record in m.configs.values():
            record.graphs.pop(last, None)

    store.update_manifest(cache, drop_last_train_graph)
    out = tmp_path / "run"
    proc = run_train(out, *TRAIN, "--max-steps", "8", "--log-every", "1", "--compile-cache", str(cache),
                     "--require-precompiled")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"(train, step {dropped[0]})" in proc.stderr and "did not reach" in proc.stderr, proc.stderr[-2000:]
    steps_logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
                    if json.loads(line)["kind"] == "train"]
    assert max(steps_logged, default=0) < 7  # stopped at the graph, not at the end of the run
    assert not (out / "summary.json").exists()
