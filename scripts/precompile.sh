#!/usr/bin/env bash
# Precompile every graph of a training run into the compile cache and record its graph manifest.
#
#   scripts/precompile.sh [--dry-run] [--compile-cache DIR] [--num-parallel N] [--nproc-per-node W] \
#       -- <the same arguments as neuron-train train>
#   scripts/precompile.sh [--dry-run] [--compile-cache DIR] [--steps N] -- python my_train.py ARGS
#
# A thin wrapper over `neuron-train precompile` (see docs/precompile.md and --help). It decides
# nothing itself: the step limit and the graph-extraction switch live in the Python process, so
# they cannot be lost between a wrapper script and neuron_parallel_compile.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
# Run this checkout's neuron_train, whatever else is installed.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m neuron_train precompile "$@"
