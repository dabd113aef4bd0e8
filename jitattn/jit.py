"""get_kernel(...): the one function that chains render -> cache/build -> load.

The in-process memo is keyed by what the caller knows without rendering (variant key, backend,
kind, dtype, head_dim, device), so a warm call never renders, hashes or touches the disk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import shutil
import sys
import time

from filelock import Timeout

from . import __version__, build, dtypes, env, load, render
from .cache import Cache, fallback_root, recorded_sha256
from .render import RenderedSource
from .spec import Variant

log = logging.getLogger("jitattn")
_MEMO: dict = {}
# launch.Launcher objects that callers keep by their own keys (api.attention): they hold
# memoised kernels, so they are forgotten with them
LAUNCHERS: dict = {}


class _Prefixed(logging.Formatter):
    """"[jitattn] message", where warnings say "jitattn: ..." for Python's default handler."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        return "[jitattn] " + (msg[len("jitattn: "):] if msg.startswith("jitattn: ") else msg)


def _say(msg: str) -> None:
    """One line per compile, visible by default (stderr) unless logging is configured."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Prefixed())
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    log.info(msg)


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int) -> str:
    """``sm_90a`` on Hopper (arch-specific features: wgmma, setmaxnreg), else ``sm_XY``."""
    import torch
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def cache_key(src: RenderedSource, arch: str | None) -> str:
    """Readable name plus a hash of everything that changes the binary: the rendered source,
    every header it can include, compiler fingerprint (its version banner, asked once per
    process: a memo on disk keyed by the compiler's file reused a stale binary when that file
    was a wrapper script whose target changed) and flags, arch, jitattn version."""
    h = hashlib.sha256()
    fingerprint = build.compiler_fingerprint(src.lang)
    for part in (src.code, src.headers_digest, fingerprint,
                 " ".join(build.flags(src.lang, arch)), str(arch), __version__):
        h.update(part.encode())
        h.update(b"\0")
    return f"{src.name}-{arch or 'host'}-{h.hexdigest()[:16]}"


LOCK_PATIENCE_S = 30.0  # how long a build waits for another process's lock before saying so


class _LockUnusable(OSError):
    """A key's lock file cannot be opened (a folder in its place, or not this user's)."""


class _EntryStuck(OSError):
    """A key's broken entry cannot be removed (another user's, or a folder this user cannot
    list): publishing a new build over it would fail."""


@contextlib.contextmanager
def _held(lock, key: str):
    """A key's build lock. When another process holds it, JITATTN_DEBUG >= 1 says so at once,
    and every level after LOCK_PATIENCE_S (a holder stopped mid-build would otherwise leave
    this process waiting without a word). Raises _LockUnusable when the lock file cannot be
    opened."""
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if env.debug_level() >= 1:
                _say(f"waiting for another process building {key} (lock {lock.lock_file})")
            try:
                lock.acquire(timeout=LOCK_PATIENCE_S)
            except Timeout:
                _say(f"still waiting after {LOCK_PATIENCE_S:.0f} s for another process to "
                     f"build {key}: it holds {lock.lock_file} (a process that has stopped "
                     f"holds it until it exits; the lock is released when it does)")
                lock.acquire()
    except OSError as e:  # (a Timeout is one, but a blocking acquire raises none)
        raise _LockUnusable(f"the build lock {lock.lock_file} cannot be used ({e})") from e
    try:
        yield
    finally:
        lock.release()


def compile_cached(src: RenderedSource, arch: str | None, cache: Cache | None = None, *,
                   reject: str | None = None):
    """Binary path for ``src``: from the cache, or built under the key's lock and published.
    ``reject``: the sha256 of an entry that passed its checksum but did not load: it is built
    anew, unless another process did so while this one waited for the lock. When the key's
    lock file cannot be opened (a folder in its place), or its broken entry cannot be removed
    (another user's), the kernel is built in a private temporary cache instead, with a
    warning. Returns (path, built: bool)."""
    cache = cache or Cache()
    key = cache_key(src, arch)
    binary = build.BINARY_NAME[src.lang]
    path = _usable(cache.load(key, binary), reject)
    if path is not None:
        if env.debug_level() >= 1:
            _say(f"cache hit {key}")
        return path, False
    try:
        with _held(cache.lock(key), key):
            return _build_locked(src, arch, cache, key, binary, reject)
    except (_LockUnusable, _EntryStuck) as e:
        private = Cache(fallback_root(str(e), f"the locks of {cache.root}"
                                      if isinstance(e, _LockUnusable) else str(cache.entry(key))))
        with _held(private.lock(key), key):  # (threads of this process build the key once)
            return _build_locked(src, arch, private, key, binary, reject)


def _usable(path, reject: str | None):
    """A verified binary's path, unless it is the rejected one (its recorded sha256)."""
    if path is None or reject is None:
        return path
    return None if recorded_sha256(path.parent) == reject else path


def _build_locked(src: RenderedSource, arch: str | None, cache: Cache, key: str, binary: str,
                  reject: str | None):
    """compile_cached's build, with the key's lock held."""
    path = _usable(cache.load(key, binary, quiet=True), reject)  # built while we waited?
    if path is not None:
        return path, False
    try:  # (before the build: publishing would remove the broken entry after it)
        cache.remove(key)
    except OSError as e:
        raise _EntryStuck(f"the cache entry {cache.entry(key)} is broken and cannot be removed "
                          f"({e}); remove it by hand") from e
    if env.debug_level() >= 4:
        print(src.code, file=sys.stderr)
    started = time.perf_counter()
    staged = cache.staging(key)
    try:
        build.build(src, staged, arch=arch)
        if render.headers_digest("cpu" if src.lang == "cpp" else "cuda") != src.headers_digest:
            raise build.CompileError(  # (the binary may hold either version: not cached)
                f"the template headers under {env.templates_dir()} changed while {src.name} "
                f"was built; call again", path=None, log="", command="")
        path = cache.publish(key, staged, binary, {"name": src.name, "arch": arch,
                                                   "version": __version__})
    except build.CompileError as e:
        kept = cache.keep_failed(key, staged)
        e.path = kept / e.path.name if e.path else kept
        e.command = e.command.replace(str(staged), str(kept))
        raise
    except OSError as e:  # (a full disk while writing the entry: no half-written entry stays)
        if e.filename is None:  # (publish's own, which says what to do)
            raise
        raise build.CompileError(f"cannot write the kernel cache entry ({e.strerror}: "
                                 f"{e.filename})", path=None, log="", command="") from e
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    _say(f"compiled {src.name} for {arch or 'cpu'} in {time.perf_counter() - started:.1f} s")
    return path, True


def get_kernel(variant: Variant, *, backend: str, head_dim: int, kind: str = "prefill",
               dtype_tag: str = "f16", device_index: int = 0, kv_tag: str | None = None,
               shared_kv: bool = False):
    """A loaded kernel for this specialisation (CudaKernel or CpuKernel), memoised. kv_tag:
    the KV cache's dtype tag when it differs from dtype_tag ("e4m3", "e5m2"); on the CPU only
    whether it is fp8 picks the library (render.render_cpu: its entries cover both q dtypes).
    shared_kv: the CUDA kernel for ragged keys with shared prefixes (render.render_cuda; the
    CPU backend reads them in every build)."""
    kv_tag = kv_tag or dtype_tag
    kv_fp8 = kv_tag in dtypes.FP8_TAGS
    # the tiles follow from the rest (render.tiles_for_variant of the device's arch), so the
    # key leaves them out: a warm call builds nothing
    memo_key = (variant.key, backend, head_dim, kv_fp8) if backend == "cpu" else (
        variant.key, backend, kind, dtype_tag, kv_tag, head_dim, device_index, shared_kv)
    kernel = _MEMO.get(memo_key)
    if kernel is not None:
        return kernel
    arch = device_arch(device_index) if backend != "cpu" else None
    tiles = render.tiles_for_variant(variant, kind, head_dim, arch=arch, kv_tag=kv_tag)
    if backend == "cpu":
        src = render.render_cpu(variant, head_dim=head_dim, kv_fp8=kv_fp8)
        kernel = _built_and_loaded(src, None, lambda path: load.load_cpu(path, src))
    else:
        src = render.render_cuda(variant, kind=kind, dtype_tag=dtype_tag, head_dim=head_dim,
                                 tiles=tiles, kv_tag=kv_tag, shared_kv=shared_kv)
        kernel = _built_and_loaded(src, arch, lambda path: load.load_cuda(path, src,
                                                                          device_index))
    _MEMO[memo_key] = kernel
    return kernel


def _built_and_loaded(src: RenderedSource, arch: str | None, loader):
    """loader(path) of compile_cached's binary. A cached binary that does not load is built
    once more: one that vanished between its checksum and the load (a ``jitattn cache clear``
    beside this process), or one that passes its checksum but is not a loadable binary
    (load.BadBinary: an empty file whose sha256 was written beside it). Other errors (the
    device's, the driver's) and a fresh build that does not load raise."""
    path, built = compile_cached(src, arch)
    try:
        return loader(path)
    except Exception as e:
        if not path.exists():  # removed: build it again
            return loader(compile_cached(src, arch)[0])
        if built or not isinstance(e, load.BadBinary):
            raise
        log.warning("jitattn: cached %s passed its checksum but does not load (%s); "
                    "rebuilding", path, e)
        reject = recorded_sha256(path.parent)
    return loader(compile_cached(src, arch, reject=reject)[0])


def clear_memo() -> None:
    """Forget loaded kernels and the launchers kept on them (tests use it to force the disk
    path)."""
    _MEMO.clear()
    LAUNCHERS.clear()


def get_merge_kernel(*, backend: str, in_tag: str, out_tag: str, device_index: int = 0):
    """The attention-state merge kernel (variant-independent), memoised."""
    memo_key = ("merge", backend) if backend == "cpu" else ("merge", in_tag, out_tag,
                                                            device_index)
    kernel = _MEMO.get(memo_key)
    if kernel is not None:
        return kernel
    if backend == "cpu":
        src = render.render_merge_cpu()
        kernel = _built_and_loaded(src, None, lambda path: load.load_cpu(path, src))
    else:
        src = render.render_merge_cuda(in_tag, out_tag)
        kernel = _built_and_loaded(src, device_arch(device_index),
                                   lambda path: load.load_cuda(path, src, device_index))
    _MEMO[memo_key] = kernel
    return kernel
