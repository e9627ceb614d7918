"""Build step of `pip install .`: compile libtinyloop with CMake and ship it in the package.

All metadata lives in pyproject.toml. The CUDA backend is built when nvcc is found (set
TINYLOOP_CUDA=OFF to skip it, ON to require it). CMake and a working C compiler are looked for
first; when either is missing (or the build fails) the install still succeeds, without the
native library, after one notice naming what was missing; `import tinyloop` then runs on the
pure-Python fallback. TINYLOOP_REQUIRE_NATIVE=1 turns that notice into an error. Whatever
happens, the package never ships a library left over from an earlier build. The wheel is
tagged py3-none-<platform>: Python reaches the library through cffi's ABI mode only, so one
wheel serves every Python 3 (tools/build_wheel.sh makes the release wheel of it).
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIBRARY_SOURCE = ROOT / "libtinyloop"


def compiles(command, work_dir):
    """True if the C compiler `command` (a list) turns a one-line C file into an object file."""
    source = work_dir / "probe.c"
    source.write_text("int tinyloop_probe(void) { return 0; }\n")
    try:
        done = subprocess.run([*command, "-c", str(source), "-o", str(work_dir / "probe.o")],
                              capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_c_compiler():
    """The C compiler CMake would use, as a command list: $CC when set (it may carry flags),
    else the first of cc, gcc, clang on PATH; None when there is none."""
    chosen = os.environ.get("CC", "").split()
    for words in [chosen] if chosen else [["cc"], ["gcc"], ["clang"]]:
        path = shutil.which(words[0])
        if path is not None:
            return [path, *words[1:]]
    return None


def check_build_tools(work_dir):
    """Raises RuntimeError naming what the build lacks: CMake, a C compiler, or one that works."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("no cmake on PATH")
    compiler = find_c_compiler()
    if compiler is None:
        cc = os.environ.get("CC", "").strip()
        missing.append(f"no C compiler: CC={cc} is not on PATH" if cc else
                       "no C compiler: none of cc, gcc, clang is on PATH (CC may name another)")
    elif not compiles(compiler, work_dir):
        missing.append(f"the C compiler {' '.join(compiler)} cannot compile a one-line C file")
    if missing:
        raise RuntimeError("; ".join(missing))


def cuda_enabled(work_dir):
    """True if the CMake configuration in `work_dir` had turned the CUDA backend on."""
    cache = work_dir / "CMakeCache.txt"
    return cache.is_file() and "TINYLOOP_CUDA:BOOL=ON" in cache.read_text(errors="replace")


def build_libtinyloop(work_dir, extra=()):
    """Configure and build the shared library; returns its path. Raises on any failure."""
    cmake = shutil.which("cmake")
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
    if a build with CUDA fails without being forced, the CPU-only library after one notice."""
    forced = os.environ.get("TINYLOOP_CUDA", "").upper()
    if forced in ("ON", "OFF", "1", "0"):
        return build_libtinyloop(work_dir / "forced", [f"-DTINYLOOP_CUDA={forced}"])
    try:
        return build_libtinyloop(work_dir / "default")
    except RuntimeError as exc:
        if not cuda_enabled(work_dir / "default"):
            raise
        print(f"tinyloop: NOTICE: building libtinyloop with its CUDA backend failed ({exc}); "
              "building it for the CPU only", file=sys.stderr)
        return build_libtinyloop(work_dir / "cpu", ["-DTINYLOOP_CUDA=OFF"])


class BuildPyWithLibrary(build_py):
    """build_py, plus libtinyloop and its header in tinyloop/_lib/."""

    def run(self):
        super().run()
        package_dir = ROOT / "tinyloop" if self.editable_mode else Path(self.build_lib) / "tinyloop"
        target = package_dir / "_lib"
        if target.exists():                          # an earlier build's library must not ship
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix="tinyloop-build-") as work:
            try:
                check_build_tools(Path(work))
                library = build_with_cuda_if_possible(Path(work))
            except (OSError, RuntimeError) as exc:  # no compiler, no cmake, a build error
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


class BdistWheelAnyPython(bdist_wheel):
    """bdist_wheel tagged py3-none-<platform>: the library is bound to the platform, not to
    an interpreter (cffi's ABI mode loads it with dlopen; no extension module is compiled)."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": BdistWheelAnyPython},
      distclass=BinaryDistribution)
