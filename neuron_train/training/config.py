"""Typed run configuration: one dataclass per component, every field a flag.

Each field carries its own flag name and help text (`opt`), so the parser, the config file keys and
`--help` cannot drift apart (config_io.py turns flags and files into a RunConfig and back). A field
that changes which graphs a run compiles says so too (`graph=Graph("label")`): the precompile
manifest records it, and a coverage message names it ("batch size 64 here, 32 in the manifest").
Validation happens here, at the edge: a bad value raises UsageError (one line, exit code 2).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_train.common.errors import UsageError

STEP_COMPILERS = ("dynamo-full", "dynamo", "lazy")
LEGACY_BF16_PRECISIONS = ("xla-use-bf16", "xla-downcast-bf16")  # XLA_USE_BF16 / XLA_DOWNCAST_BF16
PRECISIONS = ("fp32", "bf16-autocast", "bf16", *LEGACY_BF16_PRECISIONS)
DATASETS = ("digits", "synthetic", "folder")
# Defaults that depend on the device a run trains on (PJRT device kind -> {"section.field": value}),
# declared here once: config_io applies them under file values and flags, --help shows them, and the
# run's saved config.yaml holds the values they resolved to. On a Neuron device the step is traced
# lazily, as aws-neuron-samples do (4 graphs to compile instead of dynamo-full's 12), because the Neuron
# SDK 2.29.1 documentation says torch.compile support for torch 2.9 "will be available in a future
# release"; its update is flat (flat_optim.py), not the per-tensor AdamW Neuron's samples run (torch's, or
# neuronx-distributed's AdamW_FP32OptimParams, a loop over parameters): it traces the step in 0.27-0.33x their
# host time (ViT-B/16, BERT-Large-like; the CPU device executes it 1.5-2x slower: docs/measurements.md).
DEVICE_DEFAULTS: dict[str, dict[str, str]] = {
    "NEURON": {"train.step_compiler": "lazy", "optim.optimizer_impl": "flat"},
}
_DEVICE_NAMES = {"NEURON": "a Neuron device"}


def device_defaults(device_kind: str) -> dict[str, str]:
    """The defaults that differ from the fields' own on `device_kind` (a PJRT device type)."""
    return dict(DEVICE_DEFAULTS.get(device_kind.upper(), {}))


def default_text(dotted: str, default: Any) -> str:
    """A field's default as --help states it, with the device kinds whose default differs."""
    others = [f"{values[dotted]} on {_DEVICE_NAMES.get(kind, kind)}"
              for kind, values in DEVICE_DEFAULTS.items() if dotted in values]
    return f"{default}" + (f" on the CPU device; {'; '.join(others)}" if others else "")


@dataclass(frozen=True)
class Graph:
    """On a field whose value changes the graphs a run compiles (a shape, a dtype, a traced branch).

    Learning rate, momentum, weight decay and the distillation weights have none: they reach the
    graph as data (the schedule avoids the constants 0 and 1, see optim.py).
    """
    label: str                                          # how a coverage message names it
    key: str | None = None                              # its key in the manifest (default: the field's name)
    when: Callable[[RunConfig], bool] | None = None     # otherwise not in play: recorded as None
    value: Callable[[Any], Any] | None = None           # what is recorded (default: the value itself)
    # a setting added after manifests existed: left out (not None) while `when` is false, so the
    # configurations precompiled before it keep their fingerprints
    absent_when_off: bool = False


def opt(default: Any, help: str, *, choices: tuple | None = None, flag: str | None = None,
        metavar: str | None = None, alias: str | None = None, graph: Graph | None = None) -> Any:
    """A config field that is also a command-line flag (`--field-name` unless `flag` is given;
    `alias`: an older name that still works, hidden from --help; `graph`: it changes the graphs)."""
    meta = {"help": help, "choices": choices, "flag": flag, "metavar": metavar, "alias": alias, "graph": graph}
    return field(default=default, metadata=meta)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UsageError(msg)


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("vit-digits", "timm model name (e.g. vit_tiny_patch16_224) or a preset: "
                    "vit-digits, vit-digits-teacher, vit-nano, vit-micro", flag="--model", metavar="NAME",
                    graph=Graph("model", key="model"))
    img_size: int = opt(32, "input image size in pixels (square)", graph=Graph("image size"))
    num_classes: int = opt(0, "number of classes; 0 takes it from the dataset",
                           graph=Graph("number of classes"))
    pretrained: str | None = opt(None, "local weights file to start from (never downloads)",
                                 metavar="FILE")
    drop_path: float = opt(0.0, "stochastic depth rate (timm drop_path_rate)", graph=Graph("drop path"))

    def validate(self) -> None:
        _need(bool(self.name), "--model must not be empty")
        _need(8 <= self.img_size <= 4096, f"--img-size must be 8..4096, got {self.img_size}")
        _need(self.num_classes >= 0, f"--num-classes must be >= 0, got {self.num_classes}")
        _need(0.0 <= self.drop_path < 1.0, f"--drop-path must be in [0, 1), got {self.drop_path}")
        if self.pretrained:
            _need(Path(self.pretrained).is_file(), f"--pretrained: no such file: {self.pretrained}")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = opt("digits", "digits: scikit-learn's 8x8 handwritten digits, upscaled (real, "
                       "offline); synthetic: random images (benchmarks); folder: ImageFolder "
                       "layout under --data-dir (train/ and val/)", choices=DATASETS)
    data_dir: str | None = opt(None, "image folder for --dataset folder", metavar="DIR")
    num_workers: int = opt(-1, "DataLoader worker processes per rank; -1: none for the in-memory "
                           "datasets (digits, synthetic: a sample is a tensor slice, workers would only "
                           "add processes and pickling), 2 for folder (image decoding)")
    synthetic_size: int = opt(2048, "number of samples in the synthetic training set")
    batches_per_execution: int = opt(1, "batches traced into one XLA execution (MpDeviceLoader; "
                                     "with --step-compiler lazy)", graph=Graph("batches per execution"))
    check_images: bool = opt(True, "folder: check every image file before training (empty, unreadable "
                             "header, cut short); ~0.25 ms a file, on rank 0")

    def workers(self) -> int:
        """--num-workers, with -1 resolved by dataset."""
        if self.num_workers >= 0:
            return self.num_workers
        return 2 if self.dataset == "folder" else 0

    def validate(self) -> None:
        _need(self.num_workers >= -1, f"--num-workers must be >= 0 (or -1: by dataset), got {self.num_workers}")
        _need(self.synthetic_size >= 1, "--synthetic-size must be >= 1")
        _need(self.batches_per_execution >= 1, "--batches-per-execution must be >= 1")
        if self.dataset == "folder":
            _need(bool(self.data_dir), "--dataset folder needs --data-dir DIR")
            _need(Path(str(self.data_dir)).is_dir(), f"--data-dir: no such directory: {self.data_dir}")
        else:
            _need(self.data_dir is None, f"--data-dir is only used with --dataset folder, "
                                         f"not --dataset {self.dataset}")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = opt("adamw", "optimizer", choices=("adamw", "sgd"), graph=Graph("optimizer"))
    lr: float = opt(1e-3, "peak learning rate")
    weight_decay: float = opt(0.05, "weight decay")
    momentum: float = opt(0.9, "SGD momentum")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables",
                           graph=Graph("gradient clipping", value=lambda v: "on" if v > 0 else "off"))
    schedule: str = opt("cosine", "LR schedule after warm-up", choices=("cosine", "linear", "constant"))
    warmup_steps: int = opt(20, "linear LR warm-up steps")
    min_lr: float = opt(1e-5, "LR at the end of the cosine/linear decay")
    zero1: bool = opt(False, "shard optimizer state across data-parallel ranks (ZeRO-1)", graph=Graph("ZeRO-1"))
    optimizer_impl: str = opt("foreach", "foreach: torch's multi-tensor update and clipping (a few "
                              "large ops to trace); for-loop: one update per tensor (what torch "
                              "picks by itself for XLA tensors, and Neuron's samples run); flat: "
                              "weights and gradients concatenated, clipped and updated in one piece "
                              "per bucket (the fewest ops to trace; the update is traced lazily)",
                              choices=("foreach", "for-loop", "flat"), graph=Graph("optimizer implementation"))

    def validate(self) -> None:
        _need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _need(self.weight_decay >= 0, "--weight-decay must be >= 0")
        _need(0 <= self.momentum < 1, "--momentum must be in [0, 1)")
        _need(self.grad_clip >= 0, "--grad-clip must be >= 0 (0 disables)")
        _need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        _need(0 <= self.min_lr <= self.lr, f"--min-lr must be in [0, --lr], got {self.min_lr}")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = opt(32, "batch size per device (per process)", graph=Graph("batch size"))
    epochs: int = opt(10, "epochs to train (ignored when --max-steps is set)")
    max_steps: int = opt(0, "stop after this many optimizer steps; 0 trains --epochs epochs")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step", graph=Graph("gradient accumulation"))
    eval_every: int = opt(0, "evaluate every N optimizer steps; 0 evaluates at each epoch's end")
    seed: int = opt(0, "random seed (model init, data order)")
    precision: str = opt("fp32", "fp32; bf16-autocast (matmuls in bf16, f32 weights); bf16 (weights "
                         "in bf16, stochastic rounding on Neuron); xla-use-bf16 / xla-downcast-bf16 "
                         "(the legacy XLA_USE_BF16 / XLA_DOWNCAST_BF16 environment modes)",
                         choices=PRECISIONS, graph=Graph("precision"))
    output_dir: str | None = opt(None, "run directory (default: runs/<model>-<time>)", metavar="DIR")
    step_compiler: str = opt("dynamo-full", "dynamo-full: torch.compile(backend='openxla') captures "
                             "forward, backward and the optimizer update (clipping included) once, "
                             "so no Python is traced per step (fastest measured on the CPU XLA "
                             "device; not validated on Neuron); dynamo: forward and backward only, "
                             "the update traced lazily; lazy: trace the whole step with lazy tensors "
                             "every step (the torch_xla way Neuron's own samples use)",
                             choices=STEP_COMPILERS, graph=Graph("step compiler"))
    warmup_measure_steps: int = opt(3, "steps left out of the steady-state throughput figures")
    precompile_steps: int = opt(4, "train steps run under NEURON_EXTRACT_GRAPHS_ONLY "
                                "(graph extraction by neuron_parallel_compile)")

    def validate(self) -> None:
        _need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        _need(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        _need(self.max_steps >= 0, f"--max-steps must be >= 0, got {self.max_steps}")
        _need(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        _need(0 <= self.seed < 2**32, f"--seed must be in [0, 2**32) (numpy's seeds), got {self.seed}")
        _need(self.eval_every >= 0, "--eval-every must be >= 0")
        _need(self.warmup_measure_steps >= 0, "--warmup-measure-steps must be >= 0")
        _need(self.precompile_steps >= 2, "--precompile-steps must be >= 2 (first step and steady step)")


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_every: int = opt(0, "save a checkpoint every N optimizer steps (and always at the "
                                "end); 0 saves only at the end")
    keep_last: int = opt(3, "checkpoints kept on disk (oldest deleted first)")
    resume: str | None = opt(None, "resume from the latest checkpoint in --output-dir, or from FILE",
                             metavar="FILE")

    def validate(self) -> None:
        _need(self.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
        _need(self.keep_last >= 1, f"--keep-last must be >= 1, got {self.keep_last}")


@dataclass(frozen=True)
class LogConfig:
    log_every: int = opt(10, "write metrics every N optimizer steps (no host sync: step closures)")
    tensorboard: bool = opt(True, "write TensorBoard event files under the run directory")
    progress: bool = opt(True, "show a progress bar on rank 0")

    def validate(self) -> None:
        _need(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")


@dataclass(frozen=True)
class CompileConfig:
    check_graphs: bool = opt(False, "fail the run at the first recompilation after warm-up, naming "
                             "its cause and source line")
    graph_warmup_steps: int = opt(2, "optimizer steps allowed to compile new train graphs")
    compile_cache: str | None = opt(None, "persistent compile cache directory (holds the graph "
                                    "manifest written by precompile)", metavar="DIR",
                                    alias="--cache-dir")
    require_precompiled: bool = opt(False, "fail when the run compiles a graph the cache's "
                                    "manifest lacks, naming the configuration difference")

    def validate(self) -> None:
        _need(self.graph_warmup_steps >= 0, "--graph-warmup-steps must be >= 0")
        _need(not self.require_precompiled or bool(self.compile_cache),
              "--require-precompiled needs --compile-cache DIR")


@dataclass(frozen=True)
class DistillConfig:
    teacher_model: str | None = opt(None, "teacher: timm model name or preset (enables distillation)",
                                    metavar="NAME", graph=Graph("teacher model"))
    teacher_checkpoint: str | None = opt(None, "teacher weights: a checkpoint of ours or a state "
                                         "dict file", metavar="FILE")
    distill_alpha: float = opt(0.5, "weight of the KL term (1 - alpha weighs cross-entropy)")
    distill_temperature: float = opt(4.0, "softmax temperature T (the KL term is scaled by T^2)")
    teacher_bf16: bool = opt(False, "compute teacher logits in bf16",
                             graph=Graph("teacher bf16", when=lambda c: bool(c.distill.teacher_model)))

    def validate(self) -> None:
        _need(0.0 <= self.distill_alpha <= 1.0, f"--distill-alpha must be in [0, 1], got {self.distill_alpha}")
        _need(self.distill_temperature > 0, "--distill-temperature must be > 0")
        if self.teacher_model:
            _need(bool(self.teacher_checkpoint), "--teacher-model needs --teacher-checkpoint FILE "
                                                 "(a random teacher teaches nothing)")
            _need(Path(str(self.teacher_checkpoint)).is_file(),
                  f"--teacher-checkpoint: no such file: {self.teacher_checkpoint}")
        else:
            _need(self.teacher_checkpoint is None, "--teacher-checkpoint needs --teacher-model NAME")


@dataclass(frozen=True)
class SiftConfig:
    sift: str = opt("off", "loss-based data sifting: keep the highest-loss samples of each batch",
                    choices=("off", "topk", "relative"), graph=Graph("sifting"))
    sift_keep: float = opt(0.5, "topk: fraction of each batch kept for the backward pass",
                           graph=Graph("sift keep fraction", when=lambda c: c.sift.sift == "topk"))
    sift_beta: float = opt(1.0, "relative: keep probability = rank-percentile ** beta",
                           graph=Graph("sift beta", when=lambda c: c.sift.sift == "relative"))
    sift_history: int = opt(500, "relative: number of recent losses the percentile is taken over",
                            graph=Graph("sift history", when=lambda c: c.sift.sift != "off"))
    sift_delay: int = opt(0, "optimizer steps trained on full batches before sifting starts")

    def validate(self) -> None:
        _need(0.0 < self.sift_keep <= 1.0, f"--sift-keep must be in (0, 1], got {self.sift_keep}")
        _need(self.sift_beta > 0, "--sift-beta must be > 0")
        _need(self.sift_history >= 1, "--sift-history must be >= 1")
        _need(self.sift_delay >= 0, "--sift-delay must be >= 0")


@dataclass(frozen=True)
class ProfileConfig:
    profile: bool = opt(False, "record per-step phase times and name the bottleneck")
    profile_trace_steps: int = opt(0, "also capture a torch_xla profiler trace of N steps")

    def validate(self) -> None:
        _need(self.profile_trace_steps >= 0, "--profile-trace-steps must be >= 0")


@dataclass(frozen=True)
class RecipeConfig:
    """timm's training recipe (train.py's flag names and defaults), applied on the host by the loader
    (training/augment.py). --smoothing defaults to 0, not timm's 0.1: the recipe is opt-in."""
    aa: str | None = opt(None, "AutoAugment/RandAugment policy (timm's --aa), e.g. rand-m9-mstd0.5-inc1, "
                         "augmix-m5-w3, original; applied per sample in the data loader", metavar="POLICY")
    reprob: float = opt(0.0, "random erasing probability per sample (timm's --reprob, pixel mode), "
                        "in the data loader")
    # --mixup, --cutmix and --smoothing change the step's graphs one way: its targets become soft
    mixup: float = opt(0.0, "mixup alpha; > 0 enables mixup (timm's Mixup, on the host: soft targets)",
                       graph=Graph("soft targets (--mixup, --cutmix, --smoothing)", key="soft_targets",
                                   when=lambda c: c.recipe.mixup > 0 or c.recipe.cutmix > 0 or c.recipe.smoothing > 0,
                                   value=lambda _: "on", absent_when_off=True))
    cutmix: float = opt(0.0, "cutmix alpha; > 0 enables cutmix (timm's Mixup, on the host: the "
                        "device never sees the box)")
    mixup_prob: float = opt(1.0, "probability of mixing a batch when mixup or cutmix is on")
    mixup_switch_prob: float = opt(0.5, "probability of cutmix instead of mixup when both are on")
    smoothing: float = opt(0.0, "label smoothing (timm's default is 0.1; 0 keeps hard labels)")
    model_ema: bool = opt(False, "keep an exponential moving average of the weights (timm's "
                          "ModelEmaV3), updated in the step's graph, evaluated beside the raw weights",
                          graph=Graph("model EMA", when=lambda c: c.recipe.model_ema, value=lambda _: "on",
                                      absent_when_off=True))
    # no graph: the lerp weight 1 - decay reaches the graph as data (never 0 or 1: validated)
    model_ema_decay: float = opt(0.9998, "EMA decay per optimizer step")

    def validate(self) -> None:
        for flag, value in (("--reprob", self.reprob), ("--mixup-prob", self.mixup_prob),
                            ("--mixup-switch-prob", self.mixup_switch_prob)):
            _need(0.0 <= value <= 1.0, f"{flag} must be in [0, 1], got {value}")
        _need(self.mixup >= 0 and self.cutmix >= 0, "--mixup and --cutmix are alphas: >= 0 (0 is off)")
        _need(0.0 <= self.smoothing < 1.0, f"--smoothing must be in [0, 1), got {self.smoothing}")
        _need(0.0 < self.model_ema_decay < 1.0, f"--model-ema-decay must be in (0, 1), got {self.model_ema_decay}")
        if self.aa:
            from timm.data import create_transform

            try:  # timm's own parser: the policies and options it accepts
                create_transform(32, is_training=True, auto_augment=self.aa)
            except Exception as exc:  # timm raises AssertionError, KeyError or ValueError on a bad policy
                raise UsageError(f"--aa {self.aa}: not a policy timm knows ({type(exc).__name__}: "
                                 f"{str(exc)[:80]}); e.g. rand-m9-mstd0.5-inc1, augmix-m5-w3, original") from None


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    sift: SiftConfig = field(default_factory=SiftConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)

    def validate(self) -> RunConfig:
        for section in sections(self):
            values = getattr(self, section)
            for f in dataclasses.fields(values):  # inf and nan pass every comparison-free check
                value = getattr(values, f.name)
                _need(not isinstance(value, float) or math.isfinite(value),
                      f"{f.metadata.get('flag') or '--' + f.name.replace('_', '-')} must be a finite number, "
                      f"got {value}")
            values.validate()
        if self.sift.sift == "topk":
            kept = round(self.train.batch_size * self.sift.sift_keep)
            _need(kept >= 1, f"--sift-keep {self.sift.sift_keep} keeps no sample of a batch of "
                             f"{self.train.batch_size}")
        _need(self.data.batches_per_execution == 1 or self.train.step_compiler == "lazy",
              f"--batches-per-execution {self.data.batches_per_execution} joins lazily traced steps into "
              f"one execution; --step-compiler {self.train.step_compiler} runs each captured graph as "
              "it is called: add --step-compiler lazy")
        _need(not (self.recipe.model_ema and self.train.precision == "xla-use-bf16"),
              "--model-ema with --precision xla-use-bf16 (XLA_USE_BF16): every float weight, the average's "
              "too, is bf16 on the device, where an EMA update is below half a bf16 ulp and the average "
              "does not move; use --precision bf16 (a float32 EMA) or xla-downcast-bf16")
        _need(not (self.recipe.mixup or self.recipe.cutmix) or self.train.batch_size % 2 == 0,
              f"--mixup/--cutmix pair each sample with another of its batch: --batch-size must be even, "
              f"got {self.train.batch_size}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def sections(cfg: RunConfig | type[RunConfig] = RunConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg)]


def _graph_fields(cfg: RunConfig) -> list[tuple[str, dataclasses.Field, Graph]]:
    return [(section, f, f.metadata["graph"]) for section in sections(cfg)
            for f in dataclasses.fields(getattr(cfg, section)) if f.metadata.get("graph")]


def graph_settings(cfg: RunConfig) -> dict[str, Any]:
    """The settings that change which graphs the run compiles, as the manifest records them."""
    out = {}
    for section, f, graph in _graph_fields(cfg):
        value = getattr(getattr(cfg, section), f.name)
        if graph.when is not None and not graph.when(cfg):
            if graph.absent_when_off:
                continue
            value = None
        elif graph.value is not None:
            value = graph.value(value)
        out[graph.key or f.name] = value
    return out


def graph_labels() -> dict[str, str]:
    """The manifest key -> label of every graph-changing setting (for coverage messages)."""
    return {graph.key or f.name: graph.label for _, f, graph in _graph_fields(RunConfig())}
