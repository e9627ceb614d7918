"""Build step of `pip install .`: compile libtinyloop with CMake and ship it in the package.

All metadata lives in pyproject.toml. The CUDA backend is built when nvcc is found (set
TINYLOOP_CUDA=OFF to skip it, ON to require it). When no compiler (or CMake) is available the install
still succeeds, without the native library, after one clear notice; `import tinyloop` then
runs on the pure-Python fallback. TINYLOOP_REQUIRE_NATIVE=1 turns that notice into an error.
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIBRARY_SOURCE = ROOT / "libtinyloop"


def build_libtinyloop(work_dir, extra=()):
    """Configure and build the shared library; returns its path. Raises on any failure."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake not found")
    configure = [cmake, "-S", str(LIBRARY_SOURCE), "-B", str(work_dir),
                 "-DCMAKE_BUILD_TYPE=Release", "-DTINYLOOP_BUILD_TESTS=OFF", *extra]
    build = [cmake, "--build", str(work_dir), "--target", "tinyloop", "--parallel"]
    for command in (configure, build):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise RuntimeError(f"{' '.join(command[:2])} failed: " + " | ".join(tail))
    return work_dir / "libtinyloop.so"


def build_with_cuda_if_possible(work_dir):
    """The library with its CUDA backend when nvcc is found (TINYLOOP_CUDA=ON/OFF forces it);
    if that build fails without being forced, the CPU-only library after one notice."""
    forced = os.environ.get("TINYLOOP_CUDA", "").upper()
    if forced in ("ON", "OFF", "1", "0"):
        return build_libtinyloop(work_dir / "forced", [f"-DTINYLOOP_CUDA={forced}"])
    try:
        return build_libtinyloop(work_dir / "default")
    except RuntimeError as exc:
        print(f"tinyloop: NOTICE: building libtinyloop with its CUDA backend failed ({exc}); "
              "building it for the CPU only", file=sys.stderr)
        return build_libtinyloop(work_dir / "cpu", ["-DTINYLOOP_CUDA=OFF"])


class BuildPyWithLibrary(build_py):
    """build_py, plus libtinyloop and its header in tinyloop/_lib/."""

    def run(self):
        super().run()
        package_dir = ROOT / "tinyloop" if self.editable_mode else Path(self.build_lib) / "tinyloop"
        target = package_dir / "_lib"
        with tempfile.TemporaryDirectory(prefix="tinyloop-build-") as work:
            try:
                library = build_with_cuda_if_possible(Path(work))
            except Exception as exc:  # no compiler, no cmake, a build error: fall back
                if os.environ.get("TINYLOOP_REQUIRE_NATIVE") == "1":
                    raise
                print(f"tinyloop: NOTICE: libtinyloop was not built ({exc}); installing the "
                      "pure-Python backends only", file=sys.stderr)
                return
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library, target / "libtinyloop.so")
            shutil.copy2(LIBRARY_SOURCE / "include" / "tinyloop.h", target / "tinyloop.h")


class BinaryDistribution(Distribution):
    """The wheel carries a shared library, so it is tagged per platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
