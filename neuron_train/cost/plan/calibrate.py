"""Calibration of `neuron-train plan`: the achieved fraction of peak compute, fitted on the
published Neuron rows (or re-fitted on one real bench result), and the calibration's own error:
leave-one-out over the published rows, and trn1.2xlarge -> inf2.xlarge cross-prediction on the
encoder pairs, with the price-performance ranking of each pair (docs/plan.md).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from neuron_train.common import reader
from neuron_train.common.errors import UsageError
from neuron_train.cost.plan.data import (
    PublishedRow,
    load_published,
    newest,
    processes,
    published_workload,
    targets,
)
from neuron_train.cost.plan.model import (
    Calibration,
    HostFit,
    Target,
    WorkloadFigures,
    allreduce_s,
    estimate,
)
from neuron_train.cost.records import BenchResult
from neuron_train.cost.schema import RESULT_LIMIT

MODES = ("train", "infer")
BAND_PERCENTILE = 0.8     # the error band: 4 in 5 published rows, left out, fell within it


def predicted(w: WorkloadFigures, t: Target, fraction: float, processes: int | None = None,
              host: HostFit | None = None) -> float:
    """Samples/s the model predicts at this fraction of peak (the real estimate, no band)."""
    calib = Calibration({w.mode: fraction}, {w.mode: 0.0}, "fit", host)
    return estimate(w, t, calib, processes).samples_per_sec or 0.0


def fit_fraction(w: WorkloadFigures, t: Target, measured: float, processes: int | None = None,
                 host: HostFit | None = None) -> float:
    """The fraction of peak at which the estimate matches a measured rate (bisection in log space;
    1.0 when even the full peak is too slow: the row is then bound elsewhere, e.g. memory or host)."""
    low, high = FIT_BOUNDS
    if predicted(w, t, high, processes, host) <= measured:
        return high
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if predicted(w, t, mid, processes, host) < measured else (low, mid)
    return math.sqrt(low * high)


# A training row's fraction of peak as if the device were all its step (no host term): a lower bound.
DEVICE_ONLY = HostFit(trace_s_per_instruction=0.0, image_s=0.0)


@dataclass(frozen=True)
class Fitted:
    row: PublishedRow
    workload: WorkloadFigures
    target: Target
    fraction: float
    processes: int

    def rate(self, fraction: float, host: HostFit | None = None) -> float:
        return predicted(self.workload, self.target, fraction, self.processes, host) * self.row.nodes

    @property
    def step_s(self) -> float:
        """The published step time of one process (samples per step x processes x nodes / the rate)."""
        return self.workload.samples_per_step * self.processes * self.row.nodes / self.row.samples_per_sec


def fitted_rows(rows: list[PublishedRow] | None = None) -> list[Fitted]:
    """Each data-parallel published row with the fraction of peak it achieved. A row whose model replica
    spans several cores (tensor / pipeline parallel) is not what plan estimates: it calibrates nothing."""
    if rows is None:
        rows, archs = load_published()
    else:
        archs = load_published()[1]
    tgt = targets()
    out = []
    for r in (r for r in rows if r.model_shards == 1):
        t = tgt[r.instance_type]
        w, procs = published_workload(r, archs[r.arch], t.cores), processes(r, t.cores)
        host = DEVICE_ONLY if r.mode == "train" else None
        out.append(Fitted(r, w, t, fit_fraction(w, t, r.samples_per_sec / r.nodes, procs, host), procs))
    return out


def fit_host(train: list[Fitted], device_fraction: float) -> HostFit | None:
    """The target host's tracing and image costs from the training rows the device cannot explain: a row
    whose device-only fraction of peak is below the training rows' pooled one (`device_fraction`) spends
    the rest of its step on its host. A step cannot be shorter than its trace, so the tracing cost is the
    smallest step time per counted instruction of those rows that decode no images (0 when none: no
    published row shows tracing binding, the device term stands alone); the image cost likewise, from
    the image rows' step time left after their trace. None (each chip's own costs) when no row has
    counted instructions."""
    train = [f for f in train if f.workload.hlo_instructions]
    if not train:
        return None
    def spare(f: Fitted) -> float:   # the step time left after its all-reduce share
        return f.step_s - allreduce_s(f.workload.grad_bytes, f.processes, f.target) / f.workload.grad_accumulation
    bound = [f for f in train if f.fraction < device_fraction]
    trace = min((spare(f) / f.workload.hlo_instructions for f in bound if not f.workload.decoded_images), default=0.0)
    images = [max(spare(f) - trace * f.workload.hlo_instructions, 0.0) / f.workload.decoded_images
              for f in bound if f.workload.decoded_images]
    return HostFit(trace_s_per_instruction=trace, image_s=min(images, default=0.0))


def pooled_fraction(fractions: list[float]) -> float:
    """The geometric median: the middle of the fractions on a log scale (robust to outliers)."""
    return math.exp(statistics.median(math.log(f) for f in fractions))


def relative_error(predicted_rate: float, actual: float) -> float:
    return predicted_rate / actual - 1


def is_conv(f: Fitted) -> bool:
    """A row whose FLOPs are mostly convolutions: it calibrates the convolutions' fraction of peak."""
    return f.workload.conv_flops > f.workload.flops_per_step / 2


def pooled(fitted: list[Fitted], mode: str, conv: bool) -> float | None:
    """The pooled fraction of the rows of that mode and kind, or None when there is none."""
    same = [f.fraction for f in fitted if f.row.mode == mode and is_conv(f) == conv]
    return pooled_fraction(same) if same else None


def fit(fitted: list[Fitted]) -> tuple[dict[str, float], HostFit | None]:
    """The device's fractions of peak and the target host's costs, from the newest row of each workload.
    Inference: the inference rows (compiled models: the device is all their step). Training: the pooled
    device-only fraction of the training rows (a backward and an update run below the inference
    fraction: 0.08-0.30 against 0.27-0.59), and the host costs from the rows below it (`fit_host`);
    without training rows, the inference fractions (docs/plan.md)."""
    latest = set(newest([f.row for f in fitted]))
    fresh = [f for f in fitted if f.row in latest]
    dots, conv = pooled(fresh, "infer", False), pooled(fresh, "infer", True)
    fraction = {"infer": dots or conv or 1.0, "train": dots or conv or 1.0}
    if conv is not None:
        fraction.update({"infer-conv": conv, "train-conv": conv})
    train = [f for f in fresh if f.row.mode == "train" and f.workload.hlo_instructions]
    if not train:
        return fraction, None
    fraction["train"] = pooled_fraction([f.fraction for f in train])
    return fraction, fit_host(train, fraction["train"])


def leave_one_out(fitted: list[Fitted], mode: str, strict: bool = False) -> list[tuple[Fitted, float]]:
    """Each row of the mode, every release, predicted from the fractions fitted on the rows of other
    architectures only (a user's model is not in the calibration: its architecture's other rows, of
    either mode, must not be either): (row, error). The host costs are those of every row unless `strict`,
    which fits them without the row's architecture too, as a user's new model meets them (the tracing
    cost is 0 when no other architecture's row shows it: docs/plan.md)."""
    out, shipped = [], fit(fitted)[1]
    for f in (f for f in fitted if f.row.mode == mode):
        fraction, host = fit([o for o in fitted if o.row.arch != f.row.arch])
        kind = f"{mode}-conv" if is_conv(f) and f"{mode}-conv" in fraction else mode
        out.append((f, relative_error(f.rate(fraction[kind], host if strict else shipped), f.row.samples_per_sec)))
    return out


def factor_error(error: float) -> float:
    """How many times off a prediction is, minus 1, either way (0.25: x1.25 or /1.25): the band's unit."""
    return max(1 + error, 1 / (1 + error)) - 1


@dataclass(frozen=True)
class PairResult:
    model: str
    source: Fitted
    target: Fitted
    error: float               # predicted / actual - 1 of the target's rate
    ranking_right: bool        # the cheaper-per-sample type of the pair, predicted vs published


def cross_predict(fitted: list[Fitted], source_type: str = "trn1.2xlarge",
                  target_file: str = "inf2_inference_encoder.csv") -> list[PairResult]:
    """The encoder pairs: the fraction fitted on the trn1 row alone predicts the inf2 row of the same model
    and release (the batch may differ: each table's own)."""
    trn = {(f.row.model, f.row.sdk): f for f in fitted if f.row.file == "trn1_inference_encoder.csv"
           and f.row.instance_type == source_type}
    out = []
    for g in (f for f in fitted if f.row.file == target_file and (f.row.model, f.row.sdk) in trn):
        s = trn[(g.row.model, g.row.sdk)]
        rate = g.rate(s.fraction)
        cost = lambda f, r: f.target.usd_per_hour * f.row.nodes / r  # noqa: E731  ($ per sample/s)
        predicted_cheaper = cost(g, rate) < cost(s, s.row.samples_per_sec)
        actual_cheaper = cost(g, g.row.samples_per_sec) < cost(s, s.row.samples_per_sec)
        out.append(PairResult(g.row.model, s, g, relative_error(rate, g.row.samples_per_sec),
                              predicted_cheaper == actual_cheaper))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def published_calibration(fitted: list[Fitted] | None = None) -> Calibration:
    """The shipped calibration: the fractions and host costs fitted on the newest row of every published
    workload (`fit`), and per mode an error band from leave-architecture-out over every release's row
    (so it holds the release drift too)."""
    fitted = fitted if fitted is not None else fitted_rows()
    fraction, host = fit(fitted)
    # training's band from the strict leave-out (host costs fitted without the architecture too): a new
    # model's tracing and image costs are not in the calibration either
    band = {mode: percentile([factor_error(e) for _, e in leave_one_out(fitted, mode, strict=mode == "train")],
                             BAND_PERCENTILE) for mode in MODES}
    count = {m: sum(f.row.mode == m for f in fitted) for m in MODES}
    return Calibration(fraction, band, f"published Neuron rows ({count['train']} training, {count['infer']} "
                                       "inference; neuron_train/data/plan_published.yaml)", host)


FIT_BOUNDS = (1e-5, 1.0)   # fit_fraction's search range: a fit at either end reproduces nothing
# A re-fit more than 3x from the published fraction: the published rows span 0.27-0.59 (inference) of peak,
# so 3x either way means the bench measured something else (another process count, a host-bound step).
FAR_FROM_PUBLISHED = 3.0


def recalibrated(base: Calibration, w: WorkloadFigures, t: Target, measured: float, processes: int,
                 where: str) -> tuple[Calibration, float, str | None]:
    """The device side re-fitted on one real measurement of this workload: (calibration, how far the
    first estimate was off (predicted / measured - 1), a one-line warning or None). The band becomes the
    cross-instance error of the published pairs (same chip, other host). The warning says when the
    re-fit stopped at a bound of the fraction of peak, or does not reproduce the benched type's own
    rate: the device is then not what limits the estimate, and its rate is not to be trusted."""
    first = predicted(w, t, base.fraction[w.mode], processes, base.host)
    fraction = fit_fraction(w, t, measured, processes, base.host)
    pairs = cross_predict(fitted_rows())
    band = percentile([factor_error(p.error) for p in pairs], BAND_PERCENTILE)
    # the bench's fraction for both kinds: one measurement cannot tell dots from convolutions
    calib = Calibration({**base.fraction, w.mode: fraction, f"{w.mode}-conv": fraction}, {**base.band, w.mode: band},
                        f"re-fitted on {where} ({measured:.1f} samples/s on {t.instance_type})", base.host)
    refit = estimate(w, t, calib, processes)
    warning = None
    if refit.samples_per_sec is None or abs(refit.samples_per_sec / measured - 1) > 0.01:
        warning = (f"the re-fit cannot reproduce the bench on {t.instance_type} ({measured:.1f} samples/s): the "
                   f"estimate is bound by {refit.bottleneck_text or 'memory'}, not by the fitted device compute "
                   f"({fraction:.1%} of peak); check the workload matches the bench (batch, precision, --execution)")
    elif fraction >= FIT_BOUNDS[1] * 0.999 or fraction <= FIT_BOUNDS[0] * 1.001:
        warning = (f"the re-fit stopped at {fraction:.1%} of peak, a bound of its range: the bench on "
                   f"{t.instance_type} is not explained by device compute; treat the other types' figures with care")
    elif not 1 / FAR_FROM_PUBLISHED <= fraction / base.fraction[w.mode] <= FAR_FROM_PUBLISHED:
        warning = (f"the re-fit puts the device at {fraction:.1%} of peak, far from the {base.fraction[w.mode]:.1%} "
                   f"the published rows achieve: check the bench ran what this plan assumes ({processes} process(es) "
                   f"on {t.instance_type}; the published big-instance inference rows ran 2 workers, not one per core)")
    return calib, relative_error(first, measured), warning


def workload_differences(bench: BenchResult, batch: float, img_size: int | None, precision: str | None) -> list[str]:
    """What the bench measured that this plan's workload does not do (unknown on either side: not compared)."""
    out = []
    if bench.batch_size_per_device != batch:
        out.append(f"batch size {bench.batch_size_per_device} per device, this plan {batch:g}")
    bench_img = bench.model.img_size
    if bench_img is not None and img_size is not None and bench_img != img_size:
        out.append(f"image size {bench_img}, this plan {img_size}")
    if precision is not None and bench.precision.lower() != precision.lower():
        out.append(f"precision {bench.precision}, this plan {precision}")
    return out


def check_workload(bench: BenchResult, where: str, batch: float, img_size: int | None, precision: str | None) -> None:
    """A bench of another batch size, image size or precision measured another workload: its rate
    would re-fit the device on the wrong step. Refused, naming the difference."""
    diff = workload_differences(bench, batch, img_size, precision)
    if diff:
        raise UsageError(f"--calibrate {where} measured {'; '.join(diff)}: calibrate with a bench of the same "
                         "workload (or plan the bench's batch size, image size and precision)")


def calibration(w: WorkloadFigures, bench: BenchResult | None, known: dict[str, Target],
                where: str | None, processes: int | None = None) -> tuple[Calibration, float | None, list[str]]:
    """The published calibration, or with a bench result (`load_calibration`, read from `where`) the
    device side re-fitted on it: (calibration, how far the first estimate was off or None, what to tell).
    A bench run with another number of processes than this plan gives its type is accepted: the re-fit
    uses the bench's own processes, and the band is doubled (the other count is extrapolated)."""
    calib = published_calibration()
    if bench is None:
        return calib, None, []
    t = known[bench.instance_type.lower()]
    measured = bench.samples_per_sec.median
    calib, first_off, warning = recalibrated(calib, w, t, measured, bench.world_size, str(where))
    lines = [f"plan: the first estimate for {t.instance_type} was {first_off:+.0%} off the bench "
             f"({measured:.1f} samples/s measured); device side re-fitted: {calib.fraction[w.mode]:.1%} of peak"]
    planned = min(processes or t.cores, t.cores)
    if bench.world_size != planned:
        calib = dataclasses.replace(calib, band={**calib.band, w.mode: 2 * calib.band[w.mode]})
        lines.append(f"plan: warning: {where} ran {bench.world_size} process(es) on {t.instance_type}, this plan "
                     f"{planned}: the re-fit is extrapolated, its range doubled to x/{1 + calib.band[w.mode]:.2f}")
    return calib, first_off, lines + ([f"plan: warning: {warning}"] if warning else [])


def load_calibration(path: str, mode: str, name: str, known: dict[str, Target]) -> BenchResult:
    """A bench result of this workload, measured on a Neuron instance type the plan knows."""
    data = reader.load(path, "--calibrate", fmt="json", limit=RESULT_LIMIT)
    r = BenchResult.from_json(data, f"--calibrate {path}")
    if r.estimated:
        raise UsageError(f"--calibrate {path} is an estimate, not a measurement: give a bench result file")
    if r.device.kind == "CPU" or r.instance_type.lower() not in known:
        raise UsageError(f"--calibrate {path} was measured on {r.instance_type} ({r.device.kind}): "
                         "give a bench result from a trn1/inf2 instance type")
    if r.mode != mode or r.model.name.lower() != name.lower():
        raise UsageError(f"--calibrate {path} measures {r.mode} of {r.model.name}, this plan "
                         f"{mode} of {name}: calibrate with a bench result of the same workload")
    return r
