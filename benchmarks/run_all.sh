#!/usr/bin/env bash
# Every benchmark once at its default options, one JSON line each (pushpull: one per size), to stdout.
# Progress and role logs of failures go to stderr. Run from the repository root:
#   benchmarks/run_all.sh > results.jsonl
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
status=0
for cmd in \
    "-m benchmarks.pushpull" \
    "-m benchmarks.overhead" \
    "-m benchmarks.workloads w1" \
    "-m benchmarks.workloads w2" \
    "-m benchmarks.workloads w2 --zipf 1.2" \
    "-m benchmarks.workloads w3" \
    "-m benchmarks.up_local"; do
    echo "[run_all] $PY $cmd" >&2
    # shellcheck disable=SC2086
    $PY $cmd || status=1
done
exit $status
