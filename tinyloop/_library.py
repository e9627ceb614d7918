"""Loading libtinyloop through cffi in ABI mode (no compiler needed).

The cdef is derived mechanically from the C header, never retyped: preprocessor lines, the
export macro and the extern "C" guard are stripped and the rest is handed to cffi. The library
is searched in TINYLOOP_LIBRARY, then inside the package (`tinyloop/_lib/`, put there by
`pip install .`). Right after dlopen the ABI version is checked.
"""
import os
import re
from pathlib import Path

ABI_VERSION = 1
PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "_lib"
LIBRARY_NAMES = ("libtinyloop.so", "libtinyloop.dylib", "tinyloop.dll")
SOURCE_HEADER = PACKAGE_LIB_DIR.parent.parent / "libtinyloop" / "include" / "tinyloop.h"


class LibraryUnavailable(ImportError):
    """libtinyloop could not be found, loaded, or has the wrong ABI."""


def cdef_from_header(text):
    """The declarations of tinyloop.h as cffi accepts them."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace('extern "C" {', "")
    text = re.sub(r"\bTL_API\b", "", text)
    text = text.rstrip()
    if text.endswith("}"):        # the closing brace of the extern "C" guard
        text = text[:-1]
    return text


def header_path(library_path):
    """The header shipped beside the library, else the source tree's."""
    for candidate in (Path(library_path).parent / "tinyloop.h",
                      Path(library_path).parent.parent / "include" / "tinyloop.h",
                      SOURCE_HEADER):
        if candidate.is_file():
            return candidate
    raise LibraryUnavailable(f"no tinyloop.h found beside {library_path}")


def library_candidates():
    """(path, origin) pairs in search order."""
    override = os.environ.get("TINYLOOP_LIBRARY")
    if override:
        return [(Path(override), "TINYLOOP_LIBRARY")]
    return [(PACKAGE_LIB_DIR / name, "package") for name in LIBRARY_NAMES]


def load_library():
    """Returns (ffi, lib, path, origin) or raises LibraryUnavailable saying why."""
    try:
        import cffi
    except ImportError as exc:
        raise LibraryUnavailable(f"cffi is not installed ({exc})") from None
    for path, origin in library_candidates():
        if not path.is_file():
            continue
        ffi = cffi.FFI()
        ffi.cdef(cdef_from_header(header_path(path).read_text()))
        try:
            lib = ffi.dlopen(str(path))
        except OSError as exc:
            raise LibraryUnavailable(f"cannot load {path}: {exc}") from None
        found = lib.tl_abi_version()
        if found != ABI_VERSION:
            raise LibraryUnavailable(f"{path} has ABI version {found}; this tinyloop package "
                                     f"needs {ABI_VERSION} (rebuild or reinstall tinyloop)")
        return ffi, lib, path, origin
    where = os.environ.get("TINYLOOP_LIBRARY") or PACKAGE_LIB_DIR
    raise LibraryUnavailable(f"libtinyloop is not in {where} (was tinyloop installed without "
                             "a C compiler? see docs/install.md)")
