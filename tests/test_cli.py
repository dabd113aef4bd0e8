"""The jitattn command line."""

import shutil

import pytest

from jitattn import cli, env


def test_doctor(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ninja:" in out and "cache:" in out and "nvcc:" in out


def test_compile_cpu_then_ls_then_clear(capsys):
    variant_file = str(env.variants_dir() / "softcap.py")
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "64"]) == 0
    assert "kernel.so" in capsys.readouterr().out
    assert cli.main(["compile", variant_file, "--cpu", "--head-dim", "64"]) == 0
    assert "cached" in capsys.readouterr().out
    assert cli.main(["cache", "ls"]) == 0
    assert "softcap50-causal" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out


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


def test_compile_missing_file(capsys):
    assert cli.main(["compile", "no/such/variant.py", "--cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("gpu_arch, expected", [(None, "sm_90a"), ("sm_80", "sm_80")])
def test_compile_targets_the_visible_gpu_by_default(monkeypatch, capsys, gpu_arch, expected):
    """Without --arch, `jitattn compile` builds for the GPU the runtime will look kernels up for
    (the first visible one), and for sm_90a without a GPU."""
    from jitattn import jit
    built = []
    monkeypatch.setattr(cli, "_cuda", lambda: gpu_arch is not None)
    monkeypatch.setattr(jit, "device_arch", lambda index: gpu_arch)
    monkeypatch.setattr(jit, "compile_cached", lambda src, arch: built.append(arch) or
                        ("kernel.cubin", True))
    variant_file = str(env.variants_dir() / "alibi.py")
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "f16",
                     "--kind", "decode"]) == 0
    assert built and set(built) == {expected}
    assert cli.main(["compile", variant_file, "--head-dim", "64", "--dtype", "f16",
                     "--kind", "decode", "--arch", "sm_89"]) == 0
    assert built[-1] == "sm_89"
