"""The kernel cache: hits, concurrent builds, corrupt and partial entries, links, unusable
directories, the in-process memo."""

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import jitattn as ja
from jitattn import jit, render
from jitattn.cache import Cache

from helpers import check, make_batch

VARIANT = ja.Variant("cachetest", score_mod=ja.soft_cap(20.0))


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
    b = jit.cache_key(_src(ja.Variant("cachetest", score_mod=ja.soft_cap(21.0))), None)
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
    ("exit 1", "FAILED: kernel.so")])
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
