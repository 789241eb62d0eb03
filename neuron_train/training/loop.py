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

import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from neuron_train.common.errors import RunError
from neuron_train.common.fileio import write_json_atomic
from neuron_train.common.neuron_env import extracting_graphs
from neuron_train.graphs import GraphWatch
from neuron_train.training import zero1
from neuron_train.training.build import build_data, build_run, steps_per_epoch, total_steps
from neuron_train.training.cache_hook import CompileCacheHook
from neuron_train.training.checkpoint import write_failed_in_run
from neuron_train.training.checkpointer import Checkpointer, Position
from neuron_train.training.config import RunConfig
from neuron_train.training.config_io import save_config
from neuron_train.training.data import Batch, to_device
from neuron_train.training.device import Backend
from neuron_train.training.evaluator import Evaluator
from neuron_train.training.metrics import MetricsWriter, Progress
from neuron_train.training.optim import lr_at
from neuron_train.training.profiler import build_profiler
from neuron_train.training.rundir import open_run_dir
from neuron_train.training.summary import RunSummary
from neuron_train.training.throughput import Throughput


class Trainer:
    def __init__(self, cfg: RunConfig, backend: Backend) -> None:
        self.backend = backend
        self.extracting = extracting_graphs()
        self.writes = backend.is_main and not self.extracting  # only rank 0 writes, never garbage
        t = cfg.train
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        np.random.seed(t.seed)  # for libraries drawing from numpy (timm's Mixup seeds its own: augment.py)
        xm.set_rng_state(t.seed)
        # training/rundir.py: lock, clean-up; the config to run (a restarted run resumes nothing)
        self.run_dir, self.cfg = open_run_dir(cfg, backend, self.extracting)
        cfg = self.cfg
        self.data = build_data(cfg)
        # --compile-cache: records the graph manifest (graph tour) or checks against it; set up before
        # anything reaches the XLA device (torch_xla's cache must be initialised first)
        self.cache = CompileCacheHook(cfg, backend, num_classes=self.data.num_classes)
        self.pos = Position()
        self.watch = GraphWatch(cfg.compile.graph_warmup_steps, cfg.compile.check_graphs)
        # build.py: the recipe's training set, the model (and --model-ema), the task, the step (--step-compiler)
        self.built = build_run(cfg, backend, self.data, step=lambda: self.pos.step, mark_phase=self.watch.phase)
        self.model, self.params, self.ema = self.built.model, self.built.params, self.built.ema
        self.task, self.step_path = self.built.task, self.built.path
        self.input_dtype = self.step_path.input_dtype
        self.optimizer = self.step_path.optimizer
        self.steps_per_epoch = steps_per_epoch(cfg, len(self.data.train), backend.world_size)
        self.total_steps = total_steps(cfg, self.steps_per_epoch)
        if self.extracting:
            self.total_steps = min(self.total_steps, t.precompile_steps)
        self.evaluator = Evaluator(cfg, self.data.val, backend, self.model, self.watch, ema=self.ema,
                                   input_dtype=self.input_dtype, extracting=self.extracting)
        self.checkpointer = Checkpointer(cfg, backend, self.run_dir, self.watch, writes=self.writes,
                                         extracting=self.extracting)
        self.profiler = build_profiler(cfg, self.run_dir if self.writes else None)
        self.metrics: MetricsWriter | None = None   # rank 0's metrics.jsonl / TensorBoard
        self.resumed_from: str | None = None
        self.live: tuple = ()                        # the last step's logged tensors (graph outputs)
        self.last: dict[str, float] = {}             # the last logged step's values
        self.eval_result: dict[str, float] = {}
        self.nan_step: int | None = None
        self.stop_signal: int | None = None

    def _global_batch(self) -> int:
        return self.checkpointer.global_batch

    # ----- one optimizer step ----------------------------------------------------------------
    def train_step(self, batches: Iterator[Batch]) -> None:
        prof = self.profiler  # phase marks; a no-op object without --profile
        lr = lr_at(self.pos.step, self.cfg.optim, self.total_steps)  # host arithmetic: no graph
        # prof.next: the graph boundary, the previous step starts executing (step.py's StepPath.step)
        losses, grad_norm = self.step_path.step(lambda: prof.next(batches), lr, prof.mark)
        self._after_step(losses, grad_norm, lr)
        prof.mark("optimizer")

    def _after_step(self, losses: dict, grad_norm: torch.Tensor, lr: float) -> None:
        """Step closures: graph watch, precompile check, logging; they run once the step has executed."""
        step = self.pos.step
        # Keep the same tensors alive every step: live tensors are the graph's outputs, so logging
        # only on some steps would otherwise give those steps a different graph.
        self.live = (losses, grad_norm)
        xm.add_step_closure(self.watch.step_end, args=(step,))
        xm.add_step_closure(self.cache.check, args=(self.watch,))  # --require-precompiled
        if step % self.cfg.log.log_every == 0 or step == self.total_steps - 1:
            xm.add_step_closure(self._log_step, args=(step, losses, grad_norm, lr), run_async=True)

    def _log_step(self, step: int, losses: dict, grad_norm: torch.Tensor, lr: float) -> None:
        """Runs after the step executed, off the main thread: the device values are ready."""
        values = {k: float(v.detach().cpu()) for k, v in losses.items()}  # device->host copy
        values.update(grad_norm=float(grad_norm.cpu()), lr=lr)
        self.last = values
        if not self.extracting and not all(map(_finite, values.values())) and self.nan_step is None:
            self.nan_step = step
        if self.metrics is not None:
            self.metrics.write(step, values)

    # ----- between steps ---------------------------------------------------------------------
    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.stop_signal is not None:  # a second Ctrl-C: abort now
            print(f"\ninterrupted again at step {self.pos.step}: stopped without saving; the last "
                  "checkpoint is kept, continue with --resume", file=sys.stderr, flush=True)
            os._exit(130)  # no unwinding through the loader's and closures' threads (no traceback)
        self.stop_signal = signum  # acted on at the next step boundary: checkpoint, then exit

    def _stopping(self) -> bool:
        """Whether every rank stops at this step boundary: a stop signal reached any of them.
        Ranks are signalled one by one (torchrun, srun) and may see it at different boundaries; a rank
        that stopped alone would leave the others waiting in their next collective until killed, with
        no checkpoint. So the ranks agree, one host all-reduce of a flag a step (gloo: no device sync)."""
        mine = self.stop_signal is not None
        if self.backend.world_size == 1:
            return mine
        return self.backend.all_sum([float(mine)])[0] > 0

    def _end_of_step(self, progress: Progress) -> float:
        """Evaluate / checkpoint / stop checks after a step; returns seconds spent on them (0: none)."""
        step = self.pos.step
        last = step == self.total_steps
        epoch_end = self.pos.batch == self.steps_per_epoch * self.cfg.train.grad_accum
        evaluate = self.evaluator.should_evaluate(step, epoch_end=epoch_end, last=last)
        # this rank's own flag (no collective): it only decides the wait below
        if evaluate or self.checkpointer.should_save(step, last=last, stopping=self.stop_signal is not None):
            # Host waits for the device: the steps launched so far are training time. Without this
            # the eval/checkpoint clock below would count their execution (a captured step path
            # runs ahead of the device) and the throughput window would leave it out.
            xm.wait_device_ops()
        start, acted = time.perf_counter(), False
        if evaluate:
            self.eval_result, acted = self.evaluator.evaluate(), True
            if self.eval_result and self.metrics is not None:
                self.metrics.write(step, self.eval_result, kind="eval")
            if self.eval_result and self.backend.is_main:
                ema = self.eval_result.get("eval_ema_accuracy")
                progress.write(f"step {step}: eval accuracy {self.eval_result['eval_accuracy']:.4f}, "
                               f"loss {self.eval_result['eval_loss']:.4f}"
                               + (f"; EMA accuracy {ema:.4f}, loss {self.eval_result['eval_ema_loss']:.4f}"
                                  if ema is not None else ""))
        if self.nan_step is not None:
            raise RunError(f"loss is not finite at step {self.nan_step}; try a lower --lr, "
                           "--precision fp32 or bf16-autocast, or --grad-clip")
        self._check_metrics()
        # asked again, not reused from above: a stop signal may have arrived during the evaluation
        stopping = self._stopping()
        if self.checkpointer.should_save(step, last=last, stopping=stopping):
            path, acted = self.checkpointer.save(self.model, self.optimizer, self.pos, self.ema), True
            if stopping:
                why = (signal.Signals(self.stop_signal).name if self.stop_signal is not None
                       else "a stop signal to another rank")
                raise RunError(f"stopped by {why} at step {step}; checkpoint "
                               f"{path or 'saved by rank 0'}; continue with --resume")
        return time.perf_counter() - start if acted else 0.0

    # ----- the run ---------------------------------------------------------------------------
    def _start(self) -> Progress:
        """Resume, write the configuration, catch stop signals; returns the progress bar."""
        if self.cfg.checkpoint.resume is not None and not self.extracting:
            self.pos, path = self.checkpointer.resume(self.model, self.optimizer, self.ema)
            self.resumed_from = str(path)
        if self.writes:
            name = "config.yaml" if not self.resumed_from else f"config.resume-{self.pos.step}.yaml"
            save_config(self.cfg, self.run_dir / name)
            self.metrics = MetricsWriter(self.run_dir, self.cfg.log.tensorboard,
                                         resume_step=self.pos.step if self.resumed_from else None)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # Ctrl-C too: save, then stop
            signal.signal(sig, self._stop)
        return Progress(self.cfg.log.progress and self.backend.is_main, self.total_steps, self.pos.step)

    def _epoch_batches(self) -> Iterator[Batch]:
        """This rank's batches for the rest of the current epoch, on the device (MpDeviceLoader)."""
        b = self.backend
        loader = self.built.epoch_loader(world=b.world_size, rank=b.rank, epoch=self.pos.epoch,
                                         start_batch=self.pos.batch)
        return iter(to_device(loader, b.device, self.cfg.data.batches_per_execution))

    def run(self) -> RunSummary:
        progress = self._start()
        clock = Throughput(self.pos.step, self.cfg.train.warmup_measure_steps)
        accum, epoch_batches = self.cfg.train.grad_accum, self.steps_per_epoch * self.cfg.train.grad_accum
        self.model.train()
        while self.pos.step < self.total_steps:
            batches = self._epoch_batches()
            while self.pos.step < self.total_steps and self.pos.batch < epoch_batches:
                self.train_step(batches)
                self.pos.step += 1
                self.pos.batch += accum
                clock.step_traced(self.pos.step)
                spent = self._end_of_step(progress)
                clock.lap(spent)
                progress.advance({"loss": f"{self.last['loss']:.4f}"} if self.last else None)
                self.profiler.end_step(self.pos.step - 1, excluded=spent > 0)
            if self.pos.batch >= epoch_batches:
                self.pos.epoch, self.pos.batch = self.pos.epoch + 1, 0
        clock.stop()
        progress.close()
        return self._finish(clock)

    # ----- the end ---------------------------------------------------------------------------
    def _finish(self, clock: Throughput) -> RunSummary:
        profile = self.profiler.finish()  # writes profile.json and prints its table (rank 0)
        checksums = self._check_replicas()
        graphs = self.watch.summary()
        coverage = self.cache.finish(graphs, self.run_dir if self.writes else None)
        t = self.cfg.train
        evals: dict[str, Any] = dict(self.eval_result)  # eval_accuracy, eval_loss (and the EMA's): its fields
        summary = RunSummary(
            model=self.cfg.model.name, params=self.params, device=self.backend.kind, precision=t.precision,
            world_size=self.backend.world_size, batch_size=t.batch_size, global_batch_size=self._global_batch(),
            steps=self.pos.step, epochs=round(self.pos.step / self.steps_per_epoch, 3),
            **clock.figures(self._global_batch()),
            compile_count=graphs.compile_count, compile_time_s=graphs.compile_time_s, precompile_coverage=coverage,
            xla_execute_ms_median=_median_ms(met.metric_data("ExecuteTime")), final_loss=self.last.get("loss"),
            **evals, param_checksums=checksums, resumed_from=self.resumed_from, run_dir=str(self.run_dir),
            extra={**self.task.info(),  # e.g. teacher/student parameters, samples back-propagated
                   **self._optimizer_memory(), **({"bottleneck": profile.get("bottleneck")} if profile else {})})
        if self.metrics is not None:  # made by _start on the rank that writes
            self.metrics.close()
        if self.writes:
            self._check_metrics()
            # summary.json last: it marks the run complete. Each file is whole or absent.
            for name, data in (("graphs.json", graphs.to_json()), ("summary.json", summary.to_json())):
                try:
                    write_json_atomic(self.run_dir / name, data)
                except OSError as exc:
                    raise write_failed_in_run(self.run_dir, self.run_dir / name, exc,
                                              f"{name} was not written") or exc from None
        return summary

    def _check_metrics(self) -> None:
        """Stop the run when a record could not be appended to metrics.jsonl (a full disk)."""
        m = self.metrics
        if m is not None and m.error is not None:
            raise write_failed_in_run(self.run_dir, m.path, m.error, f"{m.path.name} holds no records "
                                      f"from step {m.failed_step} on") or m.error from None

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


def param_checksum(model: torch.nn.Module) -> float:
    """A position-weighted sum of all weights (one host transfer per tensor, at the end of a run)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        total += (i + 1) * float(p.detach().cpu().double().sum())
    return total


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _median_ms(data: tuple[int, float, list[tuple[float, float]]] | None) -> float | None:
    """Median of a torch_xla timing metric (samples are in ns), or None before any sample."""
    if not data or not data[2]:
        return None
    values = sorted(v for _, v in data[2])
    return values[len(values) // 2] / 1e6


def train(cfg: RunConfig, backend: Backend) -> RunSummary:
    return Trainer(cfg, backend).run()
