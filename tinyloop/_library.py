"""Loading libtinyloop through cffi in ABI mode (no compiler needed).

The cdef is derived mechanically from the C header, never retyped: preprocessor lines, the
export macro and the extern "C" guard are stripped and the rest is handed to cffi. The library
is TINYLOOP_LIBRARY when that is set; otherwise the one inside the package (`tinyloop/_lib/`,
put there by `pip install .`) and, when tinyloop is imported from a source checkout, the
checkout's CMake build (`build/`) and then the installed tinyloop package the checkout shadows.
Right after dlopen the ABI version is checked; a library that fails to load or has another ABI
version is passed over for the next one (a stale editable install must not hide a new `build/`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._source_tree import checkout_root, shadowed_package_dir

if TYPE_CHECKING:
    from types import ModuleType

    from cffi import FFI

ABI_VERSION = 2
PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "_lib"
LIBRARY_NAMES = ("libtinyloop.so", "libtinyloop.dylib", "tinyloop.dll")
BUILD_COMMAND = "cmake -S libtinyloop -B build && cmake --build build -j"


class LibraryUnavailable(ImportError):
    """libtinyloop could not be found, loaded, or has the wrong ABI."""


def cdef_from_header(text: str) -> str:
    """The declarations of tinyloop.h as cffi accepts them."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace('extern "C" {', "")
    text = re.sub(r"\bTL_API\b", "", text)
    text = text.rstrip()
    if text.endswith("}"):        # the closing brace of the extern "C" guard
        text = text[:-1]
    return text


def header_path(library_path: Path) -> Path:
    """The header shipped beside the library, else an install prefix's, else the checkout's."""
    library_dir = Path(library_path).parent
    candidates = [library_dir / "tinyloop.h", library_dir.parent / "include" / "tinyloop.h"]
    root = checkout_root()
    if root is not None:
        candidates.append(root / "libtinyloop" / "include" / "tinyloop.h")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise LibraryUnavailable(f"no tinyloop.h found beside {library_path}")


def library_candidates() -> list[tuple[Path, str]]:
    """(path, origin) pairs in search order."""
    override = os.environ.get("TINYLOOP_LIBRARY")
    if override:
        return [(Path(override), "TINYLOOP_LIBRARY")]
    folders = [(PACKAGE_LIB_DIR, "package")]
    root = checkout_root()
    if root is not None:
        folders.append((root / "build", "checkout build"))
        installed = shadowed_package_dir(root)
        if installed is not None:
            folders.append((installed / "_lib", "installed package"))
    return [(folder / name, origin) for folder, origin in folders for name in LIBRARY_NAMES]


def rebuild_advice() -> str:
    """What replaces a library this package cannot use."""
    if os.environ.get("TINYLOOP_LIBRARY"):
        return "rebuild it from this tinyloop's sources, or unset TINYLOOP_LIBRARY"
    root = checkout_root()
    if root is None:
        return "reinstall tinyloop: pip install ."
    return f"rebuild it: run `{BUILD_COMMAND}` in {root}"


def not_found_message() -> str:
    """Why no library was found, and the command that provides one."""
    override = os.environ.get("TINYLOOP_LIBRARY")
    if override:
        return f"TINYLOOP_LIBRARY={override} is not a file"
    root = checkout_root()
    if root is None:
        return (f"libtinyloop is not in {PACKAGE_LIB_DIR}: tinyloop was installed without it "
                "(no C compiler or CMake at install time? `pip install -v .` shows why; "
                "see docs/install.md)")
    searched = ", ".join(dict.fromkeys(str(path.parent) for path, _ in library_candidates()))
    return (f"libtinyloop is not built in the source checkout {root} (searched {searched}): "
            f"run `{BUILD_COMMAND}` there (needs a C compiler and CMake; see docs/install.md)")


def open_library(cffi: ModuleType, path: Path) -> tuple[FFI, Any]:
    """(ffi, lib) of the library at `path`; raises LibraryUnavailable if it does not load or
    has another ABI version."""
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(header_path(path).read_text()))
    try:
        lib = ffi.dlopen(str(path))
    except OSError as exc:
        raise LibraryUnavailable(f"cannot load {path}: {exc}") from None
    found = lib.tl_abi_version()
    if found != ABI_VERSION:
        raise LibraryUnavailable(f"{path} has ABI version {found}; this tinyloop package needs "
                                 f"{ABI_VERSION}")
    return ffi, lib


def load_library() -> tuple[FFI, Any, Path, str]:
    """Returns (ffi, lib, path, origin) or raises LibraryUnavailable saying why. A library
    that cannot be used is passed over for the next candidate (a stale one left by an old
    editable install must not hide a new build)."""
    try:
        import cffi
    except ImportError as exc:
        raise LibraryUnavailable(f"cffi is not installed ({exc})") from None
    refused = []                  # why each library found was passed over, in search order
    for path, origin in library_candidates():
        if path.is_file():
            try:
                return (*open_library(cffi, path), path, origin)
            except LibraryUnavailable as exc:
                refused.append(str(exc))
    if refused:
        raise LibraryUnavailable("; ".join(refused) + f" ({rebuild_advice()})")
    raise LibraryUnavailable(not_found_message())
