"""The kernel cache: hits, concurrent builds, corrupt and partial entries, links, unusable
directories, the in-process memo."""

import hashlib
import json
import os
import re
import stat
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import jitattn as ja
from jitattn import jit, render
from jitattn.cache import Cache

from helpers import check, make_batch

VARIANT = ja.Variant("cachetest", mask="causal", score_mod=ja.soft_cap(20.0))


def _src(variant=VARIANT):
    return render.render_cpu(variant, head_dim=64)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    jit.clear_memo()
    yield root
    jit.clear_memo()


def _run_variant():
    q, k, v, _, _ = make_batch([19], [23], 4, 2, 64, torch.float16, "cpu", seed=1)
    check(VARIANT, {}, q, k, v)


def test_root_is_private_and_second_lookup_hits(fresh_cache):
    path, built = jit.compile_cached(_src(), None)
    assert built and path.is_file()
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    path2, built2 = jit.compile_cached(_src(), None)
    assert path2 == path and not built2
    meta = json.loads((path.parent / "meta.json").read_text())
    assert meta["key"] == path.parent.name and len(meta["sha256"]) == 64
    assert (path.parent / "kernel.cpp").is_file() and (path.parent / "build.ninja").is_file()


def test_key_changes_with_the_source(fresh_cache):
    a = jit.cache_key(_src(), None)
    b = jit.cache_key(_src(ja.Variant("cachetest", mask="causal",
                                      score_mod=ja.soft_cap(21.0))), None)
    c = jit.cache_key(render.render_cpu(VARIANT, head_dim=128), None)
    assert len({a, b, c}) == 3


def test_key_follows_the_compilers_banner_through_a_wrapper(fresh_cache, tmp_path,
                                                             monkeypatch):
    """A compiler reached through a wrapper script (as /usr/local/bin/nvcc is on the CI
    machine) whose target changes: the key changes with the banner although the wrapper file
    does not (a memo keyed by the wrapper's path, size and mtime reused the old binary)."""
    from jitattn import build
    banner = tmp_path / "banner"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then cat {banner}; exit 0; fi\n'
                       f'exec g++ "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("JITATTN_CXX", str(wrapper))
    keys = []
    for version in ("fakecc 1.0", "fakecc 2.0"):
        banner.write_text(version)
        build.compiler_fingerprint.cache_clear()  # a new process
        keys.append(jit.cache_key(_src(), None))
    build.compiler_fingerprint.cache_clear()
    assert keys[0] != keys[1]


@pytest.mark.parametrize("script, expected", [
    ('echo "cc1plus: fatal error: no space left" >&2; exit 1', "cc1plus: fatal error: no space"),
    ("exit 1", "FAILED: "),  # (newer ninjas add "[code=1]" before the target)
    ('echo "Segmentation fault (core dumped)" >&2; exit 139', "FAILED: "),
    ('echo "ninja: no error-here" >&2; echo "kernel.cpp:3:5: error: x was not declared" >&2; '
     "exit 1", "kernel.cpp:3:5: error: x was not declared"),
    # a full disk: the linker's own line, not collect2's "ld returned 1 exit status"
    ('echo "/usr/bin/ld: final link failed: No space left on device" >&2; '
     'echo "collect2: error: ld returned 1 exit status" >&2; exit 1',
     "/usr/bin/ld: final link failed: No space left on device"),
    ("exit 0", "the compiler (")])  # (wrote nothing: was a raw FileNotFoundError at load)
def test_compile_error_names_the_compilers_failure(fresh_cache, tmp_path, monkeypatch, script,
                                                   expected):
    """The message is the compiler's first error or fatal line, else ninja's FAILED line (it
    was ninja's 'Entering directory' when no line said 'error')."""
    from jitattn import build
    compiler = tmp_path / "cc"
    compiler.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exit 0\n{script}\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("JITATTN_CXX", str(compiler))
    build.compiler_fingerprint.cache_clear()
    try:
        with pytest.raises(build.CompileError) as info:
            jit.compile_cached(_src(), None)
    finally:
        build.compiler_fingerprint.cache_clear()
    assert info.value.message.startswith(expected)
    if script == "exit 1":  # (it said only "FAILED: kernel.so")
        assert info.value.message.endswith(f"the compiler ({compiler}) exited with an error "
                                           f"and printed nothing")
    if "Segmentation" in script:  # (not "printed nothing": what it printed)
        assert info.value.message.endswith(": Segmentation fault (core dumped)")


def test_truncated_binary_is_rebuilt(fresh_cache):
    path, _ = jit.compile_cached(_src(), None)
    path.write_bytes(path.read_bytes()[:100])
    path2, built = jit.compile_cached(_src(), None)
    assert built and path2.stat().st_size > 100
    _run_variant()


def test_partial_entry_without_meta_is_rebuilt(fresh_cache):
    path, _ = jit.compile_cached(_src(), None)
    (path.parent / "meta.json").unlink()
    assert jit.compile_cached(_src(), None)[1]


def test_link_out_of_the_cache_is_never_loaded(fresh_cache, tmp_path):
    path, _ = jit.compile_cached(_src(), None)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "kernel.so").write_bytes(b"not a library")
    os.unlink(path)
    os.symlink(outside / "kernel.so", path)
    path2, built = jit.compile_cached(_src(), None)
    assert built and not path2.is_symlink()
    assert (outside / "kernel.so").read_bytes() == b"not a library"  # never followed or written


def test_unusable_cache_dir_falls_back_with_a_reason(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(blocker / "cache"))
    cache = Cache()
    assert cache.fallback_reason and str(blocker) in cache.fallback_reason
    assert cache.root.is_dir()
    jit.clear_memo()
    _run_variant()  # still works, from the fallback folder


def test_memo_means_a_warm_call_never_touches_disk(fresh_cache):
    _run_variant()
    import shutil
    shutil.rmtree(fresh_cache)
    _run_variant()
    assert not fresh_cache.exists()


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import jitattn as ja
    from jitattn import jit, render
    from helpers import check, make_batch
    from jitattn.cache import Cache
    assert Cache().fallback_reason is None, Cache().fallback_reason
    v = ja.Variant("cachetest", score_mod=ja.soft_cap(20.0))
    path, built = jit.compile_cached(render.render_cpu(v, head_dim=64), None)
    q, k, vv, _, _ = make_batch([19], [23], 4, 2, 64, torch.float16, "cpu", seed=1)
    check(v, {{}}, q, k, vv)
    print("BUILT" if built else "LOADED")
""")


def test_concurrent_processes_build_once(fresh_cache):
    code = CHILD.format(tests=str(Path(__file__).parent))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ)
             for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    outcomes = sorted(r[0].strip() for r in results)
    assert outcomes == ["BUILT", "LOADED", "LOADED", "LOADED"], [r[1] for r in results]
    entries = [p for p in fresh_cache.iterdir() if p.is_dir()]
    assert len(entries) == 1  # no staging folders left behind


def test_processes_starting_together_share_a_fresh_root(tmp_path):
    """Several processes creating the same new cache root at once all use it: none loses the
    race to mkdir and falls back to a private folder (which would build the kernel again)."""
    code = ("import sys; from pathlib import Path; from jitattn.cache import Cache; "
            "print(Cache(Path(sys.argv[1])).fallback_reason)")
    for trial in range(2):
        root = tmp_path / str(trial) / "nested" / "cache"
        procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) for _ in range(6)]
        reasons = [p.communicate(timeout=120)[0].strip() for p in procs]
        assert reasons == ["None"] * 6, reasons
        assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_cache_ls_and_clear(fresh_cache):
    """ls and clear concern kernels: the `jitattn tune` tables beside them stay (minutes of GPU
    time to measure again)."""
    jit.compile_cached(_src(), None)
    cache = Cache()
    table = cache.root / "tune" / "cpu.json"
    table.parent.mkdir()
    table.write_text("{}")
    assert [e["key"] for e in cache.entries()] == [jit.cache_key(_src(), None)]
    assert cache.clear() == 1 and cache.entries() == [] and table.read_text() == "{}"


def test_debug_level_1_reports_cache_hits_in_a_fresh_process(private_cache):
    """JITATTN_DEBUG=1 logs cache hits even when nothing compiles in that process."""
    script = ("import torch, jitattn as ja\n"
              "q = torch.randn(3, 2, 64).half()\n"
              "ja.attention(q, q, q, ja.Variant('debug_hits'))\n")
    env = dict(os.environ, JITATTN_CACHE_DIR=str(private_cache))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True)
    hit = subprocess.run([sys.executable, "-c", script], env=dict(env, JITATTN_DEBUG="1"),
                         check=True, capture_output=True, text=True)
    assert "cache hit debug_hits" in hit.stderr


def test_ls_and_clear_leave_folders_that_are_not_entries(fresh_cache, capsys):
    """JITATTN_CACHE_DIR pointed at a shared folder by mistake: clear removed every folder in
    it (other tools' caches) and ls listed them."""
    from jitattn import cli
    jit.compile_cached(_src(), None)
    foreign = [fresh_cache / "huggingface" / "hub", fresh_cache / "pip"]
    for folder in foreign:
        folder.mkdir(parents=True)
        (folder / "data").write_text("keep me")
    assert cli.main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "1 entry in" in out and "huggingface" not in out and "pip" not in out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 1 entry from" in capsys.readouterr().out
    assert all((folder / "data").read_text() == "keep me" for folder in foreign)


@pytest.mark.parametrize("meta", ["[]", "null", "{}", '{"sha256": 5}', "not json"])
def test_malformed_metadata_is_rebuilt_and_listed(fresh_cache, meta, capsys):
    """meta.json that is JSON but not an entry's metadata ([] or null raised TypeError in every
    process loading the kernel, and in cache ls / doctor)."""
    from jitattn import cli
    path, _ = jit.compile_cached(_src(), None)
    (path.parent / "meta.json").write_text(meta)
    assert cli.main(["cache", "ls"]) == 0 and cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "unreadable" in out and path.parent.name in out
    assert jit.compile_cached(_src(), None)[1]  # rebuilt
    _run_variant()
    meta = json.loads((path.parent / "meta.json").read_text())
    # time stamps time.localtime refuses (ValueError, OverflowError, OSError in `ls`)
    for created in ('"yesterday"', "NaN", "1e300", "-1e18", "true"):
        text = json.dumps({**meta, "created": 0}).replace('"created": 0', f'"created": {created}')
        (path.parent / "meta.json").write_text(text)
        assert cli.main(["cache", "ls"]) == 0 and "1970-01-01" in capsys.readouterr().out
    (path.parent / "meta.json").write_text("[" * 100000)  # (RecursionError in json.loads)
    assert cli.main(["cache", "ls"]) == 0 and "nested too deeply" in capsys.readouterr().out
    assert jit.compile_cached(_src(), None)[1]


def test_staging_folders_of_killed_builds_are_removed(fresh_cache):
    """A build killed mid-way leaves its staging folder: the key's next build removes it (it
    holds the key's lock, so no other build of the key is running), and so does clear() when
    the key's lock is free, never while it is held."""
    key = jit.cache_key(_src(), None)
    cache = Cache()
    dead = fresh_cache / f".tmp-{key}-999999-0123abcd"
    dead.mkdir()
    (dead / "kernel.cpp").write_text("half written")
    assert jit.compile_cached(_src(), None)[1] and not dead.exists()
    busy_key, left_key = (f"{name}-host-0123456789abcdef" for name in ("busy", "left"))
    busy, left = (fresh_cache / f".tmp-{k}-1-0123abcd" for k in (busy_key, left_key))
    for folder in (busy, left):
        folder.mkdir()
    with cache.lock(busy_key):  # a build of that key in progress
        assert cache.clear() == 1  # the entry built above
        assert busy.exists() and not left.exists()
    assert cache.clear() == 0 and not busy.exists()


def test_a_read_only_root_serves_its_kernels(fresh_cache, monkeypatch, capsys):
    """A prebuilt cache in a read-only image: its verified entries load (every process rebuilt
    them in a temporary folder), new kernels are built in a private folder, and clear says it
    cannot remove anything. (Simulated: this suite may run as root, which writes anywhere.)"""
    from jitattn import cli, env
    built, _ = jit.compile_cached(_src(), None)
    real_prepare = Cache._prepare

    def prepare(root):
        if root == fresh_cache:
            raise PermissionError(13, "Permission denied")
        real_prepare(root)
    monkeypatch.setattr(Cache, "_prepare", staticmethod(prepare))
    cache = Cache()
    assert cache.read_only == fresh_cache and cache.root != fresh_cache
    assert "read-only" in cache.fallback_reason
    assert jit.compile_cached(_src(), None) == (built, False)
    other = _src(ja.Variant("cachetest", mask="causal", score_mod=ja.soft_cap(33.0)))
    path, was_built = jit.compile_cached(other, None)
    assert was_built and fresh_cache not in path.parents
    assert cli.main(["cache", "clear"]) == 1
    err = capsys.readouterr().err
    assert "is read-only" in err and "; nothing removed" in err and built.exists()
    # a prebuild would go to the private folder, removed at exit: refused
    assert cli.main(["compile", str(env.variants_dir() / "softcap.py"), "--cpu", "--head-dim",
                     "64"]) == 1
    assert "nothing would be saved" in capsys.readouterr().err
    # whoever else can write there could plant a binary beside its checksum: not loaded
    os.chmod(built.parent, 0o770)
    assert Cache().load(built.parent.name, built.name) is None
    os.chmod(built.parent, 0o700)
    os.chmod(fresh_cache, 0o770)
    assert Cache().read_only is None
    assert "owned by another user or writable by its group" in Cache().fallback_reason
    assert "needs chmod -R a+rX, go-w" in Cache().fallback_reason
    os.chmod(fresh_cache, 0o700)


def test_a_root_every_user_can_write_is_not_used(fresh_cache):
    """Anyone could plant a binary and its checksum there: neither loaded from nor written."""
    path, _ = jit.compile_cached(_src(), None)
    os.chmod(fresh_cache, 0o777)
    try:
        cache = Cache()
        assert cache.read_only is None and cache.root != fresh_cache
        assert "writable by every user" in cache.fallback_reason
        assert cache.load(path.parent.name, path.name) is None
        with pytest.raises(OSError, match="writable by every user.*; nothing removed"):
            cache.clear()
    finally:
        os.chmod(fresh_cache, 0o700)


def test_a_binary_removed_between_its_checksum_and_its_load_is_built_again(fresh_cache):
    """`jitattn cache clear` beside a process that has just verified an entry."""
    calls = []

    def loader(path):
        calls.append(path)
        if len(calls) == 1:
            import shutil
            shutil.rmtree(path.parent)
            raise OSError(f"{path}: cannot open shared object file")
        return "loaded"
    assert jit._built_and_loaded(_src(), None, loader) == "loaded"
    assert len(calls) == 2 and calls[1].is_file()


def test_a_binary_that_passes_its_checksum_but_does_not_load_is_rebuilt(fresh_cache, caplog):
    """An empty library whose sha256 was written into meta.json (ctypes raised OSError)."""
    path, _ = jit.compile_cached(_src(), None)
    path.write_bytes(b"")
    meta = json.loads((path.parent / "meta.json").read_text())
    meta["sha256"] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    (path.parent / "meta.json").write_text(json.dumps(meta))
    assert jit.compile_cached(_src(), None) == (path, False)  # the checksum holds
    _run_variant()
    assert "passed its checksum but does not load" in caplog.text
    assert path.stat().st_size > 0 and not jit.compile_cached(_src(), None)[1]


def test_a_truncated_library_whose_checksum_was_rewritten_is_rebuilt_not_loaded(fresh_cache):
    """dlopen mapped a truncated library whose sha256 had been rewritten to match, and the
    process died of SIGBUS, on every later run (a trial's report). Its ELF headers' extent is
    checked before the load, and the entry rebuilt. In a child process: a regression kills
    the child, not the test run."""
    path, _ = jit.compile_cached(_src(), None)
    whole = path.stat().st_size
    path.write_bytes(path.read_bytes()[:whole // 3])
    meta = json.loads((path.parent / "meta.json").read_text())
    meta["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / "meta.json").write_text(json.dumps(meta))
    assert jit.compile_cached(_src(), None) == (path, False)  # the checksum holds
    child = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                               "import test_cache; test_cache._run_variant(); print('ran')"],
        capture_output=True, text=True, timeout=600)
    assert child.returncode == 0 and child.stdout.strip() == "ran", (child.returncode,
                                                                     child.stderr[-2000:])
    assert re.search(r"passed its checksum but does not load \(.*truncated: \d+ bytes, its ELF "
                     r"headers reach byte \d+\); rebuilding", child.stderr), child.stderr
    assert path.stat().st_size > whole // 3


def test_elf_headers_that_cannot_be_read_are_a_bad_binary_not_a_struct_error(fresh_cache):
    """A program header size of 0 with the table at the file's end read past the buffer
    (struct.error, which the rebuild does not catch; a review's case): it is a corrupt
    binary. An intact library, and one whose program header count is held elsewhere (0xffff),
    are not refused."""
    from jitattn import load
    path, _ = jit.compile_cached(_src(), None)
    data = path.read_bytes()
    assert load._elf_truncated(data) is None
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 0x20, len(bad) - 8)
    struct.pack_into("<H", bad, 0x36, 0)
    assert load._elf_truncated(bytes(bad)) == "corrupt: program headers of 0 bytes"
    bad = bytearray(data)
    struct.pack_into("<H", bad, 0x38, 0xffff)
    assert load._elf_truncated(bytes(bad)) is None


def test_only_a_bad_binary_is_rebuilt_and_only_once(fresh_cache):
    """A device's or driver's error while loading a good entry (a sticky CUDA error, out of
    memory) raises without rebuilding it; a fresh build that does not load raises; a rebuild
    asked for an entry another process has rebuilt meanwhile (another sha256) takes that one."""
    from jitattn import load

    def device_error(path):
        raise RuntimeError("cuModuleLoad failed: CUDA error 700 (an illegal memory access)")
    path, _ = jit.compile_cached(_src(), None)
    before = (path.parent / "meta.json").read_text()
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        jit._built_and_loaded(_src(), None, device_error)
    assert (path.parent / "meta.json").read_text() == before  # not rebuilt

    def bad_binary(path):
        raise load.BadBinary("invalid ELF header")
    Cache().remove(jit.cache_key(_src(), None))
    with pytest.raises(load.BadBinary, match="invalid ELF header"):  # (a fresh build)
        jit._built_and_loaded(_src(), None, bad_binary)
    good = json.loads((path.parent / "meta.json").read_text())["sha256"]
    assert jit.compile_cached(_src(), None, reject="0" * 64) == (path, False)
    assert jit.compile_cached(_src(), None, reject=good)[1]  # that very entry: built anew


def test_threads_building_one_key_beside_an_unusable_lock(fresh_cache):
    """The private fallback built without a lock: threads of one process building the key
    removed each other's staging folders."""
    key = jit.cache_key(_src(), None)
    fresh_cache.mkdir(mode=0o700)
    (fresh_cache / f"{key}.lock").mkdir()
    results = []

    def build():
        try:
            results.append(jit.compile_cached(_src(), None)[0].is_file())
        except Exception as e:  # noqa: BLE001 -- the failure is the result
            results.append(e)
    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


def test_a_folder_in_place_of_a_lock_builds_privately_and_clear_leaves_it(fresh_cache, caplog,
                                                                           capsys):
    """A folder at ``<key>.lock`` (IsADirectoryError from the lock): the kernel is built in a
    private temporary cache with a warning, and `jitattn cache clear` removes the others, then
    names the entry it cannot lock and exits 1."""
    from jitattn import cli
    key = jit.cache_key(_src(), None)
    fresh_cache.mkdir(mode=0o700)
    (fresh_cache / f"{key}.lock").mkdir()
    path, built = jit.compile_cached(_src(), None)
    assert built and fresh_cache not in path.parents
    assert f"the build lock {fresh_cache / key}.lock cannot be used" in caplog.text
    _run_variant()
    other = render.render_cpu(ja.Variant("cachetest", mask="causal",
                                         score_mod=ja.soft_cap(19.0)), head_dim=64)
    jit.compile_cached(other, None)  # an entry in the root, beside the stuck one's lock
    (fresh_cache / key).mkdir()  # and the stuck key's entry there too
    assert cli.main(["cache", "clear"]) == 1
    assert not (fresh_cache / jit.cache_key(other, None)).exists()
    err = capsys.readouterr().err
    assert (fresh_cache / key).exists() and f"1 left: {fresh_cache / key} (its lock" in err


def test_an_entry_that_cannot_be_removed_is_named(fresh_cache, monkeypatch):
    path, _ = jit.compile_cached(_src(), None)
    path.write_bytes(b"corrupt")

    def refuse(key):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Cache, "remove", lambda self, key: refuse(key))
    with pytest.raises(OSError, match=r"cache entry .* is broken and cannot be removed "
                                      r"\(\[Errno 13\] Permission denied\); remove it by hand"):
        jit.compile_cached(_src(), None)


def test_an_unusable_root_falls_back_once_per_process(tmp_path, monkeypatch, caplog):
    """Every Cache() of an unusable root made its own private folder and warning (the reason
    named a probe file with a random name); a non-directory root was blamed for its mode."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(blocker))
    with caplog.at_level("WARNING", logger="jitattn"):
        roots = {Cache().root for _ in range(3)}
    assert len(roots) == 1 and "is not a directory" in Cache().fallback_reason
    assert sum("using" in r.getMessage() for r in caplog.records) == 1


def test_a_build_waiting_for_a_stopped_holder_says_so(fresh_cache, monkeypatch):
    """A process that held a key's lock (stopped mid-build) left the next one waiting without
    a word; it is named after LOCK_PATIENCE_S."""
    fresh_cache.mkdir(parents=True)
    lock_file = fresh_cache / "k.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from filelock import FileLock
        lock = FileLock({str(lock_file)!r})
        lock.acquire()
        print("held", flush=True)
        time.sleep(1.5)""")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    said = []
    monkeypatch.setattr(jit, "LOCK_PATIENCE_S", 0.3)
    monkeypatch.setattr(jit, "_say", said.append)
    from filelock import FileLock
    with jit._held(FileLock(str(lock_file)), "k"):
        pass
    holder.wait()
    assert len(said) == 1 and said[0].startswith("still waiting after 0 s for another process "
                                                 "to build k") and str(lock_file) in said[0]


def test_a_compiler_path_that_cannot_be_run_is_named(fresh_cache, monkeypatch, capsys):
    from jitattn import build, cli
    monkeypatch.setenv("JITATTN_CXX", "g++ -O0")
    build.compiler_fingerprint.cache_clear()
    try:
        with pytest.raises(build.CompileError, match=r"compiler 'g\+\+ -O0' cannot be run .*"
                                                     r"JITATTN_CXX, if set, must be the path"):
            jit.compile_cached(_src(), None)
        assert cli.main(["doctor"]) == 0
        assert "cannot be run" in capsys.readouterr().out
    finally:
        build.compiler_fingerprint.cache_clear()


def test_a_relative_cache_dir_stays_where_it_was_first_read(tmp_path, monkeypatch):
    """A relative JITATTN_CACHE_DIR followed the working directory: a process that changed
    directory built its kernels again in a second cache."""
    from jitattn import env
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("JITATTN_CACHE_DIR", f"relative-cache-{tmp_path.name}")
    first = env.cache_dir()
    monkeypatch.chdir(tmp_path / "b")
    assert env.cache_dir() == first == tmp_path / "a" / f"relative-cache-{tmp_path.name}"


def test_a_variant_named_failed_is_an_entry(fresh_cache):
    """Failed builds are kept as failed-<key> folders without meta.json; a variant whose name
    begins with "failed-" is an entry all the same (ls hid it, clear did not count it)."""
    src = _src(ja.Variant("failed-x", mask="causal", score_mod=ja.soft_cap(20.0)))
    path, _ = jit.compile_cached(src, None)
    kept = fresh_cache / f"failed-{jit.cache_key(_src(), None)}"
    kept.mkdir()
    (kept / "kernel.cpp").write_text("did not compile")
    cache = Cache()
    assert [e["key"] for e in cache.entries()] == [path.parent.name]
    assert cache.clear() == 1 and not kept.exists() and not path.exists()


def test_an_unreadable_entry_is_rebuilt_and_clear_names_what_it_leaves(fresh_cache, caplog,
                                                                       monkeypatch):
    """An entry this user cannot read (chmod 000, or another user's after a sudo run) made
    every call fail with a PermissionError from the cache's link checks, and `cache clear`
    said "removed 0 entries" with the entry still there (simulated: the tests may run as
    root, who reads and removes anything)."""
    from jitattn import cache as cache_mod
    path, _ = jit.compile_cached(_src(), None)
    real = Path.is_symlink

    def unreadable(p):
        if p == path:
            raise PermissionError(13, "Permission denied", str(p))
        return real(p)
    with monkeypatch.context() as m:
        m.setattr(Path, "is_symlink", unreadable)
        again, built = jit.compile_cached(_src(), None)
    assert built and again == path and f"cache entry {path.parent.name} cannot be read" in \
        caplog.text
    # one that cannot be removed either (another user's): built privately before any
    # compile work is lost (publishing over it failed after every build)
    real_remove = Cache.remove

    def stuck(self, key):
        if self.root == fresh_cache:
            raise PermissionError(13, "Permission denied")
        real_remove(self, key)
    with monkeypatch.context() as m:
        m.setattr(Path, "is_symlink", unreadable)
        m.setattr(Cache, "remove", stuck)
        private, built = jit.compile_cached(_src(), None)
    assert built and fresh_cache not in private.parents and \
        "is broken and cannot be removed" in caplog.text
    monkeypatch.setattr(cache_mod.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(OSError, match=r"removed 0 entries; 1 left: .* \(permissions\)"):
        Cache().clear()


def test_an_entry_copied_from_another_key_or_holding_a_fifo_is_rebuilt(fresh_cache, caplog):
    """A trial of the cache: another key's entry copied into this key's folder (checksum
    intact) was loaded, another kernel; a FIFO in place of meta.json or the binary blocked
    every reader, `jitattn cache ls` too."""
    import shutil
    other = ja.Variant("cachetest", mask="causal", score_mod=ja.soft_cap(5.0))
    path, _ = jit.compile_cached(_src(), None)
    other_path, _ = jit.compile_cached(_src(other), None)
    shutil.rmtree(path.parent)
    shutil.copytree(other_path.parent, path.parent)
    assert jit.compile_cached(_src(), None)[1]  # rebuilt
    assert "records another key" in caplog.text
    _run_variant()
    for name in ("meta.json", path.name):
        (path.parent / name).unlink()
        os.mkfifo(path.parent / name)
        assert Cache().load(path.parent.name, path.name) is None
        assert jit.compile_cached(_src(), None)[1]
    assert Cache().load(path.parent.name, path.name) == path


def test_a_header_edited_while_a_process_runs_keys_its_next_builds_anew(fresh_cache, tmp_path,
                                                                        monkeypatch):
    """The headers' digest was kept for the process's life: a kernel built after an edit
    was filed under the old headers' key, and later processes loaded it as theirs. A folder
    among the headers broke every build (IsADirectoryError)."""
    import shutil
    from jitattn import env
    root = tmp_path / "templates"
    shutil.copytree(env.templates_dir(), root)
    monkeypatch.setattr(env, "templates_dir", lambda: root)
    before = render.headers_digest("cpu")
    (root / "cpu" / "include" / "detail").mkdir()
    assert render.headers_digest("cpu") == before  # (a folder: no bytes of its own)
    (root / "cpu" / "include" / "detail" / "extra.h").write_text("// included by none\n")
    assert render.headers_digest("cpu") != before
    header = root / "common" / "jitattn_math.h"
    edited = render.headers_digest("cpu")
    header.write_text(header.read_text() + "\n// edited\n")
    assert render.headers_digest("cpu") not in (before, edited)
    # edited during a build: the binary may hold either version, so it is not filed
    from jitattn import build
    real_build = build.build

    def build_and_edit(src, out_dir, arch=None):
        real_build(src, out_dir, arch=arch)
        header.write_text(header.read_text() + "// again\n")
    monkeypatch.setattr(build, "build", build_and_edit)
    with pytest.raises(build.CompileError, match="changed while .* was built; call again"):
        jit.compile_cached(_src(), None)
    monkeypatch.setattr(build, "build", real_build)
    path, built = jit.compile_cached(_src(), None)
    assert built and not any(p.name.startswith(".tmp-") for p in fresh_cache.iterdir())


def test_a_cache_path_that_is_not_utf8_builds(tmp_path, monkeypatch):
    """ninja's output, which names the build folder, was decoded as UTF-8 and raised
    UnicodeDecodeError for every build under such a path."""
    root = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xffbyte")  # (surrogate-escaped)
    monkeypatch.setenv("JITATTN_CACHE_DIR", root)
    jit.clear_memo()
    try:
        path, built = jit.compile_cached(_src(), None)
        assert built and os.fsencode(str(path)).startswith(os.fsencode(root))
    finally:
        jit.clear_memo()
