#!/usr/bin/env bash
# GPU verification of TinyLoop on one NVIDIA GPU (written for an H100/H200): libtinyloop's CUDA
# backend and the numba-cuda backend, bit for bit against the CPU and numpy, then the benches.
#
#     bash bench/gpu_check.sh          # from anywhere; results in ${OUT:-./gpu_results}
#
# Needs: cmake, nvcc, a C compiler, python3 with numpy, pytest, hypothesis, numba, numba-cuda
# and cffi (or cffi and pycparser wheels in ./.whl, installed into a temporary folder). Nothing
# is fetched. Steps, most important first, each with a time limit so the whole script ends
# within 8 minutes:
#  1. build libtinyloop with TINYLOOP_CUDA=ON (sm_90 unless CUDA_ARCH says otherwise) + ctest;
#  2. first, what CI already runs on the CPU emulation of the device: the properties that reach
#     every CUDA kernel and branch (tests/cuda_properties.sh) and the numpy golden vectors on
#     CUDA (test_golden); then the cross-backend suite with backend "native-cuda"
#     (tests/test_cross_backend.py): tokens and logits identical to numpy on every path;
#  3. benches: prefill/decode/request on the 407M-like shape (bench_backends.py --shape full,
#     CUDA and the CPU side by side, identical tokens checked), the prefix-cache table
#     (bench_prefix_cache.py --full) on CUDA, and the achieved fraction of the GPU's peaks;
#  4. the cross-backend suite again with TINYLOOP_CUDA_GRAPHS=0 (plain launches, no graphs);
#     the native suites (batched decode, automatic prefix cache, windows, paths, int4 KV,
#     prefix blobs, hidden-state prefixes, the prefix cache's disk tier) with
#     TINYLOOP_DEVICE=cuda, so every native model of those tests runs on the GPU;
#  5. the numba-cuda kernels on the real device (tests/test_numba_cuda.py and the cross-backend,
#     int4 KV, prefix blob, hidden-state prefix and disk tier suites with backend "numba-cuda");
#  6. compute-sanitizer memcheck over the long-context cross-backend test (tensor-core, int4
#     and multi-block attention paths).
# The checkout's Python side is copied to a temporary folder, the working directory and on
# PYTHONPATH, so that bench results stay out of the repository; tinyloop runs there as from any
# checkout (docs/install.md): tinyloop.fallback is its fallback/, the library its CMake build in
# build/. Exit 0 iff every step passed; $OUT/summary.txt lists them.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${OUT:-./gpu_results}" && cd "${OUT:-./gpu_results}" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
DEADLINE=$((SECONDS + 470))
status=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    [ $((DEADLINE - SECONDS)) -lt "$limit" ] && limit=$((DEADLINE - SECONDS))
    [ "$limit" -lt 1 ] && limit=1
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.txt"
    [ "$rc" -eq 0 ] || status=1
}

: >"$OUT/summary.txt"
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$REPO"/.whl/*.whl
    export PYTHONPATH="$WORK/site"
fi

mkdir -p "$WORK/libtinyloop"
cp -r "$REPO/tinyloop" "$REPO/fallback" "$REPO/tests" "$REPO/bench" "$REPO/pyproject.toml" "$WORK/"
cp -r "$REPO/libtinyloop/include" "$WORK/libtinyloop/"
rm -rf "$WORK/tinyloop/_lib" "$WORK/bench/results"     # no editable build's library, no old results
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}" HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev}
export TINYLOOP_BACKEND=native

export REPO WORK
step build 150 bash -c '
    cmake -S "$REPO/libtinyloop" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DTINYLOOP_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DTINYLOOP_BUILD_TESTS=ON &&
    cmake --build "$WORK/build" -j "$(nproc)" &&
    ctest --test-dir "$WORK/build" -j "$(nproc)" --output-on-failure -E golden'
cd "$WORK"

step environment 30 python3 -c '
import sys, numpy, tinyloop
print("python", sys.version.split()[0], "numpy", numpy.__version__, "tinyloop", tinyloop.__version__)
info = tinyloop.backend_info("native", "cuda")
print("library", info["library"], "cuda available:", info["cuda_available"], info["cuda_reason"])
with tinyloop.Model(device="cuda") as m:
    print("runtime", m.runtime())
    print(m.decode(m.generate(m.encode("And God said"), max_tokens=60)))
'
# the full-shape bench models (random, seed 0), written while the tests run
export TINYLOOP_BENCH_MODELS="$WORK/models"
mkdir -p "$TINYLOOP_BENCH_MODELS"
python3 -c 'from tinyloop.quickbench import bench_model
for fmt in ("int8", "int4"): print(bench_model("full", fmt, "."))' >"$OUT/models.txt" 2>&1 &
models=$!
step cuda_properties 90 bash tests/cuda_properties.sh
step golden_cuda 60 bash -c 'python3 "$REPO/libtinyloop/tests/make_golden.py" "$WORK/golden" >/dev/null &&
    TINYLOOP_GOLDEN_DEVICE=cuda "$WORK/build/tests/test_golden" "$WORK/golden"'
step cross_backend_cuda 90 env TINYLOOP_TEST_BACKENDS=native-cuda TINYLOOP_REQUIRE_BACKENDS=native-cuda \
    python3 -m pytest -q -p no:cacheprovider -rs tests/test_cross_backend.py tests/test_device.py
wait "$models"
step bench_backends 100 python3 bench/bench_backends.py --shape full --backends native-cuda,native \
    --formats int8,int4 --prefill 1024 --decode 32 --repeats 2 --name gpu-backends
step bench_prefix_cache 60 python3 bench/bench_prefix_cache.py --full --backend native-cuda --format int4
step peaks 10 python3 - <<'PY'
# Achieved fraction of the H200's dense int8 tensor-core peak (1979 TOPS) in prefill and of its
# HBM bandwidth (4.8 TB/s) in decode, from bench_backends' full-shape rows.
import json
from tinyloop.quickbench import SHAPES
s = SHAPES["full"]
d, F, H, G, D = s["d_model"], s["ffn_dim"], s["n_heads"], s["n_kv_heads"], s["head_dim"]
per_layer = d * (H + 2 * G) * D + H * D * d + 2 * d * F + F * d           # weights per layer
layers = s["n_pre_blocks"] + s["default_loops"]
head = s["vocab_size"] * d
rows = json.load(open("bench/results/gpu-backends-full.json"))["rows"]
for r in rows:
    if r["backend"] != "native-cuda":
        continue
    ops = 2 * (per_layer * layers + head) * r["prefill tok/s"]            # int8 ops/s in linears
    bytes_per_weight = 1.0 if r["format"] == "int8" else 0.5
    distinct = (per_layer * (s["n_pre_blocks"] + 1) + head) * bytes_per_weight
    streamed = distinct * r["decode tok/s"]                                # if weights stream once per step
    print(f'{r["format"]}: request {r["request ms"]:.1f} ms (target < 48); prefill '
          f'{ops / 1e12:.1f} TOPS = {ops / 1979e12:.1%} of the int8 peak; decode '
          f'{streamed / 1e12:.2f} TB/s of distinct weights = {streamed / 4.8e12:.1%} of HBM bandwidth')
PY
step cross_backend_cuda_no_graphs 60 env TINYLOOP_CUDA_GRAPHS=0 TINYLOOP_TEST_BACKENDS=native-cuda \
    TINYLOOP_REQUIRE_BACKENDS=native-cuda python3 -m pytest -q -p no:cacheprovider -rs tests/test_cross_backend.py
step native_suites_on_cuda 120 env TINYLOOP_DEVICE=cuda \
    python3 -m pytest -q -p no:cacheprovider -rs tests/test_batch.py tests/test_auto_prefix_cache.py \
    tests/test_window.py tests/test_paths.py tests/test_speculative.py tests/test_warm_start.py \
    tests/test_kv_int4.py tests/test_prefix_blob.py tests/test_hidden_prefix.py tests/test_prefix_disk.py
step numba_cuda 80 env TINYLOOP_TEST_BACKENDS=numba-cuda TINYLOOP_REQUIRE_BACKENDS=numba-cuda \
    python3 -m pytest -q -p no:cacheprovider -rs tests/test_numba_cuda.py tests/test_cross_backend.py \
    tests/test_kv_int4.py tests/test_prefix_blob.py tests/test_hidden_prefix.py tests/test_prefix_disk.py
step memcheck 60 env TINYLOOP_TEST_BACKENDS=native-cuda TINYLOOP_REQUIRE_BACKENDS=native-cuda \
    compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 -m pytest -q -p no:cacheprovider -x tests/test_cross_backend.py -k long_context
cp bench/results/gpu-* bench/results/prefix-cache-full-* "$OUT/" 2>/dev/null
echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/summary.txt"
exit $status
