#!/usr/bin/env bash
# The first run on real Neuron hardware (a trn1.2xlarge, then an inf2.xlarge): checks what this
# project assumed from the Neuron SDK 2.29.1 documentation, one line per check, and writes every
# answer with the tools' raw output to OUT/first-run.json, which the project reads back into
# tests/fixtures/first_run/ as recorded real output (docs/first-run.md).
#
#   scripts/neuron_first_run.sh [--out DIR] [--only CHECK,CHECK]      # from a checkout, venv active
#
# Checks: npc-num-parallel, torch-xla-requires, lazy, dynamo-full, cache-module-files,
# hlo-dump, bench-train, bench-infer (the last two use every NeuronCore of the instance).
# Each line: PASS, FAIL or INFO (a fact recorded, nothing assumed about it), the check, what it found.
# Exit code: 0 when no check failed, 1 otherwise, 2 for bad arguments. Needs bash, python3.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
PY=${NT_FIRST_RUN_PYTHON:-python3}          # the venv's python (pip show runs through it)
CHECKS=(npc-num-parallel torch-xla-requires lazy dynamo-full cache-module-files hlo-dump bench-train bench-infer)
TRAIN=(--model vit-digits --max-steps 20 --warmup-measure-steps 3 --no-progress --no-tensorboard)
out="first-run-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)"
only=""

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
    case $1 in
        --out) out=${2:?--out needs a folder}; shift 2 ;;
        --only) only=${2:?--only needs check names}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "neuron_first_run: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
for name in ${only//,/ }; do
    [[ " ${CHECKS[*]} " == *" $name "* ]] || { echo "neuron_first_run: unknown check: $name (known: ${CHECKS[*]})" >&2; exit 2; }
done
[[ -e $out ]] && { echo "neuron_first_run: $out exists: pass another --out (results are never overwritten)" >&2; exit 2; }
mkdir -p "$out/raw" || exit 2
failed=0
device=${PJRT_DEVICE:-CPU}
compgen -G '/dev/neuron[0-9]*' >/dev/null && device=${PJRT_DEVICE:-NEURON}

# record NAME STATUS DETAIL: one line on the terminal, one row for the JSON (raw output: raw/NAME.txt)
record() {
    printf '%-5s %-20s %s\n' "$2" "$1" "$3"
    printf '%s\t%s\t%s\n' "$1" "$2" "${3//$'\t'/ }" >>"$out/checks.tsv"
    [[ $2 == FAIL ]] && failed=1
    return 0
}

files_of() { find "$1" -maxdepth 1 -type f -printf '%f\n' | sort | tr '\n' ' '; }

wanted() { [[ -z $only || ",$only," == *",$1,"* ]]; }

check_npc_num_parallel() {
    if ! neuron_parallel_compile --help >"$out/raw/npc-num-parallel.txt" 2>&1; then
        record npc-num-parallel FAIL "neuron_parallel_compile --help failed (is the torch-neuronx venv active?)"
    elif grep -q -- '--num_parallel' "$out/raw/npc-num-parallel.txt"; then
        record npc-num-parallel PASS "neuron_parallel_compile --help lists --num_parallel"
    else
        record npc-num-parallel FAIL "neuron_parallel_compile --help has no --num_parallel: precompile --num-parallel cannot work"
    fi
}

check_torch_xla_requires() {
    local requires have
    { "$PY" -m pip show torch-neuronx; "$PY" -m pip show torch-xla; } >"$out/raw/torch-xla-requires.txt" 2>&1
    requires=$(sed -n 's/^Requires: //p' "$out/raw/torch-xla-requires.txt" | head -n 1)
    have=$(sed -n '/^Name: torch-xla/,/^Name:/s/^Version: //p' "$out/raw/torch-xla-requires.txt" | head -n 1)
    if [[ -z $requires ]]; then
        record torch-xla-requires FAIL "pip show torch-neuronx found nothing: activate the venv that has it"
    elif [[ $requires != *torch-xla* ]]; then
        record torch-xla-requires FAIL "torch-neuronx does not require torch-xla (requires: $requires)"
    else
        record torch-xla-requires INFO "torch-neuronx requires: $requires; torch-xla installed: ${have:-none}"
    fi
}

# precompile, then train --require-precompiled from that cache: both complete? graphs of each?
check_step_path() {
    local path=$1 cache=$out/cache-$1 optim=for-loop run
    [[ $path == dynamo-full ]] && optim=foreach
    run=(--step-compiler "$path" --optimizer-impl "$optim" --compile-cache "$cache")
    if ! "$PY" -m neuron_train precompile --cache-dir "$cache" -- "${TRAIN[@]}" "${run[@]}" \
            >"$out/raw/$path-precompile.txt" 2>&1; then
        record "$path" FAIL "precompile failed: $(tail -n 1 "$out/raw/$path-precompile.txt")"
        return
    fi
    if ! "$PY" -m neuron_train train "${TRAIN[@]}" "${run[@]}" --require-precompiled --output-dir "$out/run-$path" \
            >"$out/raw/$path-train.txt" 2>&1; then
        record "$path" FAIL "train --require-precompiled failed: $(tail -n 1 "$out/raw/$path-train.txt")"
        return
    fi
    record "$path" PASS "precompile then train --require-precompiled completed; $("$PY" -c '
import json, sys; s = json.load(open(sys.argv[1]))
print(f"{s[\"compile_count\"]} graph(s) compiled by the run, device {s[\"device\"]}")' "$out/run-$path/summary.json")"
}

# The files of one MODULE_ folder of the Neuron cache: after a success, and after a compile that
# fails on purpose (an unknown compiler option); the cache reader assumes model.done / model.log.
check_cache_module_files() {
    local ok_dir bad_dir bad=$out/cache-forced-failure
    ok_dir=$(find "$out"/cache-lazy -type d -name 'MODULE_*' 2>/dev/null | head -n 1)
    NEURON_CC_FLAGS="--cache_dir=$bad --not-a-neuronx-cc-option" "$PY" -m neuron_train train "${TRAIN[@]}" \
        --max-steps 1 --step-compiler lazy --output-dir "$out/run-forced-failure" \
        >"$out/raw/cache-module-files-forced-failure.txt" 2>&1
    bad_dir=$(find "$bad" -type d -name 'MODULE_*' 2>/dev/null | head -n 1)
    for d in "$ok_dir" "$bad_dir"; do
        [[ -n $d ]] && echo "$d: $(files_of "$d")"
    done >"$out/raw/cache-module-files.txt"
    if [[ -z $ok_dir ]]; then
        record cache-module-files FAIL "no MODULE_ folder in $out/cache-lazy (run the lazy check first)"
    elif [[ -f $ok_dir/model.done && -f $ok_dir/model.neff ]]; then
        record cache-module-files INFO "success: model.neff + model.done as assumed; both listings in raw/cache-module-files.txt"
    else
        record cache-module-files FAIL "success has no model.neff + model.done: $(files_of "$ok_dir")"
    fi
}

# Does XLA_FLAGS=--xla_dump_to write HLO text on this device? (check-graphs relies on it)
check_hlo_dump() {
    local dump=$out/hlo-dump count
    PJRT_DEVICE=$device XLA_FLAGS="--xla_dump_to=$dump --xla_dump_hlo_as_text" "$PY" -c '
import torch, torch_xla
x = torch.ones(4, 4, device=torch_xla.device())
print((x @ x).sum().item(), torch_xla.runtime.device_type())' >"$out/raw/hlo-dump.txt" 2>&1
    count=$(grep -l '^HloModule' "$dump"/*.txt 2>/dev/null | wc -l)
    if ((count > 0)); then
        record hlo-dump PASS "$count HLO text file(s) in $dump on $(tail -n 1 "$out/raw/hlo-dump.txt" | awk '{print $NF}')"
    else
        record hlo-dump FAIL "no HLO text in $dump: the checker's HLO diff has nothing to read on this device"
    fi
}

# bench on every NeuronCore: the result must say every core of the instance ran it
check_bench() {
    local mode=$1 extra=()
    [[ $mode == train ]] && extra=(--nproc "$("$PY" -c 'from neuron_train.cost.bench import resolve_instance_type
from neuron_train.cost.measure import neuron_cores
print(neuron_cores(resolve_instance_type(None)[0]) or 1)')")
    if ! "$PY" -m neuron_train bench --mode "$mode" --model vit-digits --repeats 1 "${extra[@]}" \
            --output "$out/bench-$mode.json" >"$out/raw/bench-$mode.txt" 2>&1; then
        record "bench-$mode" FAIL "bench --mode $mode failed: $(tail -n 1 "$out/raw/bench-$mode.txt")"
        return
    fi
    record "bench-$mode" INFO "$(tail -n 2 "$out/raw/bench-$mode.txt" | head -n 1)"
}

for name in "${CHECKS[@]}"; do
    wanted "$name" || continue
    case $name in
        npc-num-parallel) check_npc_num_parallel ;;
        torch-xla-requires) check_torch_xla_requires ;;
        lazy|dynamo-full) check_step_path "$name" ;;
        cache-module-files) check_cache_module_files ;;
        hlo-dump) check_hlo_dump ;;
        bench-train) check_bench train ;;
        bench-infer) check_bench infer ;;
    esac
done

python3 - "$out" "$device" <<'PY' || { echo "neuron_first_run: could not write $out/first-run.json" >&2; exit 1; }
import datetime, json, os, platform, socket, sys
out = sys.argv[1]
checks = []
for line in open(os.path.join(out, "checks.tsv")) if os.path.exists(os.path.join(out, "checks.tsv")) else []:
    name, status, detail = line.rstrip("\n").split("\t", 2)
    raw = {f: open(os.path.join(out, "raw", f), errors="replace").read()[-20000:]
           for f in sorted(os.listdir(os.path.join(out, "raw"))) if f.startswith(name)}
    checks.append({"name": name, "status": status, "detail": detail, "raw": raw})
doc = {"schema": "neuron-train-first-run", "schema_version": 1, "device": sys.argv[2],
       "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "host": {"hostname": socket.gethostname(), "os": platform.platform(), "python": platform.python_version()},
       "checks": checks}
tmp = os.path.join(out, ".first-run.json.tmp")
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
os.replace(tmp, os.path.join(out, "first-run.json"))
PY
echo "neuron_first_run: $out/first-run.json (copy it to tests/fixtures/first_run/ in the project)"
exit "$failed"
