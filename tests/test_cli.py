"""The jitattn command line."""

import shutil
import subprocess
from pathlib import Path

import pytest

from jitattn import catalog, cli, env, jit, render


def test_reports_do_not_make_the_cache(tmp_path, monkeypatch, capsys):
    """doctor, `cache ls` and `cache clear` report a cache folder that does not exist yet
    rather than make it (a report that changes the disk, and a root left by a mistyped
    JITATTN_CACHE_DIR)."""
    root = tmp_path / "never" / "made"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    for argv in (["doctor"], ["cache", "ls"], ["cache", "clear"]):
        assert cli.main(argv) == 0
        assert f"{root} (not made yet: the first build makes it), no entries" in \
            capsys.readouterr().out
    assert not (tmp_path / "never").exists()
    # a root that no build could make is reported as unusable, as before
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "a-file" / "sub"))
    assert cli.main(["doctor"]) == 0
    assert "is not usable" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 1


def test_doctor(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ninja:" in out and "cache:" in out and "nvcc:" in out
    cxx = env.cxx_path()  # its banner's first line (the last is g++'s warranty notice)
    first = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    assert "      " + first.splitlines()[0] in out.splitlines()


def test_compile_cpu_then_ls_then_clear(capsys):
    variant_file = str(env.variants_dir() / "softcap.py")
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "64"]) == 0
    assert "kernel.so" in capsys.readouterr().out
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "64"]) == 0
    assert "cached" in capsys.readouterr().out
    # CUDA's options with --cpu are said to be ignored (they were, in silence)
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "64", "--kind", "decode",
                     "--dtype", "bf16"]) == 0
    assert "jitattn compile --cpu: --kind / --dtype ignored (one CPU library per head_dim " \
        "holds every kind and q dtype; --kv-dtype picks the 16-bit caches' library and the " \
        "fp8 caches')" in capsys.readouterr().err
    # fp8 KV caches' library beside the 16-bit one (a prebuilt cache had lacked it)
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "64", "--kv-dtype",
                     "same", "e5m2"]) == 0
    out = capsys.readouterr().out
    assert "cached" in out and "-cpu-kv_fp8-d64" in out and "built" in out
    assert cli.main(["cache", "ls"]) == 0
    assert "softcap50-causal" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["document_mask", "relative_position_bias"])
def test_compile_builds_files_whose_make_takes_tensors(name, capsys):
    """make(doc_ids) / make(table) need a tensor: `compile` builds the variant of the file's
    example(), the kernel a run with other sizes of the same tensors loads too (it failed
    with make()'s missing argument)."""
    path = env.variants_dir() / f"{name}.py"
    module = catalog.load_file(path)
    (variant,) = catalog.variants_in(module)
    other, _ = module.example(3, 4, 2, 40, 57, "cpu")
    assert jit.cache_key(render.render_cpu(variant, head_dim=64), None) == \
        jit.cache_key(render.render_cpu(other, head_dim=64), None)
    assert cli.main(["compile", str(path), "--cpu", "--head-dim", "64"]) == 0
    assert "kernel.so" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compile_cuda(capsys):
    variant_file = str(env.variants_dir() / "alibi.py")
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "bf16",
                     "--kind", "decode"]) == 0
    assert "kernel.cubin" in capsys.readouterr().out
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "bf16",
                     "--kind", "decode", "--shared-kv"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "kernel.cubin" in x]
    assert len(lines) == 2 and "shared_kv" in lines[1] and "shared_kv" not in lines[0]
    assert lines[0].lstrip().startswith("cached")  # the plain build from the first command
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "bf16",
                     "--kind", "decode", "--kv-dtype", "e4m3", "e5m2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "kernel.cubin" in x]
    assert len(lines) == 2 and "-kv_e4m3-" in lines[0] and "-kv_e5m2-" in lines[1]


def test_compile_missing_file(capsys):
    assert cli.main(["compile", "no/such/variant.py", "--cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["compile", "alibi", "--cpu"]) == 2  # a built-in variant's name
    assert "(the built-in variant 'alibi' is " in capsys.readouterr().err


def test_compile_reports_a_variant_the_file_cannot_build(tmp_path, capsys):
    """A file whose Variant(...) raises SpecError at import: one line naming the file (it was a
    traceback)."""
    path = tmp_path / "typo.py"
    path.write_text("import jitattn as ja\n\nvariant = ja.Variant('t', mask='casual')\n")
    assert cli.main(["compile", str(path), "--cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"jitattn compile: {path}: Variant mask='casual': expected one of " \
        f"('none', 'causal', 'custom', 'multi_item')\n"


def test_compile_names_a_make_it_cannot_call(tmp_path, capsys):
    """make() with a required (keyword-only) argument and no example(): an error, exit 2."""
    path = tmp_path / "needs_table.py"
    path.write_text("import jitattn as ja\n\n\ndef make(*, table):\n"
                    "    return ja.Variant('t', mask='causal',\n"
                    "                      score_mod=lambda s, b, h, q, k: s + table[h])\n")
    assert cli.main(["compile", str(path), "--cpu"]) == 2
    assert "make() takes arguments (table) and the file has no example()" in \
        capsys.readouterr().err


@pytest.mark.parametrize("arch", ["90", "sm_80 -o /tmp/x", "compute_90", "sm_9"])
def test_compile_refuses_a_malformed_arch(arch, capsys):
    """--arch goes into nvcc's flags and the cache key (a '/' made a junk folder there)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["compile", str(env.variants_dir() / "softcap.py"), "--arch", arch])
    assert e.value.code == 2
    assert f"{arch!r}: expected sm_ and a compute capability" in capsys.readouterr().err


@pytest.mark.parametrize("gpu_arch, expected", [(None, "sm_90a"), ("sm_80", "sm_80")])
def test_compile_targets_the_visible_gpu_by_default(monkeypatch, capsys, gpu_arch, expected):
    """Without --arch, `jitattn compile` builds for the GPU the runtime will look kernels up for
    (the first visible one), and for sm_90a without a GPU."""
    from jitattn import jit
    built = []
    monkeypatch.setattr(cli, "_cuda", lambda: gpu_arch is not None)
    monkeypatch.setattr(jit, "device_arch", lambda index: gpu_arch)
    from jitattn.cache import Cache
    in_cache = Cache().root / "key" / "kernel.cubin"
    monkeypatch.setattr(jit, "compile_cached", lambda src, arch: built.append(arch) or
                        (in_cache, True))
    variant_file = str(env.variants_dir() / "alibi.py")
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "f16",
                     "--kind", "decode"]) == 0
    assert built and set(built) == {expected}
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "f16",
                     "--kind", "decode", "--arch", "sm_89"]) == 0
    assert built[-1] == "sm_89"


def test_output_into_a_reader_that_stops_early_is_quiet(tmp_path):
    """`jitattn cache ls | head -1`: the pipe's reader is gone before the listing is written;
    the command ends without a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    env_vars = dict(os.environ, JITATTN_CACHE_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "jitattn.cli", "cache", "ls"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_vars)
    proc.stdout.close()  # (before the interpreter has started: nothing reads the listing)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "Broken" not in err, err


def test_python_dash_m_jitattn_runs_the_command():
    """`python -m jitattn doctor` failed (no jitattn.__main__) where the console script was not
    installed, as in a plain checkout."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "jitattn", "cache", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ls: every cached kernel" in done.stdout


def test_compile_errors_are_messages_not_tracebacks(tmp_path, monkeypatch, capsys):
    """A failing compiler gave a traceback; a file that is not Python an AttributeError from
    importlib, a folder 'does not exist'."""
    from jitattn import build
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITATTN_CXX", "/bin/false")
    build.compiler_fingerprint.cache_clear()
    try:
        assert cli.main(["compile", str(env.variants_dir() / "softcap.py"), "--cpu"]) == 1
    finally:
        build.compiler_fingerprint.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("jitattn compile: ") and "Traceback" not in err
    notes = tmp_path / "notes.md"
    notes.write_text("# not python")
    for path, text in ((notes, "is not a Python file"), (tmp_path, "is not a file")):
        assert cli.main(["compile", str(path), "--cpu"]) == 2
        assert text in capsys.readouterr().err
    # the file's own errors (at import, or in make()): one line naming the file and its line
    for name, code, text in (
            ("syntax.py", "x = (\n", "syntax.py, line 1: SyntaxError: "),
            ("imports.py", "import numpy\nimport no_such_module_here\n",
             "imports.py, line 2: ModuleNotFoundError: No module named"),
            ("raises.py", "def make():\n    return {}['x']\n", "raises.py, line 2: KeyError"),
            ("five.py", "def make():\n    return 5\n", "make() returned int; expected a "
                                                     "jitattn.Variant")):
        (tmp_path / name).write_text(code)
        assert cli.main(["compile", str(tmp_path / name), "--cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and text in err and "Traceback" not in err, err


def test_compile_fails_when_its_build_went_to_a_private_folder(tmp_path, monkeypatch, capsys):
    """A folder at a key's lock path: the kernel is built in a private folder removed at exit,
    and compile said "built" with exit status 0."""
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "cache"))
    variant_file = str(env.variants_dir() / "softcap.py")
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "32"]) == 0
    built = capsys.readouterr().out.split("built ")[1].strip()
    shutil.rmtree(Path(built).parent)
    lock = Path(built).parent.with_name(Path(built).parent.name + ".lock")
    lock.unlink()  # (the first build's lock file)
    lock.mkdir()
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "32"]) == 1
    assert "was built in a private folder removed at exit" in capsys.readouterr().err


def test_tune_refuses_before_measuring_when_the_table_cannot_be_saved(tmp_path, monkeypatch,
                                                                      capsys):
    """A cache root that could not be written was found only after the measurements, which
    were lost in a traceback."""
    from jitattn import tune
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(blocker))
    monkeypatch.setattr(tune, "measure", lambda *a, **k: pytest.fail("measured"))
    assert cli.main(["tune", "--cpu"]) == 1
    assert "is not a directory); the table could not be saved" in capsys.readouterr().err


def test_options_before_the_variant_file(capsys, monkeypatch):
    """`jitattn compile --head-dim 64 file.py`: the list option took the file, and argparse
    said only "invalid int value: 'file.py'"; now the file may come anywhere."""
    variant_file = str(env.variants_dir() / "alibi.py")
    seen = []
    monkeypatch.setattr(cli, "_compile", lambda args: seen.append(args) or 0)
    assert cli.main(["compile", "--head-dim", "64", "128", variant_file, "--cpu"]) == 0
    assert cli.main(["compile", "--cpu", "--kind", "decode", variant_file]) == 0
    assert [(a.variant_file, a.head_dim, a.kind, a.cpu) for a in seen] == [
        (variant_file, [64, 128], None, True),  # (None: every kind, an option not given)
        (variant_file, [128], ["decode"], True)]
    # a "--" ends the options: the file after it stays where it is (a trailing "--" left
    # behind was refused)
    assert cli.main(["compile", "--head-dim", "64", "--", variant_file]) == 0
    assert (seen[-1].variant_file, seen[-1].head_dim) == (variant_file, [64])
    with pytest.raises(SystemExit):  # a second file, after the first
        cli.main(["compile", variant_file, "--head-dim", "64", variant_file])
    assert "compile takes one variant file, before the options or after --" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["compile", variant_file, "--head-dim", "96", "--cpu"])
    assert "'96': expected one of 32, 64, 128, 256" in capsys.readouterr().err
