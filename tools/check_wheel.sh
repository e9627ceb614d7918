#!/usr/bin/env bash
# The binary wheel on a machine without a compiler: a step of .ci/run, runnable alone.
#
# Builds the wheel with tools/build_wheel.sh, installs it into a fresh virtual environment
# whose PATH is that environment's bin/ only (no C compiler, no CMake; CC=false CXX=false),
# and from an empty folder checks that: tinyloop runs on the native library shipped in the
# wheel; the CUDA backend is compiled in when TINYLOOP_CUDA=ON; the README's Python quick start
# runs; the native and numpy backends give bit-identical logits and the same tokens on a
# random model. Prints the time the step took.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$SECONDS

"$repo/tools/build_wheel.sh" "$work/dist" | tee "$work/build.log"
wheel=$(tail -n 1 "$work/build.log")
python3 -m venv "$work/venv"
# The README's first Python block under "Python quick start" (as tests/test_source_tree.py reads it).
python3 - "$repo/README.md" > "$work/quickstart.py" <<'PY'
import re, sys
readme = open(sys.argv[1]).read()
sys.stdout.write(re.search(r"```python\n(.*?)```", readme[readme.index("## Python quick start"):], re.S).group(1))
PY

echo "== $(basename "$wheel") in a fresh virtual environment, with no compiler or CMake on PATH"
(
  export PATH="$work/venv/bin" CC=false CXX=false
  cd "$work"
  for tool in cc gcc clang c++ g++ cmake nvcc; do
    if command -v "$tool" >/dev/null; then echo "$tool is on PATH: $(command -v "$tool")"; exit 1; fi
  done
  pip install --quiet "$wheel"
  python - <<'PY'
import os
import tinyloop
info = tinyloop.backend_info()
assert info["chosen"] == "native" and info["origin"] == "package", info
assert info["library"].startswith(os.path.dirname(tinyloop.__file__)), info
cuda = tinyloop.backend_info("native", "cuda")
built = cuda["cuda_available"] or cuda["cuda_reason"].startswith("no CUDA device")
assert built or os.environ.get("TINYLOOP_CUDA") != "ON", cuda
print("native library", info["library_version"], "from", info["library"], "- CUDA backend:",
      "compiled in" if built else f"not compiled in ({cuda['cuda_reason']})")
PY
  python quickstart.py
  python - <<'PY'
import tempfile
from pathlib import Path
import numpy as np
import tinyloop
path = Path(tempfile.mkdtemp()) / "random.tinyloop"
config = tinyloop.random_model(path, seed=21)
prompt = np.random.default_rng(21).integers(0, config.vocab_size, 40).tolist()
with tinyloop.Model(path, backend="native") as native, tinyloop.Model(path, backend="numpy") as numpy:
    a, b = native.logits(prompt), numpy.logits(prompt)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, (a.shape, b.shape)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), "native and numpy logits differ"
    sample = dict(max_tokens=16, temperature=0.8, top_k=20, seed=21, return_logits=True)
    (tokens, c), (expected, d) = native.generate(prompt, **sample), numpy.generate(prompt, **sample)
    assert tokens == expected, "native and numpy sample different tokens"
    assert np.array_equal(c.view(np.uint32), d.view(np.uint32)), "sampling logits differ"
print(f"native == numpy: {a.shape} prefill logits and {len(c)} sampled tokens' logits, bit for bit")
PY
)
echo "== the binary wheel works without a compiler ($((SECONDS - started)) s)"
