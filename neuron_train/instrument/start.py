"""At interpreter start in every Python process of a command check-graphs, precompile or bench runs
(called by _startup/sitecustomize.py): arm the graph checker and, right after torch_xla's import, the
probe; mark the process as started, so one that never writes its record (os._exit, SIGKILL) is
reported as such and not as a process that never used torch_xla.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from neuron_train.graphs import process, recorder
from neuron_train.instrument import probe

STARTED_PREFIX = "started."   # <dir>/started.<pid>.json: this process imported torch_xla


def arm() -> None:
    """sitecustomize calls this when the command runs under us (NEURON_TRAIN_GRAPHS_DIR is set)."""
    process.also_internal(os.path.dirname(os.path.abspath(__file__)))  # the probe is never the user's line
    # bench measures steps: no checker on them (the probe alone)
    recorder.arm_process(then=_started, check=os.environ.get(probe.MODE_ENV) != "bench")


def _started(rec) -> None:
    folder = Path(os.environ[process.ENV_DIR])
    marker = folder / f"{STARTED_PREFIX}{os.getpid()}.json"
    marker.write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv}))
    _exit_cleanly_on_sigterm()
    probe.arm(rec, folder)


def _exit_cleanly_on_sigterm() -> None:
    """Python's default for SIGTERM ends the process without atexit: no record, no partial report.
    Unless the program handles SIGTERM itself (its own handler, set later, wins), it becomes a
    SystemExit (status 128 + 15, as a shell reports a signal), so the records are written."""
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    except ValueError:  # torch_xla imported in another thread than the main one: leave it
        pass


def started(folder: Path) -> list[dict]:
    """The processes that imported torch_xla (each one's marker)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob(STARTED_PREFIX + "*.json"))]
