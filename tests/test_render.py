"""Every built-in variant renders for both backends; the CUDA output compiles with nvcc for
sm_90a (compile only) for a representative set."""

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

import jitattn as ja
from jitattn import build, catalog, emit, jit, render, tracing
from jitattn.build import CompileError

BUILTIN = catalog.builtin()


def _example(name):
    return BUILTIN[name].example(2, 8, 2, 17, 33, "cpu")[0]


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_render_every_builtin(name):
    v = _example(name)
    for head_dim in (32, 64, 128, 256):
        cpu = render.render_cpu(v, head_dim=head_dim)
        assert "jitattn_attention_f16" in cpu.code and v.key in cpu.code
        for kind in ("prefill", "decode"):
            src = render.render_cuda(v, kind=kind, dtype_tag="bf16", head_dim=head_dim)
            assert f"jitattn_{kind}" in src.code and f"HEAD_DIM = {head_dim}" in src.code


def test_variant_files_define_make_and_example():
    assert {"softcap", "alibi", "sliding_window", "sigmoid", "rope_llama", "prefix_lm",
            "document_mask", "relative_position_bias"} <= set(BUILTIN)
    for name, module in BUILTIN.items():
        assert module.__doc__, f"{name} needs a docstring citing its source"


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

REPRESENTATIVE = [("softcap", "prefill", "f16", 128), ("alibi", "decode", "bf16", 64),
                  ("rope_llama", "prefill", "bf16", 256), ("document_mask", "decode", "f16", 256),
                  ("relative_position_bias", "prefill", "f16", 64),
                  ("sigmoid", "prefill", "bf16", 128), ("prefix_lm", "decode", "f16", 128)]
# fp8 KV caches, e4m3 and e5m2: (variant, kind, q dtype, head_dim)
FP8_KV = [("softcap", "decode", "f16", 128), ("alibi", "prefill", "bf16", 128),
          ("sigmoid", "decode", "bf16", 256), ("rope_llama", "prefill", "f16", 32)]


# prefill on Hopper's wgmma (the tiles jit.get_kernel picks on an sm_90a device)
WGMMA = [("softcap", "prefill", "f16", 128), ("document_mask", "prefill", "bf16", 64),
         ("sigmoid", "prefill", "f16", 128)]


@needs_nvcc
@pytest.mark.parametrize("name, kind, dtype_tag, head_dim, kv_tag, arch",
                         [r + (None, None) for r in REPRESENTATIVE] +
                         [r + (fp8, None) for fp8 in ("e4m3", "e5m2") for r in FP8_KV] +
                         [r + (None, "sm_90a") for r in WGMMA])
def test_nvcc_compiles_sm90a(name, kind, dtype_tag, head_dim, kv_tag, arch):
    src = render.render_cuda(_example(name), kind=kind, dtype_tag=dtype_tag, head_dim=head_dim,
                             kv_tag=kv_tag, arch=arch)
    assert src.tiles.wgmma == (arch is not None)
    path, _ = jit.compile_cached(src, "sm_90a")
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:4] == b"\x7fELF"  # a cubin is an ELF image


def test_fp8_kv_builds_are_their_own_kernels_and_cpu_entries():
    """Each fp8 format is a KV type of its own (the kernels choose its conversion at compile
    time), named and cached apart; the CPU library has an entry per q x KV dtype; other KV
    dtypes are refused, naming the accepted ones."""
    v = _example("softcap")
    srcs = {kv: render.render_cuda(v, kind="decode", dtype_tag="bf16", head_dim=128, kv_tag=kv)
            for kv in ("bf16", "e4m3", "e5m2")}
    assert "using KVType = __nv_fp8_storage_t;" in srcs["e4m3"].code
    assert "using KVType = ja_e5m2;" in srcs["e5m2"].code
    assert [s.name.split("-decode-")[1] for s in srcs.values()] == \
        ["bf16-d128", "bf16-kv_e4m3-d128", "bf16-kv_e5m2-d128"]
    assert [s.kv_fp8 for s in srcs.values()] == [False, True, True]
    assert srcs["e4m3"].smem_bytes() == srcs["e5m2"].smem_bytes() < srcs["bf16"].smem_bytes()
    assert render.render_cpu(v, head_dim=64).entries == ("jitattn_attention_f16",
                                                         "jitattn_attention_bf16")
    fp8 = render.render_cpu(v, head_dim=64, kv_fp8=True)
    assert fp8.entries == tuple(f"jitattn_attention_{q}_kv_{kv}" for q in ("f16", "bf16")
                                for kv in ("e4m3", "e5m2"))
    assert fp8.name.endswith("-cpu-kv_fp8-d64")
    with pytest.raises(ValueError, match=r"KV dtype 'f16': expected 'bf16' \(q's\), 'e4m3' or "
                                         r"'e5m2'"):
        render.render_cuda(v, kind="decode", dtype_tag="bf16", head_dim=128, kv_tag="f16")


@needs_nvcc
def test_nvcc_compiles_flex_attention_forms():
    """torch functions, tensor methods, shifts and a captured 0-d tensor (torch_forms.py)
    in one variant's CUDA."""
    temperature = torch.tensor(0.5)
    variant = ja.Variant(
        "flex_forms", mask="none",
        score_mod=lambda s, b, h, q, k: torch.where(q >= k, temperature * s, -float("inf")) +
        (k - q).abs().clamp(max=6).float() * torch.sigmoid(s) ** 0.5,
        mask_mod=lambda b, h, q, k: torch.logical_or((q >> 3) == (k >> 3), b.new_ones(())))
    src = render.render_cuda(variant, kind="decode", dtype_tag="f16", head_dim=64)
    path, _ = jit.compile_cached(src, "sm_90a")
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.parametrize("kind, arch, head_dim", [("prefill", "sm_90a", 128),
                                                 ("prefill", "sm_90a", 256),
                                                 ("prefill", None, 64), ("decode", None, 128)])
def test_the_shared_prefix_build_compiles_and_is_its_own_kernel(kind, arch, head_dim):
    """The build for ragged keys with shared prefixes (shared_kv) compiles on the wgmma, mma
    and 16-row kernels; it is named and cached apart from the plain build, whose copies do
    not look for a prefix's end."""
    v = _example("alibi")
    plain, shared = (render.render_cuda(v, kind=kind, dtype_tag="f16", head_dim=head_dim,
                                        arch=arch, shared_kv=flag) for flag in (False, True))
    assert shared.name == plain.name + "-shared_kv" and shared.code != plain.code
    assert ", true>(args, params)" in shared.code and ", false>(args, params)" in plain.code
    path, _ = jit.compile_cached(shared, "sm_90a")
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.parametrize("in_tag, out_tag", render.MERGE_COMBOS)
def test_nvcc_compiles_the_merge_kernels(in_tag, out_tag):
    src = render.render_merge_cuda(in_tag, out_tag)
    path, _ = jit.compile_cached(src, "sm_90a")
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.parametrize("mask", ["custom", "multi_item"])
def test_nvcc_compiles_data_masks_on_the_16_row_tiles(mask):
    """Short prefills (every request within 16 packed rows) run the decode kernel, with the
    masks whose data BatchPrefill.plan takes (tree attention's custom mask)."""
    src = render.render_cuda(ja.Variant(f"short_{mask}", mask=mask), kind="decode",
                             dtype_tag="f16", head_dim=128)
    assert src.tiles.rows_per_cta("decode") == 16
    path, _ = jit.compile_cached(src, "sm_90a")
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
def test_compile_error_maps_back_to_variant_line():
    def mod(score, b, h, q_idx, kv_idx):
        return score + 1.0
    v = ja.Variant("broken", mask="causal", score_mod=mod)
    src = render.render_cuda(v, kind="prefill", dtype_tag="f16", head_dim=64)
    # inject an error into the generated hook, as a bad DSL emission would
    broken = src.code.replace("return (score + 1.0f);", "return (score + not_a_function());")
    assert broken != src.code
    with pytest.raises(CompileError) as info:
        jit.compile_cached(dataclasses.replace(src, code=broken), "sm_90a")
    err = info.value
    assert "not_a_function" in err.log and err.path.exists()
    assert err.variant_source.endswith(f":{mod.__code__.co_firstlineno}")
    assert str(err.path) in str(err)


def test_divisions_by_row_invariants_become_products():
    """score / cap: a constant's reciprocal folded, a runtime scalar's (or a per-head value's)
    computed once per row; a divisor reading kv_idx stays a division, and so does 0."""
    cap = ja.scalar("cap")
    const = render.render_variant(ja.Variant("c", mask="causal",
                                             score_mod=ja.soft_cap(50.0)), backend="cpu",
                                  head_dim=64)
    assert "score * 0.019999999552965164f" in const and "/ (float)50.0f" not in const
    runtime = render.render_variant(
        ja.Variant("r", mask="causal",
                   score_mod=lambda s, b, h, q, kv: cap * ja.tanh(s / cap) + s / (h + 2) +
                   s / (kv + 1.0)), backend="cpu", head_dim=64)
    assert "row.r0 = ((float)1.0f / (float)p.jap_cap);" in runtime
    assert "row.r1 = ((float)1.0f / (float)ja_add(((long long)h), (2LL)));" in runtime
    assert "(score * row.r0)" in runtime and "(score * row.r1)" in runtime
    assert "(float)score / (float)(kv_idx + 1.0f)" in runtime
    # (a Variant refuses score / 0.0, which can be +-inf or NaN: the rewrite keeps it as it is)
    by_zero = tracing.trace(lambda s, b, h, q, kv: s / 0.0, "score_mod").expr
    assert emit.divisions_as_products(by_zero, None)[0] is by_zero
    # deciding contexts keep the division, but for a power of two (an exact reciprocal)
    deciding = render.render_variant(
        ja.Variant("d", mask="causal",
                   score_mod=lambda s, b, h, q, kv: ja.where(s / 3.0 < kv / 4.0, s / 3.0, s),
                   mask_mod=lambda b, h, q, kv: kv / (q + 1) < 1.0), backend="cpu", head_dim=64)
    assert "(float)score / (float)3.0f) < (kv_idx * 0.25f)" in deciding
    assert "? (float)(score * 0.3333333432674408f)" in deciding
    assert "(float)kv_idx / (float)row.r0) < 1.0f" in deciding


def test_row_invariant_subexpressions_are_hoisted():
    """ALiBi's slopes[h] depends on the query row only: read once per row (Variant::row), and
    the per-key score_mod refers to it; subexpressions with kv_idx or score stay per key."""
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    variant = ja.Variant("alibi", mask="causal",
                         score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q) + (q // 7))
    code = render.render_variant(variant, backend="cuda", head_dim=64)
    row_fn = code[code.index("static Row row("):code.index("static float score_mod(")]
    score_fn = code[code.index("static float score_mod("):code.index("static bool mask_mod(")]
    assert "jap_slopes[" in row_fn and "ja_floordiv" in row_fn
    assert "jap_slopes[" not in score_fn and "row.r0" in score_fn and "row.r1" in score_fn
    assert "kv_idx" in score_fn and "kv_idx" not in row_fn


def test_tiles_per_arch_and_shared_memory():
    """wgmma only for prefill on sm_90a over a 16-bit cache without RoPE;
    shared memory follows each layout (swizzled panels + 1024 alignment bytes; fp8 decode
    stages padded by 16 bytes, no 16-bit tile)."""
    wg = render.tiles_for("prefill", 128, arch="sm_90a")
    assert wg.wgmma and wg.rows_per_cta("prefill") == 128 and wg.kv_tile == 192
    assert wg.smem_bytes("prefill", 128) == \
        (128 + wg.stages * 2 * 192) * 128 * 2 + 1024 + 32 * wg.stages
    assert render.tiles_for("prefill", 128, arch="sm_90a", narrow=True).kv_tile == 128
    wg256 = render.tiles_for("prefill", 256, arch="sm_90a")  # 64-key tiles, two slots each
    assert wg256.wgmma and wg256.kv_tile == 64
    for d in (64, 128, 256):  # within what a CTA may have on the H100 / H200
        for narrow in (False, True):
            t = render.tiles_for("prefill", d, arch="sm_90a", narrow=narrow)
            assert t.smem_bytes("prefill", d) <= 227 * 1024, (d, narrow)
    for kind, d, kw in (("decode", 128, {}), ("prefill", 128, {"kv_fp8": True}),
                        ("prefill", 128, {"rope": True})):
        assert not render.tiles_for(kind, d, arch="sm_90a", **kw).wgmma, (kind, d, kw)
    assert not render.tiles_for("prefill", 128, arch="sm_80").wgmma
    # the planner's rows per CTA do not depend on the arch (plans are made before a kernel)
    assert wg.rows_per_cta("prefill") == render.tiles_for("prefill", 128).rows_per_cta("prefill")
    dec = render.tiles_for("decode", 128)
    assert dec.smem_bytes("decode", 128, kv_fp8=True) == \
        16 * 136 * 2 + dec.stages * 2 * 64 * (128 + 16)
    assert dec.smem_bytes("decode", 128, kv_fp8=True, rope=True) == \
        16 * 136 * 2 + 2 * 64 * 136 * 2 + dec.stages * 2 * 64 * 128


def test_wide_kv_tiles_only_for_plain_causal_and_full_variants():
    """192-key tiles for causal / full variants and ALiBi's one-FMA score_mod; 128 for other
    score_mods, mask_mod, custom and multi-item masks and sigmoid (whose code needs the
    registers) and sliding windows (render.tiles_for)."""
    tiles = lambda v: render.tiles_for_variant(v, "prefill", 128, arch="sm_90a").kv_tile  # noqa
    assert tiles(ja.Variant("c", mask="causal")) == tiles(ja.Variant("n", mask="none")) == 192
    assert tiles(ja.Variant("w", mask="causal", window_left=100)) == 128
    assert tiles(ja.Variant("w0", mask="causal", window_left=0)) == 128
    assert tiles(ja.Variant("w1", mask="causal", window_left=-1)) == 192  # no window
    for name in ("softcap", "sigmoid", "document_mask", "sliding_window", "prefix_lm",
                 "relative_position_bias"):
        assert tiles(_example(name)) == 128, name
    alibi = _example("alibi")
    assert tiles(alibi) == tiles(dataclasses.replace(alibi, mask="none")) == 192
    assert tiles(dataclasses.replace(alibi, window_left=64)) == 128
    assert tiles(ja.Variant("s2", mask="causal",  # not linear in kv_idx
                            score_mod=lambda s, b, h, q, k: s + _SLOPES[h] * (k - q) ** 2)) == 128
    assert tiles(ja.Variant("s3", mask="causal",  # linear, plus a row term (spilled at 192)
                            score_mod=lambda s, b, h, q, k: s + _SLOPES[h] * (k - q) +
                            ja.log(_SLOPES[h] + 2.0))) == 128
    assert tiles(ja.Variant("m", mask="custom")) == tiles(ja.Variant("i", mask="multi_item")) \
        == tiles(ja.Variant("s", mask="none", score_mod=lambda s, b, h, q, k: s)) == 128


def _cubin(src, tmp: str) -> tuple[str, str]:
    """nvcc's -Xptxas -v log of ``src`` (a render.render_cuda result) built to a cubin in
    ``tmp``, and the cubin's path."""
    path = os.path.join(tmp, "k.cu")
    with open(path, "w") as f:
        f.write(src.code)
    cmd = [shutil.which("nvcc"), *build.flags("cuda", "sm_90a"), "-Xptxas", "-v",
           "-cubin", path, "-o", path + ".cubin", *(f"-I{d}" for d in src.include_dirs)]
    log = subprocess.run(cmd, capture_output=True, text=True)
    assert log.returncode == 0, log.stderr[-2000:]
    return log.stderr, path + ".cubin"


_SLOPES = ja.tensor("slopes", ("num_qo_heads",), "float32")


@needs_nvcc
@pytest.mark.parametrize("mask, dtype_tag, head_dim, kv_tile", [("causal", "bf16", 128, 192),
                                                               ("none", "f16", 128, 192),
                                                               ("causal", "f16", 64, 192),
                                                               ("alibi", "f16", 128, 192)])
def test_wide_kv_tile_kernels_do_not_spill(mask, dtype_tag, head_dim, kv_tile):
    """The 192-key wgmma kernels (the tightest: the shared-prefix build, 255 registers at
    head_dim 128), ALiBi's among them (its bias's FMA a score, and a range's last tile first,
    narrowed: two more instantiations of a tile's step), fit in the registers: ptxas reports
    no spill stores, and it does not serialize their wgmma instructions (C75xx "Potential
    Performance Loss", e.g. a branch between them or a divergent path that holds a wait)."""
    v = ja.Variant("wide", mask=mask) if mask != "alibi" else ja.Variant(
        "alibi", mask="causal", score_mod=lambda s, b, h, qi, ki: s + _SLOPES[h] * (ki - qi))
    for shared_kv in (False, True):
        src = render.render_cuda(v, kind="prefill", dtype_tag=dtype_tag, head_dim=head_dim,
                                 arch="sm_90a", shared_kv=shared_kv)
        assert src.tiles.kv_tile == kv_tile
        with tempfile.TemporaryDirectory() as tmp:
            log, _ = _cubin(src, tmp)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(x == "0" for x in spills), (shared_kv, log[-1000:])
        assert "are serialized" not in log, (shared_kv, log[-1000:])


@pytest.mark.gpu  # (needs no GPU, but cuobjdump, which the device's CUDA toolkit has)
@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cuobjdump") is None,
                    reason="nvcc or cuobjdump not installed")
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_softmax_runs_under_the_previous_product_in_sass(mask):
    """The wgmma prefill (sm_90a, head_dim 128, 192-key tiles) waits for the previous tile's
    O += P V (WARPGROUP.DEPBAR.LE gsb0, 0x0) after the softmax's exponentials, so that the
    softmax runs under the product: ptxas moves a wgmma wait up within its basic block and had
    put it at the softmax's start (docs/performance.md, session 19). Between the first of the
    product's wgmmas (A from registers) and the next full wait, the unmasked tiles' path holds
    all 96 MUFU.EX2 of a thread's 96 scores."""
    for shared_kv in (False, True):
        src = render.render_cuda(ja.Variant("wide", mask=mask), kind="prefill",
                                 dtype_tag="f16", head_dim=128, arch="sm_90a",
                                 shared_kv=shared_kv)
        with tempfile.TemporaryDirectory() as tmp:
            _, cubin = _cubin(src, tmp)
            sass = subprocess.run([shutil.which("cuobjdump"), "-sass", cubin],
                                  capture_output=True, text=True, check=True).stdout
        counts, n = [], None  # MUFU.EX2 from each product's first wgmma to the next full wait
        for line in sass.splitlines():
            if n is None and re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", line):
                n = 0
            elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and n is not None:
                counts, n = counts + [n], None
            elif n is not None and "MUFU.EX2" in line:
                n += 1
        assert counts and max(counts) >= 96, (shared_kv, counts)


def test_tma_kernels_take_the_maps_last():
    """The wgmma prefill at head_dim 64 / 128 copies ragged K / V with TMA and takes kv_tma and
    the two maps as its last parameters (what launch.tma_values appends); head_dim 256, the
    mma.sync kernels and decode take neither."""
    v = ja.Variant("causal", mask="causal")
    for kind, d, arch, tma in (("prefill", 128, "sm_90a", True), ("prefill", 64, "sm_90a", True),
                               ("prefill", 256, "sm_90a", False), ("prefill", 128, "sm_80", False),
                               ("decode", 128, "sm_90a", False)):
        src = render.render_cuda(v, kind=kind, dtype_tag="f16", head_dim=d, arch=arch)
        assert src.tma == tma, (kind, d, arch)
        signature = src.code.split(f"{src.entries[0]}(")[1].split(")")[0]
        assert signature.rstrip().endswith("const __grid_constant__ ja::KVMaps kv_maps") == tma
        assert ("int kv_tma" in signature) == tma


def test_ahead_of_time_compile_builds_what_the_runtime_loads(tmp_path, monkeypatch):
    """`jitattn compile --arch sm_90a` must render the kernels get_kernel would pick on that
    arch (wgmma prefill), or the first call builds again: same cache key."""
    from jitattn import cli
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path))
    keys = []
    monkeypatch.setattr(jit, "compile_cached", lambda src, arch: keys.append(
        jit.cache_key(src, arch)) or (tmp_path / "key" / "kernel.cubin", False))
    variant_file = tmp_path / "v.py"
    variant_file.write_text("import jitattn as ja\nv = ja.Variant('c', mask='causal')\n")
    assert cli.main(["compile", str(variant_file), "--kind", "prefill", "--head-dim", "128",
                     "--dtype", "f16", "--arch", "sm_90a"]) == 0
    runtime = render.render_cuda(ja.Variant("c", mask="causal"), kind="prefill", dtype_tag="f16",
                                 head_dim=128, tiles=render.tiles_for_variant(
                                     ja.Variant("c", mask="causal"), "prefill", 128,
                                     arch="sm_90a"))
    assert runtime.tiles.wgmma and keys == [jit.cache_key(runtime, "sm_90a")]
