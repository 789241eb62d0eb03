"""At interpreter start in every Python process of a command check-graphs, precompile or bench runs
(called by _startup/sitecustomize.py): arm the graph checker and the probe on torch_xla's import;
mark the process as started, so one that never writes its record (os._exit, SIGKILL) is reported as
such and not as a process that never used torch_xla.

Arming is lazy: most processes of a command (a launcher, pip, a data worker, a shell-out) never
import torch_xla, so at start-up this module imports only the standard library's `os`/`sys` and
common/after_import.py. The checker (neuron_train.graphs) and the probe are imported, and torch_xla's
debug variables set, just before torch_xla itself executes: torch_xla reads them at its first compile
and XLA_FLAGS when the device starts, both later than its import.
"""

from __future__ import annotations

import os
import sys

from neuron_train.common.after_import import AfterImport


def arm() -> None:
    """sitecustomize calls this when the command runs under us (NEURON_TRAIN_GRAPHS_DIR is set)."""
    if "torch_xla" in sys.modules:  # imported before us (a sitecustomize of the environment's)
        _prepare()
        _on_import()
    else:
        sys.meta_path.insert(0, AfterImport("torch_xla", lambda _: _on_import(), before=_prepare))


def _checking() -> bool:
    from neuron_train.instrument import probe

    return os.environ.get(probe.MODE_ENV) != "bench"  # bench measures steps: no checker on them (the probe alone)


def _prepare() -> None:
    """Just before torch_xla executes: its debug log and XLA's HLO dump pointed at our files."""
    from neuron_train.graphs import process

    process.also_internal(os.path.dirname(os.path.abspath(__file__)))  # the probe is never the user's line
    if _checking():
        process.prepare_process(check=True)


def _on_import() -> None:
    """Right after torch_xla's import: the checker's hooks (unless bench), then the probe."""
    from pathlib import Path

    from neuron_train.graphs import process, recorder
    from neuron_train.instrument import marker, probe

    rec = recorder.start_instrumented_process() if _checking() else None
    folder = Path(os.environ[process.ENV_DIR])
    marker.mark(folder)
    _exit_cleanly_on_sigterm()
    probe.arm(rec, folder)


def _exit_cleanly_on_sigterm() -> None:
    """Python's default for SIGTERM ends the process without atexit: no record, no partial report.
    Unless the program handles SIGTERM itself (its own handler, set later, wins), it becomes a
    SystemExit (status 128 + 15, as a shell reports a signal), so the records are written."""
    import signal

    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    except ValueError:  # torch_xla imported in another thread than the main one: leave it
        pass
