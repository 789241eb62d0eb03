"""`neuron-train precompile`: compile every graph of a run ahead of it, then prove the run needed no more.

The precompile run is the training loop in "graph tour" mode (NEURON_EXTRACT_GRAPHS_ONLY, set by
neuron_parallel_compile on Neuron and by us elsewhere): a few train steps, one eval batch, no
checkpoints or metrics written. On Neuron, neuron_parallel_compile then compiles the extracted
graphs in parallel into the Neuron cache. Everywhere, the loop records a graph manifest in the cache
directory (store.py): each graph's fingerprint, the phase that produced it, and the settings that
determine graphs.

A later real run with `--compile-cache DIR` compares the graphs it compiles with that manifest:
it reports its coverage (100% = it compiled nothing precompile did not foresee) and, with
`--require-precompiled`, stops before its first step when no precompiled configuration matches
(naming the difference, e.g. "batch size 64 here, 32 in the manifest"), and at the first graph the
manifest lacks. `CompileCacheHook` is the small object the loop calls; the rest are pure functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_train.common.cli_parser import CommandParser
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.fileio import is_s3
from neuron_train.common.neuron_env import EXTRACT_ENV
from neuron_train.precompile import store
from neuron_train.precompile.hook import PRECOMPILE_ENV, cache_flags, network_fs_warning, tour_steps, warn
from neuron_train.precompile.listing import describe_config
from neuron_train.precompile.maintenance import check_files
from neuron_train.precompile.manifest import Manifest
from neuron_train.training.config import RunConfig, add_config_arguments, config_from_args

RETRIES_ENV = "NEURON_PARALLEL_COMPILE_MAX_RETRIES"
# Parsed by the Neuron compiler wrapper and not passed to neuronx-cc (Neuron Persistent Cache
# docs): they do not change the compiled graphs, so they are not part of a configuration.
RUN_PY = Path(__file__).resolve().parent.parent / "run.py"
# The settings that determine a run's graphs, with the words used to name a difference.
# A graph compiled for other compiler flags, compiler or framework versions, or another device is
# another cache entry: graph hashes only cover each other within the same compile environment.
# ----------------------------------------------------------------------------- configurations


# ----------------------------------------------------------------------------- coverage


# ----------------------------------------------------------------------------- environment


# ----------------------------------------------------------------------------- the loop's hook


# ----------------------------------------------------------------------------- the command


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
                        f"in TRAIN_ARGS, else {store.DEFAULT_CACHE_DIR}); one per host")
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
    parser = CommandParser(prog="neuron-train precompile [options] --", add_help=False,
                           help_command="neuron-train train --help")
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(train_args))


def _resolve_cache(cli_dir: str | None, cfg: RunConfig) -> Path:
    chosen = cli_dir or cfg.compile.compile_cache or store.DEFAULT_CACHE_DIR
    if is_s3(chosen):
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


def _report(manifest: Manifest, run_id: str, cache: Path, added: list[str], summary: dict) -> str:
    """What the precompile produced, read from the manifest the graph tour recorded."""
    found = [(fp, r) for fp, r in manifest.configs.items() if run_id in r.precompile_ids]
    if not found:
        raise RunError(f"the precompile run recorded nothing in {cache}/{store.MANIFEST}: --compile-cache or "
                       f"{EXTRACT_ENV} did not reach neuron_train (a wrapper that drops arguments or "
                       "environment variables?)")
    lines = []
    for fp, record in found:
        phases: dict[str, int] = {}
        for g in record.graphs.values():
            phases[str(g.phase)] = phases.get(str(g.phase), 0) + 1
        seconds = sum(g.compile_time_s or 0.0 for g in record.graphs.values())
        lines.append(f"precompiled  {describe_config(record.config)} (configuration {fp})")
        by_phase = ", ".join(f"{n} {p}" for p, n in sorted(phases.items()))
        lines.append(f"graphs       {len(record.graphs)} recorded" + (f" ({by_phase})" if by_phase else "")
                     + (f", {seconds:.1f} s of compiling in the tour" if seconds else ""))
        if record.unidentified_graphs:
            lines.append(f"warning      {record.unidentified_graphs} graph(s) had no fingerprint: "
                         "coverage cannot be checked for them")
    xla_new = sum(1 for r in manifest.files.values() if r.recorded_by in {fp for fp, _ in found})
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
    damaged = [f for f in check_files(cache, store.load_manifest(cache).files) if f.problem == "corrupt"]
    if damaged:
        raise RunError(f"{cache} has {len(damaged)} damaged file(s), e.g. {damaged[0].entry}: "
                       f"{damaged[0].detail}; run `neuron-train cache verify --cache-dir {cache} "
                       "--quarantine` first")
    failed = [e for e in store.scan(cache) if e.state == store.FAILED]
    if failed and not retry_failed:
        warn(f"{len(failed)} graph(s) in {cache} are cached as failed compiles and will stay failed "
             f"(e.g. {failed[0].path}): add --retry-failed to compile them again")


def _execute(plan: Plan) -> tuple[str, dict]:
    """Run the plan holding the cache's use lock; returns (the report, neuron_parallel_compile's summary)."""
    run_id = plan.env[PRECOMPILE_ENV]
    use = store.CacheUse(plan.cache)  # a prune must not delete entries under a running precompile
    try:
        code, log = _stream(plan.command, {**os.environ, **plan.env})
        summary = parse_compile_summary(log) if plan.target == "neuron" else {}
        if code != 0:
            failed = f"; {summary['failed']} graph(s) failed to compile" if summary.get("failed") else ""
            raise RunError(f"the precompile run failed (exit code {code}{failed}); its output is above")
        manifest = store.load_manifest(plan.cache)
        fps = [fp for fp, r in manifest.configs.items() if run_id in r.precompile_ids]
        added = store.record_entries(plan.cache, fps[0]) if fps and plan.target == "neuron" else []
        return _report(store.load_manifest(plan.cache), run_id, plan.cache, added, summary), summary
    finally:
        use.release()


def main(args: argparse.Namespace) -> int:
    _validate(args)
    cfg = _train_config(args.train_args)
    cache = _resolve_cache(args.cache_dir, cfg)
    from neuron_train.common.neuron_env import neuron_device_present

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
