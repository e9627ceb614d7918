#!/usr/bin/env bash
# libtinyloop's CUDA backend, its own unchanged src/cuda/*.cu, run on the CPU through the
# test-only emulation of the device (tests/cuda_emu/, docs/gpu.md), bit for bit against the numpy
# reference. CI runs it on every submission (about 10 minutes on 2 cores):
#   1. a release build with gcov on the device code: the Python properties that reach every
#      kernel and branch on backend "native-cuda" (tests/cuda_properties.sh), one of them again
#      with CUDA graphs off, the failure paths the emulation injects
#      (tests/test_cuda_emulation.py), and the part pass against the CPU's (test_cuda_part); then
#      the kernels launched and the coverage of src/cuda/ (lines and branches per file);
#   2. an ASan + UBSan build (-O2 -g; every device load and store a checked host access): the
#      emulation's own tests, test_model, and the numpy golden vectors on the emulated device
#      (every 8th case of each model: every model of make_golden.py, 42 cases).
# The order of a block's threads is random, from TINYLOOP_CUDA_EMU_SEED (printed; a run repeats
# with the same seed); the device reports TINYLOOP_CUDA_EMU_SMS multiprocessors (8 here: decode
# attention still splits, into fewer ranges, and the emulation runs 2.5 times faster than with
# the 132 of an H100).
# usage: libtinyloop/run_cuda_emulation.sh [WORK_DIR]   (python3 must import tinyloop: pip install .)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
work=${1:-$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-emu.XXXXXX")}
jobs=${JOBS:-2}
mkdir -p "$work"
export TINYLOOP_CUDA_EMU_SMS=${TINYLOOP_CUDA_EMU_SMS:-8}
export TINYLOOP_CUDA_EMU_SEED=${TINYLOOP_CUDA_EMU_SEED:-$((RANDOM * 32768 + RANDOM))}
echo "== CUDA emulation in $work: order ${TINYLOOP_CUDA_EMU_ORDER:-random}, seed $TINYLOOP_CUDA_EMU_SEED," \
    "$TINYLOOP_CUDA_EMU_SMS SMs"

echo "== 1/2 release build with coverage, the Python properties on native-cuda (at ${SECONDS} s)"
cmake -S "$here" -B "$work/release" -DCMAKE_BUILD_TYPE=Release -DTINYLOOP_CUDA_EMULATION=ON \
    -DCMAKE_CXX_FLAGS=--coverage -DCMAKE_SHARED_LINKER_FLAGS=--coverage -DCMAKE_EXE_LINKER_FLAGS=--coverage >/dev/null
cmake --build "$work/release" -j "$jobs" --target tinyloop test_cuda_part >/dev/null
cp "$here/include/tinyloop.h" "$work/release/"   # the package reads the header beside the library
export TINYLOOP_CUDA_EMU_REPORT="$work/launches.txt"
lib=(TINYLOOP_LIBRARY="$work/release/libtinyloop.so" HYPOTHESIS_PROFILE=emulated)
parallel=(-n "$jobs" --dist worksteal)
env "${lib[@]}" bash "$repo/tests/cuda_properties.sh" "${parallel[@]}"
(cd "$repo" && env "${lib[@]}" TINYLOOP_TEST_BACKENDS=native-cuda TINYLOOP_REQUIRE_BACKENDS=native-cuda \
  TINYLOOP_CUDA_GRAPHS=0 python3 -m pytest -q -p no:cacheprovider -k test_generation_matches_numpy \
  tests/test_cross_backend.py)
(cd "$repo" && env "${lib[@]}" TINYLOOP_REQUIRE_EMULATION=1 \
  python3 -m pytest -q -p no:cacheprovider "${parallel[@]}" tests/test_cuda_emulation.py)
"$work/release/tests/test_cuda_part"   # the part pass against the CPU's, bit for bit
echo "-- kernels launched (plain launches and graph replays):"
sort "$work/launches.txt" | awk '{n[$1] += $2} END {for (k in n) printf "   %-28s %d\n", k, n[k]}' | sort
echo "-- coverage of src/cuda/ (gcov):"
(cd "$work/release/CMakeFiles/tinyloop_objects.dir/src/cuda" &&
  gcov -b -n ./*.gcda 2>/dev/null | awk '
    /^File .*src\/cuda\// {file = $2; gsub(/.*\/|'\''/, "", file); show = 1; next}
    /^File / {show = 0}
    show && /^Lines executed/ {lines = $2 " " $3 " " $4}
    show && /^Taken at least once/ {printf "   %-14s lines %s, branches taken %s %s %s\n", file, lines, $4, $5, $6; show = 0}')

echo "== 2/2 ASan + UBSan build: the emulation's tests, golden vectors on CUDA, test_model (at ${SECONDS} s)"
cmake -S "$here" -B "$work/sanitize" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTINYLOOP_SANITIZE=ON -DTINYLOOP_CUDA_EMULATION=ON \
    -DPython3_EXECUTABLE="$(command -v python3)" -DTINYLOOP_REQUIRE_GOLDEN=ON >/dev/null
cmake --build "$work/sanitize" -j "$jobs" --target test_cuda_emu test_golden test_model >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1
"$work/sanitize/tests/test_cuda_emu"
"$work/sanitize/tests/test_model" >/dev/null
(cd "$work" && python3 "$here/tests/make_golden.py" "$work/golden" >/dev/null)   # the installed package's numpy
TINYLOOP_GOLDEN_DEVICE=cuda TINYLOOP_GOLDEN_CUDA_EVERY=${TINYLOOP_GOLDEN_CUDA_EVERY:-8} \
    "$work/sanitize/tests/test_golden" "$work/golden"
echo "== CUDA emulation passed (at ${SECONDS} s; seed $TINYLOOP_CUDA_EMU_SEED)"
