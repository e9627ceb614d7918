#!/usr/bin/env bash
# Long fuzzing runs (docs/testing.md, "Fuzzing"): each libFuzzer target of libtinyloop for RUNS
# executions (default 1,000,000), then each Python target (atheris) for PYTHON_SECONDS seconds
# (default 600), the readers-agree check on everything the C fuzzers kept, and a table of
# executions, edges covered and findings per target (also into bench/results/fuzz.md). The
# grown corpora are kept in WORK/grown/<target>/ for the next run or a triage; a finding's
# input is under WORK/<target>/findings/ and becomes a regress-* input of
# libtinyloop/tests/fuzz/corpus/ with its fix. Needs clang (apt-get install clang-14 libclang-rt-14-dev), atheris (pip install
# atheris) and this repository's tinyloop importable by python3.
# usage: bench/fuzz.sh [WORK_DIR]      env: RUNS, PYTHON_SECONDS, JOBS (default 2)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-fuzz-long.XXXXXX")}
lscpu | sed -n 's/^Model name: *//p'
date -u +%Y-%m-%dT%H:%MZ
status=0
time FUZZ_REQUIRE_AGREE=1 "$repo/libtinyloop/tests/fuzz/run_fuzz.sh" --runs "${RUNS:-1000000}" \
  --python "${PYTHON_SECONDS:-600}" --jobs "${JOBS:-2}" --keep "$work/grown" "$work" || status=$?
{  # the table for bench/results/fuzz.md
  echo "# fuzz"
  echo
  echo "$(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs." \
       "Command: bench/fuzz.sh (RUNS=${RUNS:-1000000}, PYTHON_SECONDS=${PYTHON_SECONDS:-600}); exit status $status."
  echo
  echo '```'
  cat "$work"/*/summary
  echo '```'
} > "$repo/bench/results/fuzz.md"
exit "$status"
