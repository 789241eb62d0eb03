#!/usr/bin/env bash
# Mutation testing of the safety-critical modules with mutmut (pip install -e '.[mutation]').
# On demand, not in CI: CPU heavy (one module at a time; about 5-30 min each on 2 busy cores).
#
#   scripts/mutation.sh                      # every module below
#   scripts/mutation.sh training/optim.py    # one (or a few) of them
#   MUTATION_TESTS=tests/common/test_fileio.py scripts/mutation.sh common/fileio.py  # against these tests only
#
# Each module is mutated alone, in a scratch copy of the checkout (mutmut writes a mutants/ folder
# and its config is per project), against the fast in-process tests that guard it: mutmut maps
# tests to functions by tracing the test process, so a test that runs the code in a subprocess
# only counts when the same test also calls it in-process. Results: runs/mutation/<module>.txt
# (every mutant and its status), runs/mutation/<module>.survivors.diff (the diff of each mutant not
# killed) and one summary line per module on stdout; docs/testing.md keeps
# the figures of the last run.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/runs/mutation"
NICE="${MUTATION_NICE:-15}"
CHILDREN="${MUTATION_CHILDREN:-2}"
TESTS="${MUTATION_TESTS:-}"  # test files instead of the module's selection (a quick lower bound: fewer tests)

# Tests that start the command, a training run or the CLI in a subprocess: deselected (slow, and
# invisible to mutmut's per-function test mapping).
SUBPROCESS_TESTS="clean_script_is_stable or recompilation_is_reported or host_read_before_the_sync \
or late_graph_is_kept_apart or warmup_and_max_graphs or torchrun_processes_are_merged \
or failing_command_is_not_stable or test_usage_errors or json_report_never_replaces or report_format \
or graph_watch or assert_graph_stable or multi_epoch_run or coverage_full_partial or precompile_hint_keeps \
or dry_run or bad_input_is_one_line or concurrent_precompiles or the_same_configuration_is_fully \
or changed_batch_size_reports or require_precompiled_stops or damaged_entry_is_never or stand_in \
or lost_extraction_switch or on_neuron or pack_removes_a_dead or read_only_output_dir \
or errors_found_before_start_up or restarted_run_trains or finished_run_resumed or truncated_newest_checkpoint_resumes \
or torchrun_world_size_mismatch or cli_verify_exit_codes or damaged_manifest_is_a_clear or prune_deletes \
or prune_refuses or prune_needs or pack_unpack_round_trip or refuses_to_overwrite_a_different \
or pack_never_overwrites or rejects_a_tampered or s3_locations or cache_list_shows or usage_errors_are_one_line \
or steps_is_the_same_flag or manifest_from_another_cache or never_touches_torch_xla or crashes_mid_tour \
or plain_sgd or drop_path or branch_and_slice_graphs_are_named"

# The tests mutmut runs for each module: only fast files that call the module in-process
# (`-m "$(markers_for MODULE)"` is added: the slow tests run training subprocesses).
tests_for() {
    case "$1" in
        graphs/analyzer.py)        echo "tests/graphs/test_graphs.py tests/graphs/test_graphs_branches.py tests/graphs/test_guards.py tests/graphs/test_analyzer_reports.py tests/graphs/test_analyzer_rules.py" ;;
        precompile/coverage.py)    echo "tests/precompile/test_coverage.py tests/precompile/test_precompile.py tests/instrument/test_byos.py" ;;
        precompile/manifest.py)    echo "tests/precompile/test_manifest.py tests/precompile/test_archive.py tests/precompile/test_reliability_cache.py tests/precompile/test_cache.py tests/graphs/test_guards.py" ;;
        precompile/archive.py)     echo "tests/precompile/test_archive.py tests/precompile/test_reliability_cache.py tests/precompile/test_cache.py tests/graphs/test_guards.py" ;;
        common/fileio.py)          echo "tests/common/test_fileio.py tests/precompile/test_reliability_cache.py tests/cost/test_report_reliability.py tests/precompile/test_cache.py tests/graphs/test_guards.py tests/training/test_reliability_checkpoint.py" ;;
        training/checkpoint.py)    echo "tests/training/test_checkpoint.py" ;;  # its reliability tests take minutes per mutant
        training/checkpointer.py)  echo "tests/training/test_checkpointer.py" ;;  # the loop's side: when, what, resume
        training/checkpoint_format.py) echo "tests/training/test_checkpoint_format.py" ;;  # the structure and checksum checks, pure
        training/optim.py)         echo "tests/graphs/test_guards.py" ;;
        training/device.py)        echo "tests/graphs/test_guards.py" ;;
        *) return 1 ;;
    esac
}
# The marker selection: the fast tier, but for device.py, whose one in-process guard of its gloo
# average (test_guards.py's, the only slow test there) forks its second rank and is therefore `slow`.
markers_for() {
    case "$1" in
        training/device.py) echo "slow or not slow" ;;
        *)                  echo "not slow" ;;
    esac
}
# Where only some functions of a module are in scope (the rest is guarded elsewhere): their mutants.
scope_of() {
    case "$1" in
        training/optim.py)  echo '\.x_(xla_safe|lr_at)__mutmut_' ;;
        training/device.py) echo '\.x__gloo_average__mutmut_' ;;
        *)                  echo '__mutmut_' ;;
    esac
}
ALL=(common/fileio.py precompile/manifest.py precompile/archive.py training/checkpoint_format.py
     training/checkpoint.py training/checkpointer.py precompile/coverage.py graphs/analyzer.py training/optim.py training/device.py)

if ! command -v mutmut >/dev/null; then
    echo "mutation.sh: mutmut is not installed: pip install -e '.[mutation]'" >&2
    exit 2
fi
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=("${ALL[@]}")
for module in "${modules[@]}"; do
    tests_for "$module" >/dev/null || {
        echo "mutation.sh: no test selection for '$module': one of: ${ALL[*]}" >&2
        exit 2
    }
done

mkdir -p "$OUT"
for module in "${modules[@]}"; do
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    cp -r "$ROOT/neuron_train" "$ROOT/tests" "$ROOT/pyproject.toml" "$scratch/"
    find "$scratch" -name __pycache__ -prune -exec rm -rf {} +
    # shellcheck disable=SC2046
    cat >> "$scratch/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["neuron_train"]
only_mutate = ["neuron_train/$module"]
pytest_add_cli_args_test_selection = [$(printf '"%s", ' ${TESTS:-$(tests_for "$module")})"-m", "$(markers_for "$module")", "-k", "not ($SUBPROCESS_TESTS)"]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
process_isolation = "forkserver"
EOF
    name="${module//\//.}"
    start=$(date +%s)
    (cd "$scratch" && PJRT_DEVICE=CPU env -u PYTHONPATH nice -n "$NICE" \
        mutmut run --max-children "$CHILDREN" >"$OUT/$name.log" 2>&1) || true
    (cd "$scratch" && mutmut results --all true) | grep -E "$(scope_of "$module")" >"$OUT/$name.txt" || true
    # the diff of every mutant not killed, to judge it (a gap to test, or equivalent)
    grep -v ': killed$' "$OUT/$name.txt" | sed 's/: .*//' | while read -r mutant; do
        (cd "$scratch" && mutmut show "$mutant") || true
    done >"$OUT/$name.survivors.diff"
    total=$(grep -c ': ' "$OUT/$name.txt" || true)
    killed=$(grep -c ': killed$' "$OUT/$name.txt" || true)
    echo "$module: $killed/$total killed ($(grep -vc ': killed$' "$OUT/$name.txt" || true) not:" \
         "$(grep -v ': killed$' "$OUT/$name.txt" | awk '{print $2}' | sort | uniq -c | tr -s ' ' | tr '\n' ',')" \
         "$(( $(date +%s) - start )) s) -> $OUT/$name.txt"
    rm -rf "$scratch"
    trap - EXIT
done
