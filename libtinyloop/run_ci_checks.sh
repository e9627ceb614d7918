#!/usr/bin/env bash
# libtinyloop CI checks (about 3-5 minutes on 2 cores):
#   1. Release build + ctest (unit, loader, model, allocation-failure and — when Python 3 with
#      the tinyloop Python package is installed — golden tests vs the numpy backend). The CUDA
#      backend is compiled when nvcc is found (TINYLOOP_CUDA=ON/OFF forces it); without a GPU
#      its code is compiled and linked, and the tests check the clean "no CUDA device" refusal.
#   2. ASan + UBSan build (-fno-sanitize-recover=all) + the same ctest suite, CPU only; then
#      the same sanitizers on the AMX emulation build (TINYLOOP_AMX_EMULATION: the tiles in plain
#      C, so every tile load and store is a checked memory access) with the tile kernel tests
#   3. ThreadSanitizer build (-O2 -g) + the multi-threaded tests: the worker crew (test_pool),
#      models sharing it (test_threads), many threads on one model (test_model), racing
#      requests on the prefix cache (test_prefix_cache), generations from a prefix while it is
#      extended (test_prefix_warm), saves of a prefix while it is extended (test_prefix_blob),
#      racing requests on a prefix cache with a disk tier (test_pcache_disk), generations from
#      one hidden-state prefix on many threads (test_hidden_prefix); about a minute
#   4. install into a temporary prefix, then build the C example against it twice: with
#      find_package(tinyloop) and with pkg-config; run it on a small generated model.
# usage: libtinyloop/run_ci_checks.sh [WORK_DIR]   (default: a fresh temporary directory)
# Exits nonzero on the first failure.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
work=${1:-$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-ci.XXXXXX")}
jobs=${JOBS:-2}
mkdir -p "$work"
echo "== libtinyloop CI in $work"

echo "== 1/4 release build + tests (at ${SECONDS} s)"
# golden tests need the tinyloop Python package installed for this python3 (see tests/)
python=$(command -v python3)
golden=(-DPython3_EXECUTABLE="$python" -DTINYLOOP_REQUIRE_GOLDEN="${TINYLOOP_REQUIRE_GOLDEN:-OFF}")
cuda=()
[ -n "${TINYLOOP_CUDA:-}" ] && cuda=(-DTINYLOOP_CUDA="$TINYLOOP_CUDA")
cmake -S "$here" -B "$work/release" -DCMAKE_BUILD_TYPE=Release "${golden[@]}" "${cuda[@]}" >/dev/null
cmake --build "$work/release" -j "$jobs"
ctest --test-dir "$work/release" --output-on-failure -j "$jobs"

echo "== 2/4 sanitizer build (ASan + UBSan) + tests (at ${SECONDS} s)"
cmake -S "$here" -B "$work/sanitize" -DCMAKE_BUILD_TYPE=Debug -DTINYLOOP_SANITIZE=ON -DTINYLOOP_CUDA=OFF \
    "${golden[@]}" >/dev/null
cmake --build "$work/sanitize" -j "$jobs"
ctest --test-dir "$work/sanitize" --output-on-failure -j "$jobs"
cmake -S "$here" -B "$work/sanitize-amx" -DCMAKE_BUILD_TYPE=Debug -DTINYLOOP_SANITIZE=ON -DTINYLOOP_CUDA=OFF \
    -DTINYLOOP_AMX_EMULATION=ON >/dev/null
cmake --build "$work/sanitize-amx" -j "$jobs" --target test_primitives test_attention_tiles
ctest --test-dir "$work/sanitize-amx" --output-on-failure -j "$jobs" -R '^(test_primitives|test_attention_tiles)$'

echo "== 3/4 ThreadSanitizer build + multi-threaded tests (at ${SECONDS} s)"
cmake -S "$here" -B "$work/tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTINYLOOP_SANITIZE_THREAD=ON -DTINYLOOP_CUDA=OFF \
    "${golden[@]}" >/dev/null
cmake --build "$work/tsan" -j "$jobs" --target test_pool test_threads test_model test_prefix_cache test_prefix_warm test_prefix_blob \
    test_pcache_disk test_hidden_prefix
ctest --test-dir "$work/tsan" --output-on-failure -j "$jobs" \
    -R '^(test_pool|test_threads|test_model|test_prefix_cache|test_prefix_warm|test_prefix_blob|test_pcache_disk|test_hidden_prefix)$'

echo "== 4/4 install + example (at ${SECONDS} s)"
cmake --install "$work/release" --prefix "$work/prefix" >/dev/null
"$work/release/tests/make_test_model" "$work/model.tinyloop"
cmake -S "$repo/examples/c" -B "$work/example" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/example" -j "$jobs"
"$work/example/prefix_threads" "$work/model.tinyloop" 12
pc_dir=$(dirname "$(find "$work/prefix" -name tinyloop.pc | head -n 1)")
libdir=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --variable=libdir tinyloop)
# shellcheck disable=SC2046
cc -std=c11 -O2 -o "$work/prefix_threads_pc" "$repo/examples/c/prefix_threads.c" \
   $(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs tinyloop) -pthread -Wl,-rpath,"$libdir"
"$work/prefix_threads_pc" "$work/model.tinyloop" 4 >/dev/null
echo "== libtinyloop CI checks passed (${SECONDS} s)"
