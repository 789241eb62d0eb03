"""The marker each instrumented process writes when it imports torch_xla (start.py): a process
that never writes its graph record (os._exit, SIGKILL) is then reported as such, not as one that
never used torch_xla."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STARTED_PREFIX = "started."   # <dir>/started.<pid>.json: this process imported torch_xla


@dataclass
class Started:
    pid: int
    argv: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Started:
        return cls(**data)


def mark(folder: Path) -> None:
    """This process imported torch_xla."""
    marker = folder / f"{STARTED_PREFIX}{os.getpid()}.json"
    marker.write_text(json.dumps(Started(os.getpid(), sys.argv).to_json()))


def started(folder: Path) -> list[Started]:
    """The processes that imported torch_xla (each one's marker)."""
    return [Started.from_json(json.loads(p.read_text())) for p in sorted(folder.glob(STARTED_PREFIX + "*.json"))]
