"""A configuration that could not be measured, classified as out-of-memory or another failure with
the line that says why. Shared by the measurements of our loop, of the forward pass and of each
NeuronCore's worker (percore.py).
"""

from __future__ import annotations

import re


class MeasureFailed(Exception):
    """A configuration that could not be measured: status 'oom' or 'failed', with the reason."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


_OOM_PATTERNS = (
    re.compile(r"RESOURCE_EXHAUSTED"),                                 # XLA / PJRT
    re.compile(r"Failed to allocate [\d.]+\s*[KMGT]?B"),                # Neuron runtime (TDRV)
    re.compile(r"out of memory", re.IGNORECASE),                        # CUDA, generic
    re.compile(r"can't allocate memory|MemoryError"),                   # torch CPU allocator, Python
    re.compile(r"Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9"),              # torchrun: child killed
)


def classify_failure(returncode: int, output: str) -> MeasureFailed:
    """Out-of-memory or another failure, with the line that says why (from a run's output)."""
    if returncode in (-9, 137):
        return MeasureFailed("oom", "killed by SIGKILL (most likely the host's out-of-memory killer)")
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for pattern in _OOM_PATTERNS:
        for line in reversed(lines):
            if pattern.search(line):
                return MeasureFailed("oom", line[:300])
    errors = [ln for ln in lines if "error" in ln.lower() or ln.startswith("neuron-train")]
    reason = (errors or lines or [f"exit code {returncode}"])[-1]
    return MeasureFailed("failed", reason[:300])
