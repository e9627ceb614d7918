#!/usr/bin/env bash
# GPU verification of the numba-cuda backend, on a machine with an NVIDIA GPU and numpy,
# numba, numba-cuda, pytest and hypothesis installed (no cffi, no network, no pip install).
#
#     bash bench/gpu_numba_check.sh          # from anywhere; results in ${OUT:-./gpu_results}
#
# 1. tests/test_numba_cuda.py on the real device: bit-identical to numpy, and the PTX of every
#    compiled kernel free of FMA, approximate division/sqrt and flush-to-zero;
# 2. the cross-backend property suite (tests/test_numba_backends.py) on numba-cuda;
# 3. bench/bench_backends.py: numba-cuda and numpy prefill/decode tok/s on the quick shape,
#    and the cost of the first call (kernel compilation).
# Nothing is installed: the package is copied in the layout pip would make (fallback/ as
# tinyloop/fallback) into a temporary folder, beside copies of tests/ and bench/; everything
# runs there, with that folder as the working directory and on PYTHONPATH.
# Each step has a time limit, cut so the whole script ends within 230 s. Exit 0 iff all passed.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${OUT:-./gpu_results}" && cd "${OUT:-./gpu_results}" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$REPO/tinyloop" "$REPO/tests" "$REPO/bench" "$REPO/pyproject.toml" "$WORK/"
rm -rf "$WORK/tinyloop/fallback" "$WORK/bench/results"
cp -r "$REPO/fallback" "$WORK/tinyloop/fallback"
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
export TINYLOOP_REQUIRE_BACKENDS=numba-cuda HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev}
cd "$WORK"
status=0

DEADLINE=$((SECONDS + 230))
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    [ $((DEADLINE - SECONDS)) -lt "$limit" ] && limit=$((DEADLINE - SECONDS))
    [ "$limit" -lt 1 ] && limit=1
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 3 "$OUT/$name.txt"
    [ "$rc" -eq 0 ] || status=1
}

: >"$OUT/summary.txt"
step environment 30 python -c '
import sys, numpy, numba, tinyloop
from numba import cuda
print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__)
print("numba.cuda", getattr(cuda, "implementation", "?"), "simulator", numba.config.ENABLE_CUDASIM)
device = cuda.get_current_device()
print("device", getattr(device, "name", "?"), "cc", getattr(device, "compute_capability", "?"))
print("tinyloop", tinyloop.__version__, "from", tinyloop.__file__)
'
step test_numba_cuda 80 pytest -q -p no:cacheprovider -rs tests/test_numba_cuda.py
step test_numba_backends 80 env TINYLOOP_TEST_BACKENDS=numba-cuda \
    pytest -q -p no:cacheprovider -rs tests/test_numba_backends.py
step bench 100 python bench/bench_backends.py --backends numba-cuda,numpy --formats int8 \
    --first-call --name gpu-numba
cp bench/results/gpu-numba-quick.* "$OUT/" 2>/dev/null
echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/summary.txt"
exit $status
