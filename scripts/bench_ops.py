#!/usr/bin/env python3
"""Where the device's time goes in our loop's steady step, op by op (the CPU XLA device).

XLA's CPU runtime marks every op it runs (a fused kernel, a dot, a copy) with a profiler event when
`--xla_cpu_enable_xprof_traceme=true` is in XLA_FLAGS, and torch_xla's profiler
(torch_xla.debug.profiler) collects those events into an .xplane.pb file. This script runs our loop
(bench_loop.py's `ours`: the CPU defaults and the chosen step path), traces its measured steps and
prints, per step:
- each graph's execution, in launch order (dynamo-full: forward, backward, update), wall ms;
- the ops' time by kind (`dot`, `copy`, `reduce-window`, each kind of fusion by XLA's name for it,
  e.g. `multiply_reduce_fusion`), each op from its start to its end (a dot runs asynchronously, as
  tasks on Eigen's thread pool, until the runtime's `end: dot.N` mark), summed over XLA's threads: ops
  overlap and a fusion XLA splits into two parallel partitions counts both, so the kinds add up to
  more than the graphs' wall time on 2 cores;
- the most expensive single ops.

    python scripts/bench_ops.py                       # ViT-Tiny/16 at 64 px, batch 32, fp32, dynamo-full
    python scripts/bench_ops.py --loop lazy --top 30

The flag enters every graph's hash and the events cost a little: the figures are those of a traced
run, in a process of its own. What they showed for issue 45 is in docs/measurements.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import bench_loop

TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
CLIENT_THREAD = "tf_XLAPjRtCpuClient"  # launches each graph's execution and runs its first ops itself
XLA_THREADS = ("tf_XLAEigen", CLIENT_THREAD)  # the runtime's compute threads (the line names)
EXECUTION = "ThunkExecutor::Execute (wait for completion)"  # a graph's execution, on the client's thread
INLINE = "ThunkExecutor::Execute"  # the part of an execution the client's thread runs itself, first
END = "end: "  # marks when an op the runtime ran asynchronously is done: `end: dot.1231`
# An HLO instruction's name (`dot.1231`, `multiply_reduce_fusion.4.clone`, `reduce-window`); runtime
# events have other names (`Transpose::Execute`, `D2H Dispatch`). `call.N` wraps a parallel fusion
# whose own event is inside it, so it is left out (counted once, as the fusion).
HLO_OP = re.compile(r"^([a-z][a-z0-9_-]*?)((\.\d+)*)(\.clone)?$")


class Event(NamedTuple):
    line: str  # the thread's name
    name: str
    start_ps: int  # from the line's timestamp
    duration_ps: int


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as ints, length-delimited as bytes."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(data, i)
            yield key >> 3, value
        elif wire == 2:
            size, i = _varint(data, i)
            yield key >> 3, data[i:i + size]
            i += size
        elif wire in (1, 5):  # fixed 64 / 32 bits: no field read here has them
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"not an xplane file: protobuf wire type {wire}")


def _by_field(data: bytes) -> dict[int, list]:
    fields: dict[int, list] = {}
    for number, value in _fields(data):
        fields.setdefault(number, []).append(value)
    return fields


def read_events(data: bytes) -> list[Event]:
    """Every event of an XSpace (tsl/profiler/protobuf/xplane.proto: XSpace.planes = 1; XPlane.lines = 3,
    event_metadata = 4; XLine.name = 2, timestamp_ns = 3, events = 4; XEvent.metadata_id = 1,
    offset_ps = 2, duration_ps = 3; XEventMetadata.name = 2)."""
    events: list[Event] = []
    for plane in _by_field(data).get(1, []):
        fields = _by_field(plane)
        names: dict[int, str] = {}
        for entry in fields.get(4, []):
            pair = _by_field(entry)
            names[pair.get(1, [0])[0]] = _by_field(pair.get(2, [b""])[0]).get(2, [b""])[0].decode(errors="replace")
        for line in fields.get(3, []):
            lf = _by_field(line)
            line_name = lf.get(2, [b""])[0].decode(errors="replace")
            base_ps = lf.get(3, [0])[0] * 1000
            for raw in lf.get(4, []):
                ev = _by_field(raw)
                events.append(Event(line_name, names.get(ev.get(1, [0])[0], "?"),
                                    base_ps + ev.get(2, [0])[0], ev.get(3, [0])[0]))
    return events


def op_kind(name: str) -> str | None:
    """The kind of an HLO op event (its name without the instruction number and `.clone`), else None."""
    m = HLO_OP.match(name)
    if m is None or m.group(1) == "call":
        return None
    return m.group(1)


def executions_ms(events: list[Event]) -> list[float]:
    """Each graph execution's wall ms in start order: the client thread's inline part, then its wait (an
    execution the client's thread finished inline has no wait)."""
    by_line: dict[str, list[Event]] = {}
    for e in events:
        if e.line.startswith(CLIENT_THREAD) and e.name in (EXECUTION, INLINE):
            by_line.setdefault(e.line, []).append(e)
    spans: list[tuple[int, int]] = []
    for line_events in by_line.values():
        line_events.sort(key=lambda e: e.start_ps)
        inline: tuple[int, int] | None = None  # the last inline part not yet given its wait
        for e in line_events:
            if e.name == INLINE:
                if inline is not None:
                    spans.append(inline)  # the one before ran inline to its end
                inline = (e.start_ps, e.start_ps + e.duration_ps)
            else:
                spans.append((inline[0] if inline is not None else e.start_ps, e.start_ps + e.duration_ps))
                inline = None
        if inline is not None:
            spans.append(inline)
    return [(end - start) / 1e9 for start, end in sorted(spans)]


class OpTable(NamedTuple):
    kinds: Counter  # kind -> ps over all XLA threads
    kind_counts: Counter
    ops: Counter  # op name (without `.clone`) -> ps
    executions: list[float]  # ms each


def op_spans(events: list[Event]) -> list[tuple[str, int]]:
    """(name, ps) of each op on XLA's threads, in start order. An op the runtime runs asynchronously (a
    dot, computed by tasks on Eigen's pool; a parallel fusion's partitions) is marked twice: its event
    covers the launch only, and an `end: NAME` event on some thread marks when it is done. Such an op
    counts from its start to that mark, the earliest unpaired start of its name first."""
    ops = sorted((e for e in events if e.line.startswith(XLA_THREADS)), key=lambda e: e.start_ps)
    spans: list[list] = []
    open_: dict[str, deque[list]] = {}  # name -> its started ops whose end mark has not come yet
    for e in ops:
        if e.name.startswith(END):
            waiting = open_.get(e.name.removeprefix(END))
            if waiting:
                span = waiting.popleft()
                span[1] = max(span[1], e.start_ps - span[2])
        elif op_kind(e.name) is not None:
            span = [e.name, e.duration_ps, e.start_ps]
            spans.append(span)
            open_.setdefault(e.name, deque()).append(span)
    return [(name, ps) for name, ps, _ in spans]


def op_table(events: list[Event]) -> OpTable:
    kinds, counts, ops = Counter(), Counter(), Counter()
    for name, ps in op_spans(events):
        kind = op_kind(name)
        kinds[kind] += ps
        counts[kind] += 1
        ops[name.removesuffix(".clone")] += ps
    return OpTable(kinds, counts, ops, executions_ms(events))


def device_ops(trace: bytes) -> OpTable:
    """The op table of an .xplane.pb's bytes; exits with one line when it holds no XLA CPU op."""
    table = op_table(read_events(trace))
    if not table.kinds:
        sys.exit("the trace holds no XLA CPU op: this reads the CPU XLA device's runtime only (run it with "
                 "PJRT_DEVICE=CPU; on Neuron, neuron-profile shows the device's ops)")
    return table


def format_table(table: OpTable, steps: int, top: int) -> str:
    per = 1e9 * steps  # ps -> ms per step
    lines = []
    ex = table.executions
    if ex and len(ex) % steps == 0:
        k = len(ex) // steps
        medians = [statistics.median(ex[i::k]) for i in range(k)]
        lines.append(f"graph executions per step (wall ms, median over {steps} steps, in launch order): "
                     + ", ".join(f"{m:.1f}" for m in medians) + f"; sum {sum(medians):.1f}")
    elif ex:
        lines.append(f"graph executions: {len(ex)} in {steps} steps, {sum(ex) / steps:.1f} ms/step of wall")
    total = sum(table.kinds.values())
    lines.append(f"ops by kind (ms/step, start to end, summed over XLA's threads; all kinds {total / per:.1f}):")
    for kind, ps in table.kinds.most_common(top):
        count = table.kind_counts[kind] / steps
        lines.append(f"  {ps / per:8.2f}  {100 * ps / total:5.1f}%  {count:7.1f}/step  {kind}")
    lines.append("most expensive ops (ms/step, its partitions summed):")
    for name, ps in table.ops.most_common(top):
        lines.append(f"  {ps / per:8.2f}  {name}")
    return "\n".join(lines)


class Trace:
    """torch_xla's profiler over the measured steps (bench_loop's Watch), into `log_dir`."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir

    def start(self) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.profiler as xp

        xm.wait_device_ops()  # the steps before are not in the trace
        xp.start_trace(str(self.log_dir))

    def stop(self) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.profiler as xp

        xm.wait_device_ops()  # every measured step has executed: all its events are in
        xp.stop_trace()


def trace_file(log_dir: Path) -> Path:
    found = sorted(log_dir.rglob("*.xplane.pb"))
    if not found:
        sys.exit(f"no .xplane.pb under {log_dir}: the profiler wrote no trace")
    return found[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_loop.add_model_args(p)
    p.add_argument("--loop", default="dynamo-full", choices=list(bench_loop.CANDIDATES), help="our step path")
    p.add_argument("--steps", type=int, default=6, help="traced steps (after --warmup and 2 one-at-a-time steps)")
    p.add_argument("--warmup", type=int, default=12, help="steps left out (compiles happen here)")
    p.add_argument("--top", type=int, default=20, help="rows of each list")
    p.add_argument("--num-workers", dest="workers", type=int, default=0)
    p.add_argument("--keep", type=Path, help="write the trace here (TensorBoard's profile plugin reads it)")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TRACE_FLAG}".strip()  # before torch_xla starts
    args.device_steps = 2
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.keep or Path(tmp)
        result = bench_loop.ours(args, args.loop, Trace(log_dir))
        table = device_ops(trace_file(log_dir).read_bytes())
    print(f"{args.model} at {args.img_size} px, batch {args.batch_size}, fp32, {args.loop}, {args.steps} traced "
          f"steps: {result['wall_ms']:.1f} ms/step wall, device {result['device_ms']:.1f} (one at a time, untraced)")
    print(format_table(table, args.steps, args.top))


if __name__ == "__main__":
    main()
