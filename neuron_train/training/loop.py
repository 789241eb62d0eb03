"""The XLA training loop.

How it stays fast on XLA:
- Every step traces the same graph: static batch shapes, an LR handed over as data (optim.py),
  the same tensors kept alive every step (they are the graph's outputs), no reads of device values.
- The graph boundary is MpDeviceLoader's `torch_xla.sync()` when the next batch is fetched, so
  tracing step N+1 overlaps the device executing step N.
- Values reach the host only in step closures that run after the step has executed: the hot loop
  never waits for the device except to measure throughput, evaluate or checkpoint.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import write_json_atomic
from neuron_train.common.neuron_env import extracting_graphs
from neuron_train.graphs import GraphWatch
from neuron_train.precompile.hook import CompileCacheHook
from neuron_train.training import checkpoint as ckpt
from neuron_train.training import zero1
from neuron_train.training.config import RunConfig, save_config
from neuron_train.training.data import (
    build_datasets,
    eval_loader,
    to_device,
    train_batches_per_epoch,
    train_loader,
)
from neuron_train.training.device import Backend
from neuron_train.training.metrics import MetricsWriter, Progress, median_and_spread
from neuron_train.training.models import build_model, count_parameters
from neuron_train.training.optim import build_optimizer, lr_at, set_lr
from neuron_train.training.profiler import build_profiler
from neuron_train.training.rundir import open_run_dir
from neuron_train.training.tasks import build_task


@dataclass
class Position:
    """How far the run has come; saved in checkpoints so a resumed run continues exactly."""

    step: int = 0    # optimizer steps done
    epoch: int = 0   # current epoch
    batch: int = 0   # micro-batches of the current epoch already trained on


def autocast(precision: str):
    """bf16-autocast: matmuls in bf16, weights and loss in f32. Other modes need no context."""
    if precision == "bf16-autocast":
        return torch.autocast("xla", dtype=torch.bfloat16)
    return torch.autocast("xla", enabled=False)


def compile_forward(task, step_compiler: str):
    """The task as the step calls it: traced lazily every step, or captured once by dynamo."""
    if step_compiler == "dynamo":
        # Dynamo replays the captured forward/backward graphs without re-tracing Python each step.
        return torch.compile(task, backend="openxla", dynamic=False)
    return task


class Trainer:
    def __init__(self, cfg: RunConfig, backend: Backend):
        self.cfg, self.backend = cfg, backend
        self.extracting = extracting_graphs()
        self.writes = backend.is_main and not self.extracting  # only rank 0 writes, never garbage
        t = cfg.train
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        xm.set_rng_state(t.seed)
        self.run_dir = open_run_dir(cfg, backend, self.extracting)  # training/rundir.py: lock, clean-up
        self.data = build_datasets(cfg.data, cfg.model.img_size, cfg.model.num_classes, t.seed)
        model = build_model(cfg.model.name, num_classes=self.data.num_classes,
                            img_size=cfg.model.img_size, drop_path=cfg.model.drop_path,
                            pretrained=cfg.model.pretrained)
        self.params = count_parameters(model)
        self.input_dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
        if t.precision == "bf16":
            model = model.to(torch.bfloat16)  # pure bf16 weights; Neuron rounds stochastically
        self.model = model.to(backend.device)
        backend.broadcast_parameters(self.model)
        self.task = build_task(cfg, self.model, backend.device, step=lambda: self.pos.step,
                               mark_phase=lambda name: self.watch.phase(name))
        self.forward = compile_forward(self.task, t.step_compiler)
        self.optimizer = build_optimizer(self.model, cfg.optim, backend)
        batches = train_batches_per_epoch(len(self.data.train), backend.world_size, t.batch_size)
        self.steps_per_epoch = batches // t.grad_accum
        if self.steps_per_epoch == 0:
            raise UsageError(f"the {cfg.data.dataset} training set ({len(self.data.train)} samples) "
                             f"has less than one step of {t.batch_size} x {t.grad_accum} x "
                             f"{backend.world_size} ranks")
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        if self.extracting:
            self.total_steps = min(self.total_steps, t.precompile_steps)
        self.pos = Position()
        self.resumed_from: str | None = None
        self.watch = GraphWatch(cfg.compile.graph_warmup_steps, cfg.compile.check_graphs)
        # --compile-cache: records the graph manifest (graph tour) or checks against it; before any compile
        self.cache = CompileCacheHook(cfg, backend, num_classes=self.data.num_classes)
        self.profiler = build_profiler(cfg, self.run_dir if self.writes else None)
        self.last: dict[str, float] = {}
        self.eval_result: dict[str, float] = {}
        self.nan_step: int | None = None
        self.stop_signal: int | None = None

    # ----- checkpoints -----------------------------------------------------------------------
    def _state(self) -> dict:
        return {"model": ckpt.to_cpu(self.model.state_dict()),
                "optimizer": (ckpt.sharded_marker(self.backend.world_size) if self.cfg.optim.zero1
                              else ckpt.to_cpu(self.optimizer.state_dict())),
                "position": asdict(self.pos), "rng": ckpt.rng_state(),
                "global_batch": self._global_batch(), "config": self.cfg.to_dict()}

    def save_checkpoint(self) -> Path | None:
        torch_xla.sync()  # closes the pending step: the same graph the loader would have cut
        self.watch.phase("checkpoint")  # after the sync: that step's graph still counts as train
        path = None
        if self.cfg.optim.zero1 and not self.extracting:  # each rank saves its own shard first
            ckpt.save_shard(self.run_dir, self.pos.step, self.backend.rank,
                            ckpt.to_cpu(self.optimizer.state_dict()))
            self.backend.barrier()  # all shards on disk before rank 0 commits the checkpoint
        if self.writes:
            path = ckpt.save(self.run_dir, self.pos.step, self._state(), self.cfg.checkpoint.keep_last)
        self.backend.barrier()
        self.watch.phase("train")
        return path

    def resume(self) -> None:
        path = ckpt.resolve(self.run_dir, self.cfg.checkpoint.resume)
        state = ckpt.load(path)
        if state["global_batch"] != self._global_batch():
            raise UsageError(f"{path} was trained with a global batch of {state['global_batch']}, "
                             f"this run has {self._global_batch()}: the data position would not match")
        ckpt.load_model_state(self.model, state, path)  # a mismatch is one line naming the model
        self.optimizer.load_state_dict(ckpt.optimizer_state(
            path, state, zero1=self.cfg.optim.zero1, world_size=self.backend.world_size,
            rank=self.backend.rank))
        self.pos = Position(**state["position"])
        ckpt.set_rng_state(state["rng"])
        torch_xla.sync()  # materialise the loaded weights before the first step
        self.resumed_from = str(path)

    def _global_batch(self) -> int:
        t = self.cfg.train
        return t.batch_size * t.grad_accum * self.backend.world_size

    # ----- one optimizer step ----------------------------------------------------------------
    def train_step(self, batches) -> None:
        accum = self.cfg.train.grad_accum
        prof = self.profiler  # phase marks; a no-op object without --profile
        for _ in range(accum):
            images, labels = prof.next(batches)  # graph boundary: the previous step starts executing
            images = images.to(self.input_dtype)
            with autocast(self.cfg.train.precision):
                losses = self.forward(images, labels)
            prof.mark("forward")
            (losses["loss"] / accum).backward()
            prof.mark("backward")
        set_lr(self.optimizer, lr_at(self.pos.step, self.cfg.optim, self.total_steps))
        if self.cfg.optim.zero1:  # reduce-scatter, global-norm clip, shard update, all-gather
            self.optimizer.step()
            grad_norm = zero1.grad_norm(self.optimizer)
            prof.mark("grad_sync")
        else:
            self.backend.reduce_gradients(self.optimizer)  # xm.optimizer_step, split to clip in between
            prof.mark("grad_sync")
            params = self.model.parameters()
            clip = self.cfg.optim.grad_clip
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip else torch.zeros(())
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step = self.pos.step
        # Keep the same tensors alive every step: live tensors are the graph's outputs, so logging
        # only on some steps would otherwise give those steps a different graph.
        self.live = (losses, grad_norm)
        xm.add_step_closure(self.watch.step_end, args=(step,))
        xm.add_step_closure(self.cache.check, args=(self.watch,))  # --require-precompiled
        if step % self.cfg.log.log_every == 0 or step == self.total_steps - 1:
            lr = self.optimizer.param_groups[0]["lr"]
            xm.add_step_closure(self._log_step, args=(step, losses, grad_norm, lr), run_async=True)
        prof.mark("optimizer")

    def _log_step(self, step: int, losses: dict, grad_norm: torch.Tensor, lr: float) -> None:
        """Runs after the step executed, off the main thread: the device values are ready."""
        values = {k: float(v.detach().cpu()) for k, v in losses.items()}  # device->host copy
        values.update(grad_norm=float(grad_norm.cpu()), lr=lr)
        self.last = values
        if not self.extracting and not all(map(_finite, values.values())) and self.nan_step is None:
            self.nan_step = step
        if self.writes:
            self.metrics.write(step, values)

    # ----- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if self.data.val is None:
            return {}
        torch_xla.sync()  # closes the pending train step (its graph is labelled train)
        self.watch.phase("eval")
        t = self.cfg.train
        loader = to_device(eval_loader(self.data.val, self.cfg.data, batch_size=t.batch_size,
                                       world=self.backend.world_size, rank=self.backend.rank),
                           self.backend.device)
        self.model.eval()
        totals = torch.zeros(3).to(self.backend.device)  # uploaded as data: one eval graph
        with torch.no_grad():
            for images, labels, valid in loader:
                with autocast(t.precision):
                    logits = self.model(images.to(self.input_dtype))
                loss = F.cross_entropy(logits.float(), labels, reduction="none")
                hit = (logits.argmax(-1) == labels).float()
                totals = totals + torch.stack([(hit * valid).sum(), valid.sum(), (loss * valid).sum()])
                if self.extracting:
                    break  # one batch reaches the eval graph; the results are garbage anyway
        torch_xla.sync()
        correct, count, loss_sum = self.backend.all_sum(totals.cpu().tolist())  # host read, after sync
        self.model.train()
        self.watch.phase("train")
        result = {"eval_accuracy": correct / max(count, 1), "eval_loss": loss_sum / max(count, 1)}
        if self.writes:
            self.metrics.write(self.pos.step, result, kind="eval")
        return result

    # ----- the run ---------------------------------------------------------------------------
    def _stop(self, signum, _frame) -> None:
        self.stop_signal = signum  # acted on at the next step boundary: checkpoint, then exit

    def _end_of_step(self, progress: Progress) -> float:
        """Evaluate / checkpoint / stop checks after a step; returns seconds spent on them (0: none)."""
        start, step, acted = time.perf_counter(), self.pos.step, False
        c, t = self.cfg.checkpoint, self.cfg.train
        last = step == self.total_steps
        epoch_end = self.pos.batch == self.steps_per_epoch * t.grad_accum
        if (t.eval_every and step % t.eval_every == 0) or (not t.eval_every and epoch_end) or last:
            self.eval_result, acted = self.evaluate(), True
            if self.eval_result and self.backend.is_main:
                progress.write(f"step {step}: eval accuracy {self.eval_result['eval_accuracy']:.4f}, "
                               f"loss {self.eval_result['eval_loss']:.4f}")
        if self.nan_step is not None:
            raise RunError(f"loss is not finite at step {self.nan_step}; try a lower --lr, "
                           "--precision fp32 or bf16-autocast, or --grad-clip")
        if (c.checkpoint_every and step % c.checkpoint_every == 0) or last or self.stop_signal:
            path, acted = self.save_checkpoint(), True
            if self.stop_signal:
                raise RunError(f"stopped by signal {self.stop_signal} at step {step}; checkpoint "
                               f"{path or 'saved by rank 0'}; continue with --resume")
        return time.perf_counter() - start if acted else 0.0

    def run(self) -> dict:
        t = self.cfg.train
        if self.cfg.checkpoint.resume is not None and not self.extracting:
            self.resume()
        if self.writes:
            name = "config.yaml" if not self.resumed_from else f"config.resume-{self.pos.step}.yaml"
            save_config(self.cfg, self.run_dir / name)
            self.metrics = MetricsWriter(self.run_dir, self.cfg.log.tensorboard)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._stop)
        progress = Progress(self.cfg.log.progress and self.backend.is_main, self.total_steps, self.pos.step)
        step_times: list[float] = []
        excluded = 0.0
        measure_from = self.pos.step + t.warmup_measure_steps
        t0 = t_prev = None
        start = time.perf_counter()
        self.model.train()
        while self.pos.step < self.total_steps:
            loader = to_device(train_loader(self.data.train, self.cfg.data, batch_size=t.batch_size,
                                            accum=t.grad_accum, world=self.backend.world_size,
                                            rank=self.backend.rank, seed=t.seed, epoch=self.pos.epoch,
                                            start_batch=self.pos.batch),
                               self.backend.device, self.cfg.data.batches_per_execution)
            batches = iter(loader)
            while self.pos.step < self.total_steps and self.pos.batch < self.steps_per_epoch * t.grad_accum:
                self.train_step(batches)
                self.pos.step += 1
                self.pos.batch += t.grad_accum
                if self.pos.step == measure_from:
                    torch_xla.sync()
                    xm.wait_device_ops()  # start the clock with an idle device
                    t0 = t_prev = time.perf_counter()
                    excluded = 0.0
                spent = self._end_of_step(progress)
                now = time.perf_counter()
                if t_prev is not None and self.pos.step > measure_from:
                    if spent == 0.0:
                        step_times.append(now - t_prev)
                    excluded += spent
                t_prev = now
                progress.advance({"loss": f"{self.last['loss']:.4f}"} if self.last else None)
                self.profiler.end_step(self.pos.step - 1, excluded=spent > 0)
            if self.pos.batch >= self.steps_per_epoch * t.grad_accum:
                self.pos.epoch, self.pos.batch = self.pos.epoch + 1, 0
        torch_xla.sync()
        xm.wait_device_ops()
        end = time.perf_counter()
        progress.close()
        self.profile = self.profiler.finish()  # writes profile.json and prints its table (rank 0)
        self.checksums = self._check_replicas()
        return self._summary(start, end, t0, measure_from, excluded, step_times)

    def _optimizer_memory(self) -> dict:
        """Optimizer bytes held by each rank (ZeRO-1 shards them); gathered from all ranks."""
        per_rank = self.backend.all_gather_object(zero1.state_bytes(self.optimizer))
        return {"zero1": self.cfg.optim.zero1,
                **{f"{k}_per_rank": [r[k] for r in per_rank] for k in per_rank[0]}}

    def _check_replicas(self) -> list[float]:
        """Data-parallel replicas must hold the same weights; diverged ones mean a broken reduce.

        One process has nothing to compare: skip the host transfer of every weight it would cost."""
        if self.backend.world_size == 1:
            return []
        checksums = self.backend.all_gather_object(param_checksum(self.model))
        if not self.extracting and any(abs(c - checksums[0]) > 1e-6 * (1 + abs(checksums[0]))
                                       for c in checksums):
            raise RunError(f"data-parallel replicas diverged (parameter checksums {checksums}): "
                           "gradients were not averaged over all ranks")
        return checksums

    def _summary(self, start: float, end: float, t0: float | None, measure_from: int,
                 excluded: float, step_times: list[float]) -> dict:
        t = self.cfg.train
        measured_steps = max(0, self.pos.step - measure_from)
        window = (end - t0 - excluded) if t0 is not None else 0.0
        samples = measured_steps * self._global_batch()
        median, spread = median_and_spread(step_times)
        graphs = self.watch.summary()
        coverage = self.cache.finish(graphs, self.run_dir if self.writes else None)
        exec_data = met.metric_data("ExecuteTime")
        summary = {
            "model": self.cfg.model.name, "params": self.params, "device": self.backend.kind,
            "precision": t.precision, "world_size": self.backend.world_size,
            "batch_size": t.batch_size, "global_batch_size": self._global_batch(),
            "steps": self.pos.step, "epochs": round(self.pos.step / self.steps_per_epoch, 3),
            "samples_per_sec": samples / window if window > 0 else None,
            "step_time_ms_median": median * 1e3 if step_times else None,
            "step_time_ms_spread": spread * 1e3 if step_times else None,
            "measured_steps": measured_steps, "warmup_steps_excluded": t.warmup_measure_steps,
            "compile_count": graphs["compile_count"], "compile_time_s": graphs["compile_time_s"],
            "precompile_coverage": coverage,
            "xla_execute_ms_median": _median_ms(exec_data), "wall_time_s": end - start,
            "final_loss": self.last.get("loss"), **self.eval_result,
            "param_checksums": self.checksums, "resumed_from": self.resumed_from, "run_dir": str(self.run_dir),
            **self.task.info(),  # e.g. teacher/student parameters, samples back-propagated
            **self._optimizer_memory(),
            **({"bottleneck": self.profile.get("bottleneck")} if self.profile else {}),
        }
        if self.writes:
            write_json_atomic(self.run_dir / "summary.json", summary)
            write_json_atomic(self.run_dir / "graphs.json", graphs)
            self.metrics.close()
        return summary


def param_checksum(model: torch.nn.Module) -> float:
    """A position-weighted sum of all weights (one host transfer per tensor, at the end of a run)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        total += (i + 1) * float(p.detach().cpu().double().sum())
    return total


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _median_ms(data) -> float | None:
    """Median of a torch_xla timing metric (samples are in ns), or None before any sample."""
    if not data or not data[2]:
        return None
    values = sorted(v for _, v in data[2])
    return values[len(values) // 2] / 1e6


def train(cfg: RunConfig, backend: Backend) -> dict:
    return Trainer(cfg, backend).run()
