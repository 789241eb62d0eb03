"""Run outputs on rank 0: metrics.jsonl, TensorBoard scalars, the progress bar, summary.json.

Values arrive from step closures that run after the step's graph has executed, so writing them
never stalls the training loop.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from neuron_train.common import writer
from neuron_train.common.fileio import write_failed, write_text_atomic


def _kept(line: str, resume_step: int) -> bool:
    """A whole record from before the resumed checkpoint: train records of steps < N (the resumed
    run logs step N again), eval records of steps <= N (the evaluation at N came before its save)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError):  # a line cut short by a killed run (or crafted)
        return False
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return False
    return record["step"] <= resume_step if record.get("kind") == "eval" else record["step"] < resume_step


def repair_metrics(path: Path, resume_step: int) -> str | None:
    """Before a resumed run appends: drop a cut last line and the records after the checkpoint
    (they will be logged again); rewritten atomically. Returns a note, or None if nothing changed."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if _kept(line, resume_step)]
    if len(kept) == len(lines) and path.read_bytes().endswith(b"\n") or not lines:
        return None
    try:
        write_text_atomic(path, "".join(line + "\n" for line in kept))
    except OSError as exc:
        raise write_failed(path, exc, kept=" (left as it was)") from None
    return (f"{path.name}: dropped {len(lines) - len(kept)} record(s) cut short or after step {resume_step}, "
            "the step this run resumes from")


class MetricsWriter:
    """Appends to `<run>/metrics.jsonl`; a resumed run first repairs it (`repair_metrics`)."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        writer.expect_regular(self.path, "run's metrics.jsonl")  # a link, a FIFO: refused before reading it
        if resume_step is not None and self.path.exists():
            note = repair_metrics(self.path, resume_step)
            if note:
                print(f"note: {note}", file=sys.stderr, flush=True)
        self.fd = writer.open_append(self.path, "run's metrics.jsonl")  # a hard-linked copy: made its own first
        self.lock = threading.Lock()  # records come from step closures (a thread) and evaluations
        self.error: OSError | None = None  # the first failed write (a full disk): the loop stops with it
        self.failed_step: int | None = None
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        """Append one record whole or not at all. A write that fails is cut back to the last whole
        line and kept in `error` (this may run in a step closure's thread: the loop raises it)."""
        line = memoryview((json.dumps({"kind": kind, "step": step, **values}) + "\n").encode())
        with self.lock:
            if self.error is not None:
                return
            size = os.fstat(self.fd).st_size
            try:
                while line:
                    line = line[os.write(self.fd, line):]
            except OSError as exc:
                self.error, self.failed_step = exc, step
                try:
                    os.ftruncate(self.fd, size)  # no cut line (also frees its bytes on a full disk)
                except OSError:
                    pass  # a cut last line is dropped by the next --resume (repair_metrics)
                return
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        os.close(self.fd)
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rank-0 progress bar (tqdm); silent elsewhere or when disabled."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            mininterval=0.5)

    def advance(self, postfix: dict[str, str] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


