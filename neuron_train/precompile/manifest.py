"""The graph manifest as typed records, checked field by field when read.

`manifest.json` (in a cache, and inside an archive made by `cache pack`) is JSON:

    {"format": "neuron-train-graph-manifest", "version": 1,
     "configs": {FINGERPRINT: {"config": {...settings...}, "graphs": {HASH: {"phase", "step",
                 "compile_time_s"}}, "precompile_ids": [...], "created", "updated", "host",
                 "tour_steps", "unidentified_graphs", "pruned_files", "pruned_at"}},
     "files": {PATH: {"sha256", "size", "recorded", "recorded_by"}}}

`Manifest.from_json` turns it into records or raises `ManifestError` naming the first bad field;
every `files` key must be a cache file path (`xla/NAME` or `neuronxcc-*/MODULE_*/...`), never
absolute, never with `..`: a manifest cannot point outside its cache. Fields this version does not
know are kept (`extra`) and written back unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import PurePosixPath
from typing import Any, TypeVar, cast

from neuron_train.common.errors import RunError
from neuron_train.common.values import header_problem, kind_problem

MANIFEST_FORMAT = "neuron-train-graph-manifest"
MANIFEST_VERSION = 1
XLA_DIR = "xla"
NEURON_VERSION_PREFIX = "neuronxcc-"
NEURON_MODULE_PREFIX = "MODULE_"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_R = TypeVar("_R")  # the record type _fields builds


class ManifestError(RunError):
    """A manifest that is not what neuron-train writes: the first bad field, in one line."""


@dataclass
class GraphRecord:
    """One graph a precompile's tour compiled (keyed by its graph hash in `ConfigRecord.graphs`)."""

    phase: str | None = None
    step: int | None = None
    compile_time_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class ConfigRecord:
    """One precompiled configuration: the settings that determine its graphs, and those graphs."""

    config: dict[str, Any]
    graphs: dict[str, GraphRecord] = field(default_factory=dict)
    precompile_ids: list[str] = field(default_factory=list)
    created: str | None = None
    updated: str = ""
    host: str | None = None
    tour_steps: int | None = None
    unidentified_graphs: int = 0
    pruned_files: int = 0          # cache files lost since the precompile (prune, quarantine)
    pruned_at: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class FileRecord:
    """A cache file we vouch for: its size and SHA-256 when recorded, and which configuration."""

    sha256: str
    size: int
    recorded: str
    recorded_by: str               # a configuration fingerprint, or "pack" / "unpack"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Manifest:
    configs: dict[str, ConfigRecord] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "configs": {fp: _record_json(r) for fp, r in self.configs.items()},
                "files": {rel: _record_json(r) for rel, r in self.files.items()}, **self.extra}

    @classmethod
    def from_json(cls, data: object, where: str) -> Manifest:
        """Records from parsed JSON; `ManifestError` ("{where}: ...") at the first bad field."""
        problem = header_problem(data, "format", MANIFEST_FORMAT, "version", MANIFEST_VERSION)
        if problem:
            raise ManifestError(f"{where}: not a neuron-train graph manifest ({problem})")
        top = cast(dict, data)  # a JSON object: header_problem checked it
        configs = _mapping(_required(top, "configs", where, "the manifest"), where, "configs")
        files = _mapping(_required(top, "files", where, "the manifest"), where, "files")
        return cls(configs={fp: _config_record(raw, where, f"configs[{fp!r}]") for fp, raw in configs.items()},
                   files={_file_path(rel, where): _file_record(raw, where, f"files[{rel!r}]")
                          for rel, raw in files.items()},
                   extra={k: v for k, v in top.items() if k not in ("format", "version", "configs", "files")})

    def merge(self, other: Manifest) -> None:
        """Union: configurations' graphs and precompile ids merge; file records are added."""
        for fp, record in other.configs.items():
            mine = self.configs.setdefault(fp, replace(record, graphs={}, precompile_ids=[]))
            for h, graph in record.graphs.items():
                mine.graphs.setdefault(h, graph)
            mine.precompile_ids = sorted(set(mine.precompile_ids) | set(record.precompile_ids))
            mine.updated = max(mine.updated, record.updated)
        for rel, rec in other.files.items():
            self.files.setdefault(rel, rec)

    def forget_entries(self, gone: set[str], when: str) -> None:
        """Drop the records of removed entries; their configurations count the files they lost."""
        lost: dict[str, int] = {}
        for rel in [r for r in self.files if entry_of(r) in gone]:
            by = self.files.pop(rel).recorded_by
            lost[by] = lost.get(by, 0) + 1
        for fp, n in lost.items():
            if fp in self.configs:
                self.configs[fp].pruned_files += n
                self.configs[fp].pruned_at = when


def entry_of(rel: str) -> str:
    """The entry a cache file belongs to: the xla/ file itself, or its MODULE_ directory."""
    return "/".join(PurePosixPath(rel).parts[:2])


def is_cache_file_path(rel: object) -> bool:
    """`xla/NAME` or `neuronxcc-*/MODULE_*/FILE...`, relative, '/'-separated, no `.` or `..` parts."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        return False
    path = PurePosixPath(rel)
    parts = path.parts
    if not parts or path.is_absolute() or path.as_posix() != rel or ".." in parts:  # "." has no parts
        return False
    if parts[0] == XLA_DIR:
        return len(parts) == 2
    return (len(parts) >= 3 and parts[0].startswith(NEURON_VERSION_PREFIX)
            and parts[1].startswith(NEURON_MODULE_PREFIX))


# ----------------------------------------------------------------------------- reading


def _record_json(record: GraphRecord | ConfigRecord | FileRecord) -> dict:
    out = {}
    for f in fields(record):
        if f.name == "extra":
            continue
        value = getattr(record, f.name)
        if f.name == "graphs":
            value = {h: _record_json(g) for h, g in value.items()}
        out[f.name] = value
    return {**out, **record.extra}


def _mapping(value: object, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: {what} must be a JSON object, not {_kind(value)}")
    return value


def _required(raw: dict, key: str, where: str, what: str) -> object:
    if key not in raw:
        raise ManifestError(f"{where}: {what} has no '{key}' field")
    return raw[key]


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _check(value: object, kind: str, where: str, what: str) -> Any:
    problem = kind_problem(value, kind)
    if problem:
        raise ManifestError(f"{where}: {what} {problem}")
    return value


def _fields(cls: Callable[..., _R], raw: object, where: str, what: str, kinds: dict[str, str],
            required: tuple[str, ...], nested: dict[str, Any] | None = None) -> _R:
    """A record of `cls` from `raw`, each known field checked against `kinds`."""
    raw = _mapping(raw, where, what)
    for key in required:
        _required(raw, key, where, what)
    values = {key: _check(raw[key], kind, where, f"{what}.{key}") for key, kind in kinds.items() if key in raw}
    for key, build in (nested or {}).items():
        if key in values:
            values[key] = build(values[key])
    extra = {k: v for k, v in raw.items() if k not in kinds}
    return cls(**values, extra=extra)


def _graph_record(raw: object, where: str, what: str) -> GraphRecord:
    return _fields(GraphRecord, raw, where, what,
                   {"phase": "str?", "step": "int>=0?", "compile_time_s": "number>=0?"}, ())


def _config_record(raw: object, where: str, what: str) -> ConfigRecord:
    def graphs(value: dict) -> dict[str, GraphRecord]:
        return {h: _graph_record(g, where, f"{what}.graphs[{h!r}]") for h, g in value.items()}

    return _fields(ConfigRecord, raw, where, what,
                   {"config": "object", "graphs": "object", "precompile_ids": "str-list", "created": "str?",
                    "updated": "str", "host": "str?", "tour_steps": "int>=0?",
                    "unidentified_graphs": "int>=0", "pruned_files": "int>=0", "pruned_at": "str?"},
                   ("config", "graphs"), {"graphs": graphs})


def _file_record(raw: object, where: str, what: str) -> FileRecord:
    record = _fields(FileRecord, raw, where, what,
                     {"sha256": "str", "size": "int>=0", "recorded": "str", "recorded_by": "str"},
                     ("sha256", "size", "recorded", "recorded_by"))
    if not _SHA256.fullmatch(record.sha256):
        raise ManifestError(f"{where}: {what}.sha256 is not a SHA-256 (64 lowercase hex digits)")
    return record


def _file_path(rel: str, where: str) -> str:
    if not is_cache_file_path(rel):
        raise ManifestError(f"{where}: files lists {rel!r}, which is not a file of a compile cache "
                            f"({XLA_DIR}/NAME or {NEURON_VERSION_PREFIX}*/{NEURON_MODULE_PREFIX}*/FILE): "
                            "it may point outside the cache")
    return rel
