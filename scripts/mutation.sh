#!/usr/bin/env bash
# Mutation testing of the safety-critical modules with mutmut (pip install -e '.[mutation]').
# On demand, not in CI: CPU heavy (one module at a time; about 5-30 min each on 2 busy cores).
#
#   scripts/mutation.sh                      # every module in ALL below
#   scripts/mutation.sh training/optim.py    # one (or a few) of them
#   scripts/mutation.sh --tests training/optim.py  # only print the test files it would run
#   MUTATION_TESTS=tests/common/test_fileio.py scripts/mutation.sh common/fileio.py  # against these tests only
#
# Each module is mutated alone, in a scratch copy of the checkout (mutmut writes a mutants/ folder
# and its config is per project), against the fast in-process tests that guard it. Those are found
# in the tree, not in a list: tests mirror the package, so the tests of neuron_train/X/Y.py are the
# files under tests/X/ (sub-folders included) that import neuron_train.X.Y (docs/testing.md). mutmut
# maps tests to functions by tracing the test process, so a test that runs the code in a subprocess
# only counts when the same test also calls it in-process. Results: runs/mutation/<module>.txt
# (every mutant and its status), runs/mutation/<module>.survivors.diff (the diff of each mutant not
# killed) and one summary line per module on stdout; docs/measurements.md keeps the figures of the
# last runs.
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

# The test files mutmut runs for a module neuron_train/X/Y.py: those under tests/X/ that import
# neuron_train.X.Y anywhere in them (`-m "$(markers_for MODULE)"` is added: slow tests run training
# subprocesses). A module of neuron_train/ itself (cli.py) takes the files directly under tests/.
tests_for() {
    python3 - "$ROOT" "$1" <<'PY'
import ast, sys
from pathlib import Path

root, module = Path(sys.argv[1]), sys.argv[2]
source = root / "neuron_train" / module
if source.suffix != ".py" or not source.is_file():
    sys.exit(f"mutation.sh: no module neuron_train/{module} (a path under neuron_train/, e.g. training/optim.py)")
dotted = ".".join(("neuron_train", *Path(module).with_suffix("").parts))
folder = root / "tests" / Path(module).parent
files = sorted(folder.rglob("test_*.py") if folder != root / "tests" else folder.glob("test_*.py"))


def imported(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


chosen = [f for f in files if any(n == dotted or n.startswith(dotted + ".") for n in imported(ast.parse(f.read_text())))]
if not chosen:
    sys.exit(f"mutation.sh: no test file under {folder.relative_to(root)}/ imports neuron_train/{module}")
print(" ".join(str(f.relative_to(root)) for f in chosen))
PY
}
# The marker and name selection: the fast tier, but for device.py, whose one in-process guard of its
# gloo average (tests/training/test_guards.py) forks its second rank and is therefore `slow`: there
# the tests named for the gloo average, slow or not.
markers_for() {
    case "$1" in
        training/device.py) echo "slow or not slow" ;;
        *)                  echo "not slow" ;;
    esac
}
names_for() {
    case "$1" in
        training/device.py) echo "gloo and " ;;
        *)                  echo "" ;;
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

if [ "${1:-}" = "--tests" ]; then
    shift
    [ $# -gt 0 ] || { echo "mutation.sh: --tests needs a module path, e.g. training/optim.py" >&2; exit 2; }
    for module in "$@"; do
        tests_for "$module" || exit 2
    done
    exit 0
fi
if ! command -v mutmut >/dev/null; then
    echo "mutation.sh: mutmut is not installed: pip install -e '.[mutation]'" >&2
    exit 2
fi
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=("${ALL[@]}")
for module in "${modules[@]}"; do
    tests_for "$module" >/dev/null || exit 2  # it said why
done

mkdir -p "$OUT"
for module in "${modules[@]}"; do
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    cp -r "$ROOT/neuron_train" "$ROOT/tests" "$ROOT/pyproject.toml" "$scratch/"
    find "$scratch" -name __pycache__ -prune -exec rm -rf {} +
    # shellcheck disable=SC2086  # the test files are words: split on purpose
    cat >> "$scratch/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["neuron_train"]
only_mutate = ["neuron_train/$module"]
pytest_add_cli_args_test_selection = [$(printf '"%s", ' ${TESTS:-$(tests_for "$module")})"-m", "$(markers_for "$module")", "-k", "$(names_for "$module")not ($SUBPROCESS_TESTS)"]
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
