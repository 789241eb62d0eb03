#!/usr/bin/env python3
"""The Python side of scripts/neuron_first_run.sh: each function reads a check's evidence and prints
one line, STATUS<TAB>DETAIL, that the shell script records. PASS is printed only with its evidence
in the detail; a fact only a Neuron device can establish is INFO on other devices, saying so.

    first_run_checks.py requires                      which torch-xla torch-neuronx requires, and the installed one
    first_run_checks.py step-path OUT PATH DEVICE     a precompiled step path reused its cache?
    first_run_checks.py bench OUT MODE DEVICE         a bench result ran on every NeuronCore?
    first_run_checks.py neuron-cores RAW [TYPE]       neuron-ls's NeuronCores against the catalog's for the instance
    first_run_checks.py cores [TYPE]                  NeuronCores of this instance type (1 when not known)
    first_run_checks.py write-json OUT DEVICE         OUT/first-run.json from OUT/checks.tsv and OUT/raw/

Python 3.10 (the Neuron DLAMIs' version); it imports neuron_train only for `cores`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import sys
from importlib import metadata
from pathlib import Path

CACHE_HIT = "Using a cached neff at"   # libneuronxla's compiler wrapper, on each NEFF taken from the cache
_HIT_PATH = re.compile(re.escape(CACHE_HIT) + r" (\S+?\.neff)")
# The wrapper's lines for a graph it compiles instead: it found no NEFF and calls neuronx-cc.
CACHE_MISSES = ("Call compiler with cmd", "No candidate found under")
ONLY_NEURON = "only a Neuron device can tell"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires() -> tuple[str, str]:
    """What torch-neuronx's metadata requires of torch-xla (Requires-Dist, with its version), and
    whether the installed torch-xla satisfies it."""
    try:
        neuronx = metadata.version("torch-neuronx")
        declared = metadata.requires("torch-neuronx") or []
    except metadata.PackageNotFoundError:
        return "FAIL", f"torch-neuronx is not installed for {sys.executable}: activate the venv that has it"
    wanted = [r for r in declared if _norm(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) == "torch-xla"]
    try:
        have = metadata.version("torch-xla")
    except metadata.PackageNotFoundError:
        have = None
    if not wanted:
        return "FAIL", f"torch-neuronx {neuronx} declares no torch-xla requirement (requires: {', '.join(declared)})"
    spec = wanted[0].split(";")[0].strip()
    if have is None:
        return "FAIL", f"torch-neuronx {neuronx} requires {spec}; no torch-xla is installed"
    satisfied = _satisfies(spec, have)
    detail = f"torch-neuronx {neuronx} requires {spec}; torch-xla {have} installed"
    if satisfied is False:
        return "FAIL", detail + ": reinstall the torch-xla torch-neuronx requires (ami/provision.sh does)"
    return ("PASS", detail) if satisfied else ("INFO", detail + " (no `packaging` here to compare them)")


def _satisfies(requirement: str, version: str) -> bool | None:
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return None
    return Requirement(requirement).specifier.contains(version, prereleases=True)


def _summary(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_path(out: Path, path: str, device: str) -> tuple[str, str]:
    """A run trained from a cold cache, then precompile, then `train --require-precompiled` from the
    precompiled cache: both completed, how long each compiled, and (Neuron) the cache-hit lines."""
    cold, warm = _summary(out / f"run-{path}-cold" / "summary.json"), _summary(out / f"run-{path}" / "summary.json")
    if cold is None or warm is None:
        which = f"run-{path}-cold" if cold is None else f"run-{path}"
        return "FAIL", f"{out / which}/summary.json is missing or unreadable: the run did not finish"
    times = (f"compile {cold['compile_time_s']:.1f} s in {cold['compile_count']} graph(s) from a cold cache, "
             f"{warm['compile_time_s']:.1f} s in {warm['compile_count']} from the precompiled one")
    if device != "NEURON":
        return "INFO", (f"{times} on {warm['device']}; whether the precompiled NEFFs are reused "
                        f"('{CACHE_HIT}' in the run's log) {ONLY_NEURON}")
    return _neffs_reused(out / "raw" / f"{path}-train.txt", out / f"cache-{path}", times)


def _neffs_reused(log: Path, cache: Path, times: str) -> tuple[str, str]:
    """PASS only when the run took NEFFs from its own precompiled cache (`cache`) and compiled none:
    every cache-hit line names a NEFF under `cache` (a hit elsewhere, e.g. the default
    /var/tmp/neuron-compile-cache, says the --cache_dir never reached the compiler), no miss line."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    hits = [m.group(1) for line in lines if (m := _HIT_PATH.search(line))]
    misses = [line for line in lines if any(m in line for m in CACHE_MISSES)]
    home = cache.resolve()
    elsewhere = [h for h in hits if not Path(h).resolve().is_relative_to(home)]
    seen = f"{len(hits)} cache hit(s), {len(misses)} compile(s) in {log}"
    if not hits:
        return "FAIL", f"no '{CACHE_HIT}' line in {log}: the precompiled graphs were not reused ({times})"
    if elsewhere:
        return "FAIL", (f"{seen}: {len(elsewhere)} NEFF(s) from outside {home} (e.g. {elsewhere[0]}): "
                        f"the run's cache is not the one the compiler used ({times})")
    if misses:
        return "FAIL", f"{seen}: the precompiled cache missed graphs (first: {misses[0].strip()[:200]}) ({times})"
    return "PASS", f"{len(hits)} cached NEFF(s) used, all under {home}, no compile; {times}"


def bench(out: Path, mode: str, device: str) -> tuple[str, str]:
    """A bench result: figures, and on Neuron whether every NeuronCore of the instance ran it."""
    result = _summary(out / f"bench-{mode}.json")
    if result is None:
        return "FAIL", f"{out}/bench-{mode}.json is missing or unreadable"
    d = result["device"]
    total = d.get("cores_total")
    how = ", ".join(f"{k} {d[k]}" for k in ("compiler_args", "threads_per_core") if d.get(k))
    figure = (f"{result['samples_per_sec']['median']:.1f} samples/s on {d['kind']} x {d['count']}"
              f"{f' of {total}' if total else ''}" + (f" ({how})" if how else ""))
    if device != "NEURON":
        return "INFO", f"{figure}; the figure on every NeuronCore {ONLY_NEURON}"
    if mode == "infer" and total != d["count"]:
        return "FAIL", f"{figure}: not every NeuronCore of the instance ran it"
    return "PASS", figure


def catalog_cores(flag: str | None) -> tuple[str, int | None]:
    """(instance type, its NeuronCores in the catalog bench uses, None when not in it)."""
    from neuron_train.cost.bench.instance import resolve_instance_type
    from neuron_train.cost.bench.measure import neuron_cores

    instance = resolve_instance_type(flag or None)[0]
    return instance, neuron_cores(instance)


def cores(flag: str | None) -> int:
    return catalog_cores(flag)[1] or 1


def neuron_ls_cores(raw: Path, flag: str | None) -> tuple[str, str]:
    """The NeuronCores `neuron-ls --json-output` lists against the catalog's count for this instance
    type: bench starts one worker per catalog core, so the two must agree."""
    from neuron_train.ops.facts import parse_neuron_ls

    try:
        devices = parse_neuron_ls(raw.read_text())
        found = sum(int(d["nc_count"]) for d in devices)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return "FAIL", f"cannot read neuron-ls --json-output ({raw}): {exc}"
    instance, listed = catalog_cores(flag)
    said = f"neuron-ls: {found} NeuronCore(s) on {len(devices)} device(s); the catalog's {instance}: {listed}"
    if listed is None:
        return "INFO", f"{said} (not in the catalog: pass --instance-type off EC2)"
    if listed != found:
        return "FAIL", f"{said}: bench would start {listed} worker(s); correct neuron_train/data/instances.yaml"
    return "PASS", said


def write_json(out: Path, device: str) -> None:
    checks = []
    table = out / "checks.tsv"
    for line in table.read_text().splitlines() if table.exists() else []:
        name, status, detail = line.split("\t", 2)
        raw = {f.name: f.read_text(errors="replace")[-20000:]
               for f in sorted((out / "raw").iterdir()) if f.name.startswith(name)}
        checks.append({"name": name, "status": status, "detail": detail, "raw": raw})
    doc = {"schema": "neuron-train-first-run", "schema_version": 1, "device": device,
           "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": {"hostname": socket.gethostname(), "os": platform.platform(),
                    "python": platform.python_version()},
           "checks": checks}
    tmp = out / ".first-run.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, out / "first-run.json")


def main(argv: list[str]) -> int:
    commands = {"requires": (0,), "step-path": (3,), "bench": (3,), "neuron-cores": (1, 2), "cores": (0, 1),
                "write-json": (2,)}
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or len(argv) - 1 not in commands.get(argv[0], ()):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    if name == "cores":
        print(cores(args[0] if args else None))
        return 0
    if name == "write-json":
        write_json(Path(args[0]), args[1])
        return 0
    status, detail = (requires() if name == "requires" else
                      step_path(Path(args[0]), args[1], args[2]) if name == "step-path" else
                      neuron_ls_cores(Path(args[0]), args[1] if len(args) > 1 else None) if name == "neuron-cores"
                      else bench(Path(args[0]), args[1], args[2]))
    print(f"{status}\t{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
