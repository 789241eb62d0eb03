"""`neuron-train plan`'s terms pinned to figures the code under test does not compute (issue 40 item 8):
each expectation is hand-computed from a published row or from the hardware table, so a changed
constant or a dropped term fails; and `--calibrate` checks the workload (issue 42): a bench of another
batch size, image size or precision is refused naming the difference, another process count is
accepted with a warning and a doubled band, and a plan never writes over its own --calibrate input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from neuron_train.common.errors import UsageError
from neuron_train.cost.plan import calibrate as plan_calibrate
from neuron_train.cost.plan import data as plan_data
from neuron_train.cost.plan.measure import compiler_precision, graphs_per_step
from neuron_train.cost.plan.model import Calibration, HostFit, estimate
from neuron_train.cost.records import BenchResult
from tests.cost.test_plan import REPORT_FIXTURES, workload

# trn1.2xlarge: one Trainium chip, 2 NeuronCores, 190 BF16 TFLOPS per chip (the hardware table)
CORE_PEAK_BF16 = 95e12


@pytest.fixture(scope="module")
def shipped() -> Calibration:
    return plan_calibrate.published_calibration()


# --- the host costs, from the published training rows --------------------------------------------

def test_the_tracing_cost_is_the_fastest_published_bert_large_step_per_counted_instruction(shipped):
    """BERT-Large Ph1 FP32, microbatch 8, 16 nodes x 32 cores, Neuron 2.28: 32,362.67 seq/s, i.e.
    512 x 8 / 32,362.67 = 0.12657 s per step, over the step's 25,521 counted instructions: 4.959 us
    (its all-reduce, once per 256 microbatches, is 0.04% of that)."""
    assert shipped.host.trace_s_per_instruction == pytest.approx(4.959e-6, rel=0.002)


def test_the_image_cost_is_what_the_clip_fine_tuning_step_leaves_after_its_trace(shipped):
    """CLIP-Base fine-tuning, microbatch 80, 32 cores, Neuron 2.18 (8.1% of peak device-only: below the
    pooled training fraction, so host-bound): 80 x 32 / 5,465.77 = 0.468372 s per step; its trace
    23,495 x 4.959 us = 0.116467 s; its ring all-reduce 2 x 31/32 x 604 MB over two 96 GB/s links =
    0.006095 s; the 80 images take the rest: 4.323 ms each (ViT-Base at 2.25, 23.8% of peak, is above
    the pooled fraction and calibrates no host cost: it would give 3.913 ms)."""
    assert shipped.host.image_s == pytest.approx(4.323e-3, rel=0.003)


def test_without_bert_large_no_published_row_shows_tracing_binding():
    """Left out with BERT-Large (the strict leave-out), the other rows are either above the pooled device
    fraction (Perceiver, ViT at 2.21/2.25) or decode images (CLIP, ViT at 2.14): the tracing cost is 0,
    not the Perceiver's 0.468 s / 26,507 instructions = 17.7 us (a device-bound step)."""
    fitted = plan_calibrate.fitted_rows()
    _, host = plan_calibrate.fit([f for f in fitted if f.row.arch != "bert-large"])
    assert host.trace_s_per_instruction == 0.0 and host.image_s > 0


def test_a_bert_large_fp32_step_on_trn1_32xlarge_is_host_bound_at_the_published_step_time(shipped):
    """The published FP32 microbatch-8 row (Neuron 2.28, 32,362.67 seq/s over 16 nodes: 2,022.7 per node):
    25,521 instructions x 4.959 us = 126.6 ms of tracing, above the device's 1.894 TFLOP at about a fifth
    of a core's 95 TFLOPS (~94 ms): 8 x 32 / 0.1267 s = 2,021 samples/s."""
    t = plan_data.targets()["trn1.32xlarge"]
    w = workload(flops_per_step=8 * 236.7e9, samples_per_step=8, hlo_instructions=25521, host_input_s=0.0,
                 loader_workers=0, grad_accumulation=256, param_bytes=1.34e9, grad_bytes=1.34e9, optimizer_bytes=2.7e9,
                 activation_bytes=0.0)
    e = estimate(w, t, shipped)
    assert e.bottleneck == "host_rest" and e.parts_s["host_rest"] == pytest.approx(0.1266 + 1e-4, rel=0.003)
    assert e.samples_per_sec == pytest.approx(2022.7, rel=0.01)


def test_the_batch_copy_to_the_device_is_in_series_with_the_compute():
    """9.5 TFLOP at half of a core's 95 TFLOPS is 0.2 s; 4 MB at the stated 4 GB/s is 1 ms more."""
    t = plan_data.targets()["trn1.2xlarge"]
    calib = Calibration({"infer": 0.5}, {"infer": 0.1}, "test")
    w = workload(mode="infer", execution="compiled", flops_per_step=9.5e12, input_bytes=4e6, grad_bytes=0.0,
                 optimizer_bytes=0.0, activation_bytes=0.0, host_input_s=0.0, bytes_per_step=1e6)
    assert estimate(w, t, calib).parts_s["compute"] == pytest.approx(0.201)
    # an LM head's logits copied back: 8 MB more at 4 GB/s is 2 ms more
    back = workload(mode="infer", execution="compiled", flops_per_step=9.5e12, input_bytes=4e6, output_bytes=8e6,
                    grad_bytes=0.0, optimizer_bytes=0.0, activation_bytes=0.0, host_input_s=0.0, bytes_per_step=1e6)
    assert estimate(back, t, calib).parts_s["compute"] == pytest.approx(0.203)


def test_one_all_reduce_per_update_is_shared_by_the_accumulated_microbatches():
    """trn1.32xlarge: 2 x 31/32 x 400 MB over two 96 GB/s links = 4.036 ms, a quarter with 4 microbatches."""
    t = plan_data.targets()["trn1.32xlarge"]
    calib = Calibration({"train": 0.5}, {"train": 0.1}, "test")
    every = estimate(workload(grad_bytes=4e8), t, calib).parts_s["allreduce"]
    fourth = estimate(workload(grad_bytes=4e8, grad_accumulation=4), t, calib).parts_s["allreduce"]
    assert every == pytest.approx(4.036e-3, rel=1e-3) and fourth == pytest.approx(4.036e-3 / 4, rel=1e-3)


def test_decoded_images_cost_the_host_what_the_calibration_says_an_image_costs():
    t = plan_data.targets()["trn1.2xlarge"]
    calib = Calibration({"train": 0.5}, {"train": 0.1}, "test", HostFit(trace_s_per_instruction=0.0, image_s=0.004))
    e = estimate(workload(flops_per_step=1e9, decoded_images=64, host_input_s=0.0, loader_workers=0), t, calib)
    assert e.bottleneck == "host_rest" and e.parts_s["host_rest"] == pytest.approx(64 * 0.004 + 1e-4)


# --- the published rows as they ran ----------------------------------------------------------------

def test_published_rows_are_expressed_as_they_ran():
    fitted = plan_calibrate.fitted_rows()
    rows, _ = plan_data.load_published()
    # the six tensor/pipeline-parallel decoder rows calibrate nothing
    assert len(fitted) == len(rows) - 6 and all(f.row.model_shards == 1 for f in fitted)
    # every published inference row of a 24- or 32-core type (xlm-roberta-base, gpt2-large at 2.10-2.22) ran
    # 2 workers (throughput x P50 latency / batch = 2.0), not one per NeuronCore
    big = [f for f in fitted if f.row.mode == "infer" and f.target.cores >= 24]
    assert len(big) == 11 and all(f.processes == 2 for f in big)
    # xlm-roberta-base's masked-LM head: each step copies 8 x 128 tokens x 250,002 f32 logits to the host
    xlm = next(f for f in fitted if f.row.model == "xlm-roberta-base" and f.row.instance_type == "trn1.32xlarge")
    assert xlm.workload.output_bytes == 1_024_008_192
    # and its FLOPs: 8 x (21,743,271,936 body + 603,979,776 attention + 2 x 128 x 768 x 250,002 head)
    assert xlm.workload.flops_per_step == 8 * (21_743_271_936 + 603_979_776 + 49_152_393_216)
    # the encoder pairs: one model at one release on both types (13 models at 2.16, gpt2 and gpt2-medium
    # at 2.10, 2.11, 2.13 and 2.14), whatever batch each table ran
    pairs = plan_calibrate.cross_predict(fitted)
    assert len(pairs) == 21 and all(p.source.row.sdk == p.target.row.sdk for p in pairs)
    one_node = next(f for f in fitted if f.row.nodes == 1 and f.row.optimizer == "AdamW" and f.row.arch == "bert-large"
                    and f.row.mode == "train")
    assert one_node.workload.grad_accumulation == 16384 // (16 * 32)
    assert one_node.workload.hlo_instructions == 25521 and one_node.workload.execution == "lazy"
    vit = next(f for f in fitted if f.row.arch == "vit-base-16" and f.row.mode == "train")
    assert vit.workload.decoded_images == vit.row.batch_per_core


def test_the_newest_release_of_each_workload_calibrates():
    rows, _ = plan_data.load_published()
    fresh = plan_data.newest(rows)
    adamw = [r for r in fresh
             if r.arch == "bert-large" and r.mode == "train" and r.nodes == 1 and r.optimizer == "AdamW"]
    assert [(r.sdk, r.samples_per_sec) for r in adamw] == [("2.28.0", 3826.6103)]


# --- what the measurement says the target runs ------------------------------------------------------

def test_only_a_dynamo_training_step_replays_two_graphs():
    assert graphs_per_step("replay", "train") == 2
    assert graphs_per_step("replay", "infer") == graphs_per_step("lazy", "train") == 1


@pytest.mark.parametrize("flags,expected", [("", "bf16"), ("--auto-cast none", "fp32"), ("--auto-cast=none", "fp32"),
                                            ("--auto-cast matmult", "bf16")])
def test_neuronx_cc_casts_matmuls_to_bf16_unless_told_not_to(flags, expected):
    assert compiler_precision(flags, "fp32") == expected


# --- --calibrate re-fits, and warns when it cannot reproduce its bench ---------------------------------

def test_a_refit_reproduces_a_convolution_bench_too(shipped):
    t = plan_data.targets()["inf2.xlarge"]
    w = workload(mode="infer", execution="compiled", conv_flops=2e12, host_input_s=0.0, grad_bytes=0.0)
    half = estimate(w, t, shipped).samples_per_sec / 2
    calib, _, warning = plan_calibrate.recalibrated(shipped, w, t, half, 2, "bench.json")
    assert warning is None and estimate(w, t, calib).samples_per_sec == pytest.approx(half, rel=1e-3)


def test_a_refit_that_misses_its_bench_by_five_percent_warns(shipped):
    t = plan_data.targets()["trn1.2xlarge"]
    traced = workload(host_input_s=0.0, hlo_instructions=10**6)     # host-bound: 4.96 s a step
    fastest = estimate(traced, t, Calibration({"train": 1.0}, {"train": 0.0}, "x", shipped.host)).samples_per_sec
    _, _, warning = plan_calibrate.recalibrated(shipped, traced, t, fastest * 1.05, 2, "bench.json")
    assert warning and "cannot reproduce the bench" in warning


# --- --calibrate checks the workload (issue 42) --------------------------------------------------------

def bench_data() -> dict:
    data = json.loads((REPORT_FIXTURES / "cpu_train_vit_digits.json").read_text())
    data.update(instance_type="trn1.2xlarge", world_size=2, global_batch_size=64)
    return data


def bench(**over) -> BenchResult:
    r = BenchResult.from_json(bench_data(), "bench.json")
    for key, value in over.items():
        if key == "img_size":
            r = dataclasses.replace(r, model=dataclasses.replace(r.model, img_size=value))
        elif key == "samples_per_sec":  # the median given, the repeats' values kept
            r = dataclasses.replace(r, samples_per_sec=dataclasses.replace(r.samples_per_sec, **value))
        else:
            r = dataclasses.replace(r, **{key: value})
    return r


@pytest.mark.parametrize("over,named", [({"batch_size_per_device": 64}, "batch size 64 per device, this plan 32"),
                                        ({"img_size": 64}, "image size 64, this plan 32"),
                                        ({"precision": "bf16-autocast"}, "precision bf16-autocast, this plan fp32")])
def test_a_bench_of_another_workload_is_refused_naming_the_difference(over, named):
    with pytest.raises(UsageError) as exc:
        plan_calibrate.check_workload(bench(**over), "bench.json", 32, 32, "fp32")
    assert named in str(exc.value) and len(str(exc.value).splitlines()) == 1


def test_a_bench_of_the_same_workload_or_of_unknown_sizes_is_accepted():
    plan_calibrate.check_workload(bench(), "bench.json", 32, 32, "fp32")
    plan_calibrate.check_workload(bench(img_size=None), "bench.json", 32, 64, None)  # unknown: not compared


def test_a_bench_of_another_process_count_is_accepted_with_a_warning_and_a_doubled_band(shipped):
    t = plan_data.targets()
    w = workload(host_input_s=0.0, hlo_instructions=0)
    rate = estimate(w, t["trn1.2xlarge"], shipped).samples_per_sec
    same, _, told = plan_calibrate.calibration(w, bench(samples_per_sec={"median": rate}), t, "bench.json")
    assert not any("warning" in line for line in told)
    one = bench(world_size=1, global_batch_size=32, samples_per_sec={"median": rate / 2})
    other, _, told = plan_calibrate.calibration(w, one, t, "bench.json")
    assert any("ran 1 process(es) on trn1.2xlarge, this plan 2" in line for line in told)
    assert other.band["train"] == pytest.approx(2 * same.band["train"])


def test_a_plan_never_writes_over_its_own_calibrate_input(tmp_path, monkeypatch):
    from neuron_train.commands import plan

    mine = tmp_path / "bench.json"
    data = bench_data()
    data["device"]["kind"] = "Neuron"
    mine.write_text(json.dumps(data))
    (tmp_path / "link.json").symlink_to(mine)
    monkeypatch.chdir(tmp_path)
    from neuron_train.cost.plan import measure as plan_measure

    monkeypatch.setattr(plan_measure, "measure_or_count", lambda *a: pytest.fail("the step was measured"))
    parser = argparse.ArgumentParser()
    plan.configure_parser(parser)
    for output in ("bench.json", str(mine), "link.json", "./sub/../bench.json"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        args = parser.parse_args(["--model", "vit-digits", "--calibrate", "bench.json", "--output", output, "--force"])
        with pytest.raises(UsageError, match="is the --calibrate input"):
            plan.main(args)
    assert json.loads(mine.read_text()) == data


def test_a_refit_far_from_the_published_fraction_warns(shipped):
    """A bench at a tenth of the estimate (as a 32-core row that ran 2 workers re-fits to ~3% of peak)."""
    t = plan_data.targets()["trn1.2xlarge"]
    w = workload(mode="infer", execution="compiled", host_input_s=0.0, grad_bytes=0.0)
    rate = estimate(w, t, shipped).samples_per_sec
    _, _, far = plan_calibrate.recalibrated(shipped, w, t, rate / 10, 2, "bench.json")
    _, _, near = plan_calibrate.recalibrated(shipped, w, t, rate / 2, 2, "bench.json")
    assert far and "far from the 36.6% the published rows achieve" in far and near is None


@pytest.mark.slow
def test_a_commands_plan_takes_the_execution_it_is_told(tmp_path):
    """`plan --execution compiled -- COMMAND`: the target dispatches a compiled graph, whatever the
    script's own loop traces (issue 40 item 8: a mutant ignoring the flag survived)."""
    import shutil
    import sys

    from tests.conftest import ROOT
    from tests.cost.test_plan import nt

    shutil.copytree(ROOT / "tests" / "fixtures" / "byos", tmp_path / "w")
    out = tmp_path / "plan.json"
    proc = nt("--instances", "trn1.2xlarge", "--execution", "compiled", "--output", str(out), "--",
              sys.executable, "mp_loader_loop.py", cwd=tmp_path / "w")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["workload"]["execution"] == "compiled"
    assert doc["results"][0]["estimate"]["parts_ms"]["host_rest"] == pytest.approx(0.1)   # one 0.1 ms dispatch
