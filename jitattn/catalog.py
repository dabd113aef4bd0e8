"""The ready-made variants shipped in ``variants/``: list them and load a variant file."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from . import env
from .spec import Variant


def load_file(path: str | Path) -> ModuleType:
    """Import a variant file as a module (its name: ``jitattn_variant_<stem>``). Raises
    FileNotFoundError (naming the built-in file when ``path`` is a built-in variant's name)
    or whatever the file raises (SpecError for a Variant it cannot build)."""
    path = Path(path)
    if not path.is_file():
        shipped = env.variants_dir() / f"{path.name}.py"
        hint = f" (the built-in variant {path.name!r} is {shipped})" if shipped.is_file() else ""
        what = "is not a file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"variant file {str(path)!r} {what}{hint}")
    if path.suffix != ".py":  # (importlib finds no loader for other names)
        raise FileNotFoundError(f"variant file {str(path)!r} is not a Python file (.py)")
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
    """Variants a file defines: module-level Variant objects, else ``make()`` with defaults;
    where make() needs arguments (tensors its hooks capture, e.g. document ids) and the file
    has ``example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device)``, the variant of
    a small example. A kernel depends on a captured tensor's dtype and rank, not its values or
    (read at run time) its size, so other documents or tables share it; what make() derives
    from a size as a Python constant is the example's (relative_position_bias: its
    max_distance of 64). Raises ValueError for a make() that needs arguments without an
    example()."""
    found = [v for v in vars(module).values() if isinstance(v, Variant)]
    make = getattr(module, "make", None)
    if not found and callable(make):
        required = [p for p in inspect.signature(make).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                               p.VAR_KEYWORD)]
        if not required:
            made, source = make(), "make()"
        elif callable(getattr(module, "example", None)):
            made, source = module.example(1, 2, 1, 16, 16, "cpu"), "example()"
            made = made[0] if isinstance(made, (tuple, list)) and made else made
        else:
            raise ValueError(f"{module.__file__}: make() takes arguments "
                             f"({', '.join(p.name for p in required)}) and the file has no "
                             f"example() to call it with")
        if not isinstance(made, Variant):
            raise TypeError(f"{module.__file__}: {source} returned {type(made).__name__}; "
                            f"expected a jitattn.Variant")
        found = [made]
    return found
