#!/usr/bin/env bash
# The first run on real Neuron hardware (a trn1.2xlarge, then an inf2.xlarge): checks what this
# project assumed from the Neuron SDK 2.29.1 documentation, one line per check, and writes every
# answer with the tools' raw output to OUT/first-run.json, which the project reads back into
# tests/fixtures/first_run/ as recorded real output (docs/first-run.md).
#
#   scripts/neuron_first_run.sh [--out DIR] [--only CHECK,CHECK] [--timeout SECONDS] [--instance-type TYPE]
#   (from a checkout, the venv active; --instance-type only where the EC2 metadata service is unreachable)
#
# Checks, in this order: npc-num-parallel, torch-xla-requires, neuron-cores, lazy, cache-module-files, hlo-dump,
# bench-train, bench-infer (the bench checks use every NeuronCore of the instance), dynamo-full
# (last: torch.compile on torch-neuronx 2.9 may hang, and a hang must not cost the other answers).
# Each check runs under its own time limit, --timeout SECONDS (default 2400): a check past it is
# stopped, with every process it started, and recorded as FAIL.
# Each line: PASS (with its evidence), FAIL, or INFO (a fact recorded, or what only a Neuron device
# can tell on another device), the check, what it found. The evidence is read by
# scripts/first_run_checks.py. NT_FIRST_RUN_TRAIN: the training checks' flags (default: --model vit-digits --max-steps 20
# --warmup-measure-steps 3).
# Exit code: 0 when no check failed, 1 otherwise, 2 for bad arguments. Needs bash, timeout, python3.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
PY=${NT_FIRST_RUN_PYTHON:-python3}          # the venv's python (the one with torch-neuronx)
EVIDENCE=$here/first_run_checks.py
CHECKS=(npc-num-parallel torch-xla-requires neuron-cores lazy cache-module-files hlo-dump bench-train bench-infer dynamo-full)
read -r -a TRAIN <<<"${NT_FIRST_RUN_TRAIN:---model vit-digits --max-steps 20 --warmup-measure-steps 3}"
TRAIN+=(--no-progress --no-tensorboard)
out="first-run-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)"
only=""
itype=""
limit=2400
deadline=0

usage() { sed -n '2,/^# Exit code/p' "$0" | sed 's/^# \{0,1\}//'; }
# need OPTION VALUE WHAT: a missing value is a usage error (exit 2), as the header says
need() { [[ -n $2 ]] || { echo "neuron_first_run: $1 needs $3 (see --help)" >&2; exit 2; }; }
while (($#)); do
    case $1 in
        --out) need "$1" "${2:-}" "a folder"; out=$2; shift 2 ;;
        --only) need "$1" "${2:-}" "check names"; only=$2; shift 2 ;;
        --timeout) need "$1" "${2:-}" "seconds"; limit=$2; shift 2 ;;
        --instance-type) need "$1" "${2:-}" "a type"; itype=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "neuron_first_run: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $limit =~ ^[1-9][0-9]*$ ]] || { echo "neuron_first_run: --timeout takes whole seconds, not '$limit'" >&2; exit 2; }
for name in ${only//,/ }; do
    [[ " ${CHECKS[*]} " == *" $name "* ]] || { echo "neuron_first_run: unknown check: $name (known: ${CHECKS[*]})" >&2; exit 2; }
done
[[ -e $out ]] && { echo "neuron_first_run: $out exists: pass another --out (results are never overwritten)" >&2; exit 2; }
mkdir -p "$out/raw" || exit 2
failed=0
device=${PJRT_DEVICE:-CPU}
compgen -G '/dev/neuron[0-9]*' >/dev/null && device=${PJRT_DEVICE:-NEURON}

# record NAME STATUS DETAIL: one line on the terminal, one row for the JSON (raw output: raw/NAME*)
record() {
    printf '%-5s %-20s %s\n' "$2" "$1" "$3"
    printf '%s\t%s\t%s\n' "$1" "$2" "${3//$'\t'/ }" >>"$out/checks.tsv"
    [[ $2 == FAIL ]] && failed=1
    return 0
}

# limited FILE COMMAND...: COMMAND with its output in FILE, stopped with every process it started
# (timeout(1) signals its whole process group) when the current check's time is up.
limited() {
    local file=$1 left=$((deadline - SECONDS))
    shift
    if ((left <= 0)); then
        echo "neuron_first_run: no time left in this check for: $*" >"$file"
        return 124
    fi
    timeout --kill-after=30 "$left" "$@" >"$file" 2>&1
}

# failed_step NAME WHAT CODE FILE: record the FAIL of a step, saying why (time limit, missing tool)
failed_step() {
    case $3 in
        124 | 137) record "$1" FAIL "$2 stopped: the check's time limit ran out ($limit s, --timeout)" ;;
        127) record "$1" FAIL "$2: command not found (is the torch-neuronx venv active?)" ;;
        *) record "$1" FAIL "$2 failed (exit $3): $(tail -n 1 "$4")" ;;
    esac
}

# evidence NAME ARGS...: record the verdict first_run_checks.py gives on the evidence (STATUS<TAB>DETAIL)
evidence() {
    local name=$1 file=$out/raw/$1-evidence.txt code=0 line
    shift
    limited "$file" "$PY" "$EVIDENCE" "$@" || code=$?
    line=$(grep -m 1 -E "^(PASS|FAIL|INFO)"$'\t' "$file")
    if ((code != 0)) || [[ -z $line ]]; then
        failed_step "$name" "reading the evidence" "$((code == 0 ? 1 : code))" "$file"
    else
        record "$name" "${line%%$'\t'*}" "${line#*$'\t'}"
    fi
}

files_of() { find "$1" -maxdepth 1 -type f -printf '%f\n' | sort | tr '\n' ' '; }

wanted() { [[ -z $only || ",$only," == *",$1,"* ]]; }

check_npc_num_parallel() {
    local raw=$out/raw/npc-num-parallel.txt code=0
    limited "$raw" neuron_parallel_compile --help || code=$?
    if ((code != 0)); then
        failed_step npc-num-parallel "neuron_parallel_compile --help" "$code" "$raw"
    elif grep -q -- '--num_parallel' "$raw"; then
        record npc-num-parallel PASS "neuron_parallel_compile --help lists --num_parallel"
    else
        record npc-num-parallel FAIL "neuron_parallel_compile --help has no --num_parallel: precompile --num-parallel cannot work"
    fi
}

# The NeuronCores neuron-ls lists, against the catalog's count that bench starts workers for
check_neuron_cores() {
    local raw=$out/raw/neuron-cores.txt code=0
    if [[ $device != NEURON ]] && ! command -v neuron-ls >/dev/null; then
        record neuron-cores INFO "no neuron-ls on $device: the NeuronCores the instance has only a Neuron device can tell"
        return
    fi
    # stdout alone is the JSON; the tool's warnings go to raw/neuron-cores-stderr.txt ($0, $@: the inner bash's)
    # shellcheck disable=SC2016
    limited "$out/raw/neuron-cores-stderr.txt" bash -c 'exec "$@" >"$0"' "$raw" neuron-ls --json-output || code=$?
    ((code == 0)) || { failed_step neuron-cores "neuron-ls --json-output" "$code" "$out/raw/neuron-cores-stderr.txt"; return; }
    evidence neuron-cores neuron-cores "$raw" "$itype"
}

# A run from a cold cache, precompile, then train --require-precompiled from the precompiled cache:
# all complete? compile time with and without the cache, and (Neuron) the cache-hit lines.
check_step_path() {
    local path=$1 cache=$out/cache-$1 optim=flat run code=0  # each path with its default update
    [[ $path == dynamo-full ]] && optim=foreach
    run=(--step-compiler "$path" --optimizer-impl "$optim")
    limited "$out/raw/$path-cold.txt" "$PY" -m neuron_train train "${TRAIN[@]}" "${run[@]}" \
        --compile-cache "$out/cache-$path-cold" --output-dir "$out/run-$path-cold" || code=$?
    ((code == 0)) || { failed_step "$path" "train from a cold cache" "$code" "$out/raw/$path-cold.txt"; return; }
    limited "$out/raw/$path-precompile.txt" "$PY" -m neuron_train precompile --compile-cache "$cache" -- \
        "${TRAIN[@]}" "${run[@]}" --compile-cache "$cache" || code=$?
    ((code == 0)) || { failed_step "$path" "precompile" "$code" "$out/raw/$path-precompile.txt"; return; }
    limited "$out/raw/$path-train.txt" "$PY" -m neuron_train train "${TRAIN[@]}" "${run[@]}" --compile-cache "$cache" \
        --require-precompiled --output-dir "$out/run-$path" || code=$?
    ((code == 0)) || { failed_step "$path" "train --require-precompiled" "$code" "$out/raw/$path-train.txt"; return; }
    evidence "$path" step-path "$out" "$path" "$device"
}

# The files of one MODULE_ folder of the Neuron cache: after a success, and after a compile that
# fails on purpose (an unknown compiler option); the cache reader assumes model.done / model.log.
check_cache_module_files() {
    local ok_dir bad_dir bad=$out/cache-forced-failure
    if [[ $device != NEURON ]]; then
        record cache-module-files INFO "no Neuron compiler on $device: which files mark a compiled and a failed MODULE_ folder only a Neuron device can tell"
        return
    fi
    ok_dir=$(find "$out"/cache-lazy -type d -name 'MODULE_*' 2>/dev/null | head -n 1)
    NEURON_CC_FLAGS="--cache_dir=$bad --not-a-neuronx-cc-option" limited "$out/raw/cache-module-files-forced-failure.txt" \
        "$PY" -m neuron_train train "${TRAIN[@]}" --max-steps 1 --step-compiler lazy --output-dir "$out/run-forced-failure"
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

# Does the checker's HLO dump (its own XLA_FLAGS, graphs/process.py dump_flags) write the files its
# HLO diff reads (module_*.before_optimizations.txt) on this device?
check_hlo_dump() {
    local dump=$out/hlo-dump flags count code=0
    flags=$(PJRT_DEVICE=$device "$PY" -c 'import sys; from pathlib import Path
from neuron_train.graphs.process import dump_flags
print(dump_flags(Path(sys.argv[1]), ""))' "$dump" 2>"$out/raw/hlo-dump-flags.txt") || code=$?
    ((code == 0)) || { failed_step hlo-dump "reading the checker's dump flags" "$code" "$out/raw/hlo-dump-flags.txt"; return; }
    echo "XLA_FLAGS=$flags" >>"$out/raw/hlo-dump-flags.txt"
    PJRT_DEVICE=$device XLA_FLAGS="$flags" limited "$out/raw/hlo-dump.txt" "$PY" -c '
import torch, torch_xla
x = torch.ones(4, 4, device=torch_xla.device())
print((x @ x).sum().item(), torch_xla.runtime.device_type())' || code=$?
    ((code == 0)) || { failed_step hlo-dump "a matmul on the XLA device" "$code" "$out/raw/hlo-dump.txt"; return; }
    count=$(grep -l '^HloModule' "$dump"/module_*.before_optimizations.txt 2>/dev/null | wc -l)
    if ((count > 0)); then
        record hlo-dump PASS "$count HLO text file(s) in $dump with the checker's XLA_FLAGS on $(tail -n 1 "$out/raw/hlo-dump.txt" | awk '{print $NF}')"
    else
        record hlo-dump FAIL "no module_*.before_optimizations.txt with HLO in $dump (the checker's XLA_FLAGS): its HLO diff has nothing to read on this device"
    fi
}

# bench on every NeuronCore: the result must say every core of the instance ran it
check_bench() {
    local mode=$1 extra=() cores code=0
    if [[ $mode == train ]]; then
        limited "$out/raw/bench-train-cores.txt" "$PY" "$EVIDENCE" cores "$itype" || code=$?
        cores=$(tail -n 1 "$out/raw/bench-train-cores.txt")
        [[ $code == 0 && $cores =~ ^[0-9]+$ ]] ||
            { failed_step bench-train "counting the NeuronCores" "$((code == 0 ? 1 : code))" "$out/raw/bench-train-cores.txt"; return; }
        extra=(--nproc "$cores")
    fi
    [[ -n $itype ]] && extra+=(--instance-type "$itype")
    limited "$out/raw/bench-$mode.txt" "$PY" -m neuron_train bench --mode "$mode" "${TRAIN[@]}" --repeats 1 \
        "${extra[@]}" --output "$out/bench-$mode.json" || code=$?
    ((code == 0)) || { failed_step "bench-$mode" "bench --mode $mode" "$code" "$out/raw/bench-$mode.txt"; return; }
    evidence "bench-$mode" bench "$out" "$mode" "$device"
}

for name in "${CHECKS[@]}"; do
    wanted "$name" || continue
    deadline=$((SECONDS + limit))  # each check has its own time
    case $name in
        npc-num-parallel) check_npc_num_parallel ;;
        torch-xla-requires) evidence torch-xla-requires requires ;;
        neuron-cores) check_neuron_cores ;;
        lazy|dynamo-full) check_step_path "$name" ;;
        cache-module-files) check_cache_module_files ;;
        hlo-dump) check_hlo_dump ;;
        bench-train) check_bench train ;;
        bench-infer) check_bench infer ;;
    esac
done

"$PY" "$EVIDENCE" write-json "$out" "$device" || { echo "neuron_first_run: could not write $out/first-run.json" >&2; exit 1; }
echo "neuron_first_run: $out/first-run.json (copy it to tests/fixtures/first_run/ in the project)"
exit "$failed"
