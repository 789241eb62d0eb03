"""`neuron-train precompile`: compile every graph of a run ahead of it, then prove the run needed no more.

The precompile run is the training loop in "graph tour" mode (NEURON_EXTRACT_GRAPHS_ONLY, set by
neuron_parallel_compile on Neuron and by us elsewhere): a few train steps, one eval batch, no
checkpoints or metrics written. On Neuron, neuron_parallel_compile then compiles the extracted
graphs in parallel into the Neuron cache. Everywhere, the loop records a graph manifest in the cache
directory (cache.py): each graph's fingerprint, the phase that produced it, and the settings that
determine graphs.

A later real run with `--compile-cache DIR` compares the graphs it compiles with that manifest:
it reports its coverage (100% = it compiled nothing precompile did not foresee) and, with
`--require-precompiled`, stops before its first step when no precompiled configuration matches
(naming the difference, e.g. "batch size 64 here, 32 in the manifest"), and at the first graph the
manifest lacks. `CompileCacheHook` is the small object the loop calls; the rest are pure functions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_train import cache as cc
from neuron_train.config import RunConfig, add_config_arguments, config_from_args, config_to_argv
from neuron_train.doctor import NETWORK_FS, _dist_version, neuron_cache_location, path_facts
from neuron_train.errors import RunError, UsageError
from neuron_train.metrics import write_json_atomic

PRECOMPILE_ENV = "NEURON_TRAIN_PRECOMPILE"   # set by precompile to its run id; the loop records under it
EXTRACT_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"    # neuron_parallel_compile's graph-extraction switch
RETRIES_ENV = "NEURON_PARALLEL_COMPILE_MAX_RETRIES"
# Parsed by the Neuron compiler wrapper and not passed to neuronx-cc (Neuron Persistent Cache
# docs): they do not change the compiled graphs, so they are not part of a configuration.
WRAPPER_FLAGS = ("--cache_dir", "--retry_failed_compilation", "--no_cache", "--log_level")
GRAPH_LIBRARIES = ("torch", "torch-xla", "timm", "torch-neuronx", "neuronx-cc", "libneuronxla")
RUN_PY = Path(__file__).resolve().parent / "run.py"
# The settings that determine a run's graphs, with the words used to name a difference.
LABELS = {
    "model": "model", "img_size": "image size", "num_classes": "number of classes",
    "drop_path": "drop path", "batch_size": "batch size", "grad_accum": "gradient accumulation",
    "batches_per_execution": "batches per execution", "precision": "precision",
    "world_size": "world size", "step_compiler": "step compiler", "optimizer": "optimizer", "zero1": "ZeRO-1",
    "grad_clip": "gradient clipping", "sift": "sifting", "sift_keep": "sift keep fraction",
    "sift_beta": "sift beta", "sift_history": "sift history", "teacher_model": "teacher model",
    "teacher_bf16": "teacher bf16", "device": "device", "neuron_cc_flags": "NEURON_CC_FLAGS",
}
# A graph compiled for other compiler flags, compiler or framework versions, or another device is
# another cache entry: graph hashes only cover each other within the same compile environment.
COMPILE_ENV_KEYS = ("device", "neuron_cc_flags", "versions")


# ----------------------------------------------------------------------------- configurations


def compiler_flags(env: Mapping[str, str]) -> str:
    """NEURON_CC_FLAGS without the cache wrapper's own flags (they do not change graphs)."""
    flags = env.get("NEURON_CC_FLAGS", "")
    try:
        tokens = shlex.split(flags)
    except ValueError:
        tokens = flags.split()
    kept, skip_value = [], False
    for tok in tokens:
        if skip_value:
            skip_value = False
            continue
        name = tok.split("=", 1)[0]
        if name in WRAPPER_FLAGS:
            skip_value = "=" not in tok and name in ("--cache_dir", "--log_level")
            continue
        kept.append(tok)
    return " ".join(kept)


def library_versions() -> dict[str, str]:
    return {name: v for name in GRAPH_LIBRARIES if (v := _dist_version(name))}


def graph_config(cfg: RunConfig, *, world_size: int, num_classes: int, device: str,
                 env: Mapping[str, str], versions: dict[str, str]) -> dict:
    """The settings that determine which graphs a run compiles (plain JSON values).

    Learning rate, momentum, weight decay and the distillation weights are left out: they reach
    the graph as data (the schedule avoids the constants 0 and 1, see optim.py).
    """
    sift = cfg.sift.sift != "off"
    teacher = cfg.distill.teacher_model
    return {
        "model": cfg.model.name, "img_size": cfg.model.img_size, "num_classes": num_classes,
        "drop_path": cfg.model.drop_path, "batch_size": cfg.train.batch_size,
        "grad_accum": cfg.train.grad_accum, "batches_per_execution": cfg.data.batches_per_execution,
        "precision": cfg.train.precision, "world_size": world_size, "step_compiler": cfg.train.step_compiler,
        "optimizer": cfg.optim.optimizer, "zero1": cfg.optim.zero1,
        "grad_clip": "on" if cfg.optim.grad_clip > 0 else "off",
        "sift": cfg.sift.sift,
        "sift_keep": cfg.sift.sift_keep if cfg.sift.sift == "topk" else None,
        "sift_beta": cfg.sift.sift_beta if cfg.sift.sift == "relative" else None,
        "sift_history": cfg.sift.sift_history if sift else None,
        "teacher_model": teacher, "teacher_bf16": cfg.distill.teacher_bf16 if teacher else None,
        "device": device, "neuron_cc_flags": compiler_flags(env), "versions": dict(sorted(versions.items())),
    }


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _shown(value) -> str:
    if value is None or value == "":
        return "(none)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def differences(here: dict, there: dict) -> list[str]:
    """Human-readable differences: 'batch size 64 here, 32 in the manifest'."""
    diffs = []
    for key, label in LABELS.items():
        if here.get(key) != there.get(key):
            diffs.append(f"{label} {_shown(here.get(key))} here, {_shown(there.get(key))} in the manifest")
    mine, theirs = here.get("versions", {}), there.get("versions", {})
    for lib in sorted(set(mine) | set(theirs)):
        if mine.get(lib) != theirs.get(lib):
            diffs.append(f"{lib} {_shown(mine.get(lib))} here, {_shown(theirs.get(lib))} in the manifest")
    return diffs


def same_compile_env(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in COMPILE_ENV_KEYS)


def nearest_config(manifest: dict, config: dict) -> tuple[str | None, list[str]]:
    """The precompiled configuration closest to `config` (fewest differences) and the differences."""
    best: tuple[str | None, list[str]] = (None, [])
    for fp, record in manifest["configs"].items():
        diffs = differences(config, record["config"])
        if best[0] is None or len(diffs) < len(best[1]):
            best = (fp, diffs)
    return best


# ----------------------------------------------------------------------------- coverage


def covering_hashes(manifest: dict, config: dict) -> set[str]:
    """Graph hashes precompiled for this compile environment (any configuration may share them).

    A configuration that lost cache files (prune, quarantine) covers nothing until precompiled
    again: which of its graphs lost their entry is not known.
    """
    return {h for record in manifest["configs"].values()
            if same_compile_env(record["config"], config) and not record.get("pruned_files")
            for h in record.get("graphs", {})}


def explain(manifest: dict, config: dict, cache_dir: str) -> str:
    """Why graphs of this configuration are missing from the manifest, in one sentence."""
    fp = fingerprint(config)
    if not manifest["configs"]:
        return f"nothing was precompiled into {cache_dir}"
    if fp in manifest["configs"]:
        record = manifest["configs"][fp]
        pruned = record.get("pruned_files", 0)
        if pruned:
            return (f"this configuration was precompiled, but {pruned} of its cache files were pruned "
                    f"on {record.get('pruned_at')}: precompile it again")
        return ("this configuration was precompiled, but the precompile run did not reach these graphs "
                "(a code path its graph tour missed): raise --precompile-steps and precompile again")
    nearest, diffs = nearest_config(manifest, config)
    return "; ".join(diffs) + f" (compared with precompiled configuration {nearest})"


def coverage_report(graphs: list[dict], manifest: dict, config: dict, cache_dir: str) -> dict:
    """Compare the graphs a run compiled with the manifest (pure)."""
    fp = fingerprint(config)
    known = covering_hashes(manifest, config)
    seen: dict[str, dict] = {}
    for g in graphs:
        if g.get("hash"):
            seen.setdefault(g["hash"], g)
    unidentified = sum(1 for g in graphs if not g.get("hash"))
    missing = [{k: g.get(k) for k in ("hash", "phase", "step", "cause", "where")}
               for h, g in seen.items() if h not in known]
    precompiled = set(manifest["configs"].get(fp, {}).get("graphs", {}))
    covered = len(seen) - len(missing)
    if unidentified and not seen:
        ratio = None  # GraphWatch gave no hashes: nothing can be compared
    else:
        ratio = covered / len(seen) if seen else 1.0
    report = {
        "cache_dir": cache_dir, "fingerprint": fp, "precompiled": fp in manifest["configs"],
        "graphs": len(seen), "covered": covered, "coverage": ratio, "unidentified": unidentified,
        "missing": missing, "unused": sorted(precompiled - set(seen)), "config": config,
        "explanation": explain(manifest, config, cache_dir) if missing else "",
    }
    return report


def format_coverage(report: dict) -> str:
    if report["coverage"] is None:
        return (f"precompile coverage unknown: {report['unidentified']} graph(s) compiled without a "
                "fingerprint (graph hashes unavailable)")
    line = (f"precompile coverage {report['coverage']:.0%} ({report['covered']}/{report['graphs']} "
            f"graphs in {report['cache_dir']}/{cc.MANIFEST})")
    if report["missing"]:
        first = report["missing"][0]
        line += (f": {len(report['missing'])} graph(s) not precompiled, first {first['hash'][:12]} "
                 f"({first['phase']}, step {first['step']}): {report['explanation']}")
    return line


# ----------------------------------------------------------------------------- environment


def cache_flags(env: Mapping[str, str], cache: Path) -> tuple[str, str | None]:
    """NEURON_CC_FLAGS pointing the Neuron compiler at `cache`, and a note about what it overrides.

    A --cache_dir elsewhere is an error: the compiler would write and look up NEFFs in a different
    directory than the one the manifest describes.
    """
    location, source = neuron_cache_location(env)
    flags = env.get("NEURON_CC_FLAGS", "")
    if source == "NEURON_CC_FLAGS --cache_dir":
        if location.startswith("s3://") or Path(location).resolve() != cache.resolve():
            raise UsageError(f"NEURON_CC_FLAGS has --cache_dir={location} but the compile cache is {cache}: "
                             "the compiler would use another cache than the manifest; drop one of them")
        return flags, None
    note = None
    if source == "NEURON_COMPILE_CACHE_URL":
        note = f"NEURON_COMPILE_CACHE_URL={location} is overridden by --cache_dir={cache.resolve()}"
    return f"{flags} --cache_dir={cache.resolve()}".strip(), note


def network_fs_warning(cache: Path, mounts: str | None = None) -> str | None:
    """A warning when the cache sits on a network file system (file locks unreliable across hosts).

    `mounts` is /proc/mounts' text (read when not given).
    """
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    facts = path_facts(str(cache), mounts)
    if facts.fstype not in NETWORK_FS:
        return None
    return (f"{cache} is on {facts.fstype} ({facts.mount_point}): several hosts sharing one cache on "
            "NFS/EFS/FSx do not see each other's file locks and can corrupt entries; use one cache "
            "directory per host (e.g. --cache-dir /var/tmp/neuron-train-cache) and move it with "
            "`neuron-train cache pack/unpack`")


def warn(message: str) -> None:
    print(f"neuron-train: warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the loop's hook


class CompileCacheHook:
    """The training loop's link to the compile cache: records graphs (precompile) or checks them.

    Without --compile-cache every method returns at once. Construct it before the first step:
    under the graph tour it points torch_xla's persistent cache at a private staging directory,
    which must happen before anything compiles.
    """

    def __init__(self, cfg: RunConfig, backend, *, num_classes: int):
        from neuron_train.device import extracting_graphs  # imports torch: only in the loop

        self.recording = extracting_graphs()
        if os.environ.get(PRECOMPILE_ENV) and not self.recording:
            raise RunError(f"{PRECOMPILE_ENV} is set but {EXTRACT_ENV} is not: the graph-extraction "
                           "switch was lost on the way (a wrapper script or launcher that drops "
                           "environment variables?); refusing to run a full training as a precompile")
        self.dir = Path(cfg.compile.compile_cache) if cfg.compile.compile_cache else None
        if self.dir is None:
            return
        if cc.is_s3(str(self.dir)):
            raise UsageError("--compile-cache must be a local directory (move caches to and from S3 "
                             "with `neuron-train cache pack/unpack`)")
        self.precompile_id = os.environ.get(PRECOMPILE_ENV)
        self.require = cfg.compile.require_precompiled and not self.recording
        self.speaks = backend.local_rank == 0  # one process per host checks files and prints
        self.writes_report = backend.is_main
        self.config = graph_config(cfg, world_size=backend.world_size, num_classes=num_classes,
                                   device=backend.kind, env=os.environ, versions=library_versions())
        self.fp = fingerprint(self.config)
        self.hint = precompile_hint(cfg, self.dir, backend.world_size)
        self.tour_steps = tour_steps(cfg)
        self.checked: set[str] = set()   # graph hashes already compared with the manifest
        self.compiles_seen = 0
        self.staging: Path | None = None
        self._point_compiler_at_cache()
        self.use = cc.CacheUse(self.dir)  # prune must wait until this run ends
        if self.recording:
            self._stage_xla_cache(backend)
        else:
            self._check_start()

    def _point_compiler_at_cache(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        flags, note = cache_flags(os.environ, self.dir)
        os.environ["NEURON_CC_FLAGS"] = flags  # read by the Neuron compiler wrapper when it compiles
        if self.speaks:
            for message in (note, network_fs_warning(self.dir)):
                if message:
                    warn(message)

    # ----- recording (the graph tour) --------------------------------------------------------
    def _stage_xla_cache(self, backend) -> None:
        """torch_xla's own persistent cache (non-Neuron devices), staged privately: see cache.py."""
        if backend.kind == "NEURON":
            return  # Neuron caches NEFFs itself, in NEURON_CC_FLAGS --cache_dir
        import torch_xla.runtime as xr

        self.staging = self.dir / cc.STAGING_DIR / f"{socket.gethostname()}-{os.getpid()}"
        self.staging.mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(self.staging), readonly=False)

    def _record(self, graphs: list[dict]) -> None:
        now = cc.utc_now()

        def add(manifest: dict) -> None:
            record = manifest["configs"].setdefault(self.fp, {"config": self.config, "graphs": {},
                                                              "precompile_ids": [], "created": now})
            for g in graphs:
                if g.get("hash"):
                    record["graphs"].setdefault(g["hash"], {"phase": g.get("phase"), "step": g.get("step"),
                                                            "compile_time_s": g.get("compile_time_s")})
            unidentified = sum(1 for g in graphs if not g.get("hash"))
            record["unidentified_graphs"] = max(record.get("unidentified_graphs", 0), unidentified)
            if self.precompile_id and self.precompile_id not in record["precompile_ids"]:
                record["precompile_ids"].append(self.precompile_id)
            record.update(updated=now, host=socket.gethostname(), tour_steps=self.tour_steps)
            record.pop("pruned_files", None)  # precompiled again: its entries are rebuilt
            record.pop("pruned_at", None)

        cc.update_manifest(self.dir, add)
        if self.staging is not None:
            cc.commit_staged(self.dir, self.staging, self.fp)

    # ----- checking (a real run) -------------------------------------------------------------
    def _check_start(self) -> None:
        """Before any compile: refuse damaged entries; with --require-precompiled, a config mismatch."""
        manifest = cc.load_manifest(self.dir)
        if self.speaks:
            findings = cc.check_files(self.dir, manifest["files"])
            corrupt = [f for f in findings if f.problem == "corrupt"]
            if corrupt:
                raise RunError(f"compile cache {self.dir} has {len(corrupt)} damaged file(s), e.g. "
                               f"{corrupt[0].entry}: {corrupt[0].detail}; it will not be used: run `neuron-train cache "
                               f"verify --cache-dir {self.dir} --quarantine`, then precompile again")
            missing = [f for f in findings if f.problem == "missing"]
            failed = [e for e in cc.scan(self.dir) if e.state == cc.FAILED]
            if missing:
                warn(f"{len(missing)} recorded cache file(s) are gone from {self.dir} (e.g. {missing[0].entry}): "
                     "those graphs will compile again")
            if failed:
                warn(f"{len(failed)} graph(s) in {self.dir} are cached as FAILED compiles and will not be "
                     f"retried (e.g. {failed[0].path}): precompile with --retry-failed")
        record = manifest["configs"].get(self.fp)
        if not self.require or (record and not record.get("pruned_files")):
            return
        raise RunError(f"--require-precompiled: this configuration is not precompiled in {self.dir}: "
                       f"{explain(manifest, self.config, str(self.dir))}. Precompile it first: {self.hint}")

    def check(self, watch) -> None:
        """Step closure: with --require-precompiled, stop at the first graph the manifest lacks.

        Only looks when the compile counter moved: GraphWatch.summary() reads the debug log, and
        most steps compile nothing.
        """
        if self.dir is None or not self.require:
            return
        import torch_xla.debug.metrics as met

        compiles = met.counter_value("UncachedCompile") or 0
        if compiles == self.compiles_seen:
            return
        self.compiles_seen = compiles
        new = [g for g in watch.summary()["graphs"] if g.get("hash") and g["hash"] not in self.checked]
        if not new:
            return
        manifest = cc.load_manifest(self.dir)
        known = covering_hashes(manifest, self.config)
        for g in new:
            self.checked.add(g["hash"])
            if g["hash"] not in known:
                raise RunError(f"--require-precompiled: graph {g['hash'][:12]} ({g.get('phase')}, step "
                               f"{g.get('step')}) is not in {self.dir}/{cc.MANIFEST}: "
                               f"{explain(manifest, self.config, str(self.dir))}. Precompile: {self.hint}")

    def finish(self, graph_summary: dict, run_dir: Path | None) -> float | None:
        """At the end of the run: record (graph tour) or report coverage; returns the coverage."""
        if self.dir is None:
            return None
        try:
            graphs = graph_summary["graphs"]
            if self.recording:
                self._record(graphs)
                return None
            report = coverage_report(graphs, cc.load_manifest(self.dir), self.config, str(self.dir))
            if self.writes_report:
                print(format_coverage(report), flush=True)
                if run_dir is not None:
                    write_json_atomic(Path(run_dir) / "precompile_coverage.json", report)
            if self.require and report["missing"]:
                raise RunError(f"--require-precompiled: {format_coverage(report)}")
            return report["coverage"]
        finally:
            self.use.release()


# ----------------------------------------------------------------------------- the command


def precompile_hint(cfg: RunConfig, cache: Path, world: int) -> str:
    """The precompile command for this run's configuration (its flags, minus the run-only ones)."""
    run_only = ("--output-dir", "--compile-cache", "--require-precompiled", "--no-require-precompiled",
                "--resume")
    argv, flags = config_to_argv(cfg), []
    i = 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if argv[i] not in run_only:
            flags += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    return shlex.join(["scripts/precompile.sh", "--cache-dir", str(cache), "--nproc-per-node", str(world),
                       "--", *flags])


def tour_steps(cfg: RunConfig) -> int:
    """Train steps the graph tour needs to reach every step-dependent graph variant of the run.

    Step 0 (optimizer state created) and a steady step; past the graph warm-up; and with sifting,
    full-batch steps before --sift-delay and sifted ones after it. Eval and checkpoint graphs are
    reached at the tour's last step (loop.py).
    """
    steps = max(cfg.train.precompile_steps, cfg.compile.graph_warmup_steps + 1)
    if cfg.sift.sift != "off":
        steps = max(steps, cfg.sift.sift_delay + 2)
    return steps


@dataclass(frozen=True)
class Plan:
    target: str                 # 'neuron' (neuron_parallel_compile) or 'cpu' (the graph tour directly)
    cache: Path
    command: list[str]
    env: dict[str, str]         # variables set on top of the current environment
    real_run: list[str]         # the training command to run afterwards
    notes: list[str]


def launcher(world: int) -> list[str]:
    """How the training processes start: one Python process, or torchrun for several."""
    if world == 1:
        return [sys.executable, str(RUN_PY)]
    torchrun = shutil.which("torchrun")
    start = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return [*start, f"--nproc_per_node={world}", str(RUN_PY)]


def build_plan(cfg: RunConfig, train_args: list[str], *, cache: Path, target: str, world: int,
               num_parallel: int | None, retries: int, retry_failed: bool, env: Mapping[str, str],
               run_id: str) -> Plan:
    """The exact commands and environment of a precompile (pure: nothing runs)."""
    flags, note = cache_flags(env, cache)
    if retry_failed:
        flags += " --retry_failed_compilation"  # a wrapper flag (Neuron Persistent Cache docs)
    extra = [] if cfg.compile.compile_cache else ["--compile-cache", str(cache)]
    steps = tour_steps(cfg)
    tour = extra + ([] if steps == cfg.train.precompile_steps else ["--precompile-steps", str(steps)])
    inner = [*launcher(world), *train_args, *tour]
    changes = {"NEURON_CC_FLAGS": flags, PRECOMPILE_ENV: run_id}
    if target == "neuron":
        command = ["neuron_parallel_compile", *(["--num_parallel", str(num_parallel)] if num_parallel else []),
                   *inner]
        changes[RETRIES_ENV] = str(retries)
    else:
        command = inner
        changes[EXTRACT_ENV] = "1"  # we play neuron_parallel_compile's extraction role
    real = [*launcher(world), *train_args, *extra,
            *([] if cfg.compile.require_precompiled else ["--require-precompiled"])]
    notes = [n for n in (note,) if n]
    if target == "cpu" and num_parallel:
        notes.append("--num-parallel only applies to neuron_parallel_compile (Neuron)")
    return Plan(target, cache, command, changes, real, notes)


def format_plan(plan: Plan) -> str:
    env_words = [f"{k}={v}" for k, v in plan.env.items()]
    lines = [f"target       {plan.target}"
             + (" (neuron_parallel_compile: extract graphs, then compile them in parallel)"
                if plan.target == "neuron" else " (graph tour on this device; no neuron_parallel_compile)"),
             f"cache        {plan.cache}",
             "environment",
             *(f"  {shlex.quote(w)}" for w in env_words),
             "command",
             f"  {shlex.join(['env', *env_words, *plan.command])}",
             "then train with",
             f"  NEURON_CC_FLAGS={shlex.quote(plan.env['NEURON_CC_FLAGS'])} {shlex.join(plan.real_run)}"]
    lines += [f"note         {n}" for n in plan.notes]
    return "\n".join(lines)


def parse_compile_summary(log: str) -> dict:
    """neuron_parallel_compile's closing summary: totals and the graphs that failed to compile."""
    totals = {}
    for key, pattern in (("graphs", r"Total graphs: (\d+)"),
                         ("compiled", r"Total successful compilations: (\d+)"),
                         ("failed", r"Total failed compilations: (\d+)")):
        found = re.findall(pattern, log)
        if found:
            totals[key] = int(found[-1])
    report = _summary_json(log)
    failed = sorted(path for path, r in report.get("compilation_report", {}).items()
                    if not r.get("status"))
    return {**totals, "failed_graphs": failed} if totals or report else {}


def _summary_json(log: str) -> dict:
    """The JSON object printed after '||NEURON_PARALLEL_COMPILE||: {', one 'INFO:' line per line."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith("||NEURON_PARALLEL_COMPILE||: {")]
    if not starts:
        return {}
    body, depth = ["{"], 1
    for line in lines[starts[-1] + 1:]:
        text = re.sub(r"^\s*INFO:\s?", "", line)
        body.append(text)
        depth += text.count("{") - text.count("}")
        if depth <= 0:
            break
    try:
        data = json.loads("\n".join(body))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.usage = "neuron-train precompile [options] -- TRAIN_ARGS ..."
    parser.description = ("Precompile every graph of a training run into the compile cache and record "
                          "a graph manifest there. TRAIN_ARGS are the arguments of the real "
                          "`neuron-train train` run, unchanged.")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and environment; run nothing")
    parser.add_argument("--cache-dir", metavar="DIR", help=f"compile cache directory (default: --compile-cache "
                        f"in TRAIN_ARGS, else {cc.DEFAULT_CACHE_DIR}); one per host")
    parser.add_argument("--num-parallel", type=int, metavar="N", help="graphs neuron_parallel_compile "
                        "compiles at once (default: its own choice; lower it when hosts run out of memory)")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="W", help="processes of the real "
                        "run (torchrun --nproc_per_node); the world size is part of every graph (default: 1)")
    parser.add_argument("--retries", type=int, default=1, metavar="N", help=f"retries of a failed compile "
                        f"({RETRIES_ENV}; default: 1)")
    parser.add_argument("--retry-failed", action="store_true", help="recompile graphs the cache holds as "
                        "failed compiles (NEURON_CC_FLAGS --retry_failed_compilation)")
    parser.add_argument("--target", choices=("auto", "neuron", "cpu"), default="auto", help="neuron: under "
                        "neuron_parallel_compile; cpu: the graph tour alone (default: neuron when a Neuron "
                        "device is present)")
    parser.add_argument("train_args", nargs="*", metavar="TRAIN_ARGS", help="after --: the real run's arguments")


def _train_config(train_args: list[str]) -> RunConfig:
    parser = argparse.ArgumentParser(prog="neuron-train precompile [options] --", add_help=False)
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(train_args))


def _resolve_cache(cli_dir: str | None, cfg: RunConfig) -> Path:
    chosen = cli_dir or cfg.compile.compile_cache or cc.DEFAULT_CACHE_DIR
    if cc.is_s3(chosen):
        raise UsageError("the compile cache must be a local directory; move it to and from S3 with "
                         "`neuron-train cache pack/unpack s3://...`")
    if cli_dir and cfg.compile.compile_cache and Path(cli_dir).resolve() != Path(cfg.compile.compile_cache).resolve():
        raise UsageError(f"--cache-dir {cli_dir} and --compile-cache {cfg.compile.compile_cache} in TRAIN_ARGS "
                         "differ: the real run must use the cache precompile fills")
    return Path(chosen).absolute()


def _validate(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.num_parallel is not None and args.num_parallel < 1:
        raise UsageError(f"--num-parallel must be >= 1, got {args.num_parallel}")
    if args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")


def _stream(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `command`, echoing its output as it comes; returns (exit code, the output's tail)."""
    tail: deque[str] = deque(maxlen=4000)
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1)
    except FileNotFoundError:
        raise RunError(f"{command[0]} not found on PATH: it comes with torch-neuronx (activate the "
                       "Neuron venv, e.g. /opt/aws_neuronx_venv_pytorch_*)") from None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line)
    return proc.wait(), "".join(tail)


def _report(manifest: dict, run_id: str, cache: Path, added: list[str], summary: dict) -> str:
    """What the precompile produced, read from the manifest the graph tour recorded."""
    found = [(fp, r) for fp, r in manifest["configs"].items() if run_id in r.get("precompile_ids", [])]
    if not found:
        raise RunError(f"the precompile run recorded nothing in {cache}/{cc.MANIFEST}: --compile-cache or "
                       f"{EXTRACT_ENV} did not reach neuron_train (a wrapper that drops arguments or "
                       "environment variables?)")
    lines = []
    for fp, record in found:
        phases: dict[str, int] = {}
        for g in record["graphs"].values():
            phases[g["phase"]] = phases.get(g["phase"], 0) + 1
        seconds = sum(g.get("compile_time_s") or 0.0 for g in record["graphs"].values())
        lines.append(f"precompiled  {cc.describe_config(record['config'])} (configuration {fp})")
        by_phase = ", ".join(f"{n} {p}" for p, n in sorted(phases.items()))
        lines.append(f"graphs       {len(record['graphs'])} recorded" + (f" ({by_phase})" if by_phase else "")
                     + (f", {seconds:.1f} s of compiling in the tour" if seconds else ""))
        if record.get("unidentified_graphs"):
            lines.append(f"warning      {record['unidentified_graphs']} graph(s) had no fingerprint: "
                         "coverage cannot be checked for them")
    xla_new = sum(1 for r in manifest["files"].values() if r.get("recorded_by") in {fp for fp, _ in found})
    lines.append(f"cache        {cache}: {len(added)} Neuron entries recorded, {xla_new} files vouched for")
    if summary:
        lines.append(f"compile      neuron_parallel_compile: {summary.get('graphs', '?')} graphs, "
                     f"{summary.get('compiled', '?')} compiled, {summary.get('failed', '?')} failed")
        for path in summary.get("failed_graphs", [])[:5]:
            lines.append(f"  failed     {path}")
    return "\n".join(lines)


def _preflight(cache: Path, retry_failed: bool) -> None:
    """Refuse a damaged cache (the compiler would skip those graphs); warn about failed compiles."""
    cache.mkdir(parents=True, exist_ok=True)
    damaged = [f for f in cc.check_files(cache, cc.load_manifest(cache)["files"]) if f.problem == "corrupt"]
    if damaged:
        raise RunError(f"{cache} has {len(damaged)} damaged file(s), e.g. {damaged[0].entry}: "
                       f"{damaged[0].detail}; run `neuron-train cache verify --cache-dir {cache} "
                       "--quarantine` first")
    failed = [e for e in cc.scan(cache) if e.state == cc.FAILED]
    if failed and not retry_failed:
        warn(f"{len(failed)} graph(s) in {cache} are cached as failed compiles and will stay failed "
             f"(e.g. {failed[0].path}): add --retry-failed to compile them again")


def _execute(plan: Plan) -> tuple[str, dict]:
    """Run the plan holding the cache's use lock; returns (the report, neuron_parallel_compile's summary)."""
    run_id = plan.env[PRECOMPILE_ENV]
    use = cc.CacheUse(plan.cache)  # a prune must not delete entries under a running precompile
    try:
        code, log = _stream(plan.command, {**os.environ, **plan.env})
        summary = parse_compile_summary(log) if plan.target == "neuron" else {}
        if code != 0:
            failed = f"; {summary['failed']} graph(s) failed to compile" if summary.get("failed") else ""
            raise RunError(f"the precompile run failed (exit code {code}{failed}); its output is above")
        manifest = cc.load_manifest(plan.cache)
        fps = [fp for fp, r in manifest["configs"].items() if run_id in r.get("precompile_ids", [])]
        added = cc.record_entries(plan.cache, fps[0]) if fps and plan.target == "neuron" else []
        return _report(cc.load_manifest(plan.cache), run_id, plan.cache, added, summary), summary
    finally:
        use.release()


def main(args: argparse.Namespace) -> int:
    _validate(args)
    cfg = _train_config(args.train_args)
    cache = _resolve_cache(args.cache_dir, cfg)
    from neuron_train.device import neuron_device_present  # imports torch: after argument checks

    target = args.target if args.target != "auto" else ("neuron" if neuron_device_present() else "cpu")
    plan = build_plan(cfg, args.train_args, cache=cache, target=target, world=args.nproc_per_node,
                      num_parallel=args.num_parallel, retries=args.retries, retry_failed=args.retry_failed,
                      env=os.environ, run_id=uuid.uuid4().hex[:12])
    if message := network_fs_warning(cache):
        warn(message)
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return 0
    _preflight(cache, args.retry_failed)
    text, summary = _execute(plan)
    print(text, flush=True)
    if summary.get("failed"):
        print(f"{summary['failed']} graph(s) failed to compile and are cached as failed: fix the cause, "
              "then precompile again with --retry-failed", file=sys.stderr)
        return 1
    return 0
