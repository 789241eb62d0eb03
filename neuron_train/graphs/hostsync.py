"""Host syncs: lines that copy a tensor value to the host, and the CPU fallback ops (pure Python).

A read before the step's sync runs part of the step as a graph of its own (torch_xla logs it as a
"host access"); a read after the sync only waits for the device. Reads inside `xm.add_step_closure`
run after the step's graph, on values already computed: the recommended pattern, never a host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from neuron_train.common.fileio import short
from neuron_train.graphs import source
from neuron_train.graphs.causes import COMPILED_READ, HOST_READ, fix_for, read_cause, read_what, setting
from neuron_train.graphs.findings import FallbackOp, HostSync
from neuron_train.graphs.frames import CLOSURE_FUNCTION
from neuron_train.graphs.log import XlaEvent, library_frame, user_frames
from neuron_train.graphs.records import HostRead, LineReads, Refused, Window
from neuron_train.graphs.report import at


def in_closure(event: XlaEvent) -> bool:
    """Run by a step closure (xm.add_step_closure): after the step's graph, values ready."""
    return any(f.function == CLOSURE_FUNCTION for f in event.frames)


def reads_by_line(w: Window, is_internal: Callable[[str], bool],
                  library_of: Callable[[str], str] = lambda path: "") -> dict[str, LineReads]:
    """Host reads of a window by line: from the hooks and from the log's host-access runs."""
    lines: dict[str, LineReads] = {}
    for read in w.of(HostRead):
        entry = lines.setdefault(read.where, LineReads(read.kind, read.phase, read.library, function=read.function))
        entry.hooked += 1
        entry.padded = entry.padded or read.answer is False
        if read.compiled:
            # dynamo broke the compiled step at the read: the part before it ran as a graph of its own
            entry.compiled = True
            entry.runs += 1
    for event, phase in w.events:
        if event.kind == "execute" and event.host_access and not in_closure(event):
            where = user_frames(event.frames, is_internal)[0].where
            kind = "fallback" if w.fallbacks else "value"
            lines.setdefault(where, LineReads(kind, phase,
                                              library_frame(event.frames, is_internal, library_of))).runs += 1
    return lines


@dataclass
class _Tally:
    """A host sync being built, and what only the builder needs: the windows and optimizer steps
    it read in, whether a read answered False (a padded batch), and the library function that read."""

    sync: HostSync
    windows: set[int] = field(default_factory=set)
    optimizer_steps: set[int] = field(default_factory=set)
    padded: bool = False
    function: str = ""


@dataclass
class HostSyncs:
    """Host reads by line over the steady steps, CPU fallback ops, and reads torch_xla refused."""

    host: dict[str, _Tally] = field(default_factory=dict)
    fallback: dict[str, FallbackOp] = field(default_factory=dict)
    scalar_reads: int = 0

    def observe(self, w: Window, reads: dict[str, LineReads], step: int | None, index: int, steady: bool,
                optimizer_step: int = 0, site: str = "") -> None:
        """`index` numbers the window; `optimizer_step` is the optimizer step the window is in (0
        before any): a Trainer syncs more than once per optimizer step, so a read in every optimizer
        step may be in a minority of the syncs. `site` is a user line of the window (a sync's)."""
        if steady:
            for where, read in reads.items():
                tally = self._tally(where, read.kind, read.phase)
                entry = tally.sync
                tally.optimizer_steps.add(optimizer_step)
                if read.compiled:
                    entry.cause = COMPILED_READ
                entry.library = entry.library or read.library
                tally.padded |= read.padded
                tally.function = tally.function or read.function
                entry.count += max(read.hooked, read.runs)
                entry.executes_graph |= read.runs > 0
                tally.windows.add(index)
                if len(entry.steps) < 10 and step not in entry.steps:
                    entry.steps.append(step)
            self.scalar_reads += w.scalar_reads
        for refused in w.of(Refused):
            entry = self._tally(refused.read.where, refused.read.kind, refused.read.phase).sync
            entry.count += 1
            entry.executes_graph, entry.refused = True, refused.message
            if step not in entry.steps:
                entry.steps.append(step)
        self._fallbacks(w, reads, step, site)

    def _tally(self, where: str, kind: str, phase: str) -> _Tally:
        if where not in self.host:
            self.host[where] = _Tally(HostSync(where, kind, read_what(kind), read_cause(kind), phase))
        return self.host[where]

    def _fallbacks(self, w: Window, reads: dict[str, LineReads], step: int | None, site: str) -> None:
        lines = [where for where, r in reads.items() if r.kind == "fallback"]
        for op, count in w.fallbacks.items():
            entry = self.fallback.get(op)
            if entry is None:  # first seen: an op whose input was ready ran no graph, so no read names it;
                entry = self.fallback[op] = FallbackOp(0, step)  # the user's call of it does (once per op)
                called = source.call_of(op, site) if site and not lines else ""
                entry.where += [called] if called else []
            entry.count += count
            for where in lines:
                if where not in entry.where and len(entry.where) < 5:
                    entry.where.append(where)

    def report(self, steady_steps: int, steady_optimizer_steps: int = 0,
               logging_steps: int = 0) -> tuple[list[HostSync], list[str]]:
        """The host syncs as reported, and the problems among them; `logging_steps` is the Trainer's
        (0 without one): its loss log reads every that many optimizer steps."""
        out, problems = [], []
        log = setting("logging_steps")  # the Trainer's loss log (read from the table now, as every lookup is)
        for tally in self.host.values():
            h = replace(tally.sync, steps=list(tally.sync.steps))
            if not h.executes_graph:
                h.cause = HOST_READ
            h.fix = fix_for(h.cause, h.library, tally.padded, tally.function)
            if _trainer_log(tally, logging_steps, log.library):
                h.logging_steps, h.fix = logging_steps, log.fix.format(value=logging_steps)
            # A read in most steady steps is part of the step itself, not an occasional log or eval.
            # A step is what the script repeats: a sync, or an optimizer step (a Trainer syncs more
            # than once per optimizer step), whichever the read is in most of.
            by_sync = (len(tally.windows), steady_steps)
            by_optimizer = (min(len(tally.optimizer_steps), steady_optimizer_steps), steady_optimizer_steps)
            seen, total = max(by_sync, by_optimizer, key=lambda r: r[0] / r[1] if r[1] else 0.0)
            if h.logging_steps:  # the Trainer's log syncs (mesh_reduce) and reads several times per log: its unit is
                seen, total = by_optimizer  # the optimizer step, whose every N-th it logs in
            h.every_step = total > 0 and seen * 2 >= total
            unit = "optimizer steps" if (seen, total) == by_optimizer and by_optimizer != by_sync else "steps"
            out.append(h)
            if h.refused:
                problems.append(f"{h.cause}: {h.what} at {short(h.where)} inside torch_xla.compile"
                                f"(full_graph=True): torch_xla refused to run it ({h.refused})")
            elif h.executes_graph and h.every_step:
                problems.append(f"{h.cause}: {h.what} at {at(h.where, h.library)} runs a graph before the step's "
                                f"sync in {min(seen, total)} of {total} {unit} after warm-up"
                                + (f": {log.problem.format(value=h.logging_steps)}" if h.logging_steps else ""))
        return out, problems


def _trainer_log(tally: _Tally, logging_steps: int, library: str) -> bool:
    """A read the Trainer makes to log the loss every `logging_steps` optimizer steps: at a transformers
    trainer line in exactly those steps (the user's lever is that argument)."""
    steps = sorted(tally.optimizer_steps)
    return logging_steps >= 1 and len(steps) >= 2 and tally.sync.library.startswith(library) \
        and all(b - a == logging_steps for a, b in zip(steps, steps[1:], strict=False))
