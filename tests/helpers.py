"""Shared test helpers: random inputs, batch layouts, and the comparison with the reference."""

from __future__ import annotations

import itertools
import math

import torch

import jitattn as ja
from jitattn import reference

# Starting points tuned on the CPU backend and the H200; outputs are compared with the float64
# reference after rounding to the kernel's dtype, so the budget is a few output ulps plus
# float32 accumulation.
TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# lse is float32, but the scores behind it come from 16-bit inputs (P is rounded to q's dtype
# before P V, and the reference rounds RoPE's rotated q and k as the kernels do, but not in
# the same float32 order), so bf16 gets a bf16-sized budget.
LSE_ATOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}


def make_batch(qo_lens, kv_lens, hq, hkv, head_dim, dtype, device, seed):
    """Fresh random q/k/v (never zeros) for a ragged batch, with int32 indptrs on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_kv = sum(qo_lens), sum(kv_lens)
    q = torch.randn(total_q, hq, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(total_kv, hkv, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(total_kv, hkv, head_dim, generator=gen).to(device=device, dtype=dtype)
    qo = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, qo, kv


def check(variant, params, q, k, v, qo_indptr=None, kv_indptr=None):
    """Run jitattn into NaN-poisoned outputs and compare out and lse with the reference."""
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    kw = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr) if qo_indptr is not None else {}
    ja.attention(q, k, v, variant, out=out, lse=lse, **kw, **params)
    ref_out, ref_lse = reference.attention(q, k, v, variant, return_lse=True, **kw, **params)
    return compare(variant, out, lse, ref_out, ref_lse)


def compare(variant, out, lse, ref_out, ref_lse, slack=None, lse_scale=1.0):
    """Outputs written everywhere, close to the reference; rows with no visible key exact.
    slack: an extra absolute allowance per output element (float64, ref_out's shape);
    lse_scale: a factor on lse's budget (scores that many times larger)."""
    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    if slack is not None:  # (the reference moved towards out by at most slack)
        ref_out = ref_out + (out.double() - ref_out).clamp(-slack, slack)
    torch.testing.assert_close(out, ref_out.to(out.dtype), **TOL[out.dtype])
    lse = lse.double()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows with no visible key differ"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=LSE_ATOL[out.dtype] * lse_scale,
                               rtol=1e-4)
    if variant.reduction == "softmax":  # rows that see no key: output exactly 0
        assert (out[torch.isinf(ref_lse)] == 0).all()
    return out, lse


def make_paged(kv_lens, hkv, head_dim, page_size, layout, dtype, device, seed, extra_pages=3):
    """A random paged KV cache (pages in shuffled order, some unused) and its page table."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    indices, indptr, last = [], [0], []
    for n, p in zip(kv_lens, pages_per):
        indices += perm[len(indices):len(indices) + p].tolist()
        indptr.append(len(indices))
        last.append(n - (p - 1) * page_size if p else 0)
    page = (page_size, hkv, head_dim) if layout == "NHD" else (hkv, page_size, head_dim)
    k = torch.randn(num_pages, *page, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(num_pages, *page, generator=gen).to(device=device, dtype=dtype)
    i32 = dict(dtype=torch.int32)
    return (k, v), torch.tensor(indptr, **i32), torch.tensor(indices, **i32), \
        torch.tensor(last, **i32)


def check_batch(wrapper, variant, params, q, kv_cache, qo_indptr, kv_indptr, kv_indices, last,
                layout, ref_kv_cache=None, scales=None, **mask):
    """Run a planned wrapper into NaN-poisoned outputs and compare with the reference (over
    ref_kv_cache when given: the dequantized values of an fp8 kv_cache; scales: run()'s
    k_scale / v_scale)."""
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    wrapper.run(q, kv_cache, out=out, lse=lse, **(scales or {}), **params)
    k, v, token_indptr = reference.paged_to_ragged(
        kv_cache if ref_kv_cache is None else ref_kv_cache, kv_indptr, kv_indices, last, layout)
    ref_out, ref_lse = reference.attention(q, k, v, variant, qo_indptr=qo_indptr,
                                           kv_indptr=token_indptr, return_lse=True,
                                           mask_data=mask, **params)
    return compare(variant, out, lse, ref_out, ref_lse)


def every_feature_variant(device):
    """A user variant using every DSL feature at once (runtime scalar and tensor, soft-cap
    plus ALiBi-style bias, window, mask_mod with Python modulo, fused RoPE with scaling), and
    its parameters for 8 query heads."""
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    cap = ja.scalar("cap")

    def mod(score, b, h, q_idx, kv_idx):
        return cap * ja.tanh(score / cap) + slopes[h] * (kv_idx - q_idx)

    def local_and_even(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 2 == 0) | (kv_idx < 3)
    variant = ja.Variant("everything", mask="causal", window_left=40, score_mod=mod,
                         mask_mod=local_and_even,
                         pos_encoding=ja.RoPE(theta=1e4, style="gptj",
                                              scaling={"type": "linear", "factor": 2.0}))
    return variant, {"cap": 20.0, "slopes": ja.alibi_slopes(8).to(device)}


def quantize_fp8(cache, scale: float, fp8_dtype=torch.float8_e4m3fn):
    """An fp8 copy (fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2) of a 16-bit cache
    tensor (values / scale) and its exact dequantized values (fp8 * scale) in the cache's dtype;
    scale a power of two keeps that exact."""
    fp8 = (cache.float() / scale).to(fp8_dtype)
    return fp8, (fp8.float() * scale).to(cache.dtype)


def fp8_across_range(shape, fp8_dtype, gen):
    """Random fp8 values of fp8_dtype, never zero, of either sign, with magnitudes log-uniform
    from the format's smallest subnormal to its largest finite value (e5m2: 2**-16 .. 57344,
    e4m3: 2**-9 .. 448); every row ([..., D]) begins with the smallest and largest subnormal,
    the smallest normal and the largest finite value (signs -, +, -, +)."""
    info = torch.finfo(fp8_dtype)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    lo, hi = math.log2(tiny), math.log2(info.max)
    mag = torch.exp2(lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64))
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    x = (sign * mag).float()
    x[..., :4] = torch.tensor([-tiny, info.smallest_normal - tiny, -info.smallest_normal,
                               info.max])
    return x.to(fp8_dtype)


def check_fp8_every_byte(device, fp8_dtype, dtype, kind):
    """One query over one key whose V holds every fp8 bit pattern (head_dim 128, 2 KV heads,
    GQA 2): the output is v_scale (0.5) x V's values exactly, as torch's own
    ``.to(torch.float32)`` gives them (subnormals, e5m2's infinities and both formats' NaNs
    included); K random and finite. kind: "decode" (BatchDecode), "prefill" / "short"
    (BatchPrefill's query_tile "long" / "short")."""
    gen = torch.Generator().manual_seed(31)
    v8 = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).reshape(1, 1, 2, 128)
    k8 = torch.randn(1, 1, 2, 128, generator=gen).to(fp8_dtype)
    q = torch.randn(1, 4, 128, generator=gen).to(dtype)
    i32 = dict(dtype=torch.int32)
    kv_indptr, kv_indices, last = (torch.tensor(x, **i32) for x in ([0, 1], [0], [1]))
    w = _fp8_wrapper(kind, ja.Variant("fp8_bytes", mask="causal"), 1, device,
                     (torch.tensor([0, 1], **i32), kv_indptr, kv_indices, last, 4), dtype,
                     fp8_dtype)
    out = w.run(q.to(device), (k8.to(device), v8.to(device)), v_scale=0.5)
    expected = (v8.to(torch.float32) * 0.5).to(dtype)[0, 0].repeat_interleave(2, dim=0)
    torch.testing.assert_close(out[0].cpu(), expected, rtol=0, atol=0, equal_nan=True)


def _fp8_wrapper(kind, variant, page_size, device, table, dtype, fp8_dtype):
    """BatchDecode (kind "decode") or BatchPrefill on query tiles "long" ("prefill") / "short",
    planned over the page table (qo_indptr, kv_indptr, kv_indices, last, num_qo_heads) with 2
    KV heads of 128 and an fp8 cache."""
    qo_indptr, kv_indptr, kv_indices, last, heads = table
    if kind == "decode":
        w = ja.BatchDecode(variant, page_size=page_size, device=device)
        w.plan(kv_indptr, kv_indices, last, heads, 2, 128, q_dtype=dtype, kv_dtype=fp8_dtype)
    else:
        w = ja.BatchPrefill(variant, page_size=page_size, device=device,
                            query_tile="short" if kind == "short" else "long")
        w.plan(qo_indptr, kv_indptr, kv_indices, last, heads, 2, 128, q_dtype=dtype,
               kv_dtype=fp8_dtype)
    return w


def check_fp8_across_range(device, fp8_dtype, dtype, kind):
    """Decode or prefill (kind as check_fp8_every_byte's) over fp8 K/V spanning the format's
    whole range (fp8_across_range: subnormals to the largest finite value), scaled by powers of
    two that bring the largest into [8, 16) (K) and [4, 8) (V), against the reference over the
    exact dequantized values (float32)."""
    kv_lens = [1, 300, 77, 0, 129]
    qo_lens = [1] * 5 if kind == "decode" else [1, 3, 2, 0, 4] if kind == "short" \
        else [1, 40, 5, 0, 129]
    # the page table, and the pages' shape for the fp8 caches
    (k, _), kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 128, 16, "NHD", dtype, "cpu",
                                                     seed=32)
    gen = torch.Generator().manual_seed(33)
    k8, v8 = (fp8_across_range(k.shape, fp8_dtype, gen) for _ in range(2))
    top = math.floor(math.log2(torch.finfo(fp8_dtype).max))
    scales = dict(k_scale=2.0 ** (3 - top), v_scale=2.0 ** (2 - top))
    ref = (k8.float() * scales["k_scale"], v8.float() * scales["v_scale"])
    q, *_ = make_batch(qo_lens, kv_lens, 8, 2, 128, dtype, device, seed=34)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    variant = ja.Variant("fp8_range", mask="causal")
    w = _fp8_wrapper(kind, variant, 16, device, (qo_indptr, kv_indptr, kv_indices, last, 8),
                     dtype, fp8_dtype)
    check_batch(w, variant, {}, q, (k8.to(device), v8.to(device)), qo_indptr, kv_indptr,
                kv_indices, last, "NHD", ref_kv_cache=tuple(c.to(device) for c in ref),
                scales=scales)


def check_linear_partition(kind: str, device: str, monkeypatch) -> None:
    """The planner's linear partition (cuts at any kv_tile multiple, 1-2 items per CTA) against
    the reference, forced where it would not be chosen: long and short requests, GQA 4."""
    from jitattn import plan as plan_module
    monkeypatch.setattr(plan_module, "FILL_MARGIN", -1.0)
    monkeypatch.setattr(plan_module, "MERGE_ITEMS", float("-inf"))  # keep the cuts
    variant = ja.Variant("causal", mask="causal")
    hq, hkv, d, dtype = 32, 8, 128, torch.float16
    kv_lens = [20000, 1, 700, 9000, 0, 4100]
    qo_lens = [1] * len(kv_lens) if kind == "decode" else [300, 1, 129, 64, 0, 1000]
    if device == "cpu":  # fewer CTAs there: shorter requests are cut as well
        kv_lens = [n // 8 for n in kv_lens]
        qo_lens = [max(1, n // 8) if n else 0 for n in qo_lens] if kind != "decode" else qo_lens
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, d, 16, "NHD", dtype, device,
                                                    seed=5)
    q, *_ = make_batch(qo_lens, kv_lens, hq, hkv, d, dtype, device, seed=6)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    if kind == "decode":
        w = ja.BatchDecode(variant, page_size=16, device=device)
        plan = w.plan(kv_indptr, kv_indices, last, hq, hkv, d, q_dtype=dtype)
    else:
        # room for the partition's partial states: on the wgmma kernel (128 rows per item) it
        # needs 27648 rows, more than the default capacity, which would rule it out
        w = ja.BatchPrefill(variant, page_size=16, device=device, max_partial_rows=1 << 16)
        plan = w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, q_dtype=dtype)
    assert len(plan.merge_rows) > 0  # the partition cut ranges
    check_batch(w, variant, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last, "NHD")


def check_shared_prefix_batch(variant, params, device, dtype, hq, hkv, head_dim, requests,
                              prefix_lens, seed, split_kv=True, fp8_scale=None,
                              fp8_dtype=torch.float8_e4m3fn):
    """A ragged batch whose requests read shared prefixes (plan(shared_prefix_start=,
    shared_prefix_len=)) against the reference over each request's keys gathered into one run.
    requests: (prefix: an index into prefix_lens or None, q_len, own_len) per request. k / v
    hold the own runs first (kv_indptr), then two junk rows and each prefix. fp8_scale: run
    over an fp8 copy of k / v (of fp8_dtype) with that scale (the reference over its exact
    values)."""
    gen = torch.Generator().manual_seed(seed)
    own = [n for _, _, n in requests]
    n_own = sum(own)
    prefix_at, at = [], n_own + 2
    for n in prefix_lens:
        prefix_at.append(at)
        at += n
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa
    k, v, q = rand(at, hkv, head_dim), rand(at, hkv, head_dim), \
        rand(sum(n for _, n, _ in requests), hq, head_dim)
    i32 = dict(dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor([n for _, n, _ in requests]).cumsum(0).tolist()],
                             **i32)
    kv_indptr = torch.tensor([0, *torch.tensor(own).cumsum(0).tolist()], **i32)
    starts = torch.tensor([0 if p is None else prefix_at[p] for p, _, _ in requests], **i32)
    lens = torch.tensor([0 if p is None else prefix_lens[p] for p, _, _ in requests], **i32)
    cache, scales = (k, v), {}
    if fp8_scale is not None:
        (k8, k), (v8, v) = (quantize_fp8(c, fp8_scale, fp8_dtype) for c in (k, v))
        cache, scales = (k8, v8), dict(k_scale=fp8_scale, v_scale=fp8_scale)
    w = ja.BatchPrefill(variant, kv_layout="ragged", device=device, split_kv=split_kv)
    w.plan(qo_indptr, kv_indptr, None, None, hq, hkv, head_dim, q_dtype=dtype,
           kv_dtype=cache[0].dtype, shared_prefix_start=starts, shared_prefix_len=lens)
    out = torch.full(q.shape, math.nan, dtype=dtype, device=device)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=device)
    w.run(q, cache, out=out, lse=lse, **scales, **params)
    rows = [torch.cat([torch.arange(s, s + n), torch.arange(a, b)])
            for s, n, a, b in zip(starts.tolist(), lens.tolist(), kv_indptr[:-1].tolist(),
                                  kv_indptr[1:].tolist())]
    gather = torch.cat(rows).to(device)
    ref_kv_indptr = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()],
                                 **i32)
    ref_out, ref_lse = reference.attention(q, k[gather], v[gather], variant,
                                           qo_indptr=qo_indptr, kv_indptr=ref_kv_indptr,
                                           return_lse=True, **params)
    return compare(variant, out, lse, ref_out, ref_lse)


def wrapping_mask_case(device):
    """A mask whose 64-bit products wrap for some keys (k * (2**62 - 1) >= 0 is False for k in
    {3, 4}, True for 5 and 6), a negation and a power that wrap too; q, k, v and the keys that
    torch's int64 arithmetic keeps."""
    c = 2**62 - 1
    variant = ja.Variant("wrapping", mask="none", mask_mod=lambda b, h, qi, ki: (
        (ki * c >= 0) & (-(ki * c) <= 0) | ((ki + 2) ** 63 == 0)))
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(n, 1, 64, generator=gen).half().to(device) for n in (3, 40, 40))
    keys = torch.arange(40)
    kept = ((keys * c >= 0) & (-(keys * c) <= 0)) | ((keys + 2) ** 63 == 0)
    return variant, q, k, v, kept.to(device)


def check_nan_key_rows(device, layouts, head_dim=64, dtype=torch.float16):
    """A NaN in one key of kv head 0 makes out and lse NaN on exactly the rows that see that
    key (causal, bottom-right aligned: query i sees keys j <= kv_len - q_len + i) and leaves the
    others finite. The kernels stored lse -inf there ("no key"), so a merge of that row's states
    dropped the NaN. Softmax and sigmoid, kernels and reference. layouts: (q_len, kv_len, NaN
    key) per call."""
    variants = (ja.Variant("causal", mask="causal"),
                ja.Variant("sigmoid", mask="causal", reduction="sigmoid"))
    for (q_len, kv_len, bad), variant in itertools.product(layouts, variants):
        q, k, v, _, _ = make_batch([q_len], [kv_len], 4, 2, head_dim, dtype, device, seed=q_len)
        k[bad, 0] = float("nan")
        for out, lse in (ja.attention(q, k, v, variant, return_lse=True),
                         reference.attention(q, k, v, variant, return_lse=True)):
            _check_nan_rows(out, lse, q_len, kv_len, bad, device)


def _check_nan_rows(out, lse, q_len, kv_len, bad, device):
    sees = torch.arange(q_len, device=device) + kv_len - q_len >= bad
    expected = torch.zeros(q_len, 4, dtype=torch.bool, device=device)
    expected[:, :2] = sees[:, None]  # (kv head 0 serves q heads 0 and 1)
    assert torch.equal(lse.isnan(), expected), (q_len, kv_len, bad)
    assert torch.equal(out.isnan().all(-1), expected) and \
        not out.isnan().any(-1)[~expected].any(), (q_len, kv_len, bad)


def check_out_is_q(device):
    """out=q itself (in place) equals a separate out, bit for bit, for ja.attention, the
    planned prefill (its 128-row tiles, split-KV over 3000 keys) and decode, and every
    shared-prefix strategy: each launch reads a row of q before it writes that row's output
    and no other item reads it (split rows go through partial states)."""
    from jitattn.shared_prefix import STRATEGIES
    i32 = dict(dtype=torch.int32, device=device)
    causal = ja.Variant("causal", mask="causal")
    q, k, v, qo, kv = make_batch([300, 1, 77], [3000, 40, 77], 8, 2, 128, torch.float16,
                                 device, seed=11)
    runs = {"attention": lambda x, out=None: ja.attention(x, k, v, causal, qo_indptr=qo,
                                                          kv_indptr=kv, out=out)}
    prefill = ja.BatchPrefill(causal, kv_layout="ragged", device=device)
    prefill.plan(qo.to(**i32), kv.to(**i32), None, None, 8, 2, 128)
    runs["BatchPrefill"] = lambda x, out=None: prefill.run(x, (k, v), out=out)
    decode = ja.BatchDecode(causal, kv_layout="ragged", device=device)
    decode.plan(torch.tensor([0, 3000, 3040], **i32), None, None, 8, 2, 128)
    runs["BatchDecode"] = lambda x, out=None: decode.run(x[:2], (k, v), out=out)
    for strategy in STRATEGIES:
        sp = ja.SharedPrefixPrefill(causal, strategy, device=device)
        sp.plan(200, [100, 78], 8, 2, 128)
        runs[strategy] = lambda x, out=None, sp=sp: sp.run(x, k[:378], v[:378], out=out)
    for name, run in runs.items():
        x = q[:2].clone() if name == "BatchDecode" else q.clone()
        want = run(x)
        assert run(x, out=x).data_ptr() == x.data_ptr(), name
        torch.testing.assert_close(x, want, rtol=0, atol=0, msg=name)


def check_rope_before_the_first_key(device):
    """RoPE under mask "none" with more queries than keys: query i of a request sits at
    position kv_len - qo_len + i, negative for the first ones, and is rotated there (the CUDA
    kernels left every query at a negative position unrotated; a fuzz seed found it)."""
    for style, head_dim, dtype in (("neox", 128, torch.float16), ("gptj", 64, torch.bfloat16)):
        variant = ja.Variant(f"rope_{style}_full", mask="none",
                             pos_encoding=ja.RoPE(theta=1e4, style=style))
        q, k, v, qo, kv = make_batch([300, 5, 1], [20, 0, 130], 8, 2, head_dim, dtype, device,
                                     seed=head_dim)
        check(variant, {}, q, k, v, qo, kv)
        # at most 16 packed rows a request: the decode kernel's tiles
        q, k, v, qo, kv = make_batch([3, 2], [1, 2], 8, 2, head_dim, dtype, device, seed=1)
        w = ja.BatchPrefill(variant, kv_layout="ragged", device=device, query_tile="short")
        w.plan(qo, kv, None, None, 8, 2, head_dim, q_dtype=dtype)
        out, lse = w.run(q, (k, v), return_lse=True)
        compare(variant, out, lse, *reference.attention(q, k, v, variant, qo_indptr=qo,
                                                        kv_indptr=kv, return_lse=True))


def check_fp8_rope_near_the_format_max(device):
    """fp16 q over an e5m2 cache with RoPE: keys whose pairs hold e5m2's largest values rotate
    past fp16's range unscaled (57344 * sqrt 2 > 65504; k_scale joins the softmax scale, so the
    kernels rotate the unscaled values). The kernels rotate such keys at half their value;
    before, the scores were NaN (a review found it)."""
    gen = torch.Generator().manual_seed(5)
    variant = ja.Variant("rope_e5m2", mask="causal", pos_encoding=ja.RoPE(theta=1e4))
    page_size, hkv, hq, d, scale = 16, 2, 4, 64, 1.0 / 8192
    kv_lens = [40, 7]
    (k16, v16), kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, d, page_size, "NHD",
                                                         torch.float16, "cpu", seed=5)
    k8 = (k16.float() * 4096).to(torch.float8_e5m2)
    k8[..., 0], k8[..., d // 2] = 57344.0, -49152.0  # (neox pairs: columns i and i + d / 2)
    v8 = (v16.float() * 4096).to(torch.float8_e5m2)
    cache = (k8.to(device), v8.to(device))
    ref_cache = tuple((c.float() * scale).half().to(device) for c in (k8, v8))
    for kind in ("prefill", "decode"):
        qo_lens = [5, 3] if kind == "prefill" else [1, 1]
        q = torch.randn(sum(qo_lens), hq, d, generator=gen).half().to(device)
        qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()],
                                 dtype=torch.int32)
        w = ja.BatchPrefill(variant, page_size=page_size, device=device) if kind == "prefill" \
            else ja.BatchDecode(variant, page_size=page_size, device=device)
        args = (kv_indptr, kv_indices, last, hq, hkv, d)
        w.plan(*((qo_indptr,) if kind == "prefill" else ()), *args, q_dtype=torch.float16,
               kv_dtype=torch.float8_e5m2)
        check_batch(w, variant, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last, "NHD",
                    ref_kv_cache=ref_cache, scales=dict(k_scale=scale, v_scale=scale))
