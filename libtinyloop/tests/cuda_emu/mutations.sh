#!/usr/bin/env bash
# mutations.sh — shows that the CUDA emulation catches the kernel bugs it exists for: builds
# libtinyloop with TINYLOOP_CUDA_EMULATION three times, from the sources as they are and from two
# copies with one deliberate slip each in src/cuda/, and runs the numpy golden vectors on the
# emulated device (test_golden, every 8th case of each model). The sources must pass; each
# mutant must fail.
#
#     bash libtinyloop/tests/cuda_emu/mutations.sh     # about 5 minutes on 2 cores
#
# The mutants: a removed __syncthreads() (attention.cu: the query's quantized values published
# to the block before the scores read them), and an off-by-one index (rows.cu: the embedding of
# element i written to i + 1). Needs cmake, g++ and a python (PYTHON, default python3) that
# imports tinyloop (pip install .) for the golden vectors. Exit 0 iff every verdict is the
# expected one.
set -uo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

(cd "$work" && "$python" "$src/tests/make_golden.py" "$work/golden" >/dev/null) || {
    echo "mutations.sh: $python cannot write the golden vectors (pip install . first)"
    exit 2
}

# copy NAME FILE OLD NEW: a copy of libtinyloop in $work/NAME with the first OLD in FILE replaced
copy() {
    mkdir -p "$work/$1"
    cp -r "$src/CMakeLists.txt" "$src/cmake" "$src/include" "$src/src" "$src/tests" "$work/$1/"
    [ $# -eq 1 ] && return 0
    "$python" - "$work/$1/$2" "$3" "$4" <<'PY' || exit 2
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if old not in text:
    sys.exit(f"mutations.sh: {path} has no {old!r}")
open(path, "w").write(text.replace(old, new, 1))
PY
}

# verdict NAME WANT: build $work/NAME, run the golden vectors on the emulated device; WANT pass|fail
status=0
verdict() {
    local b="$work/$1/build" got
    cmake -S "$work/$1" -B "$b" -DCMAKE_BUILD_TYPE=Release -DTINYLOOP_CUDA_EMULATION=ON \
        -DPython3_EXECUTABLE="$(command -v "$python")" >"$b.log" 2>&1 &&
        cmake --build "$b" -j "$(nproc)" --target test_golden >>"$b.log" 2>&1 || {
        echo "$1: the build failed"; tail -n 20 "$b.log"; status=1; return; }
    if TINYLOOP_GOLDEN_CUDA_EVERY=8 TINYLOOP_CUDA_EMU_SMS=8 "$b/tests/test_golden" "$work/golden" >"$b.run" 2>&1; then
        got=pass
    else
        got=fail
    fi
    echo "$1: $got (want $2) — $(grep -m1 -E 'CHECK|emulation:|test_golden:' "$b.run" | cut -c1-160)"
    [ "$got" = "$2" ] || status=1
}

copy sources
copy no_barrier src/cuda/attention.cu '    __syncthreads(); /* qq complete */' '    /* (barrier removed) */'
copy off_by_one src/cuda/rows.cu 'x[t * d + i] = ((float)w[i] * s) * embed_scale;' \
    'x[t * d + i + 1] = ((float)w[i] * s) * embed_scale;'
verdict sources pass
verdict no_barrier fail
verdict off_by_one fail
exit $status
