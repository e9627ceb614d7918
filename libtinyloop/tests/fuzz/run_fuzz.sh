#!/usr/bin/env bash
# Build the libFuzzer targets (tests/fuzz/, clang) and fuzz each one from its seed corpus, then
# check that the C and Python readers agree on every input the fuzzers kept; optionally fuzz
# the Python readers too (atheris: fuzz_python.py).
#   --seconds N   each C target fuzzes N seconds (CI: a short run that must find nothing)
#   --runs N      each C target runs N executions (bench/fuzz.sh: the long runs)
#   --python N    also fuzz each Python target (model_file, prefix_blob, block_file, tokenizer)
#                 for N seconds (needs atheris)
#   --jobs N      fuzzers run at once (default 2)
#   --keep DIR    also keep each target's grown corpus in DIR/<target>/ (default: discarded)
# Before fuzzing it checks that corpus/ is what make_fuzz_corpus writes, besides corpus/tokenizer/
# and the regression inputs (corpus/*/regress-*); every corpus input is run first (libFuzzer
# replays the corpus it is given). A finding (crash, leak, timeout, broken invariant, an
# exception a Python reader must not raise) fails the run and leaves its input in
# WORK/<target>/findings/: add it to corpus/<target>/ as regress-<what> with the fix. Prints one
# line per target: executions, edges covered (libFuzzer's "cov"), corpus size and findings.
# usage: run_fuzz.sh [--seconds N | --runs N] [--python N] [--jobs N] [--keep DIR] [WORK_DIR] [TARGET ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lib=$(cd "$here/../.." && pwd)
limit=(-max_total_time=60) python_seconds= jobs=2 keep= work= targets=()
while [ $# -gt 0 ]; do
  case $1 in
    --seconds) limit=(-max_total_time="$2"); shift 2 ;;
    --runs) limit=(-runs="$2"); shift 2 ;;
    --python) python_seconds=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    model_file|prefix_blob|block_file) targets+=("$1"); shift ;;
    -*) echo "run_fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) work=$1; shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(model_file prefix_blob block_file)
work=${work:-$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-fuzz.XXXXXX")}
mkdir -p "$work"
python=${PYTHON:-python3}
cc=${FUZZ_CC:-$(command -v clang || command -v clang-14 || true)}
[ -n "$cc" ] || { echo "run_fuzz.sh: no clang (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 2; }

echo "== fuzz build ($cc) in $work/build"
CC=$cc cmake -S "$lib" -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTINYLOOP_FUZZ=ON -DTINYLOOP_CUDA=OFF >/dev/null
cmake --build "$work/build" -j "$jobs" --target make_fuzz_corpus "${targets[@]/#/fuzz_}" >/dev/null
bin=$work/build/tests/fuzz

echo "== the seed corpora are make_fuzz_corpus's"
rm -rf "$work/seeds" && mkdir -p "$work/seeds"
"$bin/make_fuzz_corpus" "$work/seeds"
diff -r -x 'regress-*' -x tokenizer "$work/seeds" "$here/corpus" \
  || { echo "corpus/ differs from make_fuzz_corpus's seeds: rerun it into corpus/" >&2; exit 1; }

# fuzz NAME TARGET FUZZER...: fuzz corpus/TARGET's copy in WORK/NAME with the command FUZZER
# (libFuzzer flags and the corpus appended); its summary line in WORK/NAME/summary.
fuzz() {
  local name=$1 t=$2 dir=$work/$1
  shift 2
  rm -rf "$dir" && mkdir -p "$dir/corpus" "$dir/findings"
  cp "$here/corpus/$t/"* "$dir/corpus/"
  local status=0
  (cd "$here" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     "$@" -timeout=10 -rss_limit_mb=2560 -print_final_stats=1 -artifact_prefix="$dir/findings/" \
     "$dir/corpus" >"$dir/log" 2>&1) || status=$?
  local execs edges
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log")
  edges=$(grep -E '^#[0-9]+' "$dir/log" | tail -n 1 | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
  printf '%-19s %10s execs %6s edges %6s corpus inputs %3s findings (exit %s)\n' "$name" "${execs:-?}" \
    "${edges:-?}" "$(find "$dir/corpus" -type f | wc -l)" "$(find "$dir/findings" -type f | wc -l)" "$status" \
    >"$dir/summary"
  if [ -n "$keep" ]; then mkdir -p "$keep/$name" && cp "$dir/corpus/"* "$keep/$name/"; fi
}

runs=()
for t in "${targets[@]}"; do runs+=("$t $t $bin/fuzz_$t ${limit[*]}"); done
if [ -n "$python_seconds" ]; then
  for t in model_file prefix_blob block_file tokenizer; do
    runs+=("python-$t $t $python fuzz_python.py $t -max_total_time=$python_seconds")
  done
fi
echo "== fuzzing (${limit[*]}${python_seconds:+; Python targets $python_seconds s each}, $jobs at a time)"
for run in "${runs[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  # shellcheck disable=SC2086
  fuzz $run &
done
wait || true
failed=0
for run in "${runs[@]}"; do
  name=${run%% *}
  if [ -f "$work/$name/summary" ]; then cat "$work/$name/summary"; else echo "$name: no summary"; fi
  if ! grep -q ' 0 findings (exit 0)' "$work/$name/summary" 2>/dev/null; then
    failed=1
    echo "--- $name: the log's end"; tail -n 40 "$work/$name/log"
  fi
done
[ "$failed" -eq 0 ] || { echo "== fuzzing found something (inputs under $work/<target>/findings/)" >&2; exit 1; }
echo "== fuzzing found nothing"

# The readers-agree check on every input of the grown corpora (readers_agree.py): the harness
# writes the C reader's verdicts, the Python reader must reach the same ones.
if ! "$python" -c "import tinyloop" 2>/dev/null; then
  [ -z "${FUZZ_REQUIRE_AGREE:-}" ] || { echo "run_fuzz.sh: $python cannot import tinyloop" >&2; exit 1; }
  echo "== readers-agree skipped: $python cannot import tinyloop"
  exit 0
fi
echo "== the C and Python readers agree on the grown corpora"
for t in "${targets[@]}"; do
  mapfile -t inputs < <(find "$work/$t/corpus" -type f | sort)
  rm -f "$work/$t/verdicts"
  # -detect_leaks=0: libFuzzer runs an input a second time when it suspects a leak (a lazy
  # first allocation), which would write a second verdict for it; the fuzzing runs check leaks.
  TINYLOOP_FUZZ_VERDICTS=$work/$t/verdicts "$bin/fuzz_$t" -detect_leaks=0 "${inputs[@]}" >"$work/$t/replay.log" 2>&1 \
    || { echo "replaying $t's corpus failed"; tail -n 20 "$work/$t/replay.log"; exit 1; }
  "$python" "$here/readers_agree.py" "$t" "$work/$t/verdicts" "${inputs[@]}"
done
