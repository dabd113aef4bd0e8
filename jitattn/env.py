"""The only module that reads environment variables and locates jitattn's files on disk.

Variables:
    JITATTN_CACHE_DIR  kernel cache folder (default: the checkout's ``cache/`` when running from a
                       source tree, else ``~/.cache/jitattn``).
    JITATTN_NVCC       path of nvcc (default: ``nvcc`` on PATH, then ``$CUDA_HOME/bin/nvcc``).
    JITATTN_CXX        C++ compiler for the CPU backend (default: ``g++``).
    JITATTN_DEBUG      an int: 0 (the default) one line per compile, with its time; 1 also
                       cache hits and waits for another process's build; 4 also each built
                       kernel's rendered source; 5 also ``ptxas -v`` resource usage.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_SOURCE_ROOT = PACKAGE_DIR.parent


def _from_source_tree() -> bool:
    return (_SOURCE_ROOT / "templates").is_dir() and (_SOURCE_ROOT / "pyproject.toml").is_file()


def templates_dir() -> Path:
    """Folder holding ``cuda/`` and ``cpu/`` Jinja2 templates (checkout or installed wheel)."""
    if _from_source_tree():
        return _SOURCE_ROOT / "templates"
    return PACKAGE_DIR / "templates"


def variants_dir() -> Path:
    """Folder holding the ready-made variant files."""
    if _from_source_tree():
        return _SOURCE_ROOT / "variants"
    return PACKAGE_DIR / "variants"


_ABSOLUTE: dict = {}  # JITATTN_CACHE_DIR values -> absolute paths, as first seen


def cache_dir() -> Path:
    """Root of the kernel cache; not created here (cache.py creates it with mode 0700). A
    relative JITATTN_CACHE_DIR is taken from the working directory when the process first reads
    it (a process that changes directory keeps one cache)."""
    override = os.environ.get("JITATTN_CACHE_DIR")
    if override:
        if override not in _ABSOLUTE:
            _ABSOLUTE[override] = Path(override).expanduser().absolute()
        return _ABSOLUTE[override]
    if _from_source_tree():
        return _SOURCE_ROOT / "cache"
    return Path.home() / ".cache" / "jitattn"


def nvcc_path() -> str | None:
    """nvcc to build CUDA kernels with, or None (then NVRTC through CuPy is used)."""
    explicit = os.environ.get("JITATTN_NVCC")
    if explicit:
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return None


def cxx_path() -> str | None:
    """C++ compiler for the CPU backend, or None."""
    return os.environ.get("JITATTN_CXX") or shutil.which("g++") or shutil.which("c++")


def ninja_path() -> str | None:
    """ninja executable: the one on PATH, else the one the ``ninja`` wheel ships."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary
    except ImportError:
        return None
    candidate = Path(ninja.BIN_DIR) / "ninja"
    return str(candidate) if candidate.is_file() else None


def debug_level() -> int:
    """JITATTN_DEBUG as an int (0 when unset or not an integer)."""
    try:
        return int(os.environ.get("JITATTN_DEBUG", "0"))
    except ValueError:
        return 0
