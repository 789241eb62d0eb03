"""check-graphs, precompile and bench on the scripts teams actually run (issue 20): a Hugging Face
Trainer run, an accelerate loop and torch.compile(backend="openxla") loops, unmodified and with planted
bugs. The Trainer and accelerate scripts (tests/fixtures/scripts/) are ours; transformers and accelerate
are registry packages (the `test` extras): tiny random configurations, local random data, no download.

Each finding is asserted at its line: the user's line (`# <- LABEL`) and, inside a library, the
library's own line (package-relative, e.g. `transformers/masking_utils.py:369`) with the fix the user
can apply from their own code, checked by running the script with that fix.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_train.graphs import causes
from tests.conftest import ROOT, cpu_env
from tests.graphs.test_graphs import FIXTURES, check_graphs, check_script, line_of
from tests.instrument.test_byos import nt

pytestmark = pytest.mark.slow  # every test runs check-graphs/precompile/bench on a script: processes

SCRIPTS = ROOT / "tests" / "fixtures" / "scripts"
HF = SCRIPTS / "hf_trainer.py"
ACCELERATE = SCRIPTS / "accelerate_loop.py"


def label(path: Path, name: str) -> str:
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <- {name}"):
            return f"{path}:{n}"
    raise AssertionError(f"no line labelled {name} in {path}")


# ----- torch.compile(backend="openxla") ------------------------------------------------------------
@pytest.mark.parametrize("case", ["clean", "tensor_lr", "item_after"])
def test_a_compiled_loop_is_counted_by_its_calls_and_stable(tmp_path, case):
    """Unmodified, with the fix the report gives for a float-LR schedule (an LR tensor), and with the
    fix for a read inside the compiled step (read the returned loss after the call's sync)."""
    code, report, output = check_script(tmp_path, "dynamo_loop.py", case)
    assert code == 0, output
    assert report["steps"] >= 12  # 4 epochs of 3 compiled calls, not one "step" for the whole loop
    assert not [d for d in report["dynamo"] if d["defect"]]


@pytest.mark.slow
def test_a_read_inside_a_compiled_step_is_a_host_sync_every_step_at_the_users_line(tmp_path):
    """`.item()` inside a torch.compile(backend="openxla") step: dynamo breaks the step's graph there
    and the device is waited for mid-step, every step. Named at the user's line (not at the checker's
    own read hook, which dynamo meets when it traces the patched method)."""
    code, report, output = check_script(tmp_path, "dynamo_loop.py", "item")
    assert code == 1, output
    [read] = report["host_syncs"]
    assert (read["cause"], read["where"], read["every_step"], read["executes_graph"]) == (
        causes.COMPILED_READ, line_of("dynamo_loop.py", "ITEM"), True, True), output
    assert "return the tensor from the compiled function" in read["fix"]
    assert read["count"] >= 8  # every compiled call after the warm-up, not 0
    assert "neuron_train/graphs" not in json.dumps(report["dynamo"]), output


def dynamo_recompiles(tmp_path, case: str) -> tuple[list[dict], dict, str]:
    """A dynamo_loop.py case that fails: its dynamo recompilations past the warm-up, report, output."""
    code, report, output = check_script(tmp_path, "dynamo_loop.py", case)
    assert code == 1, output
    return [d for d in report["dynamo"] if d["cause"] == causes.DYNAMO_RECOMPILE and d["defect"]], report, output


def test_a_float_lr_schedule_under_dynamo_is_named_with_dynamos_reason(tmp_path):
    recompiles, report, output = dynamo_recompiles(tmp_path, "exponential_lr")
    step = line_of("dynamo_loop.py", "OPT_STEP")
    assert recompiles and all(d["where"] == step for d in recompiles), output
    assert "self.param_groups[0]['lr'] ==" in recompiles[0]["reason"]
    assert recompiles[0]["function"].startswith("step (torch/optim/sgd.py:")
    assert "lr=torch.tensor" in recompiles[0]["fix"]
    # the optimizer state appearing (its first guard failure) is warm-up, not a defect
    assert not any("len(self.state" in d["reason"] for d in recompiles)
    [eager] = [d for d in report["dynamo"] if d["cause"] == causes.DYNAMO_EAGER]
    assert eager["where"] == step and "recompile_limit" in eager["reason"]
    assert "dynamo recompilation of step (torch/optim/sgd.py:" in output


@pytest.mark.slow
def test_a_float_lr_written_into_param_groups_is_named_at_the_write_with_a_fix_that_survives_it(tmp_path):
    """`g["lr"] = float` before each compiled step: dynamo recompiles SGD.step on the guard; named at the
    assignment, with the fix `g["lr"].fill_(...)` on a tensor LR (a tensor LR alone does not survive the
    assignment); with that fix applied the run is stable. The first count includes them."""
    recompiles, report, output = dynamo_recompiles(tmp_path, "float_lr_write")
    assert recompiles and all(d["where"] == line_of("dynamo_loop.py", "LR_WRITE") for d in recompiles), output
    assert all('g["lr"].fill_(value)' in d["fix"] for d in recompiles)
    assert f"recompilations: {len(recompiles)} (" in output
    code, report, output = check_script(tmp_path, "dynamo_loop.py", "fill_lr")
    assert code == 0 and not report["host_syncs"], output  # dynamo's own generated code reads nothing of ours


@pytest.mark.slow
def test_a_python_int_passed_into_a_compiled_step_is_named_at_the_call(tmp_path):
    """The step number, a Python int, handed to the compiled step: dynamo guards on its value and
    recompiles every step. Named at the user's call that passes it (the graphs it makes too, whose
    logged frames end inside torch_xla); passed as a device tensor (the fix), the run is stable."""
    recompiles, report, output = dynamo_recompiles(tmp_path, "int_arg")
    call = line_of("dynamo_loop.py", "INT_ARG")
    assert recompiles and all(d["where"] == call for d in recompiles), output
    assert "as a tensor" in recompiles[0]["fix"]
    assert not [g for g in report["graphs"] if "dynamo_bridge.py" in (g["site"] or [""])[0]], output
    code, report, output = check_script(tmp_path, "dynamo_loop.py", "tensor_arg")
    assert code == 0, output


def test_a_ragged_batch_under_dynamo_is_named_at_its_loader(tmp_path):
    code, report, output = check_script(tmp_path, "dynamo_loop.py", "ragged")
    assert code == 1, output
    assert report["recompiles"], output
    for graph in report["recompiles"]:
        assert (graph["cause"], graph["where"]) == (causes.NEW_INPUT_SHAPE, line_of("dynamo_loop.py", "LOADER"))
        assert "size mismatch at index 0. expected 8, actual 6" in graph["detail"]
    assert all(g["cause"] != causes.UNKNOWN for g in report["graphs"]) and "--xla_dump_to" not in output


# ----- a loop that never syncs (timm's train.py on an XLA device) --------------------------------------
NO_SYNC = "no_sync_timm.py"


@pytest.mark.slow
def test_a_loop_that_never_syncs_is_named_with_its_growing_graph_and_the_sync_fix_passes(tmp_path):
    """A timm model trained as timm's train.py does on `--device xla`: no sync, a `loss.item()` every
    step. The step is the optimizer step; its graph grows; named at the optimizer step where the
    sync goes, with the ops by step. With `torch_xla.sync()` there (the fix) the run is stable."""
    code, report, output = check_script(tmp_path, NO_SYNC, "nosync", "24")
    assert code == 1, output
    grown = [g for g in report["recompiles"] if g["cause"] == causes.GROWING_GRAPH]
    assert grown and all(g["where"] == line_of(NO_SYNC, "OPT_STEP") for g in grown), output
    assert grown[0]["detail"].startswith("ops by step: 1: "), output
    assert "torch_xla.sync()" in grown[0]["fix"]
    assert report["steps"] >= 2, output  # optimizer steps after the first, not "0 steps"
    code, report, output = check_script(tmp_path, NO_SYNC, "sync", "24")
    assert code == 0 and not report["recompiles"], output


@pytest.mark.slow
def test_a_check_whose_process_is_killed_mid_compile_reports_what_it_saw(tmp_path):
    """The never-syncing loop's process killed while it compiles a long graph (what `timeout` and the
    SIGKILL escalation do to a process that handles a signal only after the compile): it wrote its
    record at each new graph, so the report still names the growing graph, and says the process
    ended without its final record."""
    report = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "neuron_train", "check-graphs", "--json", str(report), "--",
                             sys.executable, str(FIXTURES / NO_SYNC), "nosync", "80"], env=cpu_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, pid = [], 0
    for line in proc.stdout:
        seen.append(line)
        pid = int(line.split()[1]) if line.startswith("pid ") else pid
        if line.strip() == "step 4":  # step 3's window has ended: the growth is recorded
            os.kill(pid, signal.SIGKILL)
            break
    output = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, output
    result = json.loads(report.read_text())
    assert result["killed_by"] == "SIGKILL", output
    assert any(g["cause"] == causes.GROWING_GRAPH for g in result["recompiles"]), output
    assert any(f"process {pid} (" in p and "ended without writing its record" in p and "until step" in p
               for p in result["problems"]), output


@pytest.mark.slow
def test_inference_mode_on_xla_is_named_at_its_line_with_no_grad_as_the_fix(tmp_path):
    """timm's validate() runs under torch.inference_mode(): torch_xla fails ("Cannot set version_counter
    for inference tensor"). Named at the `with` line with torch.no_grad(), which then runs."""
    code, report, output = check_script(tmp_path, NO_SYNC, "inference_mode", "16")
    assert code == 1, output
    [named] = [p for p in report["problems"] if p.startswith("torch.inference_mode()")]
    assert f"at {line_of(NO_SYNC, 'EVAL').replace(str(ROOT) + '/', '')} " in named, named
    assert "use torch.no_grad() there" in named
    code, report, output = check_script(tmp_path, NO_SYNC, "no_grad", "16")
    assert code == 0, output


@pytest.mark.slow
def test_mark_dynamic_on_a_ragged_batch_is_named_at_its_line_and_its_fix_passes(tmp_path):
    """torch._dynamo.mark_dynamic under the openxla backend: XLA compiles per shape, dynamo refuses the
    mark (ConstraintViolationError). Named at the mark_dynamic line; without it, drop_last=True: stable."""
    code, report, output = check_script(tmp_path, "mark_dynamic.py")
    assert code == 1, output
    [named] = [p for p in report["problems"] if p.startswith("torch._dynamo.mark_dynamic")]
    assert f"at {line_of('mark_dynamic.py', 'MARK').replace(str(ROOT) + '/', '')}: " in named, named
    assert "remove mark_dynamic there" in named and "drop_last=True" in named
    code, report, output = check_script(tmp_path, "mark_dynamic.py", "fixed")
    assert code == 0, output


# ----- torch_xla eager mode ------------------------------------------------------------------------
def test_eager_mode_graphs_without_a_hash_are_explained_and_coverage_is_unknown(tmp_path):
    code, report, output = check_script(tmp_path, "eager_compile.py")
    assert code == 0, output
    unhashed = [g for g in report["graphs"] if not g["hash"]]
    assert unhashed and all("compiled by torch_xla's eager mode" in g["detail"] for g in unhashed)
    script = str(ROOT / "tests" / "fixtures" / "graphs" / "eager_compile.py")
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--", sys.executable, script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = nt(tmp_path, "check-graphs", "--compile-cache", "cc", "--", sys.executable, script)
    assert "precompile coverage unknown:" in proc.stdout and "coverage 100%" not in proc.stdout, proc.stdout


# ----- accelerate ---------------------------------------------------------------------------------
def test_an_accelerate_loop_is_stable_and_its_ragged_batch_is_named(tmp_path):
    code, report, output = check_graphs(tmp_path, sys.executable, str(ACCELERATE))
    assert code == 0 and report["distinct_graphs"] == 2, output
    code, report, output = check_graphs(tmp_path, sys.executable, str(ACCELERATE), "--samples", "30")
    assert code == 1, output
    [ragged] = report["recompiles"]
    assert (ragged["cause"], ragged["where"]) == (causes.NEW_INPUT_SHAPE, label(ACCELERATE, "LOADER"))
    assert ragged["library"].startswith("accelerate/data_loader.py:")  # accelerator.prepare re-made it
    assert "30 samples: each pass ends with a batch of 6" in ragged["detail"]
    assert "drop_last=True on the DataLoader you hand to accelerator.prepare" in ragged["fix"]


def test_an_accelerate_loop_under_torchrun_with_two_processes_is_stable(tmp_path):
    """The same clean loop in two torchrun processes (accelerate's XLA state in each): no false alarm, and
    both processes are checked (a rank whose record went missing would pass as nothing seen)."""
    code, report, output = check_graphs(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc_per_node=2", str(ACCELERATE))
    assert code == 0 and report["distinct_graphs"] == 2, output
    assert sorted(p["rank"] for p in report["processes"]) == ["0", "1"], report["processes"]
    assert not report["recompiles"] and not report["host_syncs"], output


def test_an_accelerate_loop_is_precompiled_covered_and_benched(tmp_path):
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--", sys.executable, str(ACCELERATE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = nt(tmp_path, "check-graphs", "--compile-cache", "cc", "--require-precompiled", "--",
              sys.executable, str(ACCELERATE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "precompile coverage 100% (2/2 graphs" in proc.stdout
    proc = nt(tmp_path, "bench", "--steps", "0", "--output", "b.json", "--", sys.executable, str(ACCELERATE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["batch_size_per_device"] == 8 and result["samples_per_sec"]["median"] > 0


# ----- Hugging Face Trainer ------------------------------------------------------------------------
def test_a_trainer_run_names_transformers_lines_and_the_users_line(tmp_path):
    """Unmodified Trainer on 30 samples: a ragged last batch (the Trainer's loader) and transformers'
    per-forward `padding_mask.all()`; both fixes applied from the user's code: stable."""
    code, report, output = check_graphs(tmp_path, sys.executable, str(HF), "--samples", "30",
                                        "--output-dir", str(tmp_path / "out"))
    assert code == 1 and "nothing was checked" not in output, output
    train = label(HF, "TRAIN")
    [ragged] = report["recompiles"]
    assert (ragged["cause"], ragged["where"]) == (causes.NEW_INPUT_SHAPE, train)
    assert re.fullmatch(r"transformers/trainer\.py:\d+", ragged["library"])  # where the Trainer makes its loader
    assert "dataloader_drop_last=True" in ragged["fix"]
    [mask] = [h for h in report["host_syncs"] if h["executes_graph"]]
    assert (mask["cause"], mask["where"]) == (causes.VALUE_BRANCH, train) and mask["every_step"]
    assert re.fullmatch(r"transformers/masking_utils\.py:\d+", mask["library"])
    assert "leave `attention_mask` out" in mask["fix"]
    assert "transformers/masking_utils.py:" in output and "from tests/fixtures/scripts/hf_trainer.py:" in output

    code, report, output = check_graphs(tmp_path, sys.executable, str(HF), "--samples", "30", "--drop-last",
                                        "--no-mask", "--output-dir", str(tmp_path / "out2"))
    assert code == 0, output


@pytest.mark.slow
def test_the_masking_read_on_padded_batches_gets_a_fix_that_keeps_the_mask_and_passes(tmp_path):
    """Batches padded to one fixed length (zeros in the attention mask): transformers' `padding_mask.all()`
    answers False, so the fix is not to leave the mask out but a prepared 4D mask; applied, stable."""
    command = (sys.executable, str(HF), "--padded", "--drop-last")
    code, report, output = check_graphs(tmp_path, *command, "--output-dir", str(tmp_path / "o"))
    assert code == 1, output
    [mask] = [h for h in report["host_syncs"] if h["executes_graph"]]
    assert (mask["cause"], mask["where"]) == (causes.VALUE_BRANCH, label(HF, "TRAIN")) and mask["every_step"]
    assert "keep `attention_mask`" in mask["fix"] and "4D mask" in mask["fix"], mask["fix"]
    assert "leave `attention_mask` out" not in output
    code, report, output = check_graphs(tmp_path, *command, "--mask-4d", "--output-dir", str(tmp_path / "o2"))
    assert code == 0 and not [h for h in report["host_syncs"] if h["executes_graph"]], output


@pytest.mark.slow
def test_a_trainers_dynamic_padding_is_named_at_the_collator_and_its_fix_removes_the_recompilations(tmp_path):
    """DataCollatorWithPadding pads each batch to its longest sample: named at the user's trainer.train()
    with the collator's library line (not trainer.py's) and padding="max_length"; applied, no recompilation
    is left (the masking read padded batches bring is the other test's)."""
    command = (sys.executable, str(HF), "--drop-last", "--samples", "40")
    code, report, output = check_graphs(tmp_path, *command, "--dynamic-padding", "--output-dir", str(tmp_path / "o"))
    assert code == 1, output
    found = report["recompiles"]
    assert found and all((g["cause"], g["where"]) == (causes.NEW_INPUT_SHAPE, label(HF, "TRAIN")) for g in found)
    assert all(re.fullmatch(r"transformers/data/data_collator\.py:\d+", g["library"]) for g in found), output
    assert 'padding="max_length"' in found[0]["fix"] and "DataCollatorWithPadding" in found[0]["detail"]
    code, report, output = check_graphs(tmp_path, *command, "--dynamic-padding", "max_length",
                                        "--output-dir", str(tmp_path / "o2"))
    assert report["recompiles"] == [], output
    # group_by_length (transformers 5: train_sampling_strategy): its LengthGroupedSampler makes each batch's length
    code, report, output = check_graphs(tmp_path, *command, "--dynamic-padding",
                                        "--arg", "train_sampling_strategy='group_by_length'",
                                        "--output-dir", str(tmp_path / "o3"))
    assert code == 1 and report["recompiles"], output
    assert 'train_sampling_strategy="group_by_length"' in report["recompiles"][0]["detail"], output


@pytest.mark.slow
def test_a_trainer_callbacks_read_in_every_optimizer_step_fails_and_its_fix_passes(tmp_path):
    """A TrainerCallback.on_step_end reading a fresh device value with `.item()` every optimizer step:
    named at the callback's line, counted per optimizer step; read in a step closure (the fix the
    report gives), the same run is stable."""
    command = (sys.executable, str(HF), "--no-mask", "--drop-last")
    code, report, output = check_graphs(tmp_path, *command, "--read-every-step", "--output-dir", str(tmp_path / "o"))
    assert code == 1, output
    [read] = [h for h in report["host_syncs"] if h["executes_graph"]]
    assert (read["cause"], read["where"], read["every_step"]) == (causes.HOST_ACCESS, label(HF, "READ"), True)
    assert "xm.add_step_closure" in read["fix"]
    code, report, output = check_graphs(tmp_path, *command, "--read-every-step", "closure",
                                        "--output-dir", str(tmp_path / "o2"))
    assert code == 0 and not [h for h in report["host_syncs"] if h["executes_graph"]], output


@pytest.mark.slow
def test_the_trainers_eval_loop_growing_its_outputs_is_named_with_its_fix(tmp_path):
    """Evaluation with compute_metrics (4 eval batches): transformers concatenates each batch's losses,
    logits and labels onto the last ones on the device, a new length and a new graph per batch; with
    the fix the report gives (eval_accumulation_steps=1) the same run is stable."""
    command = (sys.executable, str(HF), "--no-mask", "--epochs", "1", "--eval", "--metrics", "--eval-samples", "32")
    code, report, output = check_graphs(tmp_path, *command, "--output-dir", str(tmp_path / "out"))
    assert code == 1, output
    grown = report["recompiles"]
    assert len(grown) == 6, output  # 3 tensors x (batches 3 and 4): every longer one, no warm-up allowance
    for graph in grown:
        assert (graph["cause"], graph["where"]) == (causes.GROWING_CONCAT, label(HF, "TRAIN")), output
        assert re.fullmatch(r"transformers/trainer_pt_utils\.py:\d+", graph["library"])  # nested_concat's torch.cat
        assert "eval_accumulation_steps=1" in graph["fix"]
    assert {g["detail"].split(":")[1].strip() for g in grown} >= {"f32[8] -> f32[16]", "f32[16] -> f32[24]"}
    assert "tensor grown by concatenation at transformers/trainer_pt_utils.py:" in output

    code, report, output = check_graphs(tmp_path, *command, "--arg", "eval_accumulation_steps=1",
                                        "--output-dir", str(tmp_path / "out2"))
    assert code == 0 and not report["recompiles"], output


def test_a_trainer_run_is_precompiled_covered_and_benched(tmp_path):
    command = [sys.executable, str(HF), "--no-mask", "--output-dir", str(tmp_path / "out")]
    proc = nt(tmp_path, "precompile", "--cache-dir", "cc", "--", *command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = nt(tmp_path, "check-graphs", "--compile-cache", "cc", "--require-precompiled", "--", *command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"precompile coverage 100% \((\d+)/\1 graphs", proc.stdout), proc.stdout
    proc = nt(tmp_path, "bench", "--steps", "0", "--output", "b.json", "--", *command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "b.json").read_text())["samples_per_sec"]["median"] > 0
