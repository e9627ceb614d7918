"""tinyloop imported from a source checkout rather than from an installed package.

`pip install` puts the top-level `fallback/` folder inside the package as `tinyloop.fallback`
(pyproject.toml's package-dir); a checkout keeps the two side by side. Python started in the
checkout's root (a script saved there, `python -m pytest`, PYTHONPATH=.) imports the checkout's
`tinyloop/`, so `install_fallback_finder()` maps exactly the name `tinyloop.fallback` onto
`<root>/fallback/`; its submodules then load from there by the ordinary path machinery. An
installed package has its own `tinyloop/fallback/` and registers nothing. `_library` asks
`checkout_root()` and `shadowed_package_dir()` where a checkout's native library may be.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
FALLBACK = "tinyloop.fallback"


def checkout_root() -> Path | None:
    """The root of the source checkout this tinyloop was imported from, or None if installed."""
    root = PACKAGE_DIR.parent
    if (PACKAGE_DIR / "fallback").is_dir():
        return None
    if (root / "fallback" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def shadowed_package_dir(root: Path) -> Path | None:
    """The tinyloop package `import tinyloop` would find if the checkout at `root` were not on
    sys.path (typically the one `pip install .` put in site-packages), or None."""
    others = [entry for entry in sys.path
              if isinstance(entry, str) and Path(entry or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("tinyloop", others)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


class FallbackFinder(importlib.abc.MetaPathFinder):
    """A meta path finder that knows one module: `tinyloop.fallback`, found in `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != FALLBACK:
            return None
        return importlib.util.spec_from_file_location(
            FALLBACK, str(self.folder / "__init__.py"),
            submodule_search_locations=[str(self.folder)])


def install_fallback_finder() -> None:
    """In a checkout, make `tinyloop.fallback` the checkout's `fallback/` (once per process)."""
    root = checkout_root()
    if root is None or any(isinstance(f, FallbackFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, FallbackFinder(root / "fallback"))
