"""`neuron-train cache list|verify|prune|pack|unpack`: the command over the cache modules
(store.py, maintenance.py, archive.py, listing.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from neuron_train.common.cli_parser import add_cache_option
from neuron_train.common.errors import RunError, UsageError
from neuron_train.precompile.archive import pack, unpack
from neuron_train.precompile.listing import cache_listing, format_listing, human_age, human_size, state_word
from neuron_train.precompile.maintenance import (
    BAD_FINDINGS,
    QUARANTINE_DIR,
    interrupted_prunes,
    parse_age,
    parse_size,
    prune,
    quarantine,
    select_prune,
    unvouched,
    verify,
)
from neuron_train.precompile.store import (
    ADOPT_FLAG,
    DEFAULT_CACHE_DIR,
    FAILED,
    LOCKED,
    MANIFEST,
    Entry,
    has_manifest,
    load_manifest,
    open_cache,
    require_cache,
    scan,
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    add_cache_option(common, default=DEFAULT_CACHE_DIR,
                     help=f"the compile cache directory (default: {DEFAULT_CACHE_DIR})")
    common.add_argument(ADOPT_FLAG, action="store_true", help="let verify --quarantine, prune, pack and "
                        "unpack change a folder that has neither our manifest nor the Neuron cache layout")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("list", parents=[common], help="size, entries, age and configurations")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p = sub.add_parser("verify", parents=[common], help="check entries against the manifest's checksums "
                       "and report failed compiles (exit 1 when the cache is unsafe)")
    p.add_argument("--quarantine", action="store_true", help="move damaged entries to "
                   f"{QUARANTINE_DIR}/<time>/ (never deleted) and forget missing ones")
    p = sub.add_parser("prune", parents=[common], help="delete entries by age or total size "
                       "(refused while a precompile or run uses the cache)")
    p.add_argument("--older-than", metavar="AGE", help="delete entries not written for AGE (30d, 12h, 2w)")
    p.add_argument("--max-size", metavar="SIZE", help="delete oldest entries until the cache fits in "
                   "SIZE (500M, 20G)")
    p.add_argument("--failed", action="store_true", help="delete entries cached as failed compiles "
                   "(they are otherwise never retried)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p = sub.add_parser("pack", parents=[common], help="write finished entries and the manifest into "
                       "one .tar.gz, locally or to s3://BUCKET/KEY")
    p.add_argument("archive", metavar="FILE", help="FILE.tar.gz or s3://BUCKET/KEY (never overwritten)")
    p = sub.add_parser("unpack", parents=[common], help="add an archive's entries to the cache "
                       "(refuses entries that exist and differ)")
    p.add_argument("archive", metavar="FILE", help="FILE.tar.gz or s3://BUCKET/KEY")


def _existing(cache_dir: str) -> Path:
    cache = open_cache(cache_dir)
    if not cache.is_dir():
        raise UsageError(f"no such cache directory: {cache_dir}")
    return cache


def _cmd_list(args: argparse.Namespace) -> int:
    info = cache_listing(_existing(args.compile_cache))
    print(json.dumps(info.to_json(), indent=2) if args.json else format_listing(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    cache = _existing(args.compile_cache)
    if args.quarantine:
        require_cache(cache, "verify --quarantine", args.adopt)
    manifest, entries = load_manifest(cache), scan(cache)
    if not entries and not manifest.files:
        print(f"{cache}: empty cache, nothing to verify")
        return 0
    if not has_manifest(cache):
        raise RunError(f"{cache} has no {MANIFEST}: none of its {len(entries)} entries was recorded by a "
                       "precompile, so none can be verified; precompile into it, or prune it")
    findings = verify(cache, manifest)
    for f in findings:
        print(f"{f.problem:<11} {f.entry}: {f.detail}")
    killed = interrupted_prunes(cache)
    if killed and any(f.problem == "missing" for f in findings):
        print(f"note: a `cache prune` was killed before it finished ({killed[0].name.rsplit('-', 1)[1]} was its "
              "process id): the files it deleted are still recorded, hence `missing`; `neuron-train cache "
              "verify --quarantine` forgets them")
    bad = [f for f in findings if f.problem in BAD_FINDINGS]
    unrecorded = sum(1 for f in findings if f.problem == "unrecorded")
    checked = f"{len(manifest.files)} recorded files checked, {len(entries)} entries" + (
        f" ({unrecorded} not recorded, not checked)" if unrecorded else "")
    verdict = f"{len(bad)} problem(s)" if bad else "OK" if manifest.files else "nothing verified"
    print(f"{checked}: {verdict}")
    if args.quarantine:
        moved_to = quarantine(cache, findings, args.adopt)
        if moved_to:
            print(f"moved damaged entries to {moved_to}; precompile again to rebuild them")
        bad = [f for f in bad if f.problem == FAILED]
    if any(f.problem == FAILED for f in bad):
        print("failed compiles stay failed: precompile with --retry-failed, or `neuron-train cache prune "
              "--failed`")
    return 1 if bad or not manifest.files else 0


def _cmd_prune(args: argparse.Namespace) -> int:
    cache = _existing(args.compile_cache)
    if not (args.older_than or args.max_size or args.failed):
        raise UsageError("say what to prune: --older-than AGE, --max-size SIZE and/or --failed")
    older = parse_age(args.older_than) if args.older_than is not None else None
    max_size = parse_size(args.max_size) if args.max_size is not None else None
    require_cache(cache, "prune", args.adopt)
    entries = scan(cache)
    foreign = unvouched(cache, entries, load_manifest(cache))  # kept: prune deletes only what it vouches for
    chosen = select_prune(entries, now=time.time(), older_than=older, max_size=max_size, failed=args.failed,
                          protected=frozenset(e.path for e in foreign))

    def announce(e: Entry, verb: str = "delete") -> None:
        print(f"{verb} {e.path} ({human_size(e.size)}, {human_age(time.time() - e.mtime)} old, "
              f"{state_word(e.state)})", flush=True)

    if args.dry_run:
        for e in chosen:
            announce(e, "would delete")
    elif chosen:
        prune(cache, chosen, announce, args.adopt)  # announces each entry once the cache is ours, not before
    if foreign:
        print(f"kept {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} holding files not recorded in "
              f"the manifest and not compiler artifacts, e.g. {foreign[0].path} (never deleted)")
    locked = [e for e in entries if e.state == LOCKED]
    if locked:
        print(f"kept {len(locked)} locked entr{'y' if len(locked) == 1 else 'ies'} (compile in progress)")
    freed = sum(e.size for e in chosen)
    print(f"{'would free' if args.dry_run else 'freed'} {human_size(freed)} in {len(chosen)} entries; "
          f"{human_size(sum(e.size for e in entries) - freed)} left")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    result = pack(_existing(args.compile_cache), args.archive, args.adopt)
    print(f"packed {result.entries} entries ({result.files} files, {human_size(result.bytes)}) "
          f"into {args.archive}")
    if result.left_out:
        print(f"left out {len(result.left_out)} failed, locked or unfinished entries, or entries holding files "
              f"not recorded by a precompile, e.g. {result.left_out[0]}")
    return 0


def _cmd_unpack(args: argparse.Namespace) -> int:
    result = unpack(args.archive, open_cache(args.compile_cache), args.adopt)
    print(f"unpacked {result.new_files} new files into {args.compile_cache} ({result.identical} already "
          f"present and identical, {result.configs} configuration(s) merged into the manifest)")
    return 0


def main(args: argparse.Namespace) -> int:
    actions = {"list": _cmd_list, "verify": _cmd_verify, "prune": _cmd_prune, "pack": _cmd_pack,
               "unpack": _cmd_unpack}
    return actions[args.action](args)
