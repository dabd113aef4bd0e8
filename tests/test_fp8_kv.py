"""fp8 KV caches, e4m3 and e5m2, in the batch wrappers (dequantized on load, scales at run()),
against the reference over the dequantized cache, on the CPU backend."""

import pytest
import torch
from helpers import (check_batch, check_fp8_across_range, check_fp8_every_byte,
                     check_fp8_rope_near_the_format_max, make_batch, make_paged, quantize_fp8)

import jitattn as ja

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
SCALES = dict(k_scale=0.5, v_scale=2.0)


def _fp8_cache(kv_cache, fp8):
    (k8, k_ref), (v8, v_ref) = (quantize_fp8(c, SCALES[s], fp8) for c, s in
                                zip(kv_cache, ("k_scale", "v_scale")))
    return (k8, v8), (k_ref, v_ref)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 1), ("NHD", 3)])
def test_fp8_kv_decode_matches_reference(dtype, layout, page_size, fp8):
    kv_lens = [1, 700, 33, 0, 129]   # one token, split across CTAs, empty, not page multiples
    variant = ja.Variant("fp8_softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    kv_cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 128, page_size, layout,
                                                       dtype, "cpu", seed=11)
    cache8, cache_ref = _fp8_cache(kv_cache, fp8)
    q, *_ = make_batch([1] * len(kv_lens), kv_lens, 8, 2, 128, dtype, "cpu", seed=12)
    w = ja.BatchDecode(variant, page_size=page_size, kv_layout=layout, device="cpu")
    w.plan(kv_indptr, kv_indices, last, 8, 2, 128, q_dtype=dtype, kv_dtype=fp8)
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    check_batch(w, variant, {}, q, cache8, qo_indptr, kv_indptr, kv_indices, last, layout,
                ref_kv_cache=cache_ref, scales=SCALES)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_kv_prefill_and_one_cache_tensor(fp8):
    """Prefill (GQA 8/2, head_dim 64) over an fp8 cache given as one [pages, 2, ...] tensor."""
    qo_lens, kv_lens = [5, 0, 1, 40, 17], [5, 9, 300, 40, 0]
    variant = ja.Variant("fp8_causal", mask="causal")
    kv_cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 64, 16, "NHD",
                                                       torch.float16, "cpu", seed=13)
    cache8, cache_ref = _fp8_cache(kv_cache, fp8)
    q, *_ = make_batch(qo_lens, kv_lens, 8, 2, 64, torch.float16, "cpu", seed=14)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    w = ja.BatchPrefill(variant, page_size=16, device="cpu")
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 8, 2, 64, kv_dtype=fp8)
    stacked = torch.stack(cache8, 1)  # [pages, 2, page_size, heads, head_dim]
    check_batch(w, variant, {}, q, stacked, qo_indptr, kv_indptr, kv_indices, last, "NHD",
                ref_kv_cache=cache_ref, scales=SCALES)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fp8_kv_dequantizes_every_byte_exactly(fp8, dtype, kind):
    check_fp8_every_byte("cpu", fp8, dtype, kind)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fp8_kv_across_the_formats_range(fp8, dtype, kind):
    check_fp8_across_range("cpu", fp8, dtype, kind)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_kv_errors_name_the_argument(fp8):
    kv_cache, kv_indptr, kv_indices, last = make_paged([20, 7], 2, 64, 16, "NHD",
                                                       torch.float16, "cpu", seed=15)
    cache8, _ = _fp8_cache(kv_cache, fp8)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    w = ja.BatchDecode(ja.Variant("c", mask="causal"), page_size=16, device="cpu")
    # each dtype argument named on its own (a string q_dtype was shown as if a dtype, with a
    # kv_dtype the caller never gave)
    for kwargs, text in ((dict(q_dtype=fp8), f"q_dtype={fp8}: expected one of"),
                         (dict(q_dtype="float16"), "q_dtype='float16': expected one of"),
                         (dict(kv_dtype=torch.float32), r"kv_dtype=torch.float32: expected "
                                                        r"q_dtype \(torch.float16\) or one of "
                                                        r"\(torch.float8_e4m3fn, "
                                                        r"torch.float8_e5m2\)")):
        with pytest.raises(TypeError, match=text):
            w.plan(kv_indptr, kv_indices, last, 4, 2, 64, **kwargs)
    w.plan(kv_indptr, kv_indices, last, 4, 2, 64, kv_dtype=fp8)
    with pytest.raises(TypeError, match="k_cache has dtype torch.float16; the plan was made "
                                        f"for kv_dtype={fp8}"):
        w.run(q, kv_cache)
    other = FP8[1 - FP8.index(fp8)]  # the other fp8 format: refused, not reinterpreted
    with pytest.raises(TypeError, match=f"k_cache has dtype {other}; the plan was made "
                                        f"for kv_dtype={fp8}"):
        w.run(q, tuple(c.view(other) for c in cache8))
    for bad in (0.0, -1.0, float("nan"), True, "1", 1e-45):  # 1e-45 x sm_scale: 0 in float32
        with pytest.raises(ValueError, match="k_scale="):
            w.run(q, cache8, k_scale=bad)
    with pytest.raises(ValueError, match=r"v_scale=tensor\(2\.\).*\.item\(\)"):
        w.run(q, cache8, v_scale=torch.tensor(2.0))
    out = w.run(q, cache8, v_scale=2.0)
    torch.testing.assert_close(out, 2 * w.run(q, cache8), rtol=1e-3, atol=1e-3)


def test_scales_belong_to_the_batch_wrappers_and_compile_checks_parameters():
    """Cascades and shared-prefix prefill refuse k_scale / v_scale (eager and compiled alike);
    under torch.compile a missing variant parameter raises as in eager mode, instead of the
    op's positional scalars shifting."""
    cascade = ja.CascadeDecode(ja.Variant("c", mask="causal"), page_size=16, device="cpu")
    with pytest.raises(ValueError, match="takes no k_scale"):
        cascade.run(torch.zeros(1, 4, 64, dtype=torch.float16), None, k_scale=0.5)
    i32 = dict(dtype=torch.int32)  # planned, with plain decode chosen: the same refusal
    plain = ja.CascadeDecode(ja.Variant("c", mask="causal"), page_size=16, device="cpu",
                             strategy="plain")
    plain.plan(torch.arange(2, **i32), 16, torch.tensor([0, 1], **i32),
               torch.tensor([2], **i32), torch.tensor([16], **i32), 4, 4, 64)
    cache16 = tuple(torch.randn(3, 16, 4, 64, dtype=torch.float16) for _ in range(2))
    with pytest.raises(ValueError, match="takes no k_scale"):
        plain.run(torch.zeros(1, 4, 64, dtype=torch.float16), cache16, k_scale=0.5)
    shared = ja.SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu")
    with pytest.raises(ValueError, match="takes no v_scale"):
        shared.run(*(torch.zeros(1, 4, 64, dtype=torch.float16),) * 3, v_scale=2.0)
    cap = ja.scalar("cap")
    variant = ja.Variant("fp8_cap_runtime", mask="causal",
                         score_mod=lambda s, b, h, q, k: cap * ja.tanh(s / cap))
    kv_cache, kv_indptr, kv_indices, last = make_paged([20, 7], 2, 64, 16, "NHD",
                                                       torch.float16, "cpu", seed=16)
    w = ja.BatchDecode(variant, page_size=16, device="cpu")
    w.plan(kv_indptr, kv_indices, last, 4, 2, 64)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    compiled = torch.compile(lambda q: w.run(q, kv_cache, k_scale=2.0), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(Exception, match=r"missing parameter\(s\) \['cap'\]"):
        compiled(q)


def test_fp8_rope_near_the_format_max():
    check_fp8_rope_near_the_format_max("cpu")
