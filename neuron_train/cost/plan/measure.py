"""What `neuron-train plan` measures on this machine: one process's steady training (or inference)
step of our loop or of any script, as `WorkloadFigures` for the estimate (plan/model.py).

- our loop (`measure_loop`): the loop's own steady optimizer step (training/build.py's: its micro-batches,
  task, clipping, update, EMA, as the configuration says) traced on the CPU XLA device in this process and
  read as HLO before it would run (FLOPs, bytes, instructions; never executed); the input pipeline as the
  images it decodes per step; activations = the bytes autograd saves for the backward. No time of this
  machine is taken (wall or CPU): the host terms are computed from the counts (plan/model.py).
- a model too large for this machine (`from_shapes`): the same figures counted on the meta device
  (torch's FLOP counter, nothing allocated, no host time): an estimate from shapes.
- any script (`measure_script`): the command runs under bench's probe with XLA's HLO dump on; the
  graph with the most dot/convolution FLOPs is its step.
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_train.common.errors import RunError
from neuron_train.cost.plan.hlo import HloFigures, hlo_figures
from neuron_train.cost.plan.model import GIB, WorkloadFigures
from neuron_train.training.config import RunConfig

if TYPE_CHECKING:
    import torch

    from neuron_train.training.data import Datasets
    from neuron_train.training.step import StepPath

# The fields training/config.py marks `graph=` whose change leaves plan's counted facts as they are, and
# why. Every other graph= field moves them (tests/cost/test_plan_fields.py checks both ways).
SAME_COST: dict[str, str] = {
    "data.batches_per_execution": "N lazily traced steps joined into one execution: the same ops per step; "
                                  "plan counts one graph launch per step (at most the host's dispatches)",
}

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATES = 2              # AdamW's two moments per parameter (SGD with momentum: 1)


def matmul_precision(precision: str) -> str:
    """What the matrix units run for one of our --precision values (fp32: --auto-cast none)."""
    return "fp32" if precision == "fp32" else "bf16"


def _weights_bytes(n_params: int, precision: str) -> int:
    return n_params * (2 if precision in ("bf16", "xla-use-bf16", "xla-downcast-bf16") else 4)


def _optimizer_states(name: str) -> int:
    return 1 if name == "sgd" else ADAM_STATES


def _saved_bytes(model: torch.nn.Module, run_forward: Callable[[], Any]) -> tuple[float, Any]:
    """Bytes autograd saves for the backward during one forward (activations; weights excluded),
    and the forward's output."""
    import torch

    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    return float(sum(seen.values())), out


def decoded_images(cfg: RunConfig, mode: str = "train") -> int:
    """Images the host decodes and preprocesses per step (training: an optimizer step's every micro-batch):
    a folder's every sample (read, decode, resize);
    none for the in-memory datasets (digits, synthetic: a sample is a slice of tensors made once, and the
    batch's one copy is counted as its copy to the device). A count of the workload, never a timing of
    this machine, whose load would move it (the target's cost per image: the calibration's)."""
    return samples_per_step(cfg, mode) if cfg.data.dataset == "folder" else 0


def samples_per_step(cfg: RunConfig, mode: str) -> int:
    """One process's samples in the step plan traces: an optimizer step's --grad-accum micro-batches
    (training), one batch (inference)."""
    return cfg.train.batch_size * (cfg.train.grad_accum if mode == "train" else 1)


def graphs_per_step(execution: str, mode: str) -> int:
    """Graph calls the host makes per step: a dynamo-full training step replays two captured graphs
    (forward/backward, then the update); anything else one."""
    return 2 if execution == "replay" and mode == "train" else 1


def compiler_precision(neuron_cc_flags: str, graph_precision: str) -> str:
    """What the matrix units run: neuronx-cc casts matmuls to bf16 by default (--auto-cast matmult);
    `--auto-cast none` (or `--auto-cast=none`) keeps the graph's own precision."""
    return graph_precision if "--auto-cast none" in neuron_cc_flags.replace("=", " ") else "bf16"


def default_execution(mode: str, step_compiler: str | None = None) -> str:
    """How the target runs the step when the user does not say (plan --execution): inference as the
    published rows run it (a compiled model), training as our loop's --step-compiler says (lazy for a COMMAND)."""
    if mode == "infer":
        return "compiled"
    return "replay" if step_compiler not in (None, "lazy") else "lazy"


def _warm_optimizer(path: StepPath) -> None:
    """Create the loop's optimizer state with zero gradients (a cheap element-wise graph), so the step
    traced next is the steady one (its first step would also build the state)."""
    import torch
    import torch_xla

    for p in path.model.parameters():
        p.grad = torch.zeros_like(p)
    path.optimizer.step()
    path.optimizer.zero_grad(set_to_none=True)
    # Sync point: runs the state's creation now, apart from the step whose graph is read next.
    torch_xla.sync()


def steady_step(cfg: RunConfig) -> int:
    """The optimizer step plan traces: past --sift-delay (its full-batch steps and the switch), so a
    sifting run's steady step is the sifted one, as it is for most of the run."""
    return cfg.sift.sift_delay + 1


def _traced_step(cfg: RunConfig, data: Datasets) -> tuple[HloFigures, float, float, int]:
    """The loop's own optimizer step (training/build.py), traced lazily and read as HLO, not run: its
    figures, the activation bytes of one micro-batch, the batches' bytes copied in, the parameters."""
    import torch_xla

    from neuron_train.training.build import build_run
    from neuron_train.training.device import local_backend
    from neuron_train.training.optim import xla_safe

    backend = local_backend()
    run = build_run(cfg, backend, data, step=lambda: steady_step(cfg), mark_phase=lambda _: None, capture=False)
    _warm_optimizer(run.path)
    host = iter(run.epoch_loader(world=1, rank=0, epoch=0))
    batches = [[t.to(backend.device) for t in next(host)] for _ in range(cfg.train.grad_accum)]
    fed = iter(batches)
    run.model.train()
    # any learning rate but 0 and 1 traces the same graph (optim.py): it reaches the graph as data
    activations, (losses, grad_norm) = _saved_bytes(
        run.model, lambda: run.path.step(lambda: next(fed), xla_safe(cfg.optim.lr), lambda _: None))
    # The steady step's pending graph, read and not run: its counts are all the estimate needs.
    hlo = hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo([*losses.values(), grad_norm, *run.path.state()]))
    copied = float(sum(t.numel() * t.element_size() for batch in batches for t in batch))
    return hlo, activations / cfg.train.grad_accum, copied, run.params


def _traced_forward(cfg: RunConfig, data: Datasets) -> tuple[HloFigures, float, int]:
    """The inference forward bench times (training/build.py's), traced and read as HLO, not run: its
    figures, the batch's bytes copied in, the parameters."""
    import torch
    import torch_xla

    from neuron_train.training.build import inference_forward, inference_model

    device = torch_xla.device()
    model, dtype = inference_model(cfg, data.num_classes)
    model = model.to(device)
    images = torch.zeros(cfg.train.batch_size, 3, cfg.model.img_size, cfg.model.img_size, dtype=dtype)
    logits = inference_forward(model, images.to(device), cfg.train.precision)
    hlo = hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo([logits]))
    return hlo, float(images.numel() * images.element_size()), sum(p.numel() for p in model.parameters())


def measure_loop(cfg: RunConfig, mode: str = "train", execution: str | None = None) -> tuple[WorkloadFigures, dict]:
    """Our loop's own step (training) or bench's forward (inference), traced on the XLA device and read
    as HLO (FLOPs, bytes, instructions), never executed, and the input pipeline counted (`decoded_images`):
    nothing here depends on this machine's speed, load or free memory. Returns the figures and details.
    A training step is one optimizer step: its --grad-accum micro-batches and one update."""
    from neuron_train.training.build import build_data

    data = build_data(cfg)
    train = mode == "train"
    if train:
        hlo, activations, copied, n = _traced_step(cfg, data)
    else:
        (hlo, copied, n), activations = _traced_forward(cfg, data), 0.0
    weights = _weights_bytes(n, cfg.train.precision)
    execution = execution or default_execution(mode, cfg.train.step_compiler)
    figures = WorkloadFigures(
        name=cfg.model.name, mode=mode, flops_per_step=hlo.flops, conv_flops=hlo.conv_flops, input_bytes=copied,
        precision=matmul_precision(cfg.train.precision), bytes_per_step=hlo.bytes_in + hlo.bytes_out,
        samples_per_step=samples_per_step(cfg, mode), param_bytes=weights, grad_bytes=weights if train else 0.0,
        optimizer_bytes=n * 4 * _optimizer_states(cfg.optim.optimizer) if train else 0.0,
        activation_bytes=activations, host_input_s=0.0, decoded_images=decoded_images(cfg, mode),
        loader_workers=cfg.data.workers(),
        execution=execution, hlo_instructions=hlo.instructions, graphs_per_step=graphs_per_step(execution, mode),
        measured_by="counted on the CPU XLA device of this machine (one step traced, not run)")
    return figures, {"parameters": n, "num_classes": data.num_classes, "train_samples": len(data.train),
                     "hlo": {"dots": hlo.dots, "convolutions": hlo.convolutions, "instructions": hlo.instructions,
                             "flops_by_dtype": hlo.flops_by_dtype}}


def model_classes(cfg: RunConfig) -> int:
    """The classes our loop's model is built with: --num-classes, or with 0 (the default) the dataset's.
    A model built with 0 classes has no head (timm): its weights and FLOPs would be missing."""
    from neuron_train.training.build import build_data

    return cfg.model.num_classes or build_data(cfg).num_classes


def too_large(cfg: RunConfig) -> tuple[bool, float]:
    """Would our loop's model (weights, gradients, two optimizer states) fill half this machine's
    physical memory? And its GiB. The machine's size, not its free memory: another process holding
    memory must not switch the plan to counting from shapes (its figures differ)."""
    import torch

    from neuron_train.training.build import host_model

    with torch.device("meta"):
        n = sum(p.numel() for p in host_model(cfg, model_classes(cfg), weights=False).parameters())
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return n * 16 > physical / 2, n * 16 / GIB


def measure_or_count(cfg: RunConfig, mode: str, execution: str | None, shapes: bool,
                     log: Callable[[str], None]) -> tuple[WorkloadFigures, dict]:
    """Our loop's figures: one step traced (`measure_loop`), or counted from shapes (`from_shapes`) when
    asked (`shapes`) or when the model would not fit in this machine's memory."""
    large, gib = too_large(cfg)
    if shapes or large:
        why = f" (weights, gradients and optimizer state ~{gib:.1f} GiB)" if large else ""
        log(f"plan: counting {cfg.model.name} from shapes on the meta device, nothing allocated{why}")
        return from_shapes(cfg, mode, execution)
    log(f"plan: tracing one step of {cfg.model.name} on this machine's CPU XLA device")
    return measure_loop(cfg, mode, execution)


def from_shapes(cfg: RunConfig, mode: str = "train", execution: str | None = None) -> tuple[WorkloadFigures, dict]:
    """Our loop's model counted on the meta device: FLOPs of forward + backward (torch's counter),
    weights, gradients, optimizer state and activations from shapes; nothing is allocated and no
    HLO exists, so a lazy step's traced instructions are not counted (plan warns when that matters)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from neuron_train.training.build import host_model

    classes = model_classes(cfg)  # the plan file would refuse a head-less model's num_classes
    with torch.device("meta"):
        model = host_model(cfg, classes, weights=False)
        images = torch.empty(cfg.train.batch_size, 3, cfg.model.img_size, cfg.model.img_size)
    train = mode == "train"
    with FlopCounterMode(display=False) as counter:
        activations, logits = _saved_bytes(model, lambda: model(images))
        if train:
            logits.float().sum().backward()
    n = sum(p.numel() for p in model.parameters())
    weights = _weights_bytes(n, cfg.train.precision)
    figures = WorkloadFigures(
        name=cfg.model.name, mode=mode, flops_per_step=float(counter.get_total_flops()),
        conv_flops=float(sum(v for op, v in counter.get_flop_counts().get("Global", {}).items()
                             if "convolution" in str(op))),
        precision=matmul_precision(cfg.train.precision), bytes_per_step=(3.0 if train else 1.0) * weights,
        samples_per_step=cfg.train.batch_size, param_bytes=weights, grad_bytes=weights if train else 0.0,
        optimizer_bytes=n * 4 * _optimizer_states(cfg.optim.optimizer) if train else 0.0,
        activation_bytes=activations if train else 0.0,
        # one micro-batch counted: --grad-accum of them share an update's all-reduce
        grad_accumulation=cfg.train.grad_accum if train else 1,
        execution=execution or default_execution(mode, cfg.train.step_compiler),
        measured_by="estimated from shapes on the meta device (nothing allocated; traced instructions not counted)")
    return figures, {"parameters": n, "num_classes": classes, "train_samples": None}


def image_size(shape: list[int] | None) -> int | None:
    """A script's image size, read from its input batch's shape (N, C, H, W with H == W), else None."""
    return shape[2] if shape and len(shape) == 4 and shape[2] == shape[3] else None


def steady_graph(dump_dir: Path) -> tuple[HloFigures, int]:
    """The dumped graph with the most dot/convolution FLOPs (a script's step), and how many graphs."""
    texts = sorted(dump_dir.rglob("*before_optimizations.txt"))
    figures = [hlo_figures(p.read_text(errors="replace")) for p in texts]
    best = max(figures, key=lambda f: f.flops, default=HloFigures())
    return best, len(figures)


def measure_script(command: list[str], *, steps: int, samples_flag: int | None, mode: str,
                   name: str | None, execution: str | None = None) -> tuple[WorkloadFigures, dict]:
    """Run the command under bench's probe with the HLO dump on; one process's step figures."""
    from neuron_train.cost import script_figures
    from neuron_train.instrument.script import require_ran, run_script

    with tempfile.TemporaryDirectory(prefix="neuron-train-plan-") as folder:
        dump = Path(folder) / "hlo"
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
        run = run_script(command, Path(folder), mode="bench", steps=steps, extra_env={"XLA_FLAGS": flags}, echo=False)
        if run.interrupted == signal.SIGINT:  # Ctrl-C: the command was ended, nothing to estimate
            raise KeyboardInterrupt
        require_ran(run, "nothing was measured", stopped_ok=("bench",))
        hlo, graphs = steady_graph(dump)
    if hlo.flops <= 0:
        raise RunError(f"{run.line}: no graph with a matrix multiply or convolution was compiled: nothing to "
                       "estimate (does the command train a model on the XLA device?)")
    f = script_figures.figures(run, samples_flag)
    n = f.parameters
    legacy_bf16 = os.environ.get("XLA_USE_BF16") == "1" or os.environ.get("XLA_DOWNCAST_BF16") == "1"
    weights = n * (2 if legacy_bf16 else 4)
    precision = compiler_precision(os.environ.get("NEURON_CC_FLAGS", ""), hlo.precision)
    figures = WorkloadFigures(
        name=name or script_figures.script_name(command), mode=mode, flops_per_step=hlo.flops, precision=precision,
        conv_flops=hlo.conv_flops, input_bytes=4.0 * math.prod(f.batch_shape or [0]),  # 4 bytes an element: assumed
        bytes_per_step=hlo.bytes_in + hlo.bytes_out, samples_per_step=f.samples_per_step,
        param_bytes=weights, grad_bytes=weights if mode == "train" else 0.0,
        optimizer_bytes=n * 4 * ADAM_STATES if mode == "train" else 0.0, activation_bytes=0.0, host_input_s=None,
        # The host term from counted facts (the step graph's instructions); a COMMAND's input pipeline is
        # not told apart from its step, so it is unknown, not counted.
        execution=execution or default_execution(mode), hlo_instructions=hlo.instructions,
        measured_by="counted on the CPU XLA device of this machine (a COMMAND: input pipeline and "
                    "activations unknown)")
    return figures, {"parameters": n or None, "cpu_samples_per_sec": f.samples_per_sec,
                     "graphs_dumped": graphs,
                     "batch_shape": f.batch_shape, "step_site": f.site, "world_size": f.world_size,
                     "hlo": {"dots": hlo.dots, "convolutions": hlo.convolutions, "instructions": hlo.instructions,
                             "flops_by_dtype": hlo.flops_by_dtype}}
