"""Variant + kernel kind + dtype/head_dim/tiles -> RenderedSource. Pure: reads templates, no I/O
beyond that, no compilation.

Templates are Jinja2 with StrictUndefined; they only fill in constants and the generated variant
struct, while the logic lives in ordinary headers (templates/cuda/include, templates/cpu/include,
templates/common).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

import jinja2

from . import __version__, dtypes, emit, env
from .params import ScalarParam
from .spec import Variant

HEAD_DIMS = (32, 64, 128, 256)
KINDS = ("prefill", "decode")
SMEM_ROW_PAD = 8  # 16-bit elements of padding per shared-memory row (jitattn_attend.cuh)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of a CUDA kernel (templates/cuda/include/jitattn_attend.cuh): num_warps
    warps of ``rows`` query rows each (a multiple of 16, the mma row block), over K/V tiles of
    kv_tile keys through ``stages`` shared-memory buffers. Prefill splits a CTA's rows among
    its warps; decode gives every warp the same ``rows`` rows and a share of each K/V tile.
    wgmma: prefill on Hopper's warpgroup MMA (a warpgroup of 4 warps per 64 rows, operands in
    128-byte swizzled shared memory)."""

    num_warps: int
    rows: int
    kv_tile: int
    stages: int = 2
    wgmma: bool = False

    def rows_per_cta(self, kind: str) -> int:
        return self.num_warps * self.rows if kind == "prefill" else self.rows

    def smem_bytes(self, kind: str, head_dim: int, kv_fp8: bool = False,
                   rope: bool = False) -> int:
        """Dynamic shared memory in bytes: the Q tile and the stages of K and V tiles, 16-bit,
        in padded rows (decode reuses the stages to merge the warps' states). With an fp8 KV
        cache the stages hold fp8 rows: decode without RoPE reads them as mma fragments, in
        rows padded by 16 bytes; otherwise they are unpadded and one 16-bit K/V tile more
        receives each dequantized tile."""
        row = (head_dim + SMEM_ROW_PAD) * 2
        if self.wgmma:  # unpadded swizzled panels, 1024-byte aligned; 4 mbarriers per stage
            return (self.rows_per_cta(kind) + self.stages * 2 * self.kv_tile) * head_dim * 2 \
                + 1024 + 4 * 8 * self.stages
        if not kv_fp8:
            kv = self.stages * 2 * self.kv_tile * row
        elif kind == "decode" and not rope:
            kv = self.stages * 2 * self.kv_tile * (head_dim + 16)
        else:
            kv = 2 * self.kv_tile * row + self.stages * 2 * self.kv_tile * head_dim
        return self.rows_per_cta(kind) * row + kv


def tiles_for(kind: str, head_dim: int, *, arch: str | None = None, kv_fp8: bool = False,
              rope: bool = False, narrow: bool = False) -> Tiles:
    """Tile configuration per kind and head_dim. Prefill: 4 warps x 32 rows over K/V tiles of
    64 keys (each K/V fragment feeds two mma row blocks); at head_dim 256, where a 16-row block
    already holds 128 accumulators of O per lane, 8 warps x 16 rows over 32 keys. Decode: 16 rows
    (GQA groups up to 16 in one tile), 4 warps taking 16 keys each of 64-key tiles, three tiles
    in flight (two at head_dim 256, whose three would need 211 KB of shared memory, more than
    an A100 has). On Hopper (arch "sm_90a"), prefill over a 16-bit cache without RoPE runs on
    wgmma: 2 warpgroups x 64 rows over 192-key tiles (a tile's fixed costs, its barriers,
    waits and row reductions, spread over 1.5x the keys; two slots each for K and V at head_dim
    128, where three would exceed the 227 KB of shared memory a CTA may have, three at 64), or
    over 128-key tiles with three slots each for ``narrow`` variants: a score_mod (but one of
    ALiBi's one-FMA form), mask_mod, custom or multi-item mask or the sigmoid reduction (their
    per-score code needs the registers that 64 more keys take, and ptxas spills), or a sliding
    window (more of its
    tiles are partly masked: 2.5% slower at window 1024 on 192); at head_dim 256 over 64-key
    tiles with two slots each (O already holds 128 floats per thread). Measured on the H200
    (docs/performance.md, session 11)."""
    if kind == "prefill" and arch == "sm_90a" and head_dim in (64, 128, 256) and not kv_fp8 \
            and not rope:
        if head_dim == 256:  # O holds 128 floats per thread: 64-key tiles keep S at 32
            return Tiles(8, 16, 64, stages=2, wgmma=True)
        if narrow:
            return Tiles(8, 16, 128, stages=3, wgmma=True)
        return Tiles(8, 16, 192, stages=3 if head_dim == 64 else 2, wgmma=True)
    if kind == "prefill":
        return Tiles(8, 16, 32) if head_dim == 256 else Tiles(4, 32, 64)
    return Tiles(4, 16, 64, stages=3 if head_dim <= 128 else 2)


QUERY_TILES = ("auto", "short", "long")


def query_kind(max_qo_len: int, group: int, head_dim: int, query_tile: str = "auto") -> str:
    """The kernel kind a batch whose longest request has max_qo_len queries, GQA group
    ``group``, runs on, by query length (FlashInfer's choice of the query tile by the packed
    query length, arXiv 2501.01005 section 3.3): "decode" for one query per request, or when
    every request's packed query rows (qo_len x group) fit in the decode kernel's one 16-row
    tile ("short": its warps split each K/V tile, so a few rows stream the KV at the memory's
    pace instead of filling 16 or fewer of a prefill tile's 128 rows, as in speculative
    verification or a decode step of several tokens), else "prefill" ("long"). query_tile
    "short" / "long" fixes the choice; both kernels give the same results for any query
    length (a short tile cuts a longer request into several)."""
    if query_tile == "auto":
        rows = tiles_for("decode", head_dim).rows_per_cta("decode")
        return "decode" if max_qo_len <= 1 or max_qo_len * group <= rows else "prefill"
    return "decode" if query_tile == "short" else "prefill"


def tiles_for_variant(variant: Variant, kind: str, head_dim: int, *, arch: str | None = None,
                      kv_tag: str | None = None) -> Tiles:
    """The tiles jitattn builds ``variant``'s CUDA kernel with on ``arch`` (tiles_for with the
    variant's RoPE and the KV cache's dtype tag)."""
    narrow = (variant.score_mod is not None and not _score_kv_linear(variant)) or \
        variant.mask_mod is not None or variant.mask in ("custom", "multi_item") or \
        variant.reduction != "softmax" or variant.window_left not in (None, -1)
    return tiles_for(kind, head_dim, arch=arch, kv_fp8=kv_tag in dtypes.FP8_TAGS,
                     rope=variant.pos_encoding is not None, narrow=narrow)


def _score_kv_linear(variant: Variant) -> bool:
    """Whether the variant's score_mod is ALiBi's one-FMA form (emit.kv_linear: score + slope *
    (kv_idx - q_idx)) with one row-invariant coefficient and no added term, whose per-score code
    leaves the registers of a 192-key tile free: ALiBi 1 x 32 x 16384 ran 2.6% faster on
    192-key tiles than on 128 (4 x 32 x 4096 unchanged), where exact soft-cap 4 x 32 x 4096 ran
    1.7% slower and the window 1024 2-3% slower (H200, docs/performance.md, session 26). (A
    coefficient and a term of several row-invariant functions made ptxas spill 104 bytes at
    192 keys: a review's case.)"""
    score, _ = emit.divisions_as_products(variant.score.expr, None)
    lin = emit.kv_linear(score)
    return lin is not None and lin[3] is None and \
        len(emit.hoist_row_invariants([score])[0]) <= 1


@dataclass(frozen=True)
class RenderedSource:
    """Generated source plus what building and launching it needs."""

    code: str
    lang: str                      # "cuda" | "cpp"
    name: str                      # readable name, the prefix of the cache key
    entries: tuple                 # extern "C" symbols
    include_dirs: tuple            # absolute paths
    headers_digest: str            # sha256 of every header the code can include
    hooks: dict = field(default_factory=dict)  # "score_mod" -> (line in code, "file.py:line")
    kind: str = "prefill"
    head_dim: int = 128
    tiles: Tiles | None = None
    kv_fp8: bool = False           # CUDA attention: the KV cache is fp8 (e4m3 or e5m2)
    rope: bool = False             # the variant rotates Q and K (RoPE)

    @property
    def tma(self) -> bool:
        """Whether the kernel copies ragged K / V tiles with TMA and so takes kv_tma and the
        two tensor maps as its last arguments (launch.tma_values): the wgmma kernels at
        head_dim 64 and 128. (At 256 the copy's coordinates cost the two registers that made
        ptxas spill 12-24 bytes.)"""
        return self.tiles is not None and self.tiles.wgmma and self.head_dim <= 128

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a CUDA attention kernel (0 without tiles)."""
        return self.tiles.smem_bytes(self.kind, self.head_dim, self.kv_fp8, self.rope) \
            if self.tiles else 0


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(env.templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


_DIGESTS: dict = {}  # backend -> (the headers' paths, sizes and mtimes, their digest)


def headers_digest(backend: str) -> str:
    """sha256 over the names and bytes of every file under the templates' common/ and
    <backend>/include folders (subfolders included), for the cache key of the code that can
    include them ("cuda" or "cpu"). Hashed again whenever a file's size or modification time
    changed: a header edited while a process runs keys that process's next builds anew (a
    digest kept for the process's life keyed them with the old header's)."""
    root = env.templates_dir()
    files = sorted(p for d in ("common", f"{backend}/include") for p in (root / d).rglob("*")
                   if p.is_file())
    signature = tuple((p, st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),))
    known = _DIGESTS.get(backend)
    if known is not None and known[0] == signature:
        return known[1]
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    _DIGESTS[backend] = (signature, h.hexdigest())
    return _DIGESTS[backend][1]


def _include_dirs(backend: str) -> tuple:
    root = env.templates_dir()
    return (str(root / "common"), str(root / backend / "include"))


def _param_decls(variant: Variant, backend: str) -> tuple[list, list]:
    """C declarations (one per kernel argument) and the matching argument names."""
    decls, names = [], []
    for p in variant.params:
        c = emit.c_name(p.name)
        if isinstance(p, ScalarParam):
            decls.append(f"float {c}")
            names.append(c)
            continue
        ctype = dtypes.CTYPE[backend][dtypes.tag(p.dtype)]
        decls.append(f"const {ctype}* {c}")
        names.append(c)
        for i in range(len(p.shape)):
            decls.append(f"int {c}_d{i}")
            names.append(f"{c}_d{i}")
    return decls, names


def render_variant(variant: Variant, *, backend: str, head_dim: int) -> str:
    """The generated VariantParams / Variant struct (and RoPE table) as C++ source."""
    decls, _ = _param_decls(variant, backend)
    rope = variant.pos_encoding
    freqs = [repr(float(f)) + "f" for f in rope.inv_freq(head_dim)] if rope else ["0.0f"]
    score, mask = emit.divisions_as_products(
        variant.score.expr if variant.score else None,
        variant.mask_pred.expr if variant.mask_pred else None)
    row_fields, hoisted = emit.hoist_row_invariants([t for t in (score, mask) if t is not None])
    lin = emit.kv_linear(score)
    scaled = emit.scaled_form(score)
    kv_linear = None if lin is None else dict(
        coef=emit.emit_cpp(lin[0], hoisted), sign=lin[1],
        off="0" if lin[2] is None else emit.emit_cpp(lin[2], hoisted),
        cst="0.0f" if lin[3] is None else emit.emit_cpp(lin[3], hoisted))
    return _environment().get_template("common/variant.h.j2").render(
        variant=variant, version=__version__, param_fields=decls,
        mask_mode=("none", "causal", "custom", "multi_item").index(variant.mask),
        row_fields=row_fields, kv_linear=kv_linear,
        scaled=None if scaled is None else dict(
            outer=emit.float_literal(scaled[0]), inner=emit.float_literal(scaled[1]),
            call=scaled[2]),
        score_expr=emit.emit_cpp(score, hoisted) if score is not None else "score",
        mask_expr=emit.emit_cpp(mask, hoisted) if mask is not None else "true",
        rope_mode=0 if rope is None else (1 if rope.style == "neox" else 2),
        rope_inv_freq=freqs, head_dim=head_dim)


def _hook_lines(code: str, variant: Variant) -> dict:
    hooks = {}
    for i, line in enumerate(code.splitlines(), start=1):
        for hook, traced in (("score_mod", variant.score), ("mask_mod", variant.mask_pred)):
            if f"jitattn:{hook} " in line and traced is not None:
                hooks[hook] = (i, traced.source)
    return hooks


def render_cuda(variant: Variant, *, kind: str, dtype_tag: str, head_dim: int,
                tiles: Tiles | None = None, kv_tag: str | None = None,
                arch: str | None = None, shared_kv: bool = False) -> RenderedSource:
    """CUDA source of one prefill or decode kernel: q / o of dtype_tag ("f16" | "bf16") over a
    KV cache of kv_tag (default the same; "e4m3" / "e5m2": fp8, dequantized on load). tiles:
    default the ones jitattn picks for ``arch`` (tiles_for_variant). shared_kv: the kernel
    reads ragged keys whose requests may begin with a shared prefix (BatchPrefill.plan's
    shared_prefix_start / shared_prefix_len); without it the copies assume one run per request
    (finding the run of every tile cost plain prefill 1-2% on the H200, docs/performance.md
    session 10). Raises ValueError for an unknown kind, head_dim, dtype_tag or kv_tag."""
    kv_tag = kv_tag or dtype_tag
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim}: expected one of {HEAD_DIMS}")
    if dtype_tag not in ("f16", "bf16"):
        raise ValueError(f"dtype {dtype_tag!r}: expected 'f16' or 'bf16'")
    if kv_tag != dtype_tag and kv_tag not in dtypes.FP8_TAGS:
        raise ValueError(f"KV dtype {kv_tag!r}: expected {dtype_tag!r} (q's), 'e4m3' or 'e5m2'")
    tiles = tiles or tiles_for_variant(variant, kind, head_dim, arch=arch, kv_tag=kv_tag)
    decls, names = _param_decls(variant, "cuda")
    entry = f"jitattn_{kind}"
    code = _environment().get_template("cuda/attention.cu.j2").render(
        version=__version__, kind=kind, variant=variant, dtype_tag=dtype_tag,
        dtype=dtypes.CTYPE["cuda"][dtype_tag], kv_dtype=dtypes.CTYPE["cuda"][kv_tag],
        head_dim=head_dim, num_warps=tiles.num_warps, rows=tiles.rows, kv_tile=tiles.kv_tile,
        stages=tiles.stages, wgmma=tiles.wgmma, tma=tiles.wgmma and head_dim <= 128,
        shared_kv=shared_kv, entry=entry, param_args=decls, param_names=names,
        variant_code=render_variant(variant, backend="cuda", head_dim=head_dim))
    return RenderedSource(
        code=code, lang="cuda", name=f"{variant.key}-{kind}-{dtype_tag}"
        f"{'' if kv_tag == dtype_tag else '-kv_' + kv_tag}-d{head_dim}"
        f"{'-shared_kv' if shared_kv else ''}",
        entries=(entry,), include_dirs=_include_dirs("cuda"),
        headers_digest=headers_digest("cuda"), hooks=_hook_lines(code, variant), kind=kind,
        head_dim=head_dim, tiles=tiles, kv_fp8=kv_tag in dtypes.FP8_TAGS,
        rope=variant.pos_encoding is not None)


def cpu_entry(q_tag: str, kv_tag: str) -> str:
    """The CPU library's entry point for q/o of q_tag over a KV cache of kv_tag."""
    return f"jitattn_attention_{q_tag}" + ("" if kv_tag == q_tag else f"_kv_{kv_tag}")


def render_cpu(variant: Variant, *, head_dim: int, kv_fp8: bool = False) -> RenderedSource:
    """C++/OpenMP source of the CPU backend: one library with an entry point per q dtype (fp16,
    bf16) and KV-cache dtype: q's own, or with kv_fp8 fp8 e4m3 and e5m2 (a library of their
    own: each entry is an instantiation of the whole kernel, so one with all six took g++ 2.2
    s where two take about a third of that)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim}: expected one of {HEAD_DIMS}")
    decls, names = _param_decls(variant, "cpu")
    entries = tuple((cpu_entry(q, kv), dtypes.CTYPE["cpu"][q], dtypes.CTYPE["cpu"][kv])
                    for q in ("f16", "bf16") for kv in (dtypes.FP8_TAGS if kv_fp8 else (q,)))
    code = _environment().get_template("cpu/attention.cpp.j2").render(
        version=__version__, variant=variant, head_dim=head_dim, param_args=decls,
        param_names=names, entries=entries,
        variant_code=render_variant(variant, backend="cpu", head_dim=head_dim))
    return RenderedSource(
        code=code, lang="cpp", name=f"{variant.key}-cpu{'-kv_fp8' if kv_fp8 else ''}-d{head_dim}",
        entries=tuple(e for e, _, _ in entries), include_dirs=_include_dirs("cpu"),
        headers_digest=headers_digest("cpu"), hooks=_hook_lines(code, variant), kind="cpu",
        head_dim=head_dim)


#: (input, output) dtype tags the merge kernels are built for: public merges keep the dtype,
#: planned split-KV merges read float32 partial states.
MERGE_COMBOS = (("f16", "f16"), ("bf16", "bf16"), ("f32", "f32"), ("f32", "f16"),
                ("f32", "bf16"))


def render_merge_cuda(in_tag: str, out_tag: str) -> RenderedSource:
    """CUDA attention-state merge kernel (variant-independent)."""
    if (in_tag, out_tag) not in MERGE_COMBOS:
        raise ValueError(f"merge {in_tag} -> {out_tag}: expected one of {MERGE_COMBOS}")
    code = _environment().get_template("cuda/merge.cu.j2").render(
        version=__version__, in_tag=in_tag, out_tag=out_tag,
        in_ctype=dtypes.CTYPE["cuda"][in_tag], out_ctype=dtypes.CTYPE["cuda"][out_tag])
    return RenderedSource(code=code, lang="cuda", name=f"merge-{in_tag}-{out_tag}",
                          entries=("jitattn_merge",), include_dirs=_include_dirs("cuda"),
                          headers_digest=headers_digest("cuda"), kind="merge", head_dim=0)


def render_merge_cpu() -> RenderedSource:
    """CPU attention-state merge, every dtype combination in one library."""
    combos = [(i, dtypes.CTYPE["cpu"][i], o, dtypes.CTYPE["cpu"][o]) for i, o in MERGE_COMBOS]
    code = _environment().get_template("cpu/merge.cpp.j2").render(version=__version__,
                                                                 combos=combos)
    return RenderedSource(code=code, lang="cpp", name="merge-cpu",
                          entries=tuple(f"jitattn_merge_{i}_{o}" for i, o in MERGE_COMBOS),
                          include_dirs=_include_dirs("cpu"), headers_digest=headers_digest("cpu"),
                          kind="merge", head_dim=0)
