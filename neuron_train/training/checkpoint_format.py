"""What a checkpoint must hold to be resumed, and the checksum written with it.

A file that loads is not yet a checkpoint we can resume: `structure_problem` checks every entry
the resume reads (model weights, optimizer state, position, RNG states, global batch, the config's
model and batch) before any of it is used, so a damaged or crafted file is one line, never a
KeyError half-way through start-up.

Every checkpoint file (and ZeRO-1 shard) is written with a SHA-256 beside it, `NAME.sha256` in the
`sha256sum` format (`sha256sum -c step-N.pt.sha256` checks it by hand). It is computed from the
bytes on disk after the fsync and written before the checkpoint takes its final name, so a
checkpoint never appears without its checksum. Bytes changed later (a bad disk, a damaged copy)
are found before the file is used. A file without one (saved by an older version, or copied
alone) is loaded unverified, with a note (`checkpoint._note_unverified`); none is written for it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from neuron_train.common import reader
from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import sha256_file
from neuron_train.common.values import plain, shown

CHECKSUM_SUFFIX = ".sha256"
SIDECAR_LIMIT = 4096  # one line
_PLAIN = re.compile(r"^\\?(?P<hex>[0-9a-fA-F]{64}) [ *].+$")
_TAGGED = re.compile(r"^\\?SHA256 \(.+\) = (?P<hex>[0-9a-fA-F]{64})$")
_REQUIRED = ("model", "optimizer", "position", "rng", "global_batch", "config")
_POSITION = ("step", "epoch", "batch")
_CONFIG = (("model", "name", str), ("model", "img_size", int), ("train", "batch_size", int),
           ("train", "grad_accum", int))


def checksum_file(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + CHECKSUM_SUFFIX)


def checksum_line(data_file: Path, final_name: str) -> str:
    """The `sha256sum` line for `data_file` (read back from disk) under its final name."""
    return f"{sha256_file(data_file)}  {final_name}\n"


def sidecar_digest(text: str) -> str | None:
    """The SHA-256 in a checksum file, in any form `sha256sum -c` accepts for one file
    (`HEX  NAME`, `HEX *NAME`, `--tag`'s `SHA256 (NAME) = HEX`; hex in either case); None if none."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    found = _PLAIN.match(first) or _TAGGED.match(first)
    return found["hex"].lower() if found else None


def checksum_problem(path: Path) -> str | None:
    """None if `path` matches the checksum saved with it (or has none), else what is wrong."""
    side = checksum_file(path)
    if not side.exists() and not side.is_symlink():
        return None
    try:
        text = reader.read_bytes(side, limit=SIDECAR_LIMIT).decode("ascii", "replace")  # a directory, a FIFO: refused
    except UsageError as exc:
        return f"its checksum file cannot be used ({exc})"
    expected = sidecar_digest(text)
    if expected is None:
        return f"its checksum file {side.name} holds no SHA-256 line (empty or damaged)"
    if sha256_file(path) != expected:
        return (f"its SHA-256 differs from the one saved with it in {side.name}: the file changed after "
                "it was written (damaged on disk or in a copy)")
    return None


def _int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def structure_problem(state: dict) -> str | None:
    """None if `state` (a loaded format-1 checkpoint) holds everything a resume reads, else the first problem."""
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        return f"it has no {', '.join(repr(k) for k in missing)} entr{'y' if len(missing) == 1 else 'ies'}"
    for key in ("model", "optimizer", "position", "rng", "config"):
        if not isinstance(state[key], dict):
            return f"'{key}' must be a dictionary, got {type(state[key]).__name__}"
    if not _int(state["global_batch"], 1):
        return f"'global_batch' must be an integer >= 1, got {shown(state['global_batch'])}"
    return (_position_problem(state["position"]) or _config_problem(state["config"])
            or _rng_problem(state["rng"]) or _optimizer_problem(state["optimizer"])
            or _model_problem(state["model"]))


def _position_problem(pos: dict) -> str | None:
    if sorted(map(str, pos)) != sorted(_POSITION):
        return f"'position' must hold exactly {', '.join(_POSITION)}, got {sorted(map(str, pos))[:6]}"
    bad = [k for k in _POSITION if not _int(pos[k], 0)]
    return f"'position.{bad[0]}' must be an integer >= 0, got {shown(pos[bad[0]])}" if bad else None


def _config_problem(cfg: dict) -> str | None:
    for section, key, kind in _CONFIG:
        value = cfg.get(section, {}).get(key) if isinstance(cfg.get(section), dict) else None
        if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 1):
            return f"'config.{section}.{key}' must be {'a string' if kind is str else 'an integer >= 1'}, " \
                   f"got {shown(value)}"
    return None


def _rng_problem(rng: dict) -> str | None:
    if not isinstance(rng.get("torch"), torch.Tensor) or rng["torch"].dtype != torch.uint8:
        return "'rng.torch' must be torch's RNG state (a uint8 tensor)"
    python = rng.get("python")
    if not isinstance(python, (list, tuple)) or len(python) != 3:
        return "'rng.python' must be Python's random state (3 items)"
    if not _int(rng.get("xla"), 0):
        return f"'rng.xla' must be an integer >= 0, got {shown(rng.get('xla'))}"
    return None


def _optimizer_problem(opt: dict) -> str | None:
    if opt.get("sharded") == "zero1":
        return None if _int(opt.get("world_size"), 1) else "'optimizer.world_size' must be an integer >= 1"
    groups = opt.get("param_groups")
    if not isinstance(opt.get("state"), dict) or not isinstance(groups, list) or not groups \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return "'optimizer' holds no optimizer state (it needs 'state' and non-empty 'param_groups')"
    return None


def _model_problem(model: dict) -> str | None:
    if not model:
        return "'model' holds no weights"
    bad = [str(k) for k, v in model.items() if not isinstance(v, torch.Tensor)]
    return f"'model' entry {bad[0][:40]!r} is not a tensor" if bad else None


class SavedModel(BaseModel):
    """What a checkpoint's config says of its model: the file is untrusted, so it is validated
    like a file format before a message or a check uses it."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(min_length=1)
    img_size: int = Field(ge=1)


def saved_model(cfg: dict) -> SavedModel | None:
    """The model a checkpoint's config names, or None when the config names no valid one."""
    try:
        return SavedModel.model_validate(cfg.get("model"))
    except ValidationError:
        return None


def origin(state: object) -> str:
    """Which model a loaded file is from, for messages (its metadata is untrusted: validated first)."""
    cfg = state.get("config") if isinstance(state, dict) else None
    if not isinstance(cfg, dict):
        return "a file without neuron_train metadata (model unknown)"
    m = saved_model(cfg)
    if m is None:
        return "a file whose neuron_train metadata names no valid model (model unknown)"
    return f"model {plain(m.name)} (--img-size {m.img_size})"


def describe_mismatch(saved: dict, own: dict) -> str | None:
    """How a state dict differs from a model's, in one line (None: it fits exactly)."""
    missing = [k for k in own if k not in saved]
    unknown = [k for k in saved if k not in own]
    reshaped = [k for k in own if k in saved and tuple(saved[k].shape) != tuple(own[k].shape)]
    parts = [f"{len(names)} {label} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"
             for label, names in (("missing", missing), ("unknown", unknown)) if names]
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} of another shape ({k}: {list(saved[k].shape)} in the file, "
                     f"{list(own[k].shape)} in the model)")
    return ", ".join(parts) or None
