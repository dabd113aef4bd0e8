"""Content-addressed kernel store: one folder per key, a FileLock per key, atomic publish,
checksums verified on every load.

An entry is ``<root>/<key>/`` holding the generated source, build.ninja, the binary and
``meta.json`` (sha256 of the binary). It is built in a private temporary folder inside the root
and published with one ``os.replace``; an entry that is partial, fails its checksum, or has a
link leading out of the cache is removed and rebuilt, never loaded. Entries are the folders named
like a key (``<name>-<arch>-<16 hex digits>``): ``ls`` and ``clear`` leave anything else alone (a
JITATTN_CACHE_DIR pointed at a shared folder by mistake). A root that exists but cannot be
written (a prebuilt cache in a read-only image) still serves its verified entries; kernels
missing there are built in a private temporary folder.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from glob import escape as glob_escape
from pathlib import Path

from filelock import FileLock

from . import env

log = logging.getLogger("jitattn")


_FALLBACK: dict = {}


def fallback_root(reason: str, root) -> Path:
    """One private temporary cache per process for each unusable ``root`` (the cache root, or
    a lock in it), removed at exit; the first call's ``reason`` is logged (once: a reason can
    name a per-call file)."""
    if str(root) not in _FALLBACK:
        _FALLBACK[str(root)] = Path(tempfile.mkdtemp(prefix="jitattn-cache-"))
        atexit.register(shutil.rmtree, _FALLBACK[str(root)], ignore_errors=True)
        log.warning("jitattn: %s; using %s for this process", reason, _FALLBACK[str(root)])
    return _FALLBACK[str(root)]


class _Untrusted(OSError):
    """A cache root that other users can write to: neither loaded from nor written."""


def _trusted_read_only(path: Path) -> bool:
    """Whether a folder or file of a root this process cannot write may be loaded from: owned
    by this user or by root, and writable by neither its group nor others (whoever can write
    there could plant a binary beside its checksum, or swap it after the check)."""
    st = path.stat()
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_KEY = r".+-(host|sm_\d{2,3}[a-z]?)-[0-9a-f]{16}"  # jit.cache_key's form: name-arch-hash
_ENTRY_NAME = re.compile(rf"(failed-)?{_KEY}")  # an entry, or a failed build kept for reading
_STAGING_NAME = re.compile(rf"\.tmp-(?P<key>{_KEY})-\d+-[0-9a-f]{{8}}")  # staging()'s folders


def _meta(folder: Path) -> dict:
    """An entry's meta.json as a dict; ValueError when it is not one (or unreadable)."""
    if not (folder / "meta.json").is_file():  # (a FIFO there blocked every reader)
        raise ValueError("meta.json is not a regular file")
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except OSError as e:
        raise ValueError(str(e)) from None
    except RecursionError:  # (JSON nested deeper than the parser's recursion)
        raise ValueError("meta.json is nested too deeply") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str):
        raise ValueError(f"meta.json is not an entry's metadata: {str(meta)[:60]!r}")
    return meta


def recorded_sha256(folder: Path) -> str | None:
    """The sha256 an entry's meta.json records (that of a binary load() verified), or None."""
    try:
        return _meta(folder)["sha256"]
    except ValueError:
        return None


TUNE_DIR = "tune"  # the cache root's folder of `jitattn tune` tables (tune.py): not kernels, so
#                    entries() does not list it and clear() keeps it (minutes of GPU to measure)

class Cache:
    """The kernel cache rooted at ``root`` (default: env.cache_dir()).

    If the root cannot be created or written, or other users can write to it, a private
    temporary folder is used instead and a warning is logged; ``fallback_reason`` then says
    why. A root that exists and can be read but not written stays in ``read_only``: load()
    verifies and returns its entries too.
    """

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else env.cache_dir()
        self.configured = self.root    # the root asked for (ls / clear report on it)
        self.read_only: Path | None = None  # an unwritable root whose entries are still loaded
        self.fallback_reason = None
        try:
            self._prepare(self.root)
        except OSError as e:
            readable = not isinstance(e, _Untrusted) and self.root.is_dir() and \
                os.access(self.root, os.R_OK | os.X_OK)
            if readable and not _trusted_read_only(self.root):
                readable, e = False, f"{e}; owned by another user or writable by its group, so " \
                                     f"not loaded from either"
            if readable:
                self.read_only = self.root
            self.fallback_reason = (
                f"cache directory {self.root} is read-only ({e}): its kernels are loaded, new "
                f"ones built in a private folder" if readable else
                f"cache directory {self.root} is not usable ({e})" + (
                    "" if isinstance(e, _Untrusted) or not self.root.is_dir() else
                    "; a cache prebuilt for other users needs chmod -R a+rX, go-w, and this "
                    "user or root as its owner"))
            self.root = fallback_root(self.fallback_reason, self.root)

    @staticmethod
    def _prepare(root: Path) -> None:
        try:
            root.mkdir(parents=True, mode=0o700)
            os.chmod(root, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass  # made earlier, or by a process starting beside this one
        if not root.is_dir():  # (/dev/null, a file: before its mode is blamed)
            raise NotADirectoryError(f"{root} is not a directory")
        mode = root.stat().st_mode
        if mode & stat.S_IWOTH:  # anyone could plant a binary (and its checksum) we would run
            raise _Untrusted(f"writable by every user (mode {stat.S_IMODE(mode):o}); chmod o-w "
                             f"to use it")
        probe = root / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()

    def entry(self, key: str) -> Path:
        return self.root / key

    def lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / f"{key}.lock"))

    def _inside(self, path: Path, root: Path) -> bool:
        try:
            path.resolve(strict=True).relative_to(root.resolve())
            return True
        except (OSError, ValueError):
            return False

    def load(self, key: str, binary_name: str, *, quiet: bool = False) -> Path | None:
        """Path of a verified binary for ``key`` (in the root, else in a read-only root), or
        None (missing, partial or corrupt; logged unless quiet)."""
        for root in (self.root, self.read_only) if self.read_only else (self.root,):
            found = self._verified(root, key, binary_name, quiet)
            if found is not None:
                return found
        return None

    def _verified(self, root: Path, key: str, binary_name: str, quiet: bool) -> Path | None:
        folder = root / key
        binary = folder / binary_name
        try:
            if not folder.exists() and not folder.is_symlink():
                return None
            linked = folder.is_symlink() or binary.is_symlink() or \
                (folder / "meta.json").is_symlink()
        except OSError as e:  # (an entry this user cannot read: another's, or chmod 000)
            if not quiet:
                log.warning("jitattn: cache entry %s cannot be read (%s); rebuilding", key, e)
            return None
        if linked or not (self._inside(binary, root) and self._inside(folder / "meta.json",
                                                                        root)):
            if not quiet:
                log.warning("jitattn: cache entry %s has links or missing files; rebuilding",
                            key)
            return None
        try:
            meta = _meta(folder)
            # (an entry copied from another key's folder holds another kernel; a FIFO in
            # place of the binary blocked the read)
            ok = meta.get("key") == key and binary.is_file() and _sha256(binary) == meta["sha256"]
            if ok and root == self.read_only:
                untrusted = [p for p in (folder, binary, folder / "meta.json")
                             if not _trusted_read_only(p)]
                if untrusted:
                    log.warning("jitattn: %s in the read-only cache is writable by other users "
                                "or owned by one; not loaded", untrusted[0])
                    return None
        except (OSError, ValueError):
            ok = False
        if not ok:
            if not quiet:
                log.warning("jitattn: cache entry %s failed its checksum (or records another "
                            "key); rebuilding", key)
            return None
        return binary

    def staging(self, key: str) -> Path:
        """A fresh private folder inside the root to build ``key`` in. Call with the key's lock
        held: other staging folders of the key are then leftovers of builds that were killed,
        and are removed."""
        for old in self.root.glob(f".tmp-{glob_escape(key)}-*"):
            shutil.rmtree(old, ignore_errors=True)
        path = self.root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
        return path

    def publish(self, key: str, staged: Path, binary_name: str, info: dict) -> Path:
        """Write meta.json into ``staged`` and move it into place as the entry for ``key``.
        Call with the key's lock held."""
        meta = {"key": key, "sha256": _sha256(staged / binary_name), "created": time.time(),
                **info}
        try:
            (staged / "meta.json").write_text(json.dumps(meta, indent=1))
        except OSError as e:  # (a full disk: named, for the caller's message)
            raise OSError(e.errno, e.strerror, str(staged / "meta.json")) from e
        try:
            self.remove(key)
        except OSError as e:
            raise OSError(f"the cache entry {self.entry(key)} is broken and cannot be removed "
                          f"({e}); remove it by hand, or point JITATTN_CACHE_DIR elsewhere") \
                from None
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

    @staticmethod
    def _failed(folder: Path) -> bool:
        """A failed build kept by keep_failed (never has meta.json; an entry of a variant
        whose name begins with "failed-" does)."""
        return folder.name.startswith("failed-") and not (folder / "meta.json").exists()

    def _entry_folders(self, root: Path) -> list[Path]:
        def entry(p: Path) -> bool:
            try:
                return p.is_dir() and not p.is_symlink() and bool(_ENTRY_NAME.fullmatch(p.name)) \
                    and not self._failed(p)
            except OSError:  # a path whose type cannot be read (a root at /proc/1)
                return False
        return sorted(p for p in root.iterdir() if entry(p))

    def entries(self) -> list[dict]:
        """meta.json of every entry, a read-only root's too (unreadable or malformed ones with
        an ``error``); ``created`` is a time stamp, 0 when unknown."""
        out = []
        roots = [r for r in (self.read_only, self.root) if r is not None]
        for folder in (f for root in roots for f in self._entry_folders(root)):
            try:
                meta = _meta(folder)
            except ValueError as e:
                meta = {"error": str(e)}
            created = meta.get("created")
            try:
                size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            except OSError as e:
                size, meta = 0, {"error": str(e)}
            # a time stamp that time.localtime takes (NaN, 1e300 and -1e18 raised in `ls`)
            known = isinstance(created, (int, float)) and not isinstance(created, bool) and \
                0 <= created < 2**33
            meta.update(key=folder.name, bytes=size, created=created if known else 0)
            out.append(meta)
        return out

    def clear(self) -> int:
        """Remove every entry and failed build (each under its key's lock) and the staging
        folders of builds that were killed (whose key's lock is free); returns how many entries
        are gone. Folders not named like an entry, links to them, lock files, staging folders of
        builds in progress and the tune tables (TUNE_DIR) are left alone. Raises OSError when
        the root is not in use (read-only, or unusable: see fallback_reason), and after the
        others are gone, when an entry could not be removed (naming it)."""
        if self.fallback_reason is not None:  # (this process's private folder is not it)
            raise OSError(f"{self.fallback_reason}; nothing removed")
        n, left = 0, []
        for p in list(self.root.iterdir()):
            if p.is_symlink() or not p.is_dir():
                continue
            staging = _STAGING_NAME.fullmatch(p.name)
            if staging:
                try:
                    with self.lock(staging["key"]).acquire(timeout=0):
                        shutil.rmtree(p, ignore_errors=True)
                except OSError:  # (Timeout is one) a build in progress, or an unusable lock
                    pass
            elif _ENTRY_NAME.fullmatch(p.name):
                failed = self._failed(p)
                lock = self.lock(p.name.removeprefix("failed-") if failed else p.name)
                try:
                    lock.acquire()  # (keep_failed runs under the key's lock)
                except OSError as e:  # a folder at the lock's path, or another user's file
                    left.append(f"{p} (its lock {lock.lock_file} cannot be used: {e})")
                    continue
                try:
                    shutil.rmtree(p, ignore_errors=True)
                finally:
                    lock.release()
                n += not failed and not p.exists()
                if p.exists():  # (another user's, or a folder this user cannot list)
                    left.append(f"{p} (permissions)")
        if left:
            raise OSError(f"removed {n} {'entry' if n == 1 else 'entries'}; {len(left)} left: "
                          f"{'; '.join(left)}")
        return n
