"""tinyloop imported from a source checkout: Python started in the repository's root.

The README's quick start runs from the root as a script saved there would, whether tinyloop is
installed in editable mode (development) or not (CI): `tinyloop.fallback` is the checkout's
`fallback/`, and the native library is whichever one the package runs on. In copies of the
checkout, the library is found in the CMake build `build/`, else in the installed tinyloop
package the checkout shadows; with neither, the message names the command that builds it.
Each case runs in a fresh interpreter, since one process imports tinyloop only once.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tinyloop

from conftest import require_backend

ROOT = Path(__file__).resolve().parent.parent
REPORT = """
import json, tinyloop, tinyloop.fallback
info = tinyloop.backend_info("native")
print("REPORT", json.dumps({"tinyloop": tinyloop.__file__, "fallback": tinyloop.fallback.__file__,
                            "backend": tinyloop.backend, "library": info["library"],
                            "origin": info["origin"], "reason": info["reason"]}))
"""


def run_in(cwd, code, pythonpath=None):
    """Runs `code` as `python -c` in `cwd` (so cwd comes first on sys.path, like a script
    saved there); returns the dict REPORT printed. Fails the test on a non-zero exit. With
    `pythonpath` (folders put ahead of PYTHONPATH) the library search itself is under test, so
    TINYLOOP_LIBRARY and TINYLOOP_BACKEND are left out of the environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    if pythonpath is not None:
        env.pop("TINYLOOP_LIBRARY", None)
        env.pop("TINYLOOP_BACKEND", None)
        inherited = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *inherited])
    done = subprocess.run([sys.executable, "-c", code + REPORT], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def readme_quickstart():
    """The first Python block under the README's "Python quick start" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quickstart_runs_from_the_repository_root():
    report = run_in(ROOT, readme_quickstart())
    assert Path(report["tinyloop"]) == ROOT / "tinyloop" / "__init__.py"
    assert Path(report["fallback"]) == ROOT / "fallback" / "__init__.py"
    assert report["backend"] == tinyloop.backend, report
    library = tinyloop.backend_info("native")["library"]     # the one this test process runs on
    assert (report["library"] is None) == (library is None), report
    assert library is None or os.path.samefile(report["library"], library), report


@pytest.fixture
def checkout(tmp_path):
    """A copy of the checkout's Python side and header, with no library anywhere in it."""
    root = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("_lib", "__pycache__")
    for folder in ("tinyloop", "fallback", "libtinyloop/include"):
        shutil.copytree(ROOT / folder, root / folder, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def installed_package(site, library=None):
    """A stand-in for an installed tinyloop in the folder `site`: with `library` in its _lib/
    like `pip install .` with a compiler leaves it, without one like a compiler-less install."""
    (site / "tinyloop").mkdir(parents=True)
    (site / "tinyloop" / "__init__.py").write_text("")
    if library is not None:
        (site / "tinyloop" / "_lib").mkdir()
        shutil.copy2(library, site / "tinyloop" / "_lib" / "libtinyloop.so")
        shutil.copy2(ROOT / "libtinyloop" / "include" / "tinyloop.h", site / "tinyloop" / "_lib")
    return site / "tinyloop"


def built_library():
    require_backend("native")
    return Path(tinyloop.backend_info("native")["library"])


def test_checkout_uses_its_cmake_build(checkout, tmp_path):
    (checkout / "build").mkdir()
    shutil.copy2(built_library(), checkout / "build" / "libtinyloop.so")
    installed_package(tmp_path / "site", built_library())     # build/ comes first
    report = run_in(checkout, "", pythonpath=[tmp_path / "site"])
    assert Path(report["fallback"]) == checkout / "fallback" / "__init__.py"
    assert (report["origin"], report["library"]) == (
        "checkout build", str(checkout / "build" / "libtinyloop.so")), report


def test_checkout_without_a_build_uses_the_installed_package(checkout, tmp_path):
    installed = installed_package(tmp_path / "site", built_library())
    report = run_in(checkout, "", pythonpath=[tmp_path / "site"])
    assert Path(report["tinyloop"]) == checkout / "tinyloop" / "__init__.py"
    assert (report["origin"], report["library"]) == (
        "installed package", str(installed / "_lib" / "libtinyloop.so")), report


def test_checkout_without_a_library_says_how_to_build_one(checkout, tmp_path):
    installed_package(tmp_path / "site")
    code = ("import tinyloop\n"
            "with tinyloop.Model(backend='numpy') as model:\n"
            "    assert len(model.generate([1, 2], max_tokens=2)) > 2\n")
    report = run_in(checkout, code, pythonpath=[tmp_path / "site"])
    assert report["library"] is None and report["backend"] != "native", report
    assert f"libtinyloop is not built in the source checkout {checkout}" in report["reason"]
    assert "run `cmake -S libtinyloop -B build && cmake --build build -j` there" in report["reason"]
    assert Path(report["fallback"]) == checkout / "fallback" / "__init__.py"


def stale_library(path, abi_version):
    """A shared library at `path` that says it has `abi_version` and exports nothing else, as
    an old build left behind would."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build a stale library with")
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_suffix(".c")
    source.write_text(f"int tl_abi_version(void) {{ return {abi_version}; }}\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    source.unlink()


def test_a_stale_library_does_not_hide_the_checkout_build(checkout, tmp_path):
    """An old `pip install -e .` left tinyloop/_lib/ with another ABI; build/ has a new one."""
    from tinyloop import _library
    stale_library(checkout / "tinyloop" / "_lib" / "libtinyloop.so", _library.ABI_VERSION - 1)
    (checkout / "build").mkdir()
    shutil.copy2(built_library(), checkout / "build" / "libtinyloop.so")
    report = run_in(checkout, "", pythonpath=[])
    assert (report["origin"], report["library"]) == (
        "checkout build", str(checkout / "build" / "libtinyloop.so")), report


def test_a_stale_library_alone_is_named_with_the_command_that_replaces_it(checkout, tmp_path):
    from tinyloop import _library
    stale = checkout / "tinyloop" / "_lib" / "libtinyloop.so"
    stale_library(stale, _library.ABI_VERSION - 1)
    installed_package(tmp_path / "site")       # hides this environment's installed tinyloop
    report = run_in(checkout, "", pythonpath=[tmp_path / "site"])
    assert report["library"] is None, report
    assert (f"{stale} has ABI version {_library.ABI_VERSION - 1}; this tinyloop package needs "
            f"{_library.ABI_VERSION} (rebuild it: run `cmake -S libtinyloop -B build && "
            f"cmake --build build -j` in {checkout})") in report["reason"], report


def test_a_library_that_does_not_load_is_passed_over_too(checkout):
    (checkout / "tinyloop" / "_lib").mkdir()
    (checkout / "tinyloop" / "_lib" / "libtinyloop.so").write_bytes(b"not a shared library")
    (checkout / "build").mkdir()
    shutil.copy2(built_library(), checkout / "build" / "libtinyloop.so")
    report = run_in(checkout, "", pythonpath=[])
    assert (report["origin"], report["library"]) == (
        "checkout build", str(checkout / "build" / "libtinyloop.so")), report
