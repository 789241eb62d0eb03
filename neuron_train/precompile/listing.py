"""What `neuron-train cache list` shows: the cache's size, entries, age and precompiled
configurations, as data (`cache_listing`) and as text (`format_listing`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neuron_train.precompile.store import FILE, Entry, load_manifest, recordable, scan


def state_word(state: str) -> str:
    return "torch_xla" if state == FILE else state


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def describe_config(config: dict) -> str:
    """One line naming the settings that matter most to a reader of `cache list`."""
    parts = [f"{config.get('model')} {config.get('img_size')}px", f"batch {config.get('batch_size')}"]
    if config.get("grad_accum", 1) != 1:
        parts.append(f"accum {config['grad_accum']}")
    parts += [str(config.get("precision")), f"world {config.get('world_size')}", str(config.get("device"))]
    return ", ".join(parts)


@dataclass
class ConfigListing:
    """One precompiled configuration of the cache."""

    fingerprint: str
    summary: str          # describe_config's line
    graphs: int
    entries: int          # cache entries it recorded
    bytes: int
    updated: str
    host: str | None
    pruned_files: int


@dataclass
class CacheListing:
    """What `cache list` shows (`--json`: this record's fields)."""

    cache_dir: str
    entries: int
    bytes: int
    states: dict[str, int]     # entry state -> how many
    oldest_age_s: float
    newest_age_s: float
    configs: list[ConfigListing]
    unrecorded: int            # entries a precompile did not record

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cache_listing(cache: Path, now: float | None = None) -> CacheListing:
    """What `cache list` shows, as data."""
    cache = Path(cache)
    now = time.time() if now is None else now
    manifest = load_manifest(cache)
    entries = scan(cache)
    by_config: dict[str, list[Entry]] = {}
    for e in entries:
        owners = {manifest.files[f].recorded_by for f in e.files if f in manifest.files}
        for fp in owners:
            by_config.setdefault(fp, []).append(e)
    states: dict[str, int] = {}
    for e in entries:
        states[e.state] = states.get(e.state, 0) + 1
    configs = []
    for fp, record in sorted(manifest.configs.items(), key=lambda kv: kv[1].updated):
        mine = by_config.get(fp, [])
        configs.append(ConfigListing(fp, describe_config(record.config), len(record.graphs), len(mine),
                                     sum(e.size for e in mine), record.updated, record.host, record.pruned_files))
    return CacheListing(str(cache.absolute()), len(entries), sum(e.size for e in entries), states,
                        now - min((e.mtime for e in entries), default=now),
                        now - max((e.mtime for e in entries), default=now), configs,
                        sum(1 for e in entries if recordable(e) and not any(f in manifest.files for f in e.files)))


def format_listing(info: CacheListing) -> str:
    lines = [f"cache      {info.cache_dir}",
             f"entries    {info.entries} ({human_size(info.bytes)})"
             + (": " + ", ".join(f"{n} {state_word(s)}" for s, n in sorted(info.states.items()))
                if info.states else ""),
             ]
    if info.entries:
        lines.append(f"age        newest {human_age(info.newest_age_s)}, oldest {human_age(info.oldest_age_s)}")
    lines.append(f"configs    {len(info.configs)} precompiled configuration(s)"
                 + (f"; {info.unrecorded} entries not from a precompile" if info.unrecorded else ""))
    for c in info.configs:
        pruned = f", {c.pruned_files} files pruned" if c.pruned_files else ""
        lines.append(f"  {c.fingerprint}  {c.summary}: {c.graphs} graphs, {c.entries} entries "
                     f"({human_size(c.bytes)}), updated {c.updated} on {c.host}{pruned}")
    return "\n".join(lines)
