"""What determines a run's graphs, and whether a compile cache covers them (pure functions).

A *configuration* is the set of settings that determine which graphs a run compiles (plain JSON
values) and its fingerprint; the manifest (store.py) records the graph hashes each precompiled
configuration produced. For neuron-train's own loop it is the run's settings (training/cache_hook.py); for
any other script, its command line and compile environment (`script_config`). Coverage compares
the graphs a run compiled with those records and names what differs: per configuration ("batch
size 64 here, 32 in the manifest") and per graph, against the precompiled graph of the same call
site ("input 0: f32[16,784] here, f32[32,784] in the manifest").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from neuron_train.common.fileio import short
from neuron_train.common.neuron_env import compiler_flags, library_versions, xla_hashed_env
from neuron_train.graphs.records import Graph
from neuron_train.precompile.manifest import Manifest
from neuron_train.precompile.store import MANIFEST

GRAPH_LIBRARIES = ("torch", "torch-xla", "timm", "torch-neuronx", "neuronx-cc", "libneuronxla")


# Labels of the keys a compile environment and a script's configuration hold; our loop's settings
# are labelled where they are declared (training/config.py) and handed in as `labels`.
LABELS = {"device": "device", "neuron_cc_flags": "NEURON_CC_FLAGS", "script": "command"}
# The key of a configuration that holds what torch_xla hashes from the environment (xla_hashed_env);
# left out when nothing is set, so the fingerprints of caches made before it was kept stay the same.
XLA_ENV = "xla_env"


COMPILE_ENV_KEYS = ("device", "neuron_cc_flags", "versions", XLA_ENV)
# What a graph record keeps besides phase, step and compile time (GraphRecord.extra): its call site
# (innermost user line, then the stack), the checker's kind, and its input shapes (from the HLO).
GRAPH_DETAILS = ("where", "site", "kind", "input_shapes")
MAX_NAMED = 3   # shape differences named per graph


_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def graph_library_versions() -> dict[str, str]:
    return library_versions(GRAPH_LIBRARIES)


def xla_env_setting(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The configuration entry for what torch_xla hashes from `env` ({} when nothing is set)."""
    hashed = xla_hashed_env(env)
    return {XLA_ENV: hashed} if hashed else {}


def script_config(command: list[str], *, device: str, env: Mapping[str, str]) -> dict:
    """What determines a script's graphs, as far as can be seen from outside: its command line and
    the compile environment (a graph hash covers another run's graph only within the same one)."""
    return {"script": shlex.join(command), "device": device, "neuron_cc_flags": compiler_flags(env),
            "versions": dict(sorted(graph_library_versions().items())), **xla_env_setting(env)}


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _shown(value: object) -> str:
    if value is None or value == "":
        return "(none)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def differences(here: dict, there: dict, labels: Mapping[str, str] | None = None) -> list[str]:
    """Human-readable differences: 'batch size 64 here, 32 in the manifest' (a key without a label
    is named by its words: 'sift_keep' -> 'sift keep')."""
    names = {**LABELS, **(labels or {})}
    diffs = []
    for key in [k for k in {**here, **there} if k not in ("versions", XLA_ENV)]:
        label = names.get(key, key.replace("_", " "))
        if key == "script" and here.get(key) and there.get(key):
            diffs += command_differences(here[key], there[key])
        elif here.get(key) != there.get(key):
            diffs.append(f"{label} {_shown(here.get(key))} here, {_shown(there.get(key))} in the manifest")
    mine, theirs = here.get("versions", {}), there.get("versions", {})
    for lib in sorted(set(mine) | set(theirs)):
        if mine.get(lib) != theirs.get(lib):
            diffs.append(f"{lib} {_shown(mine.get(lib))} here, {_shown(theirs.get(lib))} in the manifest")
    return diffs + xla_env_differences(here.get(XLA_ENV) or {}, there.get(XLA_ENV) or {})


def xla_env_differences(here: Mapping[str, str], there: Mapping[str, str]) -> list[str]:
    """'XLA_HLO_DEBUG=1 here, unset in the precompile run: set the same for both' per variable."""
    return [f"{name}{'=' + here[name] if name in here else ' unset'} here, {there.get(name, 'unset')} in the "
            "precompile run: set the same for both (torch_xla hashes it into every graph)"
            for name in sorted(set(here) | set(there)) if here.get(name) != there.get(name)]


def _is_option(token: str) -> bool:
    """`--lr`, `-x`; not `-` (stdin) nor a negative number (`--lr -0.1`: the value of --lr)."""
    return token.startswith("-") and token != "-" and not _NUMBER.fullmatch(token)


def _arguments(line: str) -> tuple[list[str], dict[str, str]]:
    """A command line as its positional words and its options (`--flag value`, `--flag=value`, `-x`)."""
    words, options = [], {}
    tokens = shlex.split(line)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if _is_option(token):
            name, _, value = token.partition("=")
            takes = not value and i + 1 < len(tokens) and not _is_option(tokens[i + 1])
            options[name] = value or (tokens[i + 1] if takes else "")
            i += 1 + takes
        else:
            words.append(token)
            i += 1
    return words, options


def command_differences(here: str, there: str) -> list[str]:
    """How two command lines differ, option by option: '--batch_size 16 here, 32 in the manifest'."""
    if here == there:
        return []
    (words, mine), (their_words, theirs) = _arguments(here), _arguments(there)

    def shown(options: dict[str, str], name: str) -> str:
        return "not given" if name not in options else options[name] or "given"

    diffs = [f"{name} {shown(mine, name)} here, {shown(theirs, name)} in the manifest"
             for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]
    if words != their_words:
        diffs.insert(0, f"command {shlex.join(words)} here, {shlex.join(their_words)} in the manifest")
    return diffs or ["the same command with its options in another order"]


def same_compile_env(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in COMPILE_ENV_KEYS)


def nearest_config(manifest: Manifest, config: dict,
                   labels: Mapping[str, str] | None = None) -> tuple[str | None, list[str]]:
    """The precompiled configuration closest to `config` (fewest differences) and the differences."""
    best: tuple[str | None, list[str]] = (None, [])
    for fp, record in manifest.configs.items():
        if ("script" in record.config) != ("script" in config):
            continue  # our loop's settings and a script's command line do not compare
        diffs = differences(config, record.config, labels)
        if best[0] is None or len(diffs) < len(best[1]):
            best = (fp, diffs)
    return best


def covering_hashes(manifest: Manifest, config: dict) -> set[str]:
    """Graph hashes precompiled for this compile environment (any configuration may share them).

    A configuration that lost cache files (prune, quarantine) covers nothing until precompiled
    again: which of its graphs lost their entry is not known.
    """
    return {h for record in manifest.configs.values()
            if same_compile_env(record.config, config) and not record.pruned_files
            for h in record.graphs}


def explain(manifest: Manifest, config: dict, cache_dir: str, labels: Mapping[str, str] | None = None) -> str:
    """Why graphs of this configuration are missing from the manifest, in one sentence."""
    fp = fingerprint(config)
    if not manifest.configs:
        return f"nothing was precompiled into {cache_dir}"
    if fp in manifest.configs:
        record = manifest.configs[fp]
        if record.pruned_files:
            return (f"this configuration was precompiled, but {record.pruned_files} of its cache files "
                    f"were pruned on {record.pruned_at}: precompile it again")
        steps = "--steps" if "script" in config else "--precompile-steps"
        return ("this configuration was precompiled, but the precompile run did not reach these graphs "
                f"(a code path its graph tour missed): raise {steps} and precompile again")
    nearest, diffs = nearest_config(manifest, config, labels)
    if nearest is None:
        return f"nothing of this kind was precompiled into {cache_dir}"
    return "; ".join(diffs) + f" (compared with precompiled configuration {nearest})"


@dataclass
class MissingGraph:
    """A graph the run compiled that the cache was not precompiled with, and the nearest that was."""

    hash: str
    phase: str
    step: int | None
    cause: str
    where: str
    nearest: str | None     # the precompiled graph of the same call site closest to it
    difference: str         # how the two differ ("" when nothing names it)


@dataclass
class CoverageReport:
    """A run's coverage by a compile cache (`precompile_coverage.json`)."""

    cache_dir: str
    fingerprint: str
    precompiled: bool          # this configuration was precompiled into the cache
    graphs: int                # graphs compiled that have a hash
    covered: int
    coverage: float | None     # None: a graph without a hash makes it unknown
    unidentified: int          # graphs compiled without a hash
    missing: list[MissingGraph]
    unused: list[str]          # precompiled graphs the run did not compile
    config: dict[str, Any]
    explanation: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def coverage_report(graphs: Sequence[Graph], manifest: Manifest, config: dict, cache_dir: str,
                    labels: Mapping[str, str] | None = None,
                    shapes: Mapping[str, list[str]] | None = None) -> CoverageReport:
    """Compare the graphs a run compiled with the manifest (pure); `labels` name the settings,
    `shapes` are the graphs' input shapes by hash when known (GraphReport.input_shapes)."""
    fp = fingerprint(config)
    known = covering_hashes(manifest, config)
    seen: dict[str, Graph] = {}
    for g in graphs:
        if g.hash:
            seen.setdefault(g.hash, g)
    unidentified = sum(1 for g in graphs if not g.hash)
    missing = [_missing(g, manifest, config, (shapes or {}).get(h)) for h, g in seen.items() if h not in known]
    precompiled = set(manifest.configs[fp].graphs) if fp in manifest.configs else set()
    covered = len(seen) - len(missing)
    # A graph without a hash cannot be compared with the manifest: coverage is unknown, never 100%.
    ratio = None if unidentified else covered / len(seen) if seen else 1.0
    return CoverageReport(cache_dir, fp, fp in manifest.configs, len(seen), covered, ratio, unidentified, missing,
                          sorted(precompiled - set(seen)), config,
                          _explanation(manifest, config, cache_dir, missing, labels))


def _explanation(manifest: Manifest, config: dict, cache_dir: str, missing: list[MissingGraph],
                 labels: Mapping[str, str] | None) -> str:
    """Why graphs are missing. A script's command line can be the one precompiled while the script
    itself changed (a constant, its data): then its graphs differ at lines the tour did reach."""
    if not missing:
        return ""
    if "script" in config and fingerprint(config) in manifest.configs and any(m.nearest for m in missing):
        return ("this command line was precompiled, but the script compiled other graphs at lines its tour "
                "reached (the script or its data changed since: see each graph)")
    return explain(manifest, config, cache_dir, labels)


def _missing(graph: Graph, manifest: Manifest, config: dict, shapes: list[str] | None) -> MissingGraph:
    nearest, difference = nearest_graph(graph.where, shapes, manifest, config)
    return MissingGraph(graph.hash, graph.phase, graph.step, graph.cause, graph.where, nearest, difference)


def same_site(a: str | None, b: str | None) -> bool:
    """Two call sites (file:line) are the same line, also when the script moved to another folder."""
    if not a or not b:
        return False
    return a == b or os.path.basename(a) == os.path.basename(b)


def shape_distance(here: list[str] | None, there: list[str] | None) -> int:
    """How many inputs differ (position by position when the counts match); unknown: very far."""
    if here is None or there is None:
        return 1 << 20
    if len(here) == len(there):
        return sum(a != b for a, b in zip(here, there, strict=True))
    return sum(((Counter(here) - Counter(there)) + (Counter(there) - Counter(here))).values())


def shape_changes(here: list[str] | None, there: list[str] | None) -> list[str] | None:
    """How two graphs' input shapes differ (None when either is unknown)."""
    if here is None or there is None:
        return None
    if len(here) == len(there):
        return [f"input {i}: {a} here, {b} in the manifest"
                for i, (a, b) in enumerate(zip(here, there, strict=True)) if a != b]
    only_here = ", ".join((Counter(here) - Counter(there)).elements())
    only_there = ", ".join((Counter(there) - Counter(here)).elements())
    return [f"{len(here)} inputs here, {len(there)} in the manifest"
            + (f" ({only_here or 'none'} here, {only_there or 'none'} in the manifest)" if only_here or only_there
               else "")]


def _shapes(value: object) -> list[str] | None:
    """Input shapes read from a manifest: a list of strings, else unknown."""
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def nearest_graph(where: str, shapes: list[str] | None, manifest: Manifest,
                  config: dict) -> tuple[str | None, str]:
    """The precompiled graph of call site `where` closest to a graph with input `shapes` (None:
    unknown), and what differs from it.

    Only graphs of the same compile environment count (others are another cache entry whatever
    their shapes); closest = fewest input shape differences.
    """
    same_env = [(h, g) for r in manifest.configs.values() if same_compile_env(r.config, config)
                for h, g in r.graphs.items()]
    if not any(g.extra.get("where") for _, g in same_env):
        return None, ""  # nothing to compare with: no call sites recorded in this environment
    candidates = [(h, g) for h, g in same_env if isinstance(g.extra.get("where"), str)
                  and same_site(g.extra["where"], where)]
    if not candidates:
        return None, (f"no precompiled graph comes from {short(where)}: the precompile run never reached "
                      "that line" if where else "")

    nearest, record = min(candidates, key=lambda c: shape_distance(shapes, _shapes(c[1].extra.get("input_shapes"))))
    changes = shape_changes(shapes, _shapes(record.extra.get("input_shapes")))
    if changes is None:
        return nearest, f"differs from {nearest[:12]} of the same line (input shapes not recorded)"
    if not changes:
        return nearest, (f"same input shapes as {nearest[:12]} of the same line: a constant or the program "
                         "differs (a Python scalar 0 or 1, a branch, a loop length)")
    more = f" (+{len(changes) - MAX_NAMED} more)" if len(changes) > MAX_NAMED else ""
    return nearest, "; ".join(changes[:MAX_NAMED]) + more


def _when(graph: MissingGraph) -> str:
    step = "before the first step ended" if graph.step is None else f"step {graph.step}"
    return f"{graph.phase}, {step}" if graph.phase else step


def format_coverage(report: CoverageReport) -> str:
    if report.coverage is None:
        known = (f"; of the {report.graphs} with one, {report.covered} in {report.cache_dir}/{MANIFEST}"
                 if report.graphs else "")
        return (f"precompile coverage unknown: {report.unidentified} graph(s) compiled without a "
                f"fingerprint (graph hashes unavailable){known}")
    line = (f"precompile coverage {report.coverage:.0%} ({report.covered}/{report.graphs} "
            f"graphs in {report.cache_dir}/{MANIFEST})")
    if not report.missing:
        return line
    first = report.missing[0]
    lines = [line + f": {len(report.missing)} graph(s) not precompiled, first {first.hash[:12]} "
             f"({_when(first)}): {report.explanation}"]
    for g in report.missing:
        lines.append(f"  not precompiled: {g.hash[:12]} at {short(g.where or '?')} ({_when(g)})"
                     + (f": {g.difference}" if g.difference else ""))
    return "\n".join(lines)
