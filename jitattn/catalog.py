"""The ready-made variants shipped in ``variants/``: list them and load a variant file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from . import env
from .spec import Variant


def load_file(path: str | Path) -> ModuleType:
    """Import a variant file as a module (its name: ``jitattn_variant_<stem>``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"variant file {str(path)!r} does not exist")
    name = f"jitattn_variant_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def builtin() -> dict[str, ModuleType]:
    """Ready-made variant modules by file stem; each has ``make(...)`` and ``example(...)``."""
    return {p.stem: load_file(p) for p in sorted(env.variants_dir().glob("*.py"))
            if not p.name.startswith("_")}


def variants_in(module: ModuleType) -> list[Variant]:
    """Variants a file defines: module-level Variant objects, else ``make()`` with defaults."""
    found = [v for v in vars(module).values() if isinstance(v, Variant)]
    if not found and callable(getattr(module, "make", None)):
        made = module.make()
        found = [made] if isinstance(made, Variant) else []
    return found
