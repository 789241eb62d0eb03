#!/usr/bin/env python3
"""Benchmark: our training loop's step paths against a plain hand-written torch_xla loop, side by side.

Every loop trains the same timm model on the same synthetic batches (one process at a time, each
run in a fresh process, on the current XLA device) and is timed the same way: after warm-up steps,
from an idle device to an idle device. Runs are interleaved (baseline, candidate 1, 2, ..., then
again) and the table shows medians, so a busy machine slows every loop alike.

Phases of every run: warm-up steps (compiles), then device steps run one at a time (the host waits
for the device after each step, so no execution queues behind another and XLA's ExecuteTime is the
device's own time for a step), then the measured steps, free-running as in training.

Columns: samples/s and wall ms per step of the measured steps; device ms per step (ExecuteTime
summed over a step's executions, from the device steps); wall / device: how much longer a step takes
than the device needs for it (above 1: the device waits for the host; 1: the host is off the
critical path); the process's CPU ms per step (host and XLA's CPU execution together). The last line
bounds what any loop can gain over the baseline by host work alone: its wall / device.

    python scripts/bench_loop.py                         # ViT-Tiny/16 at 64 px, batch 32, fp32
    python scripts/bench_loop.py --model vit-digits --img-size 32 --num-classes 10   # the default run
    python scripts/bench_loop.py --loops baseline,lazy,dynamo-full --repeats 5

--outside times whole processes instead, as a user sees them: `neuron-train train` with the CPU
defaults and the plain loop as a script of its own (`plain_loop`: MpDeviceLoader + AdamW +
xm.optimizer_step), each run for 10 and for 40 steps; the steady step is (t40 - t10) / 30, so start-up,
compiles, the final evaluation and checkpoint cancel out (the table takes t10 and t40 as medians over the
rounds; the per-round figures show how far start-up moves a single round). Both draw the same synthetic set through a
DataLoader with the same workers; ours also clips gradients, follows its LR schedule, logs every 10 steps
and records graphs (the plain loop prints its loss every 10 steps).

Whole processes of one length still start up seconds apart (imports, 7-9 compiles on 2 shared cores), as
much as 30 steps take. So --outside also reads each long run's steady step without its start-up: this
script notes when the run's step-10 and last-step log records appear (the plain loop's `step N` lines,
our loop's metrics.jsonl records, each written once its step has executed) and divides their time apart
by the steps between. The last line of the table gives that reading.

    python scripts/bench_loop.py --outside --repeats 3   # ViT-Tiny/16, 64 px, batch 32, fp32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

ROOT = Path(__file__).resolve().parent.parent
# Our loop's step paths: name -> config overrides (+ "syncfree": torch_xla's AdamW swapped in).
CANDIDATES: dict[str, dict] = {
    "lazy": {"train.step_compiler": "lazy", "optim.optimizer_impl": "for-loop"},
    "lazy-syncfree": {"train.step_compiler": "lazy", "optim.optimizer_impl": "for-loop", "syncfree": True},
    "lazy-foreach": {"train.step_compiler": "lazy", "optim.optimizer_impl": "foreach"},
    "lazy-flat": {"train.step_compiler": "lazy", "optim.optimizer_impl": "flat"},
    # 4 steps per execution; logging every 2nd step gives every execution the same graph (see --warmup).
    "lazy-foreach-bpe4": {"train.step_compiler": "lazy", "optim.optimizer_impl": "foreach",
                          "data.batches_per_execution": 4, "log.log_every": 2},
    "dynamo": {"train.step_compiler": "dynamo", "optim.optimizer_impl": "for-loop"},
    "dynamo-foreach": {"train.step_compiler": "dynamo", "optim.optimizer_impl": "foreach"},
    "dynamo-full": {"train.step_compiler": "dynamo-full", "optim.optimizer_impl": "foreach"},
}
LOOPS = ("baseline", *CANDIDATES)
FIGURES = ("samples_per_sec", "wall_ms", "device_ms", "cpu_ms")
SYNTHETIC_SIZE = 2048  # our loop's default --synthetic-size
OUTSIDE_STEPS = "10,40"  # --outside: whole runs of each length; the steady step is their difference


def synthetic_size(batch: int, steps: int) -> int:
    """The synthetic set both loops draw from in a run of `steps`: one epoch covers the run, so no
    epoch-end evaluation (ours) falls among the timed steps."""
    return max(SYNTHETIC_SIZE, batch * steps)


class Phases:
    """Called before each step: device steps one at a time after the warm-up, then the measured ones."""

    def __init__(self, args: argparse.Namespace):
        self.first_device, self.first_measured = args.warmup, args.warmup + args.device_steps
        self.device_steps, self.device_ms, self.cpu0 = args.device_steps, 0.0, 0.0
        self.cpu_end: float | None = None

    def before(self, step: int) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        if self.first_device <= step <= self.first_measured:
            xm.wait_device_ops()  # the steps before ran alone: no execution queued behind another
        if step == self.first_device:
            _one_graph_at_a_time(True)
            met.clear_all()
        elif step == self.first_measured:
            _one_graph_at_a_time(False)
            self.device_ms = _execute_ms() / self.device_steps
            met.clear_all()
            self.cpu0 = time.process_time()

    def stop(self) -> None:
        """The measured steps are over: the CPU column stops here (not after a loop's teardown)."""
        self.cpu_end = time.process_time()

    def result(self, steps: int, batch: int, wall_s: float) -> dict:
        cpu_end = self.cpu_end if self.cpu_end is not None else time.process_time()
        return {"samples_per_sec": steps * batch / wall_s, "wall_ms": wall_s / steps * 1e3,
                "device_ms": self.device_ms, "cpu_ms": (cpu_end - self.cpu0) / steps * 1e3}


class Watch(Protocol):
    """Something run alongside the measured steps of `ours` (bench_ops.py: the profiler's trace)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


_RUN_CACHED_GRAPH: list = []  # torch_xla's own, while _one_graph_at_a_time replaces it


def _one_graph_at_a_time(on: bool) -> None:
    """Dynamo launches a step's graphs back to back (forward, backward, update): the next one's
    ExecuteTime would include its wait behind the previous. While on, each waits for the device."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    if on and not _RUN_CACHED_GRAPH:
        _RUN_CACHED_GRAPH.append(torch_xla._XLAC._run_cached_graph)

        def run_alone(graph_hash, graph_input):
            out = _RUN_CACHED_GRAPH[0](graph_hash, graph_input)
            xm.wait_device_ops()  # this graph finished before the host launches anything else
            return out

        torch_xla._XLAC._run_cached_graph = run_alone
    elif not on and _RUN_CACHED_GRAPH:
        torch_xla._XLAC._run_cached_graph = _RUN_CACHED_GRAPH.pop()


def _execute_ms() -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return data[1] / 1e6 if data else 0.0


def plain_loop(args: argparse.Namespace, steps: int, before: Callable[[int], None] | None = None) -> float:
    """The hand-written loop a torch_xla user writes first (the shape of Neuron's samples and pytorch/xla's
    train_resnet_base.py): MpDeviceLoader + AdamW + xm.optimizer_step, the loss printed every 10 steps
    from a step closure. The same model, data and loader settings as our loop's defaults; no clipping,
    no LR schedule. `steps` steps, each after `before(step)`; returns the last logged loss."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    from neuron_train.training.data import SyntheticDataset
    from neuron_train.training.models import create_model

    torch.manual_seed(0)
    dev = torch_xla.device()
    model = create_model(args.model, num_classes=args.num_classes, img_size=args.img_size).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    ds = SyntheticDataset(synthetic_size(args.batch_size, steps), args.img_size, args.num_classes)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         num_workers=args.workers)
    logged: list[float] = []

    def log(step: int, loss: torch.Tensor) -> None:
        logged.append(float(loss))  # a device->host copy: waits for the step, as a user's print does
        print(f"step {step} loss {logged[-1]:.4f}", flush=True)  # --outside times these lines (watch_logs)

    for step, (x, y) in enumerate(pl.MpDeviceLoader(loader, dev)):  # each fetch: the previous step's sync
        if step == steps:
            break
        if before is not None:
            before(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        xm.optimizer_step(opt)
        if step % 10 == 0 or step == steps - 1:
            xm.add_step_closure(log, args=(step, loss))  # read once executed
    torch_xla.sync()  # the last step's graph: no next batch will cut it
    xm.wait_device_ops()  # the process ends with the last step executed, as ours does
    return logged[-1]


def baseline(args: argparse.Namespace) -> dict:
    """The plain loop, timed by the phases as ours is: from an idle device to an idle device."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    phases, t0 = Phases(args), [0.0]

    def before(step: int) -> None:
        phases.before(step)
        if step == phases.first_measured:
            torch_xla.sync()
            xm.wait_device_ops()  # start the clock on an idle device
            t0[0] = time.perf_counter()

    plain_loop(args, _total_steps(args), before)
    return phases.result(args.steps, args.batch_size, time.perf_counter() - t0[0])


def _total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.device_steps + args.steps


def _swap_in_syncfree(trainer) -> None:
    """torch_xla.amp.syncfree.AdamW over the same parameter groups (what Neuron's AMP samples use)."""
    from torch_xla.amp import syncfree

    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in trainer.optimizer.param_groups]
    trainer.optimizer = trainer.step_path.optimizer = syncfree.AdamW(groups, lr=trainer.cfg.optim.lr)


def ours(args: argparse.Namespace, which: str, watch: Watch | None = None) -> dict:
    """Our loop (training.loop.Trainer) with its defaults (AdamW, clipping, LR schedule, logging
    closures, graph recording) and the candidate's step path; `watch` starts with the measured steps
    and stops with them (bench_ops.py's profiler trace)."""
    from neuron_train.training.config_io import build_config
    from neuron_train.training.device import init_backend, resolve_precision

    spec = dict(CANDIDATES[which])
    syncfree = spec.pop("syncfree", False)
    with tempfile.TemporaryDirectory() as out:
        cfg = build_config(overrides={
            "model.name": args.model, "model.img_size": args.img_size, "model.num_classes": args.num_classes,
            "data.dataset": "synthetic", "data.synthetic_size": synthetic_size(args.batch_size, _total_steps(args)),
            "train.batch_size": args.batch_size, "train.max_steps": _total_steps(args),
            "train.warmup_measure_steps": args.warmup + args.device_steps, "train.eval_every": 10**9,
            "train.output_dir": out, "log.progress": False, "log.tensorboard": False,
            "data.num_workers": args.workers, **spec,  # the baseline's DataLoader workers
        })
        cfg = resolve_precision(cfg)
        from neuron_train.training.loop import Trainer

        trainer = Trainer(cfg, init_backend())
        if syncfree:
            _swap_in_syncfree(trainer)
        trainer.evaluator.val = None  # time training only, like the baseline
        original, phases = trainer.train_step, Phases(args)

        def step(batches):
            phases.before(trainer.pos.step)  # the loop's own clock starts at the measured steps
            if watch is not None and trainer.pos.step == phases.first_measured:
                watch.start()
            original(batches)

        trainer.train_step = step
        finish = trainer._finish

        def finish_after_stop(*args):
            phases.stop()  # the loop's clock has stopped on an idle device; teardown follows
            if watch is not None:
                watch.stop()
            return finish(*args)

        trainer._finish = finish_after_stop
        s = trainer.run()
    return phases.result(args.steps, args.batch_size, args.steps * args.batch_size / s.samples_per_sec)


def outside_command(which: str, steps: int, args: argparse.Namespace, out: str) -> list[str]:
    """A whole run as a user starts it: `neuron-train train` with the CPU defaults, or the plain loop."""
    shape = ["--model", args.model, "--img-size", str(args.img_size), "--num-classes", str(args.num_classes),
             "--batch-size", str(args.batch_size), "--num-workers", str(args.workers)]
    if which == "plain":
        return [sys.executable, __file__, "--_plain", str(steps), *shape]
    return [sys.executable, "-m", "neuron_train", "train", *shape, "--dataset", "synthetic",
            "--synthetic-size", str(synthetic_size(args.batch_size, steps)), "--max-steps", str(steps),
            "--output-dir", out]


IN_RUN_FROM = 10  # --outside's in-run reading starts at this logged step: compiles end by step 2


class Run(NamedTuple):
    """One whole process as seen from outside: wall and CPU seconds, and the in-run steady step."""

    wall: float
    cpu: float
    in_run_ms: float | None  # ms/step between its log records of step IN_RUN_FROM and its last step


def in_run_ms(seen: dict[int, float]) -> float | None:
    """ms per step between the first record of a step >= IN_RUN_FROM and the last step's record,
    from the times (s) each logged step's record appeared; None without two such records."""
    steps = sorted(k for k in seen if k >= IN_RUN_FROM)
    if len(steps) < 2:
        return None
    return (seen[steps[-1]] - seen[steps[0]]) / (steps[-1] - steps[0]) * 1e3


def plain_log_step(line: str) -> int | None:
    """The step of one of the plain loop's log lines (`step 10 loss 6.9541`, plain_loop's `log`), else None."""
    words = line.split()
    return int(words[1]) if len(words) >= 2 and words[0] == "step" and words[1].isdigit() else None


def metrics_log_steps(text: str) -> list[int]:
    """The training steps of the whole records in our loop's metrics.jsonl text (a record is appended
    whole by one write, so only a last line without its newline can be unfinished)."""
    records = (json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines())
    return [r["step"] for r in records if r.get("kind") == "train"]


def watch_logs(proc: subprocess.Popen, which: str, run_dir: Path) -> dict[int, float]:
    """When (perf_counter s) each logged step's record appeared, until `proc` ends: the plain loop's
    lines on its stdout, our loop's records in metrics.jsonl (polled every 20 ms: a record is seen up to
    20 ms late, about 0.3% of 29 steps of 200 ms)."""
    seen: dict[int, float] = {}
    if which == "plain":
        assert proc.stdout is not None
        for line in proc.stdout:  # flushed as each step's loss is read
            step = plain_log_step(line)
            if step is not None:
                seen.setdefault(step, time.perf_counter())
        proc.wait()
        return seen
    metrics = run_dir / "metrics.jsonl"
    while True:
        ended = proc.poll() is not None  # read once more after the end: the last records
        now = time.perf_counter()
        if metrics.exists():
            for step in metrics_log_steps(metrics.read_text()):
                seen.setdefault(step, now)
        if ended:
            return seen
        time.sleep(0.02)


def time_outside(which: str, steps: int, args: argparse.Namespace) -> Run:
    """One whole process: wall and CPU seconds (start-up, compiles and teardown included) and the steady
    step between two of its log records, both timed here, from outside."""
    env = {**os.environ, "PJRT_DEVICE": _device(), "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = outside_command(which, steps, args, str(run_dir))
        with open(Path(tmp) / "stderr", "w+") as err:
            cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if which == "plain" else subprocess.DEVNULL,
                                    stderr=err, text=True, cwd=tmp)
            seen = watch_logs(proc, which, run_dir)
            wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            err.seek(0)
            if proc.returncode != 0:
                sys.exit(f"{which} ({steps} steps) failed: {' '.join(cmd)}\n{err.read()[-3000:]}")
    return Run(wall, (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), in_run_ms(seen))


def outside(args: argparse.Namespace) -> None:
    """Rounds of (plain, ours) x (short, long runs: --outside-steps, 10 and 40 by default), each a whole
    process; steady step = (t_long - t_short) / (long - short), per round and from the medians of each
    run length over the rounds (a round whose start-up ran long moves one median, not the result)."""
    short, long = args.outside_steps
    print(f"from outside: {args.model} at {args.img_size} px, batch {args.batch_size}, fp32, AdamW, synthetic "
          f"data, {args.workers} loader workers; whole runs of {short} and {long} steps, {args.repeats} "
          f"interleaved rounds, device {_device()}", flush=True)
    runs: dict[tuple[str, int], list[Run]] = {}  # (loop, steps) -> one Run per round
    for r in range(args.repeats):
        for n in args.outside_steps:
            for which in ("plain", "ours") if r % 2 == 0 else ("ours", "plain"):
                runs.setdefault((which, n), []).append(time_outside(which, n, args))
        for which in ("plain", "ours"):
            a, b = runs[which, short][-1], runs[which, long][-1]
            print(f"  round {r + 1} {which}: {short} steps {a.wall:.1f} s, {long} steps {b.wall:.1f} s, "
                  f"steady {(b.wall - a.wall) / (long - short) * 1e3:.1f} ms/step; in the {long}-step run "
                  f"{'-' if b.in_run_ms is None else f'{b.in_run_ms:.1f}'} ms/step", file=sys.stderr, flush=True)

    def median_s(which: str, n: int, figure: int = 0, rounds: slice = slice(None)) -> float:
        """The median over the chosen rounds of the n-step runs' wall (figure 0) or CPU (1) seconds."""
        return statistics.median((run.wall, run.cpu)[figure] for run in runs[which, n][rounds])

    def steady(which: str, figure: int, rounds: slice = slice(None)) -> float:
        """ms per step between the two run lengths, from the medians of the chosen rounds' runs."""
        return (median_s(which, long, figure, rounds) - median_s(which, short, figure, rounds)) / (long - short) * 1e3

    per_round = {which: [steady(which, 0, slice(r, r + 1)) for r in range(args.repeats)] for which in ("plain", "ours")}
    ratios = [p / o for p, o in zip(per_round["plain"], per_round["ours"], strict=True)]
    print(f"{'loop':<8}{'steady ms/step':>16}{'samples/s':>11}{'CPU ms/step':>13}{'vs plain':>10}"
          f"{f'{short}-step run s':>16}{f'{long}-step run s':>16}  steady per round")
    for which in ("plain", "ours"):
        wall = steady(which, 0)
        lengths = "".join(f"{median_s(which, n):>16.1f}" for n in (short, long))
        print(f"{which:<8}{wall:>16.1f}{args.batch_size / wall * 1e3:>11.1f}{steady(which, 1):>13.1f}"
              f"{steady('plain', 0) / wall:>9.2f}x{lengths}  {', '.join(f'{v:.0f}' for v in per_round[which])}")
    print(f"medians of {args.repeats} rounds per run length; ratio per round: {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f}x)")
    print_in_run(runs, long)


def print_in_run(runs: dict[tuple[str, int], list[Run]], long: int) -> None:
    """The second reading, free of start-up: in each long run, the steady step between two of its log
    records as they appeared (step IN_RUN_FROM and the last), the median over the rounds and the ratio."""
    pairs = [(p.in_run_ms, o.in_run_ms) for p, o in zip(runs["plain", long], runs["ours", long], strict=True)
             if p.in_run_ms is not None and o.in_run_ms is not None]
    if not pairs:
        print(f"in-run: the {long}-step runs log no two steps from step {IN_RUN_FROM} on (give a longer run)")
        return
    med = {which: statistics.median(pair[k] for pair in pairs) for k, which in enumerate(("plain", "ours"))}
    ratios = [p / o for p, o in pairs]
    print(f"in-run (each {long}-step run, from its step-{IN_RUN_FROM} log record to its last, timed here): "
          f"plain {med['plain']:.1f} ms/step, ours {med['ours']:.1f}: {med['plain'] / med['ours']:.2f}x "
          f"(medians; per round {', '.join(f'{x:.2f}' for x in ratios)})")


def run_one(which: str, args: argparse.Namespace) -> dict:
    """Each measurement in a fresh process: clean metrics, compile caches and memory."""
    cmd = [sys.executable, __file__, "--_one", which, "--model", args.model, "--img-size", str(args.img_size),
           "--num-classes", str(args.num_classes), "--batch-size", str(args.batch_size),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device-steps", str(args.device_steps),
           "--num-workers", str(args.workers)]
    env = {**os.environ, "PJRT_DEVICE": _device(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{which} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _step_pair(text: str) -> tuple[int, int]:
    try:
        short, long = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give two step counts, e.g. 10,40") from None
    if not 0 < short < long:
        raise argparse.ArgumentTypeError(f"{text!r}: the first count must be positive and below the second")
    return short, long


def _device() -> str:
    """The children's PJRT device: PJRT_DEVICE, else this machine's (Neuron when present, else CPU)."""
    from neuron_train.common.neuron_env import default_pjrt_device

    return default_pjrt_device()


def default_loop() -> str:
    """The candidate that is our loop's default configuration on this machine's device."""
    from neuron_train.training.config_io import build_config

    cfg = build_config(device_kind=_device())
    wanted = {"train.step_compiler": cfg.train.step_compiler, "optim.optimizer_impl": cfg.optim.optimizer_impl}
    return next((name for name, spec in CANDIDATES.items() if spec == wanted), "?")


def print_table(results: dict[str, list[dict]], repeats: int) -> None:
    default = default_loop()
    print(f"{'loop':<22}{'samples/s':>10}{'wall ms/step':>14}{'device ms/step':>16}{'wall/device':>13}"
          f"{'CPU ms/step':>13}{'vs baseline':>13}")
    med = {which: {k: statistics.median(r[k] for r in runs) for k in FIGURES} for which, runs in results.items()}
    first = med.get("baseline", next(iter(med.values())))
    for which, m in med.items():
        name = which + (" (default)" if which == default else "")
        print(f"{name:<22}{m['samples_per_sec']:>10.1f}{m['wall_ms']:>14.1f}{m['device_ms']:>16.1f}"
              f"{m['wall_ms'] / m['device_ms']:>13.2f}{m['cpu_ms']:>13.1f}"
              f"{m['samples_per_sec'] / first['samples_per_sec']:>12.2f}x")
    print(f"medians of {repeats} interleaved runs each, every run a fresh process")
    if "baseline" in med:  # the device's part of the baseline's step is a floor for any loop of the same graphs
        print(f"bound: a loop with no host cost and the baseline's device time runs "
              f"{first['wall_ms'] / first['device_ms']:.2f}x the baseline (its wall / device)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and batch every loop trains (this script's and bench_ops.py's): ViT-Tiny/16 at 64 px."""
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=40, help="measured steps (a multiple of 4: see bpe4)")
    # 11 + 8 = 4k + 3: MpDeviceLoader with 4 batches per execution cuts before batches 3, 7, 11, ...;
    # the clock's syncs after 19 and 19 + steps batches then fall on those cuts, adding no graph.
    p.add_argument("--warmup", type=int, default=11, help="steps left out (compiles happen here)")
    p.add_argument("--device-steps", type=int, default=8, help="steps run one at a time for the device time")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loop, interleaved")
    p.add_argument("--loops", default=",".join(LOOPS), help="comma-separated subset of: " + ", ".join(LOOPS))
    p.add_argument("--num-workers", dest="workers", type=int, default=0,
                   help="DataLoader workers of every loop (0: our default for synthetic data)")
    p.add_argument("--outside", action="store_true", help="time whole processes of `neuron-train train` "
                   "(CPU defaults) and the plain loop, runs of two lengths (--outside-steps): steady step = "
                   "their time's difference over the steps between")
    p.add_argument("--outside-steps", type=_step_pair, default=OUTSIDE_STEPS, metavar="SHORT,LONG",
                   help="--outside: the two run lengths (default %(default)s; longer runs read through start-up "
                   "noise; each run's synthetic set holds all its batches, one epoch)")
    p.add_argument("--_one", choices=LOOPS, help=argparse.SUPPRESS)
    p.add_argument("--_plain", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._plain:
        print(f"final loss {plain_loop(args, args._plain):.4f}")
        return
    if args.outside:
        outside(args)
        return
    if args._one:
        print(json.dumps(baseline(args) if args._one == "baseline" else ours(args, args._one)))
        return
    loops = args.loops.split(",")
    unknown = [name for name in loops if name not in LOOPS]
    if unknown:
        p.error(f"--loops: unknown {', '.join(unknown)} (known: {', '.join(LOOPS)})")
    print(f"{args.model} at {args.img_size} px, batch {args.batch_size}, fp32, {args.steps} measured "
          f"steps after {args.warmup} warm-up and {args.device_steps} one-at-a-time steps, device "
          f"{_device()}", flush=True)
    results: dict[str, list[dict]] = {which: [] for which in loops}
    for _ in range(args.repeats):
        for which in loops:
            results[which].append(run_one(which, args))
            print(f"  {which}: {results[which][-1]}", file=sys.stderr, flush=True)
    print_table(results, args.repeats)


if __name__ == "__main__":
    main()
