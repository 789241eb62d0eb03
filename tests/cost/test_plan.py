"""`neuron-train plan` (issue 23): the estimate's model (pure), FLOPs from HLO, the calibration's
validation, bad input (one line, exit 2 for usage, nothing written), and one end-to-end run on our
loop with a tiny model, its plan.json in `report` and `--calibrate` with a bench result.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from neuron_train.cost.plan import calibrate as plan_calibrate
from neuron_train.cost.plan import data as plan_data
from neuron_train.cost.plan.hlo import hlo_figures
from neuron_train.cost.plan.model import (
    GIB,
    Calibration,
    WorkloadFigures,
    allreduce_s,
    estimate,
    rank_by_price_performance,
)
from tests.conftest import ROOT, cpu_env

REPORT_FIXTURES = ROOT / "tests" / "fixtures" / "report"
CALIB = Calibration({"train": 0.25, "infer": 0.5}, {"train": 0.2, "infer": 0.1}, "test")


def workload(**over) -> WorkloadFigures:
    base = dict(name="m", mode="train", flops_per_step=2e12, precision="bf16", bytes_per_step=1e9,
                samples_per_step=16, param_bytes=4e8, grad_bytes=4e8, optimizer_bytes=8e8, activation_bytes=1e9,
                host_input_s=0.01, loader_workers=4, execution="lazy", hlo_instructions=400, graphs_per_step=1)
    return WorkloadFigures(**{**base, **over})


def nt(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_train", "plan", *args], cwd=cwd, env=cpu_env(),
                          capture_output=True, text=True, timeout=timeout)


# --- the model (pure) ---------------------------------------------------------------------------

def test_compute_bound_step_is_flops_over_calibrated_peak_plus_ring_allreduce():
    t = plan_data.targets()["trn1.32xlarge"]
    w = workload()
    e = estimate(w, t, CALIB)
    per_core = t.chip.peak_tflops["bf16"] * 1e12 / t.chip.cores * CALIB.fraction["train"]
    compute = w.flops_per_step / per_core
    ring = 2 * (t.cores - 1) / t.cores * w.grad_bytes / (t.chip.links // 2 * t.chip.link_gb_per_s * 1e9)
    assert e.processes == 32 and e.fits
    assert e.step_s == pytest.approx(compute + ring)
    assert e.samples_per_sec == pytest.approx(16 * 32 / (compute + ring))
    assert e.bottleneck == "compute" and "device compute" in e.bottleneck_text
    assert e.band == pytest.approx((e.samples_per_sec / 1.2, e.samples_per_sec * 1.2))
    assert e.usd_per_million == pytest.approx(t.usd_per_hour / (e.samples_per_sec * 3600) * 1e6)


def test_host_input_pipeline_is_spread_over_the_workers_the_vcpus_allow():
    targets = plan_data.targets()
    w = workload(flops_per_step=1e9, host_input_s=0.8, loader_workers=4)
    small, big = estimate(w, targets["inf2.xlarge"], CALIB), estimate(w, targets["inf2.8xlarge"], CALIB)
    # inf2.xlarge: 4 vCPUs for 2 processes, each busy with its own thread -> 1 worker each;
    # inf2.8xlarge: 32 vCPUs -> the loader's 4
    assert small.bottleneck == big.bottleneck == "host_input"
    assert small.parts_s["host_input"] == pytest.approx(0.8) and big.parts_s["host_input"] == pytest.approx(0.2)
    serial = estimate(workload(flops_per_step=1e9, host_input_s=0.8, loader_workers=0), targets["inf2.8xlarge"], CALIB)
    host = targets["inf2.8xlarge"].chip.host
    rest = 400 * host.trace_s_per_instruction + host.dispatch_s
    assert "host_input" not in serial.parts_s and serial.parts_s["host_rest"] == pytest.approx(0.8 + rest)


def test_allreduce_none_for_one_process_through_memory_on_one_chip_over_links_across_chips():
    targets = plan_data.targets()
    assert allreduce_s(4e8, 1, targets["trn1.2xlarge"]) == 0
    one_chip = allreduce_s(4e8, 2, targets["trn1.2xlarge"])
    assert one_chip == pytest.approx(4e8 / (820 * GIB / 2))
    assert allreduce_s(4e8, 12, targets["inf2.24xlarge"]) > allreduce_s(4e8, 32, targets["trn1.32xlarge"]) > one_chip
    assert "allreduce" not in estimate(workload(mode="infer"), targets["inf2.xlarge"], CALIB).parts_s


def test_a_model_that_does_not_fit_says_how_much_it_needs_per_core():
    e = estimate(workload(activation_bytes=20 * GIB), plan_data.targets()["trn1.2xlarge"], CALIB)
    assert not e.fits and e.samples_per_sec is None
    assert e.note == f"does not fit in device memory: needs {e.needs_gib_per_core:.1f} GiB per NeuronCore, has 16"


def test_ranking_is_by_cost_per_sample_and_rows_without_a_figure_come_last():
    targets = plan_data.targets()
    ests = [estimate(workload(), targets[n], CALIB) for n in ("trn1.2xlarge", "inf2.xlarge", "trn1.32xlarge")]
    ests.append(estimate(workload(activation_bytes=40 * GIB), targets["inf2.8xlarge"], CALIB))
    ranked = rank_by_price_performance(ests)
    costs = [e.usd_per_million for e in ranked[:3]]
    assert costs == sorted(costs) and [e.rank for e in ranked] == [1, 2, 3, None]
    assert ranked[-1].instance_type == "inf2.8xlarge"


def test_unknown_or_untrainable_instance_types_are_refused():
    known = plan_data.targets()
    with pytest.raises(Exception, match="unknown instance type 'trn9.xlarge'"):
        plan_data.choose_targets(known, ["trn9.xlarge"], "train")
    with pytest.raises(Exception, match="inf1.xlarge cannot train"):
        plan_data.choose_targets(known, ["inf1.xlarge"], "train")
    default_train = {t.instance_type for t in plan_data.choose_targets(known, None, "train")}
    default_infer = {t.instance_type for t in plan_data.choose_targets(known, None, "infer")}
    assert {"trn1.2xlarge", "inf2.xlarge"} <= default_train and not any(n.startswith("inf1") for n in default_train)
    assert "inf1.xlarge" in default_infer and "g5.xlarge" not in default_infer


# --- FLOPs from HLO -------------------------------------------------------------------------------

HLO = """
ENTRY %IrToHlo.9 (p0.1: f32[8,16], p1.2: bf16[16,4], p2.3: f32[2,3,8,8], p3.4: f32[5,3,3,3]) -> (f32[8,4], f32[2,5,6,6]) {
  %dot.5 = bf16[8,4]{1,0} dot(bf16[8,16]{1,0} %convert.1, bf16[16,4]{1,0} %p1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %convolution.7 = f32[2,5,6,6]{3,2,1,0} convolution(f32[2,3,8,8]{3,2,1,0} %p2.3, f32[5,3,3,3]{3,2,1,0} %p3.4), window={size=3x3}, dim_labels=bf01_oi01->bf01
}
"""  # noqa: E501 (HLO text as torch_xla prints it)


def test_hlo_flops_count_dots_and_convolutions_and_the_entry_bytes():
    f = hlo_figures(HLO)
    dot = 2 * 8 * 4 * 16
    conv = 2 * (2 * 5 * 6 * 6) * (3 * 3 * 3)
    assert (f.dots, f.convolutions) == (1, 1)
    assert f.flops == dot + conv and f.flops_by_dtype == {"bf16": dot, "f32": conv}
    assert f.bytes_in == 8 * 16 * 4 + 16 * 4 * 2 + 2 * 3 * 8 * 8 * 4 + 5 * 27 * 4
    assert f.bytes_out == 8 * 4 * 4 + 2 * 5 * 36 * 4
    assert f.precision == "fp32"  # most FLOPs in f32


DUMPED = """
ENTRY %SyncTensorsGraph.9 (p0.1: f32[16,4], p1.2: f32[8,16]) -> (f32[8,4]) {
  %p1.2 = f32[8,16]{1,0} parameter(1)
  %p0.1 = f32[16,4]{1,0} parameter(0)
  ROOT %dot.3 = f32[8,4]{1,0} dot(%p1.2, %p0.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_transposed_convolution_counts_only_its_non_zero_inputs():
    """An input's gradient through a stride-16 patch embedding is a convolution over the input dilated
    16x16: counting the inserted zeros made ViT-Base's training step 1.56x its FLOPs."""
    line = ("  %convolution.9 = f32[2,3,224,224]{3,2,1,0} convolution(f32[2,768,14,14]{3,2,1,0} %g, "
            "f32[3,768,16,16]{3,2,1,0} %w), window={size=16x16 pad=15_15x15_15 lhs_dilate=16x16}, "
            "dim_labels=bf01_oi01->bf01")
    f = hlo_figures(line)
    assert f.convolutions == 1 and f.flops == 2 * (2 * 3 * 224 * 224) * (768 * 16 * 16) / (16 * 16)


def test_hlo_flops_read_operand_shapes_from_their_definitions_in_xla_dumps():
    f = hlo_figures(DUMPED)
    assert f.dots == 1 and f.flops == 2 * 8 * 4 * 16


@pytest.mark.slow
def test_hlo_flops_of_a_real_graph_agree_with_torchs_flop_counter():
    """The forward of a conv + linear model traced on the XLA device: the HLO count is torch's."""
    code = (
        "import torch, torch_xla\n"
        "from torch.utils.flop_counter import FlopCounterMode\n"
        "from neuron_train.cost.plan.hlo import hlo_figures\n"
        "m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, groups=1), torch.nn.Flatten(), "
        "torch.nn.Linear(8*30*30, 10))\n"
        "x = torch.randn(4, 3, 32, 32)\n"
        "with FlopCounterMode(display=False) as fc: m(x)\n"
        "d = torch_xla.device(); y = m.to(d)(x.to(d))\n"
        "print(fc.get_total_flops(), hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo([y])).flops)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    counted, from_hlo = map(float, proc.stdout.split()[-2:])
    assert counted > 0 and from_hlo == counted


# --- calibration and its validation ---------------------------------------------------------------

@pytest.mark.slow
def test_validation_reports_finite_errors_and_the_ranking_right_in_every_pair():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_plan.py"), "--json"], env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    f = json.loads(proc.stdout)
    # 13 encoder models at 2.16, gpt2 and gpt2-medium at 2.10/2.11/2.13/2.14 (same model and release)
    assert f["cross"]["pairs"] == 21 and f["cross"]["ranking_right"] == 21
    # every published single-node data-parallel trn1 training row (2.9-2.28), each release a row
    assert f["loo"]["train"]["rows"] == 101 and f["loo"]["infer"]["rows"] >= 28
    # the strict leave-out (host costs fitted without the architecture) is over the same rows, and the
    # inference rows outside the BERT family: GPT-2 (24 rows) and CLIP (12), ViT-Base (7), the CNNs (7)
    assert f["loo"]["train-strict"]["rows"] == 101 and f["loo"]["infer-outside-bert"]["rows"] == 50
    figures = [f["cross"]["median_abs_error"], *(f["loo"][m]["median_abs_error"] for m in ("train", "infer"))]
    assert all(math.isfinite(x) and x > 0 for x in figures)
    assert all(0 < f["fraction_of_peak"][m] < 1 for m in ("train", "infer"))
    # rows plan cannot express (TP x PP shards, multi-node) are labelled, never estimated as test rows
    refused = {r["row"] for r in f["end_to_end"]["not_expressible"]}
    assert len(f["end_to_end"]["not_expressible"]) == 64 and any("Llama2-70B" in r for r in refused)
    assert all("cores per replica" in r["why"] or "multi-node" in r["why"] for r in f["end_to_end"]["not_expressible"])
    estimated = f["end_to_end"]["each"]
    assert estimated and not refused & {r["row"] for r in estimated}
    assert {r["mode"] for r in estimated} == {"train", "infer"}
    assert all(math.isfinite(r["error"]) and r["range"][0] < r["estimate"] < r["range"][1] for r in estimated)


def test_validation_errors_come_from_the_rows(tmp_path, monkeypatch):
    """Doubling one published rate doubles that row's predicted/actual ratio when it is left out."""
    data = yaml.safe_load(plan_data.PUBLISHED_PATH.read_text())
    before = {f.row.label: e for f, e in plan_calibrate.leave_one_out(plan_calibrate.fitted_rows(), "infer")}
    row = next(r for r in data["rows"] if r["model"] == "resnet50")
    row["samples_per_sec"] *= 2
    changed = tmp_path / "published.yaml"
    changed.write_text(yaml.safe_dump(data))
    monkeypatch.setattr(plan_data, "PUBLISHED_PATH", changed)
    rows, _ = plan_data.load_published(changed)
    after = {f.row.label: e for f, e in plan_calibrate.leave_one_out(plan_calibrate.fitted_rows(rows), "infer")}
    label = "resnet50 on inf2.xlarge [2.21.0]"
    assert (1 + after[label]) == pytest.approx((1 + before[label]) / 2, rel=0.05)


def test_recalibration_matches_the_bench_and_says_how_far_off_the_first_estimate_was():
    t = plan_data.targets()["trn1.2xlarge"]
    w = workload(host_input_s=0.0, hlo_instructions=0)
    base = plan_calibrate.published_calibration()
    first = estimate(w, t, base).samples_per_sec
    calib, off, warning = plan_calibrate.recalibrated(base, w, t, first / 2, 2, "bench.json")
    assert off == pytest.approx(1.0, rel=1e-3) and warning is None  # the first estimate was twice the measurement
    assert estimate(w, t, calib).samples_per_sec == pytest.approx(first / 2, rel=1e-3)
    assert calib.fraction["infer"] == base.fraction["infer"] and "bench.json" in calib.source


def test_a_refit_at_a_bound_or_that_misses_its_own_bench_warns():
    t = plan_data.targets()["trn1.2xlarge"]
    base = plan_calibrate.published_calibration()
    w = workload(host_input_s=0.0, hlo_instructions=0)
    at_peak = predicted_rate(w, t, 1.0)
    _, _, saturated = plan_calibrate.recalibrated(base, w, t, at_peak * 1.0005, 2, "bench.json")
    assert saturated and "a bound of its range" in saturated and len(saturated.splitlines()) == 1
    # host-bound (a lazy trace far longer than the device step): no fraction of peak reproduces a fast bench
    traced = workload(host_input_s=0.0, hlo_instructions=10**6)
    calib, _, missed = plan_calibrate.recalibrated(base, traced, t, at_peak * 3, 2, "bench.json")
    assert missed and "cannot reproduce the bench on trn1.2xlarge" in missed and "host" in missed
    assert estimate(traced, t, calib).samples_per_sec < at_peak * 3


def predicted_rate(w, t, fraction):
    return plan_calibrate.predicted(w, t, fraction)


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--"], "no command given"),
    ([], "nothing to plan"),
    (["--instances", "trn9.xlarge", "--model", "vit-digits"], "unknown instance type 'trn9.xlarge'"),
    (["--instances", "inf1.xlarge", "--model", "vit-digits"], "inf1.xlarge cannot train"),
    (["--nproc-per-instance", "x", "--model", "vit-digits"], "--nproc-per-instance must be a number"),
    (["--model", "vit-digits", "--", "python", "x.py"], "train options"),
])
def test_usage_errors_are_one_line_and_exit_2(tmp_path, args, message):
    proc = nt(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def _bench_file(path: Path, **over) -> Path:
    data = json.loads((REPORT_FIXTURES / "cpu_train_vit_digits.json").read_text())
    for dotted, value in over.items():
        node = data
        *parents, key = dotted.split(".")
        for p in parents:
            node = node[p]
        node[key] = value
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
def test_calibration_files_of_another_schema_model_or_a_cpu_are_refused(tmp_path):
    other_schema = tmp_path / "other.json"
    other_schema.write_text(json.dumps({"schema": "something-else", "schema_version": 1}))
    cases = [(other_schema, "not a bench result"),
             (_bench_file(tmp_path / "cpu.json"), "give a bench result from a trn1/inf2 instance type"),
             (_bench_file(tmp_path / "model.json", **{"instance_type": "trn1.2xlarge", "device.kind": "Neuron",
                                                      "model.name": "resnet50"}), "of the same workload")]
    for path, message in cases:
        proc = nt("--calibrate", str(path), "--model", "vit-digits", "--output", str(tmp_path / "p.json"), cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_an_existing_output_is_not_overwritten(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("mine")
    proc = nt("--model", "vit-digits", "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "already exists" in proc.stderr and out.read_text() == "mine"


@pytest.mark.slow
def test_a_model_that_fits_nowhere_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "plan.json"
    proc = nt("--from-shapes", "--model", "vit_large_patch16_224", "--img-size", "224", "--batch-size", "512",
              "--dataset", "synthetic", "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and "does not fit on any instance type" in last[0] and "has 16" in last[0]
    assert not out.exists()


@pytest.mark.slow
def test_a_command_that_never_runs_a_graph_is_one_line(tmp_path):
    out = tmp_path / "plan.json"
    proc = nt("--output", str(out), "--", sys.executable, "-c", "print('hello')", cwd=tmp_path)
    assert proc.returncode == 1 and "never imported torch_xla" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.slow
def test_an_instance_type_named_twice_is_estimated_once(tmp_path):
    out = tmp_path / "plan.json"
    proc = nt("--from-shapes", "--model", "vit-nano", "--batch-size", "8", "--instances",
              "trn1.2xlarge,inf2.xlarge,trn1.2xlarge", "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(r["instance_type"] for r in json.loads(out.read_text())["results"]) == ["inf2.xlarge", "trn1.2xlarge"]


# --- end to end: our loop, report, --calibrate -----------------------------------------------------

@pytest.mark.slow
def test_plan_on_our_loop_then_report_and_calibrate(tmp_path):
    plan = tmp_path / "plan.json"
    proc = nt("--model", "vit-digits", "--batch-size", "32", "--instances", "trn1.2xlarge,inf2.xlarge,trn1.32xlarge",
              "--output", str(plan), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ESTIMATES" in proc.stdout and "estimate" in proc.stdout.splitlines()[-2]
    doc = json.loads(plan.read_text())
    assert doc["source"] == "estimated" and doc["assumptions"]
    assert {r["instance_type"] for r in doc["results"]} == {"trn1.2xlarge", "inf2.xlarge", "trn1.32xlarge"}
    assert all(r["source"] == "estimated" and r["estimate"]["bottleneck"] for r in doc["results"])
    assert doc["workload"]["flops_per_step"] > 0 and doc["workload"]["hlo_instructions"] > 0

    rep = subprocess.run([sys.executable, "-m", "neuron_train", "report", str(plan),
                          str(REPORT_FIXTURES / "cpu_train_vit_digits.json"), "--reference",
                          str(REPORT_FIXTURES / "trn1_training_data_vision_transformers.csv"), "--out",
                          str(tmp_path / "rep")], env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr
    csv_text = (tmp_path / "rep" / "report.csv").read_text()
    origins = [line.split(",")[2] for line in csv_text.splitlines()[1:] if line.startswith("Training · vit-digits")]
    assert origins.count("estimated") == 3 and "measured" in origins
    assert "ESTIMATE" in (tmp_path / "rep" / "report.md").read_text()
    assert "ESTIMATE" in (tmp_path / "rep" / "report.html").read_text()

    trn1 = next(r for r in doc["results"] if r["instance_type"] == "trn1.2xlarge")
    half = trn1["samples_per_sec"]["median"] / 2
    bench = _bench_file(tmp_path / "bench.json", **{"instance_type": "trn1.2xlarge", "device.kind": "Neuron",
                                                    "device.count": 2, "world_size": 2, "global_batch_size": 64,
                                                    "samples_per_sec.median": half, "samples_per_sec.values": [half],
                                                    "repeats": 1})
    proc = nt("--model", "vit-digits", "--batch-size", "32", "--instances", "trn1.2xlarge,inf2.xlarge",
              "--calibrate", str(bench), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the first estimate for trn1.2xlarge was +" in proc.stdout and "off the bench" in proc.stdout


def test_a_shapes_only_plan_counts_the_datasets_classes_as_the_run_would():
    """--from-shapes with --num-classes 0 (the default: the dataset's) built a timm model without a head
    (0 classes) and plan --output then refused its own plan file (issue 31, bad row 5): the head is
    counted with the dataset's classes, exactly as with --num-classes given."""
    import dataclasses

    import torch_xla

    from neuron_train.cost.plan import measure as plan_measure
    from neuron_train.training.config import RunConfig

    # autograd sizes its per-device queues at a process's first backward: this one runs on the meta
    # device, and an XLA backward later in this test process (tests/training/test_recipe.py) would then fail
    # an internal assert unless the XLA device exists first.
    torch_xla.device()
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="vit-nano", num_classes=0))
    given = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=10))  # digits: 10
    (w, details), (w10, details10) = plan_measure.from_shapes(cfg), plan_measure.from_shapes(given)
    assert cfg.data.dataset == "digits" and details["num_classes"] == details10["num_classes"] == 10
    assert (w.flops_per_step, details["parameters"]) == (w10.flops_per_step, details10["parameters"])


def test_the_memory_check_sizes_the_model_with_the_classes_the_plan_counts():
    """plan's check that a model fits this machine (`too_large`) built --num-classes 0 as 1000 classes
    while from_shapes counted the dataset's 10: both take plan_measure.model_classes now."""
    import dataclasses

    from neuron_train.cost.plan import measure as plan_measure
    from neuron_train.training.config import RunConfig

    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="vit-nano", num_classes=0))
    given = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=10))  # digits: 10
    (_, gib), (_, details) = plan_measure.too_large(cfg), plan_measure.from_shapes(cfg)
    assert plan_measure.model_classes(cfg) == plan_measure.model_classes(given) == 10
    assert gib == plan_measure.too_large(given)[1] == details["parameters"] * 16 / GIB


def test_plan_prints_its_estimates_labelled_and_warns_when_the_host_decides_the_rate():
    from neuron_train.cost.plan.model import estimate_all
    from neuron_train.cost.plan.result import format_estimates

    chosen = [plan_data.targets()[n] for n in ("trn1.2xlarge", "inf2.xlarge")]
    traced = workload()
    lines = format_estimates(traced, estimate_all(traced, chosen, CALIB, None, None), CALIB)
    assert lines[0].startswith("plan: ESTIMATES for train of m (") and "band: /1.2 to x1.2" in lines[0]
    assert lines[1].startswith("instance type") and len(lines) == 1 + 2 + 2 + 1  # header, table of 2, verdict
    assert lines[-1] == "plan: estimate: fastest trn1.2xlarge; best price-performance inf2.xlarge"
    # counted from shapes (no traced instructions) with a device step under 1 ms: an upper bound
    tiny = dict(flops_per_step=1e6, bytes_per_step=1e3, host_input_s=0.0, grad_bytes=1e3)  # a 0.1 ms step
    for w, warned in ((workload(**tiny, hlo_instructions=0), True), (workload(**tiny), False)):
        lines = format_estimates(w, estimate_all(w, chosen, CALIB, None, None), CALIB)
        assert ("these figures are an upper bound" in lines[-2]) is warned, lines


def test_processes_per_instance_are_capped_at_its_neuroncores_and_a_fit_nowhere_is_one_error():
    from neuron_train.common.errors import RunError
    from neuron_train.cost.plan.model import estimate_all

    targets = plan_data.targets()
    chosen = [targets["trn1.2xlarge"], targets["trn1.32xlarge"]]
    by_type = {e.instance_type: e.processes for e in estimate_all(workload(), chosen, CALIB, 4, None)}
    assert by_type == {"trn1.2xlarge": 2, "trn1.32xlarge": 4}
    assert {e.processes for e in estimate_all(workload(), chosen, CALIB, None, None)} == {2, 32}
    with pytest.raises(RunError, match="does not fit on any instance type estimated: needs .* has 16"):
        estimate_all(workload(activation_bytes=40 * GIB), chosen, CALIB, None, None)
