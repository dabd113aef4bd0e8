"""Content-addressed kernel store: one folder per key, a FileLock per key, atomic publish,
checksums verified on every load.

An entry is ``<root>/<key>/`` holding the generated source, build.ninja, the binary and
``meta.json`` (sha256 of the binary). It is built in a private temporary folder inside the root
and published with one ``os.replace``; an entry that is partial, fails its checksum, or has a
link leading out of the cache is removed and rebuilt, never loaded.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from filelock import FileLock

from . import env

log = logging.getLogger("jitattn")


_FALLBACK: dict = {}


def _fallback_root(reason: str) -> Path:
    """One private temporary cache per process (and per reason), removed at exit."""
    if reason not in _FALLBACK:
        _FALLBACK[reason] = Path(tempfile.mkdtemp(prefix="jitattn-cache-"))
        atexit.register(shutil.rmtree, _FALLBACK[reason], ignore_errors=True)
        log.warning("jitattn: %s; using %s for this process", reason, _FALLBACK[reason])
    return _FALLBACK[reason]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


TUNE_DIR = "tune"  # the cache root's folder of `jitattn tune` tables (tune.py): not kernels, so
#                    entries() does not list it and clear() keeps it (minutes of GPU to measure)

class Cache:
    """The kernel cache rooted at ``root`` (default: env.cache_dir()).

    If the root cannot be created or written, a private temporary folder is used instead and a
    warning is logged; ``fallback_reason`` then says why.
    """

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else env.cache_dir()
        self.fallback_reason = None
        try:
            self._prepare(self.root)
        except OSError as e:
            self.fallback_reason = f"cache directory {self.root} is not usable ({e})"
            self.root = _fallback_root(self.fallback_reason)

    @staticmethod
    def _prepare(root: Path) -> None:
        try:
            root.mkdir(parents=True, mode=0o700)
            os.chmod(root, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass  # made earlier, or by a process starting beside this one
        probe = root / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()

    def entry(self, key: str) -> Path:
        return self.root / key

    def lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / f"{key}.lock"))

    def _inside(self, path: Path) -> bool:
        try:
            path.resolve(strict=True).relative_to(self.root.resolve())
            return True
        except (OSError, ValueError):
            return False

    def load(self, key: str, binary_name: str) -> Path | None:
        """Path of a verified binary for ``key``, or None (missing, partial or corrupt)."""
        folder = self.entry(key)
        binary, meta = folder / binary_name, folder / "meta.json"
        if not folder.exists() and not folder.is_symlink():
            return None
        if folder.is_symlink() or binary.is_symlink() or meta.is_symlink() or not (
                self._inside(binary) and self._inside(meta)):
            log.warning("jitattn: cache entry %s has links or missing files; rebuilding", key)
            return None
        try:
            expected = json.loads(meta.read_text())["sha256"]
            ok = _sha256(binary) == expected
        except (OSError, ValueError, KeyError):
            ok = False
        if not ok:
            log.warning("jitattn: cache entry %s failed its checksum; rebuilding", key)
            return None
        return binary

    def staging(self, key: str) -> Path:
        """A fresh private folder inside the root to build ``key`` in."""
        path = self.root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
        return path

    def publish(self, key: str, staged: Path, binary_name: str, info: dict) -> Path:
        """Write meta.json into ``staged`` and move it into place as the entry for ``key``.
        Call with the key's lock held."""
        meta = {"key": key, "sha256": _sha256(staged / binary_name), "created": time.time(),
                **info}
        (staged / "meta.json").write_text(json.dumps(meta, indent=1))
        self.remove(key)
        os.replace(staged, self.entry(key))
        return self.entry(key) / binary_name

    def keep_failed(self, key: str, staged: Path) -> Path:
        """Keep a failed build's folder as ``failed-<key>`` for reading; returns its path."""
        target = self.root / f"failed-{key}"
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staged, target)
        return target

    def remove(self, key: str) -> None:
        """Delete an entry (a link is unlinked, never followed)."""
        folder = self.entry(key)
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)

    def entries(self) -> list[dict]:
        """meta.json of every entry (unreadable ones reported with an ``error``)."""
        out = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()
                             and not p.name.startswith((".", "failed-")) and p.name != TUNE_DIR):
            try:
                meta = json.loads((folder / "meta.json").read_text())
            except (OSError, ValueError) as e:
                meta = {"key": folder.name, "error": str(e)}
            meta["bytes"] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            out.append(meta)
        return out

    def clear(self) -> int:
        """Remove every entry (under its lock) and failed build; returns how many entries.
        Lock files, in-progress staging folders of other processes and the tune tables
        (TUNE_DIR) are left alone."""
        n = 0
        for p in list(self.root.iterdir()):
            if p.name.startswith(".") or p.name.endswith(".lock") or p.name == TUNE_DIR:
                continue
            if p.is_symlink():
                p.unlink(missing_ok=True)
            elif p.is_dir():
                with self.lock(p.name):
                    shutil.rmtree(p, ignore_errors=True)
                n += not p.name.startswith("failed-")
        return n
