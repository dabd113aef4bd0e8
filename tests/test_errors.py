"""Bad input raises a clear TypeError / ValueError naming the argument, before any launch."""

import math
import warnings

import numpy as np
import pytest
import torch

import jitattn as ja

from helpers import check_out_is_q

V = ja.Variant("plain")
f16 = torch.float16


def qkv(total_q=10, hq=8, total_kv=12, hkv=2, d=64, dtype=f16):
    return (torch.randn(total_q, hq, d, dtype=dtype), torch.randn(total_kv, hkv, d, dtype=dtype),
            torch.randn(total_kv, hkv, d, dtype=dtype))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, k, v: (q.float(), k, v), TypeError, "q has dtype torch.float32"),
    (lambda q, k, v: (q, k.bfloat16(), v), TypeError, "share one dtype"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 3 dimensions"),
    (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), ValueError, "head_dim"),
    (lambda q, k, v: (q, k[..., :32].contiguous(), v[..., :32].contiguous()), ValueError,
     "k/v head_dim"),
    (lambda q, k, v: (q, k, v[:5]), ValueError, "same shape"),
    (lambda q, k, v: (q[:, :7], k, v), ValueError, "multiple of num_kv_heads"),
    # SDPA-style [heads, tokens, head_dim]: the message names the layout and the fix
    (lambda q, k, v: (q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(),
                      v.transpose(0, 1).contiguous()), ValueError,
     r"\[tokens, heads, head_dim\].*transpose\(0, 1\)"),
    (lambda q, k, v: (q.transpose(0, 1).contiguous().transpose(0, 1)[:, :, :],
                      k.transpose(1, 2).contiguous().transpose(1, 2), v), ValueError, "strides"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
])
def test_bad_tensors(mutate, exc, match):
    with pytest.raises(exc, match=match):
        ja.attention(*mutate(*qkv()), V)


def test_inputs_that_require_grad_warn_that_there_is_no_backward():
    q, k, v = (t.requires_grad_() for t in qkv())
    with pytest.warns(UserWarning, match="no backward"):
        out = ja.attention(q, k, v, V)
    assert not out.requires_grad
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        ja.attention(q, k, v, V)  # under no_grad: no warning


def test_variant_must_be_a_variant():
    with pytest.raises(TypeError, match="variant must be a jitattn.Variant"):
        ja.attention(*qkv(), "causal")


@pytest.mark.parametrize("qo, kv, match", [
    ([0, 4, 10], None, "given together"),
    ([0, 4, 10], [0, 12], "entries"),
    ([1, 4, 10], [0, 6, 12], r"qo_indptr\[0\] is 1"),
    ([0, 6, 4, 10], [0, 2, 6, 12], "non-decreasing"),
    ([0, 4, 9], [0, 6, 12], r"qo_indptr\[-1\] is 9 but q has 10 rows"),
    ([0, 4, 10], [0, 6, 25], r"kv_indptr\[-1\] is 25 but k has 12 rows .*== 12"),
])
def test_bad_indptr(qo, kv, match):
    q, k, v = qkv()
    kw = dict(qo_indptr=torch.tensor(qo, dtype=torch.int32))
    if kv is not None:
        kw["kv_indptr"] = torch.tensor(kv, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        ja.attention(q, k, v, V, **kw)


def test_indptr_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="qo_indptr has dtype torch.float32"):
        ja.attention(q, k, v, V, qo_indptr=torch.tensor([0.0, 10.0]),
                     kv_indptr=torch.tensor([0, 12], dtype=torch.int32))
    empty = torch.tensor([], dtype=torch.int32)  # (the message said "must be 1-D" of a 1-D one)
    with pytest.raises(ValueError, match=r"qo_indptr must be a non-empty 1-D tensor "
                                         r"\[batch_size \+ 1\] \(a batch of none is \[0\]\), "
                                         r"got shape \(0,\)"):
        ja.attention(q[:0], k[:0], v[:0], V, qo_indptr=empty, kv_indptr=empty)


def test_missing_extra_and_misshaped_params():
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    alibi = ja.Variant("alibi", mask="causal",
                       score_mod=lambda s, b, h, q, k: s + slopes[h] * (k - q))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="missing parameter"):
        ja.attention(q, k, v, alibi)
    with pytest.raises(ValueError, match="unexpected parameter"):
        ja.attention(q, k, v, alibi, slopes=torch.ones(8), bias=1.0)
    with pytest.raises(ValueError, match=r"shape \(2,\), expected \(8,\)"):
        ja.attention(q, k, v, alibi, slopes=torch.ones(2))
    with pytest.raises(ValueError, match="unexpected parameter"):
        ja.attention(q, k, v, V, slopes=torch.ones(8))


def test_captured_tensor_too_small_for_its_index():
    table = torch.randn(4, 9)  # covers 4 heads

    def bias(s, b, h, q_idx, kv_idx):
        return s + table[h, 0]
    v = ja.Variant("bias", mask="causal", score_mod=bias)
    q, k, vv = qkv()
    assert ja.attention(q[:, :4], k, vv, v).shape == (10, 4, 64)  # 4 heads: fine
    with pytest.raises(ValueError, match="indexed by h in dimension 0"):
        ja.attention(q, k, vv, v)  # 8 heads would read past the table


def test_bad_out_buffer():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out is"):
        ja.attention(q, k, v, V, out=torch.empty(10, 8, 32, dtype=f16))


def test_a_captured_tensor_too_short_for_its_index_is_named_by_its_variable():
    bad = torch.randn(5)
    variant = ja.Variant("short_table", mask="causal", score_mod=lambda s, b, h, q, kv: s + bad[q])
    q = torch.randn(20, 2, 64).half()
    with pytest.raises(ValueError, match=r"tensor 'bad \(score_captured0\)' .* indexed by "
                                         r"q_idx .* reaches 19: that dimension needs 20 "
                                         r"entries, it has 5"):
        ja.attention(q, q, q, variant)


def test_a_table_declared_by_another_size_than_its_index_needs_is_told_which():
    """A ja.tensor declared ("qo_len",) and indexed by q_idx, which is a query's position in
    its request's KV, was refused with qo_len entries (it needs kv_len) and with kv_len entries
    (its declaration says qo_len), each error asking for what the other refused (a trial's
    report); one declared by num_kv_heads and indexed by h worked until GQA. The error names
    the size to declare."""
    q = torch.randn(6, 4, 32).half()
    k = torch.randn(13, 2, 32).half()
    per_query, per_head = ja.tensor("qb", ("qo_len",)), ja.tensor("hb", ("num_kv_heads",))
    for score_mod, params, text in (
            (lambda s, b, h, qi, ki: s + per_query[qi], dict(qb=torch.randn(6)),
             r"tensor 'qb' \(shape \(6,\)\) is indexed by q_idx in dimension 0, which reaches "
             r"12: that dimension needs 13 entries, it has 6; declare dimension 0 'kv_len', "
             r"not 'qo_len' \(q_idx is a query's position in its request's KV"),
            (lambda s, b, h, qi, ki: s + per_head[h], dict(hb=torch.randn(2)),
             r"indexed by h in dimension 0, which reaches 3: that dimension needs 4 entries, "
             r"it has 2; declare dimension 0 'num_qo_heads', not 'num_kv_heads' \(h is the "
             r"query head\)")):
        variant = ja.Variant("declared", mask="causal", score_mod=score_mod)
        with pytest.raises(ValueError, match=text):
            ja.attention(q, k, k, variant, **params)


@pytest.mark.parametrize("sm_scale", [0.0, -0.125, float("nan"), float("inf"), True, "0.1",
                                      1e-46, 1e39])
def test_bad_sm_scale(sm_scale):
    """sm_scale must be a finite number > 0 (the CUDA kernels fold it into the exponent)."""
    with pytest.raises(ValueError, match=r"sm_scale=.*expected a finite number > 0"):
        ja.attention(*qkv(), V, sm_scale=sm_scale)
    w = ja.BatchPrefill(V, page_size=1, kv_layout="ragged", device="cpu")
    indptr = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sm_scale=.*expected a finite number > 0"):
        w.plan(indptr, torch.tensor([0, 12], dtype=torch.int32), None, None, 8, 2, 64,
               sm_scale=sm_scale)


def test_huge_int_arguments_are_shown_by_their_ends_and_digit_count():
    """Counts, head_dim, sm_scale and k_scale given a huge int printed every digit (401 for
    10**400); beyond 4300 digits str() refused it, and the error said so instead of naming the
    argument."""
    i32 = dict(dtype=torch.int32)
    args = (torch.tensor([0, 2, 4], **i32), torch.arange(4, **i32), torch.tensor([5, 16], **i32))
    shown = r"100000\.\.\.000000 \(5001 digits\)"
    with pytest.raises(ValueError, match=rf"^max_batch_size=-{shown}: expected an int >= 1$"):
        ja.BatchDecode(V, device="cpu", max_batch_size=-(10**5000))
    w = ja.BatchDecode(V, device="cpu")
    with pytest.raises(ValueError, match=rf"^head_dim={shown}: expected one of"):
        w.plan(*args, 8, 2, 10**5000)
    w.plan(*args, 8, 2, 64)
    cache = tuple(torch.randn(4, 16, 2, 64).half() for _ in range(2))
    with pytest.raises(ValueError, match=rf"^k_scale={shown}: expected a finite Python float"):
        w.run(torch.randn(2, 8, 64).half(), cache, k_scale=10**5000)
    with pytest.raises(ValueError, match=rf"^sm_scale={shown}: expected a finite number > 0"):
        ja.attention(*qkv(), V, sm_scale=10**5000)


def test_hints_for_ported_code():
    """Mistakes of code ported from SDPA / FlexAttention get a hint at the fix."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q\.transpose\(1, 2\)\.reshape"):
        ja.attention(q[None].transpose(1, 2), k, v, V)
    with pytest.raises(ValueError, match="the softmax scale is the sm_scale= argument"):
        ja.attention(q, k, v, V, scale=0.1)
    w = ja.BatchPrefill(V, page_size=1, kv_layout="ragged", device="cpu")
    w.plan(torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0, 12], dtype=torch.int32),
           None, None, 8, 2, 64)
    with pytest.raises(TypeError, match=r"plan\(\.\.\., q_dtype=\) sets it"):
        w.run(q.bfloat16(), (k.bfloat16(), v.bfloat16()))


def test_out_must_be_16_byte_aligned():
    q, k, v = qkv()
    buf = torch.empty(q.numel() + 8, dtype=q.dtype)
    out = buf[1:q.numel() + 1].view(q.shape)  # contiguous, 2 bytes past an aligned start
    with pytest.raises(ValueError, match="out starts at address .* not 16-byte aligned"):
        ja.attention(q, k, v, V, out=out)
    ja.attention(q, k, v, V, out=buf[8:].view(q.shape))  # 16 bytes in: accepted


def test_lse_needs_only_float_alignment():
    """lse is stored a float at a time: a view 4 bytes into a buffer is taken and filled."""
    q, k, v = qkv()
    want_out, want_lse = ja.attention(q, k, v, V, return_lse=True)
    buf = torch.full((want_lse.numel() + 1,), float("nan"))
    lse = buf[1:].view(want_lse.shape)  # 4 bytes past an aligned start
    out, got = ja.attention(q, k, v, V, lse=lse, return_lse=True)
    assert got.data_ptr() == lse.data_ptr() and torch.equal(got, want_lse)
    assert torch.equal(out, want_out)


def test_lse_sharing_memory_with_out_is_refused():
    """out and lse in one buffer gave NaN (the kernels write both at once): every run() that
    takes an lse refuses it, and ja.attention / SharedPrefixPrefill an lse inside q, k or v
    too; lse right after out in one buffer is fine."""
    i32 = dict(dtype=torch.int32)
    q, k, v = qkv(total_q=12)
    hkv, d = k.shape[1], q.shape[2]
    decode = ja.BatchDecode(V, page_size=4, device="cpu")
    decode.plan(torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32),
                torch.tensor([4, 3], **i32), q.shape[1], hkv, d)
    cache = tuple(torch.randn(2, 4, hkv, d).half() for _ in range(2))
    shared = ja.SharedPrefixPrefill(V, device="cpu")
    shared.plan(3, [7, 2], q.shape[1], hkv, d)
    calls = {"attention": (q, lambda x, o, s: ja.attention(x, k, v, V, out=o, lse=s,
                                                          return_lse=True)),
             "BatchDecode.run": (q[:2], lambda x, o, s: decode.run(x, cache, out=o, lse=s,
                                                                   return_lse=True)),
             "SharedPrefixPrefill.run": (q, lambda x, o, s: shared.run(x, k, v, out=o, lse=s,
                                                                      return_lse=True))}
    for name, (x, call) in calls.items():
        n = x.numel()
        buf = torch.empty(n + 2 * x.shape[0] * x.shape[1], dtype=x.dtype)
        out = buf[:n].view(x.shape)
        overlapping = buf[n - 16:n - 16 + 2 * x.shape[0] * x.shape[1]].view(torch.float32)
        with pytest.raises(ValueError, match=r"lse shares memory with out \(bytes 0x"):
            call(x, out, overlapping.view(x.shape[:2]))
        # an lse inside q (SharedPrefixPrefill's ragged strategy returned NaN); the planned
        # wrappers' run() checks out only (host time per layer)
        if name != "BatchDecode.run":
            inside_q = x.view(torch.float32).reshape(-1)[:x.shape[0] * x.shape[1]]
            with pytest.raises(ValueError, match=r"lse shares memory with q \(bytes 0x"):
                call(x, None, inside_q.view(x.shape[:2]))
        after = buf[n:].view(torch.float32).view(x.shape[:2])
        got = call(x, out, after)
        assert got[0].data_ptr() == out.data_ptr() and got[1].data_ptr() == after.data_ptr()
        torch.testing.assert_close(got, call(x, None, None), rtol=0, atol=0, msg=name)


def test_an_out_sharing_memory_with_the_inputs_is_refused():
    """ja.attention's out was not checked against q, k and v (only lse was): out=k was written
    while other rows' products still read k."""
    q, k, v = (torch.randn(12, 4, 32).half() for _ in range(3))
    for name, t in (("k", k), ("v", v)):
        with pytest.raises(ValueError, match=f"out shares memory with {name} \\(bytes 0x"):
            ja.attention(q, k, v, V, out=t)
    buf = torch.cat([q, q[:1]])
    with pytest.raises(ValueError, match=r"out shares memory with q \(bytes 0x"):
        ja.attention(buf[:-1], k, v, V, out=buf[1:])  # partly: refused
    out = torch.empty_like(q)
    assert ja.attention(q, k, v, V, out=out).data_ptr() == out.data_ptr()


def test_a_planned_runs_out_inside_q_is_refused():
    """BatchPrefill / BatchDecode.run wrote out one row past q (one buffer) while other rows
    still read q: wrong rows."""
    i32 = dict(dtype=torch.int32)
    dec = ja.BatchDecode(V, page_size=4, device="cpu")
    dec.plan(torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32),
             torch.tensor([4, 3], **i32), 4, 2, 32)
    cache = tuple(torch.randn(2, 4, 2, 32).half() for _ in range(2))
    buf = torch.randn(3, 4, 32).half()
    with pytest.raises(ValueError, match=r"out shares memory with q \(bytes 0x"):
        dec.run(buf[:2], cache, out=buf[1:])
    out = torch.empty(2, 4, 32).half()
    assert dec.run(buf[:2], cache, out=out).data_ptr() == out.data_ptr()


def test_hints_for_keywords_and_layouts_of_other_libraries():
    """A new user's first mistakes (session 21's trial from the README): SDPA's / FlashInfer's
    keywords on a jitattn call say where the setting lives, flash-attn's 4-D layout gets its
    own reshape, ja.soft_cap passed uncalled says to call it, a float64 captured tensor is
    named, and a plan() missing its first argument shows where the rest went (Python's error
    named head_dim)."""
    q, k, v = qkv()
    for keyword, where in (("causal", r"the Variant's mask"), ("is_causal", r"the Variant's mask"),
                           ("logits_soft_cap", r"score_mod=ja\.soft_cap\(cap\)"),
                           ("q_scale", r"fold q's scale into sm_scale")):
        with pytest.raises(ValueError, match=rf"\['{keyword}'\] .*; {keyword}= is .*{where}"):
            ja.attention(q, k, v, V, **{keyword: 1.0})
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]: q\.reshape\("):
        ja.attention(q[None], k, v, V)
    with pytest.raises(ja.SpecError, match=r"pass its result, e\.g\. score_mod=ja\.soft_cap\("):
        ja.Variant("uncalled", mask="causal", score_mod=ja.soft_cap)
    wide = torch.ones(8, dtype=torch.float64)
    with pytest.raises(ja.SpecError, match=r"captured tensor 'wide' of dtype torch\.float64"):
        ja.Variant("wide", mask="causal", score_mod=lambda s, b, h, qi, ki: s + wide[h])
    i32 = dict(dtype=torch.int32)
    w = ja.BatchPrefill(V, page_size=16, device="cpu")
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'head_dim': "
                                        r"the positional arguments were taken as qo_indptr="
                                        r"<tensor of shape \(3,\)>, .* num_kv_heads=64$"):
        w.plan(torch.tensor([0, 4, 8], **i32), torch.tensor([0, 1, 2], **i32),
               torch.tensor([1, 2], **i32), 8, 2, 64)
    d = ja.BatchDecode(V, page_size=16, device="cpu")
    d.plan(torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([5], **i32),
           8, 2, 64)
    cache = tuple(torch.randn(1, 16, 2, 64).half() for _ in range(2))
    with pytest.raises(ValueError, match=r"sm_scale= is plan\(\)'s for a planned wrapper"):
        d.run(torch.randn(1, 8, 64).half(), cache, sm_scale=0.1)


def test_a_planned_run_refuses_lse_inside_q_and_plan_refuses_huge_head_counts():
    """BatchDecode.run(lse=) with lse inside q's memory (the kernels write lse while other rows
    still read q: a wrong row, silently) is refused as ja.attention refuses it; head counts
    past MAX_HEADS are refused before the planner (2**31 heads allocated 16 GiB)."""
    i32 = dict(dtype=torch.int32)
    kc, vc = (torch.randn(2, 16, 2, 64).half() for _ in range(2))
    w = ja.BatchDecode(V, page_size=16, device="cpu")
    w.plan(torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32),
           torch.tensor([16, 16], **i32), 8, 2, 64)
    buf = torch.randn(2 * 8 * 64).half()
    with pytest.raises(ValueError, match="lse shares memory with q"):
        w.run(buf.view(2, 8, 64), (kc, vc), lse=buf.view(torch.float32)[-16:].view(2, 8))
    for heads in ((2**32, 2**31), (2**16, 1)):
        with pytest.raises(ValueError, match=r"num_qo_heads=\d+: expected an int in 1 \.\. "
                                             r"65535"):
            w.plan(torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
                   torch.tensor([3], **i32), *heads, 64)


def test_out_may_be_q_itself():
    check_out_is_q("cpu")


def test_a_misspelt_keyword_is_named():
    """A misspelt keyword of the call lands among the variant's parameters: say which."""
    q, k = torch.randn(2, 4, 64).half(), torch.randn(3, 2, 64).half()
    with pytest.raises(ValueError, match=r"unexpected parameter\(s\) \['retrun_lse'\] for "
                                         r"variant 'plain' \(a keyword the call does not take "
                                         r"is read as the variant's runtime parameter\); it "
                                         r"takes none; did you mean return_lse=\?"):
        ja.attention(q, k, k, ja.Variant("plain"), retrun_lse=True)
    # no hint that names the keyword itself, nor a second one after sm_scale's
    with pytest.raises(ValueError, match=r"\['v_scale'\] for variant 'plain' .*; it takes none; "
                                         r"v_scale= is not a keyword of this call$"):
        ja.attention(q, k, k, ja.Variant("plain"), v_scale=2.0)
    with pytest.raises(ValueError, match=r"\(the softmax scale is the sm_scale= argument\)$"):
        ja.attention(q, k, k, ja.Variant("plain"), scale=0.1)
    # flash-attn's and FlashInfer's keywords: where each lives here
    for kwargs, match in ((dict(kv_layout="NHD"), "kv_layout= is the batch wrappers'"),
                          (dict(cu_seqlens_q=None), "cu_seqlens_q= is qo_indptr= here"),
                          (dict(softmax_scale=0.1), "softmax_scale= is sm_scale= here"),
                          (dict(window_size=(4, -1)), "window_size= is the Variant's "
                                                      "window_left")):
        with pytest.raises(ValueError, match=match):
            ja.attention(q, k, k, ja.Variant("plain"), **kwargs)


def test_a_function_where_a_variant_goes_gets_a_hint():
    """FlexAttention's score_mod / mask_mod passed where jitattn takes a Variant (or as
    Variant's positional name or mask): each error says where the function goes."""
    q, k = torch.randn(2, 4, 64).half(), torch.randn(3, 2, 64).half()

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * ja.tanh(score / 20.0)
    where = r"jitattn.Variant\(score_mod=f, mask='none'\)"
    with pytest.raises(TypeError, match=r"variant must be a jitattn.Variant, got function .*"
                                        + where):
        ja.attention(q, k, k, softcap)
    with pytest.raises(TypeError, match=r"attention\(\) takes a Variant.*" + where):
        ja.attention(q, k, k, score_mod=softcap)
    with pytest.raises(TypeError, match="variant must be a jitattn.Variant, got function"):
        ja.BatchPrefill(softcap, device="cpu")
    # a mask function's hint leads with mask_mod=; SDPA's is_causal / FlashInfer's causal
    # without a Variant say which mask (the Variant's)
    for kw, want in ((dict(mask_mod=softcap), r"not mask_mod=: .*Variant\(mask_mod=f, "
                                              r"mask='none'\)"),
                     (dict(causal=True), r"not causal=: .*Variant\(mask='causal'\)"),
                     (dict(is_causal=False), r"not is_causal=: .*Variant\(mask='none'\)"),
                     (dict(score_mod=softcap, is_causal=True),
                      r"not is_causal= / score_mod=: .*Variant\(score_mod=f, "
                      r"mask='causal'\)")):
        with pytest.raises(TypeError, match=r"attention\(\) takes a Variant, " + want):
            ja.attention(q, k, k, **kw)
    for args in ((softcap,), ("softcap", softcap)):
        with pytest.raises(ja.SpecError, match=r"the positional arguments are name, then mask: "
                                               r"pass a function as score_mod= or mask_mod="):
            ja.Variant(*args)


def test_flags_must_be_bools():
    """A string flag counted as true (return_lse="no" returned a tuple)."""
    q, k = torch.randn(2, 4, 64).half(), torch.randn(3, 2, 64).half()
    with pytest.raises(TypeError, match=r"return_lse='no': expected True or False"):
        ja.attention(q, k, k, ja.Variant("plain"), return_lse="no")
    with pytest.raises(TypeError, match=r"split_kv='no': expected True or False"):
        ja.BatchDecode(ja.Variant("plain"), device="cpu", split_kv="no")
    w = ja.BatchDecode(ja.Variant("plain"), page_size=4, device="cpu")
    i32 = dict(dtype=torch.int32)
    w.plan(torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([3], **i32),
           4, 2, 64)
    cache = tuple(torch.randn(1, 4, 2, 64).half() for _ in range(2))
    with pytest.raises(TypeError, match=r"return_lse=1: expected True or False"):
        w.run(q[:1], cache, return_lse=1)
    assert len(w.run(q[:1], cache, return_lse=np.bool_(True))) == 2
    with pytest.raises(ja.SpecError, match=r"returned something other than an expression "
                                           r"\(None: is its return statement missing\?\): "
                                           r"cannot use NoneType"):
        ja.Variant("none", mask="causal", score_mod=lambda s, b, h, q_idx, kv_idx: None)


def test_numpy_numbers_are_numbers_and_counts_are_checked_up_front():
    """numpy ints / floats were refused with a wrong reason ("expected an int >= 1", "expected
    a finite number > 0"); head_dim=64.0 passed plan() and failed inside run(); capacities were
    not checked until plan() (or never: max_batch_size=-1)."""
    import numpy as np
    i32 = dict(dtype=torch.int32)
    variant = ja.Variant("c", mask="causal")
    args = (torch.tensor([0, 2, 4], **i32), torch.arange(4, **i32), torch.tensor([5, 16], **i32))
    cache = tuple(torch.randn(4, 16, 2, 64).half() for _ in range(2))
    q = torch.randn(2, 8, 64).half()
    w = ja.BatchDecode(variant, page_size=np.int64(16), device="cpu")
    w.plan(*args, np.int64(8), np.int32(2), np.int64(64), sm_scale=np.float32(0.125))
    ref = ja.BatchDecode(variant, page_size=16, device="cpu")
    ref.plan(*args, 8, 2, 64, sm_scale=0.125)
    torch.testing.assert_close(w.run(q, cache), ref.run(q, cache), rtol=0, atol=0)
    k = torch.randn(3, 2, 64).half()
    torch.testing.assert_close(ja.attention(q, k, k, variant, sm_scale=np.float32(0.5)),
                               ja.attention(q, k, k, variant, sm_scale=0.5), rtol=0, atol=0)
    torch.testing.assert_close(w.run(q, cache, k_scale=np.float32(0.5)),
                               ref.run(q, cache, k_scale=0.5), rtol=0, atol=0)
    assert ja.Variant("w", window_left=np.int64(4)).window_left == 4
    with pytest.raises(TypeError, match=r"head_dim=64.0: expected an int >= 1"):
        w.plan(*args, 8, 2, 64.0)
    with pytest.raises(ValueError, match=r"head_dim=48: expected one of"):
        w.plan(*args, 8, 2, 48)
    for name, value, error in (("max_num_pages", "x", TypeError), ("page_size", 16.0, TypeError),
                               ("max_batch_size", 0, ValueError),
                               ("max_partial_rows", -1, ValueError)):
        with pytest.raises(error, match=f"{name}={value!r}: expected an int >= "):
            ja.BatchDecode(variant, device="cpu", **{name: value})
    with pytest.raises(ValueError, match=r"sm_scale=1000.*: expected a finite number > 0"):
        ja.attention(q, k, k, variant, sm_scale=10**400)
    # without room for partial rows (or mask bytes, item tokens) a long request is not split
    long = (torch.tensor([0, 2000], **i32), torch.arange(2000, **i32), torch.tensor([16], **i32))
    cache = tuple(torch.randn(2000, 16, 2, 64).half() for _ in range(2))
    q = torch.randn(1, 8, 64).half()
    ref.plan(*long, 8, 2, 64)
    lean = ja.BatchDecode(variant, device="cpu", max_partial_rows=0, max_mask_bytes=0,
                          max_item_tokens=0)
    lean.plan(*long, 8, 2, 64)
    assert ref._plan.num_partial_rows > 0 and lean._plan.num_partial_rows == 0
    torch.testing.assert_close(lean.run(q, cache), ref.run(q, cache), rtol=1e-3, atol=1e-3)


def test_strides_beyond_int32_are_refused_on_the_cpu_too():
    """The kernels take q's head stride and K/V's slot / head strides as int32: on the CPU
    backend a head stride of 2**32 + 64 wrapped to 64 and head 1 read head 0's keys (CUDA
    refused it already). Views into lazily committed 8 GiB buffers: a few KiB are touched."""
    n, d = 8, 64
    big = torch.empty(2**32 + 64 + 2 * n * d, dtype=torch.float16)
    wide = big.as_strided((n, 2, d), (d, 2**32 + 64, 1))
    wide.copy_(torch.randn(n, 2, d).half())
    v = torch.randn(n, 2, d).half()
    dec = ja.BatchDecode(ja.Variant("c", mask="causal"), kv_layout="ragged", device="cpu")
    dec.plan(torch.tensor([0, n], dtype=torch.int32), None, None, 2, 2, d)
    with pytest.raises(ValueError, match=r"K's head stride is 4294967360 elements; the kernels "
                                         r"address it in int32: expected below 2\*\*31"):
        dec.run(torch.randn(1, 2, d).half(), (wide, v))
    q = big[:2 * d].as_strided((1, 2, d), (2 * d, 2**32 + 64, 1))
    with pytest.raises(ValueError, match=r"q's head stride is 4294967360 elements"):
        ja.attention(q, v[:1], v[:1], ja.Variant("c", mask="causal"))
    del wide, q, big


def test_a_request_of_2_to_the_32_keys_is_refused_not_wrapped():
    """kv lengths were computed in int32 from the page counts: 2**16 pages of 2**16 tokens (one
    page listed again and again) wrapped to 0 keys (an output of zeros) or, with a shorter last
    page, below 0 (the CPU kernel aborted the process)."""
    i32 = dict(dtype=torch.int32)
    dec = ja.BatchDecode(ja.Variant("n", mask="none"), page_size=1 << 16, device="cpu")
    for last in (1 << 16, 5):
        with pytest.raises(ValueError, match=f"a request has {(2**16 - 1) * 2**16 + last} key "
                                             f"tokens; expected fewer than"):
            dec.plan(torch.tensor([0, 1 << 16], **i32), torch.zeros(1 << 16, **i32),
                     torch.tensor([last], **i32), 1, 1, 32)


def test_tables_sized_by_an_empty_length_are_bound():
    """A ("kv_len",) / ("qo_len",) table is empty when the batch has no keys / queries: it was
    refused (every shape was), and an empty one passed to the kernel would have been read where
    a query row's part is hoisted (a segfault on the CPU backend)."""
    t = ja.tensor("t", ("kv_len",), "float32")
    u = ja.tensor("u", ("qo_len",), "float32")
    variant = ja.Variant("empty_len", mask="causal",
                         score_mod=lambda s, b, h, q, k: s * t[q] + u[k])
    q, no_keys = torch.randn(3, 4, 64).half(), torch.randn(0, 1, 64).half()
    out, lse = ja.attention(q, no_keys, no_keys, variant, t=torch.ones(0), u=torch.ones(3),
                            return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()
    keys = torch.randn(5, 1, 64).half()
    out = ja.attention(q[:0], keys, keys, variant, t=torch.ones(5), u=torch.ones(0))
    assert out.shape == (0, 4, 64)
    with pytest.raises(ValueError, match=r"parameter 't' has shape \(1,\), expected \(0,\)"):
        ja.attention(q, no_keys, no_keys, variant, t=torch.ones(1), u=torch.ones(3))


def test_the_transpose_hint_only_where_it_would_help():
    q, k = torch.randn(5, 3, 64).half(), torch.randn(4, 2, 64).half()
    with pytest.raises(ValueError, match=r"got q \(5, 3, 64\), k \(4, 2, 64\)\)$"):
        ja.attention(q, k, k, V)
    with pytest.raises(ValueError, match=r"if they are \[heads, tokens, head_dim\], "
                                         r"\.transpose\(0, 1\) them"):
        ja.attention(q[:4], k, k, V)
    with pytest.raises(ValueError, match=r"got q \(0, 3, 64\), k \(4, 2, 64\)\)$"):
        ja.attention(q[:0], k, k, V)


def test_flashinfer_plan_keywords_say_where_they_live():
    """FlashInfer's plan() keywords were bare "unexpected keyword argument" TypeErrors."""
    i32 = dict(dtype=torch.int32)
    dec = ja.BatchDecode(V, page_size=4, device="cpu")
    args = (torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([4], **i32), 4,
            2, 32)
    for keyword, where in (("logits_soft_cap", r"the Variant's score_mod \(score_mod=ja\.soft_cap"),
                           ("q_data_type", "q_dtype= here"),
                           ("page_size", r"the constructor's \(BatchDecode\(variant, page_size")):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}': "
                                            f"{keyword}= is {where}"):
            dec.plan(*args, **{keyword: 1})
    prefill = ja.BatchPrefill(V, page_size=4, device="cpu")
    with pytest.raises(TypeError, match=r"causal= is the Variant's mask"):
        prefill.plan(torch.tensor([0, 1], **i32), *args, causal=True)
    with pytest.raises(TypeError, match=r"\(BatchPrefill\(variant, page_size=16\)\)"):
        prefill.plan(torch.tensor([0, 1], **i32), *args, page_size=16)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'$"):
        dec.plan(*args, bogus=1)
    assert dec.plan(*args) is not None  # (plan itself unchanged)
    # FlashInfer's names of the page-table arguments; several unknown keywords are all named,
    # each hint beside its own (one named 'qo_indptr_arr' and explained page_size=)
    with pytest.raises(TypeError, match=r"^BatchDecode\.plan\(\) got unexpected keyword "
                                        r"arguments \['indptr', 'indices'\]: indptr= is "
                                        r"kv_indptr= here; indices= is kv_indices= here"):
        dec.plan(indptr=args[0], indices=args[1], kv_last_page_len=args[2], num_qo_heads=4,
                 num_kv_heads=2, head_dim=32)
    cascade = ja.MultiLevelCascade(V, 2, device="cpu")
    with pytest.raises(TypeError, match=r"arguments \['qo_indptr_arr', 'page_size'\]: "
                                        r"qo_indptr_arr= is qo_indptr= here \(a list: one tensor "
                                        r"per level\); page_size= is the constructor's"):
        cascade.plan(qo_indptr_arr=[], page_size=16)
    with pytest.raises(TypeError, match=r"paged_kv_indptr_arr= is unique_kv_indptr= here "
                                        r"\(each request's own pages; the shared prefix's are "
                                        r"shared_kv_indices=\)"):
        ja.CascadeDecode(V, device="cpu").plan(paged_kv_indptr_arr=[])
    with pytest.raises(TypeError, match=r"qo_indptr_arr= is qo_indptr= here \(README"):
        ja.BatchPrefill(V, device="cpu").plan(qo_indptr_arr=[])  # (one tensor, not per level)
    with pytest.raises(TypeError, match=r"got unexpected keyword arguments \['bogus', "
                                        r"'bogus2'\]$"):
        dec.plan(*args, bogus=1, bogus2=2)
    # a prefill plan's qo_indptr first (its page_size hint blamed head_dim's 32)
    with pytest.raises(TypeError, match=r"BatchDecode\.plan\(\) takes no qo_indptr \(one query "
                                        r"per request\): plan\(kv_indptr, kv_indices, "):
        dec.plan(torch.tensor([0, 1], **i32), *args)


def test_a_wrapper_on_cpu_0_names_the_real_problem():
    """device="cpu:0" kept its index, and every check after a failed fast path then said
    "q and k_cache are on cpu / cpu; the wrapper was built for cpu:0" instead of what was
    wrong (here: a cache one page short)."""
    i32 = dict(dtype=torch.int32)
    decode = ja.BatchDecode(ja.Variant("c", mask="causal"), page_size=4, device="cpu:0")
    assert decode.device == torch.device("cpu")
    decode.plan(torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32),
                torch.tensor([3], **i32), 8, 2, 64)
    q = torch.randn(1, 8, 64).half()
    cache = torch.randn(2, 4, 2, 64).half()
    with pytest.raises(ValueError, match=r"the plan refers to page 1 \(the largest entry of "
                                         r"plan\(\)'s kv_indices\) but k_cache has 1 pages"):
        decode.run(q, (cache[:1], cache))
    assert decode.run(q, (cache, cache)).shape == q.shape
    # a level of a cascade says which (a page past the cache was only caught at run())
    mlc = ja.MultiLevelCascade(ja.Variant("c", mask="causal"), 2, page_size=4, device="cpu")
    one = torch.tensor([0, 1], **i32)
    mlc.plan([one, one], [one, one], [torch.tensor([0], **i32), torch.tensor([1], **i32)],
             [torch.tensor([4], **i32), torch.tensor([2], **i32)], 8, 2, 64)
    with pytest.raises(ValueError, match=r"level 1: the plan refers to page 1 \(the largest "
                                         r"entry of plan\(\)'s kv_indices\) but k_cache"):
        mlc.run(q, (cache[:1], cache[:1]))
    assert mlc.run(q, (cache, cache)).shape == q.shape
    cd = ja.CascadeDecode(ja.Variant("c", mask="causal"), page_size=4, strategy="cascade",
                          device="cpu")
    cd.plan(torch.tensor([0], **i32), 4, one, torch.tensor([1], **i32),
            torch.tensor([2], **i32), 8, 2, 64)
    with pytest.raises(ValueError, match=r"the requests' own level \(unique_kv_indices\): the "
                                         r"plan refers to page 1"):
        cd.run(q, (cache[:1], cache[:1]))


def test_index_tensors_and_request_containers_are_named_when_refused():
    """A meta or sparse index tensor failed inside torch / numpy without naming the argument;
    an empty shared_kv_indices is fine, so a 2-D one is not refused as "non-empty"; plain
    decode's page count includes the prefix copied into every request's table, which the
    capacity error now says; a set or dict of requests has no order to name groups by."""
    i32 = dict(dtype=torch.int32)
    decode = ja.BatchDecode(ja.Variant("c", mask="causal"), page_size=4, device="cpu")
    indptr, indices, last = (torch.tensor(x, **i32) for x in ([0, 2, 3], [0, 1, 2], [1, 2]))
    with pytest.raises(ValueError, match="kv_indptr is on the meta device"):
        decode.plan(indptr.to("meta"), indices, last, 8, 2, 64)
    with pytest.raises(ValueError, match="kv_indptr is a torch.sparse_coo tensor; expected a "
                                         "dense one"):
        decode.plan(indptr.to_sparse(), indices, last, 8, 2, 64)
    cascade = ja.CascadeDecode(ja.Variant("c", mask="causal"), page_size=4, device="cpu")
    with pytest.raises(ValueError, match="shared_kv_indices must be a 1-D tensor, got shape"):
        cascade.plan(torch.tensor([[5, 6]], **i32), 4, indptr, indices, last, 8, 2, 64)
    plain = ja.CascadeDecode(ja.Variant("c", mask="causal"), page_size=4, strategy="plain",
                             device="cpu", max_num_pages=6)
    with pytest.raises(ValueError, match="the batch uses 11 pages.*prefix's 4 pages in each of "
                                         "the 2 requests' tables, before their own 3"):
        plain.plan(torch.tensor([3, 4, 5, 6], **i32), 4, indptr, indices, last, 8, 2, 64)
    for requests in ({(1, 2, 3, 9), (1, 2, 3, 8)}, {"a": [1, 2, 3], "b": [1, 2, 4]}):
        with pytest.raises(TypeError, match="expected the requests in order"):
            ja.find_shared_prefixes(requests, 1)


def test_the_reference_names_the_mask_data_a_custom_or_multi_item_mask_needs():
    """reference.attention of a custom or multi-item mask without mask_data failed inside
    ("'NoneType' object is not subscriptable"), and custom_mask= as plan() takes it was
    refused as an unknown variant parameter."""
    from jitattn import reference
    q, k = torch.randn(5, 2, 16), torch.randn(7, 2, 16)
    custom = ja.Variant("cm", mask="custom")
    with pytest.raises(ValueError, match=r"mask_data=\{'custom_mask': ...\} \(missing"):
        reference.attention(q, k, k, custom)
    with pytest.raises(ValueError, match=r"got \['custom_mask'\] as keywords"):
        reference.attention(q, k, k, custom, custom_mask=torch.ones(35, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"missing \['token_pos_in_items'\]"):
        reference.attention(q, k, k, ja.Variant("mi", mask="multi_item"),
                            mask_data={"prefix_len": torch.tensor([3])})
    full = reference.attention(q, k, k, ja.Variant("f", mask="none"))
    torch.testing.assert_close(
        reference.attention(q, k, k, custom, mask_data={"custom_mask": torch.ones(35) > 0}), full)


def test_flashinfer_positional_plan_calls_get_hints():
    """FlashInfer's plan() takes page_size after head_dim, and its ragged wrapper has no page
    table arguments: ported calls got Python's bare "takes 8 positional arguments but 9 were
    given" / "missing 2 required positional arguments"."""
    i32 = dict(dtype=torch.int32)
    causal = ja.Variant("c", mask="causal")
    qo, kv, idx, last = (torch.tensor(x, **i32) for x in ([0, 3], [0, 1], [0], [5]))
    with pytest.raises(TypeError, match=r"the argument after head_dim \(16\) would be "
                                        r"FlashInfer's page_size.*BatchPrefill\(variant, "
                                        r"page_size=16\)"):
        ja.BatchPrefill(causal, device="cpu").plan(qo, kv, idx, last, 4, 2, 64, 16)
    with pytest.raises(TypeError, match=r"plan\(qo_indptr, kv_indptr, None, None, "
                                        r"num_qo_heads, num_kv_heads, head_dim\)"):
        ja.BatchPrefill(causal, kv_layout="ragged", device="cpu").plan(qo, kv, 4, 2, 64)
    with pytest.raises(TypeError) as plain:  # (no hint where none applies)
        ja.SharedPrefixPrefill(causal, "ragged", device="cpu").plan(8, [2], 4, 2, 64, 1)
    assert "FlashInfer" not in str(plain.value)


def test_flashinfer_shaped_constructor_and_run_calls_get_hints():
    """FlashInfer's wrappers take a workspace buffer first (its cascade wrapper num_levels)
    and the layout second, and its ragged run() takes k and v apart: ported calls were refused
    as "got Tensor" ("got int"), "page_size='NHD': expected an int" and "takes 3 positional
    arguments but 4 were given"."""
    causal = ja.Variant("c", mask="causal")
    workspace = torch.empty(16, dtype=torch.uint8)
    for wrapper in (ja.BatchPrefill, ja.BatchDecode, ja.CascadeDecode):
        with pytest.raises(TypeError, match=f"got Tensor \\(FlashInfer's wrappers take a "
                                            f"workspace buffer first.*{wrapper.__name__}"):
            wrapper(workspace, device="cpu")
    with pytest.raises(TypeError, match=r"got int \(FlashInfer's cascade wrapper takes "
                                        r"num_levels first; jitattn's take the Variant first: "
                                        r"MultiLevelCascade\(variant, num_levels, \.\.\.\)\)"):
        ja.MultiLevelCascade(2, workspace, "NHD", device="cpu")
    with pytest.raises(TypeError, match=r"^variant must be a jitattn.Variant, got int$"):
        ja.BatchDecode(16, device="cpu")  # (that hint is the cascade's alone)
    with pytest.raises(TypeError, match="the layout is the argument after it \\(BatchPrefill"
                                        "\\(variant, page_size=16, kv_layout='NHD'\\)\\)"):
        ja.BatchPrefill(causal, "NHD", device="cpu")
    i32 = dict(dtype=torch.int32)
    ragged = ja.BatchPrefill(causal, kv_layout="ragged", device="cpu")
    ragged.plan(torch.tensor([0, 3], **i32), torch.tensor([0, 5], **i32), None, None, 4, 2, 64)
    q, k = torch.randn(3, 4, 64).half(), torch.randn(5, 2, 64).half()
    with pytest.raises(TypeError, match=r"run\(q, \(k, v\)\) or run\(q, kv_cache\)"):
        ragged.run(q, k, k)
    with pytest.raises(ValueError, match="q is on meta, k_cache on cpu; the wrapper was built "
                                         "for cpu"):
        ragged.run(q.to("meta"), (k, k))
    torch.testing.assert_close(ragged.run(q, (k, k)).float(),
                               ja.attention(q, k, k, causal).float(), rtol=0, atol=0)


def test_flashinfer_hints_name_the_right_constructor_and_only_where_they_apply():
    """Review of the hints: MultiLevelCascade's needs num_levels (the hint suggested a call
    that fails); the cascades' layout hint named BatchPrefill; a ragged plan has no page_size,
    so an argument after head_dim is not one."""
    i32 = dict(dtype=torch.int32)
    causal = ja.Variant("c", mask="causal")
    ml = ja.MultiLevelCascade(causal, 2, device="cpu")
    with pytest.raises(TypeError, match=r"MultiLevelCascade\(variant, num_levels, "
                                        r"page_size=16\)"):
        ml.plan([], [], [], [], 4, 2, 64, page_size=16)
    with pytest.raises(TypeError, match=r"\(CascadeDecode\(variant, page_size=16, "
                                        r"kv_layout='NHD'\)\)"):
        ja.CascadeDecode(causal, "NHD", device="cpu")
    with pytest.raises(TypeError, match=r"\(MultiLevelCascade\(variant, num_levels, "
                                        r"page_size=16, kv_layout='HND'\)\)"):
        ja.MultiLevelCascade(causal, 2, "HND", device="cpu")
    ragged = ja.BatchPrefill(causal, kv_layout="ragged", device="cpu")
    qo, kv = torch.tensor([0, 3], **i32), torch.tensor([0, 5], **i32)
    with pytest.raises(TypeError) as extra:
        ragged.plan(qo, kv, None, None, 4, 2, 64, 64)
    assert "page_size" not in str(extra.value)
    with pytest.raises(ValueError, match=r"kv_indices must be a list of 2 tensors \(None for a "
                                         r"ragged layout\), one per level"):
        ja.MultiLevelCascade(causal, 2, kv_layout="ragged", device="cpu").plan(
            [qo, qo], [kv, kv], None, [None, None], 4, 2, 64)


def test_flashinfer_constructor_keywords_say_where_they_went():
    """FlashInfer's wrapper constructors take use_cuda_graph, use_tensor_cores, backend and
    preallocated *_buf / *_buffer tensors; jitattn's gave Python's bare "unexpected keyword
    argument" (BatchPrefill) or a list of its own keywords with no word on those."""
    causal = ja.Variant("c", mask="causal")
    with pytest.raises(TypeError, match=r"BatchPrefill\(\) got unexpected keyword arguments "
                                        r"\['paged_kv_indptr_buf', 'use_cuda_graph'\]; it takes "
                                        r"\['page_size', .*'query_tile'\] \(use_cuda_graph= is "
                                        r"not needed.*paged_kv_indptr_buf= is the wrapper's own "
                                        r"buffer"):
        ja.BatchPrefill(causal, device="cpu", use_cuda_graph=True,
                        paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"use_tensor_cores= is chosen per device"):
        ja.BatchDecode(causal, device="cpu", use_tensor_cores=True)
    with pytest.raises(TypeError, match=r"backend= is chosen per device"):
        ja.MultiLevelCascade(causal, 2, device="cpu", backend="fa3")
    with pytest.raises(TypeError) as plain:  # (a misspelling gets the list, no FlashInfer word)
        ja.BatchPrefill(causal, device="cpu", max_batch=8)
    assert "FlashInfer" not in str(plain.value) and "'max_batch_size'" in str(plain.value)


def test_more_flashinfer_plan_keywords_get_hints():
    """data_type=, non_blocking= and head_dim_qk= / head_dim_vo= (FlashInfer's plan()) were
    Python's bare "unexpected keyword argument" (a new user's port)."""
    i32 = dict(dtype=torch.int32)
    decode = ja.BatchDecode(ja.Variant("c", mask="causal"), device="cpu")
    args = (torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([3], **i32), 4, 2)
    for kwargs, text in ((dict(head_dim=64, data_type=torch.float16), "data_type= is q_dtype="),
                         (dict(head_dim=64, non_blocking=True), "non_blocking= is not needed"),
                         (dict(head_dim_qk=64), "head_dim_qk= is head_dim= here")):
        with pytest.raises(TypeError, match=text):
            decode.plan(*args, **kwargs)


def test_every_entry_point_warns_that_outputs_do_not_track_gradients():
    """attention() warned that it has no backward; the wrappers' run() and merge_state
    returned outputs without gradients in silence."""
    i32 = dict(dtype=torch.int32)
    variant = ja.Variant("plain", mask="causal")
    q = torch.randn(3, 4, 64).half().requires_grad_()
    cache = tuple(torch.randn(2, 16, 2, 64).half() for _ in range(2))
    w = ja.BatchPrefill(variant, page_size=16, device="cpu")
    w.plan(torch.tensor([0, 3], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
           torch.tensor([5], **i32), 4, 2, 64)
    sp = ja.SharedPrefixPrefill(variant, "ragged", device="cpu")
    sp.plan(2, [1], 4, 2, 64)
    kv = torch.randn(3, 2, 64).half()
    o, lse = torch.randn(3, 4, 64), torch.randn(3, 4)
    grad_cache = (cache[0].clone().requires_grad_(), cache[1])  # (a cache alone: the eager
    #                                               run() said nothing, the compiled one warned)
    cd = ja.CascadeDecode(variant, page_size=16, device="cpu", strategy="cascade")
    cd.plan(torch.tensor([0], **i32), 5, torch.tensor([0, 1], **i32), torch.tensor([1], **i32),
            torch.tensor([3], **i32), 4, 2, 64)
    for call, fn in (("BatchPrefill.run", lambda: w.run(q, cache)),
                     ("BatchPrefill.run", lambda: w.run(q.detach(), grad_cache)),
                     ("CascadeDecode.run", lambda: cd.run(q[:1].detach(), grad_cache)),
                     ("SharedPrefixPrefill.run", lambda: sp.run(q, kv, kv)),
                     ("merge_state", lambda: ja.merge_state(o.requires_grad_(), lse, o, lse))):
        with pytest.warns(UserWarning, match=f"{call} has no backward"):
            fn()
    import warnings
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # (without grad: nothing to say)
        w.run(q, cache)


def test_plan_errors_show_what_they_got():
    """A 2-D custom_mask was refused without its shape; a paged wrapper's plan() given None
    page tables (a ragged plan's) said only NoneType."""
    i32 = dict(dtype=torch.int32)
    args = (torch.tensor([0, 5], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
            torch.tensor([7], **i32), 4, 2, 64)
    w = ja.BatchPrefill(ja.Variant("c", mask="custom"), page_size=16, device="cpu")
    with pytest.raises(TypeError, match=r"got a tensor of shape \(5, 7\) and dtype torch.bool"):
        w.plan(*args, custom_mask=torch.ones(5, 7, dtype=torch.bool))
    w = ja.BatchPrefill(ja.Variant("c", mask="causal"), page_size=16, device="cpu")
    with pytest.raises(TypeError, match=r"kv_indices must be a torch.Tensor of int32, got "
                                        r"NoneType \(None is a ragged layout's"):
        w.plan(args[0], torch.tensor([0, 7], **i32), None, None, 4, 2, 64)


def test_other_libraries_keywords_say_where_they_live():
    """Variant(causal=True), BatchDecode(variant, sm_scale=...) were bare TypeErrors (the
    dataclass's, or a list of accepted keywords)."""
    with pytest.raises(TypeError, match=r"Variant\(\) got unexpected keyword arguments "
                                        r"\['causal'\]; it takes \['name', 'mask', .*causal= "
                                        r"is mask='causal'"):
        ja.Variant("x", causal=True)
    with pytest.raises(TypeError, match="sliding_window= is window_left="):
        ja.Variant(sliding_window=4)
    with pytest.raises(TypeError, match=r"sm_scale= is plan\(\)'s"):
        ja.BatchDecode(ja.Variant("p"), device="cpu", sm_scale=0.1)
    with pytest.raises(TypeError, match="causal= is the Variant's mask"):
        ja.BatchPrefill(ja.Variant("p"), device="cpu", causal=True)
    with pytest.warns(UserWarning) as record:  # (the warning points at the caller's line)
        ja.Variant(score_mod=lambda s, b, h, q, k: s)
    assert record[0].filename == __file__


def test_review_cases_of_grad_subclasses_and_hints():
    """A review's cases: an out that requires grad would keep a stale autograd history (now
    refused, as torch refuses out= there); a tensor subclass q gave an output of its
    subclass (empty_like); the cascades' constructors pointed kv_dtype= at a plan() keyword
    they do not have."""
    import warnings
    variant = ja.Variant("c", mask="causal")
    q, k = torch.randn(5, 4, 64).half(), torch.randn(7, 2, 64).half()
    out = (q.float().requires_grad_() * 1.0).half()
    with pytest.raises(ValueError, match="out requires grad; jitattn writes it without "
                                         "autograd"):
        ja.attention(q, k, k, variant, out=out)
    with torch.no_grad():
        ja.attention(q, k, k, variant, out=out)  # (no autograd: nothing goes stale)

    class Sub(torch.Tensor):
        pass
    assert type(ja.attention(q.as_subclass(Sub), k, k, variant)) is torch.Tensor
    with pytest.raises(TypeError, match="kv_dtype= is not taken here: the caches are read in "
                                        "q's dtype"):
        ja.CascadeDecode(variant, device="cpu", kv_dtype=torch.float16)
    lse = torch.randn(4, 2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning that outputs do not track gradients)
        empty = torch.zeros(4, 2, 0)
        torch.testing.assert_close(ja.merge_state(empty, lse, empty.clone(), lse.detach())[1],
                                   lse.detach() + math.log(2))
    with pytest.raises(ValueError, match="merge_state_in_place: lse requires grad"):
        ja.merge_state_in_place(empty, lse, empty.clone(), lse.detach().clone())


def test_the_reference_refuses_indptrs_and_page_tables_that_do_not_fit():
    """The oracle took kv_indptr = [0, 5, 50] over 10 keys and an HND cache read as NHD
    (page_size from its head axis) without a word, and compared kernels with garbage."""
    from jitattn import reference
    q, k, v = qkv(total_q=3, total_kv=10)
    for kw, text in ((dict(qo_indptr=torch.tensor([0, 1, 3]), kv_indptr=torch.tensor([0, 5, 50])),
                      r"kv_indptr = \[0, 5, 50\].*ending at k's rows \(10\)"),
                     (dict(qo_indptr=torch.tensor([0, 2])), r"qo_indptr = \[0, 2\].*\(3\)"),
                     (dict(qo_indptr=torch.tensor([0, 2, 1, 3]), kv_indptr=torch.tensor(
                         [0, 3, 4, 10])), "never decreasing"),
                     (dict(qo_indptr=torch.tensor([0, 3]), kv_indptr=torch.tensor([0, 4, 10])),
                      "1 requests in qo_indptr and 2 in kv_indptr")):
        with pytest.raises(ValueError, match=text):
            reference.attention(q, k, v, V, **kw)
    k_cache = torch.randn(4, 2, 16, 64)  # HND: [pages, heads, page_size, head_dim]
    tables = (torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([3, 1, 0],
              dtype=torch.int32), torch.tensor([14, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] = 14: expected 1..page_size "
                       r"\(2 in k_cache's NHD pages \(4, 2, 16, 64\)\).*kv_layout='HND'"):
        reference.paged_to_ragged((k_cache, k_cache), *tables)
    k, _, tokens = reference.paged_to_ragged((k_cache, k_cache), *tables, kv_layout="HND")
    assert k.shape == (46, 2, 64) and tokens.tolist() == [0, 30, 46]
    torch.testing.assert_close(k[:16], k_cache[3].transpose(0, 1))
    for bad, text in (((tables[0], torch.tensor([3, 9, 0]), tables[2]),
                       r"request 0 = \[3, 9\]: the cache has 4 pages"),
                      ((torch.tensor([0, 2, 4]), tables[1], tables[2]), "at most kv_indices"),
                      ((tables[0], tables[1], torch.tensor([14])), "one per request")):
        with pytest.raises(ValueError, match=text):
            reference.paged_to_ragged((k_cache, k_cache), *bad, kv_layout="HND")
    with pytest.raises(ValueError, match="kv_layout='nhd'"):
        reference.paged_to_ragged((k_cache, k_cache), *tables, kv_layout="nhd")


def test_a_flexattention_users_slips_get_hints():
    """A trial port from FlexAttention: None as no mask was silently causal, a BlockMask or a
    call's score_mod= got no hint, torch.div(..., rounding_mode=) did not trace."""
    q, k = torch.randn(37, 4, 64).half(), torch.randn(37, 2, 64).half()
    with pytest.raises(ja.SpecError, match=r"mask=None: .* no mask is mask='none'"):
        ja.Variant(mask=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ja.Variant().mask == "causal"  # (the default, no mods: no warning)
    with pytest.warns(UserWarning, match="score_mod without mask= is causal"):
        assert ja.Variant(score_mod=lambda s, b, h, q_idx, kv_idx: s * 2).mask == "causal"

    class BlockMask:  # (FlexAttention's BlockMask: not callable, with these attributes)
        kv_indices = None

        @staticmethod
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    with pytest.raises(ja.SpecError, match=r"mask_mod=block_mask.mask_mod\)"):
        ja.Variant(mask="none", mask_mod=BlockMask())
    with pytest.raises(ja.SpecError, match=r"mask_mod=block_mask.mask_mod, a mask, not a "):
        ja.Variant(mask="none", score_mod=BlockMask())
    with pytest.raises(TypeError, match=r"Variant\(mask_mod=block_mask.mask_mod, mask='none'\)"):
        ja.attention(q, k, k, BlockMask())
    with pytest.raises(ValueError, match=r"score_mod= is the Variant's \(Variant\(score_mod=f"):
        ja.attention(q, k, k, V, score_mod=lambda s, b, h, q_idx, kv_idx: s)
    with pytest.raises(TypeError, match=r"attention-gym's sliding window W .* window_left=W"):
        ja.Variant(sliding_window=32)

    def floor(score, b, h, q_idx, kv_idx):
        return score + torch.div(q_idx - kv_idx, 4, rounding_mode="floor") * 0.1

    def slashes(score, b, h, q_idx, kv_idx):
        return score + ((q_idx - kv_idx) // 4) * 0.1
    outs = [ja.attention(q, k, k, ja.Variant(mask="none", score_mod=f)) for f in (floor, slashes)]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    with pytest.raises(ja.SpecError, match=r"rounding_mode='trunc'\) cannot be traced; "
                                           r"rounding_mode='floor' \(or //\) can"):
        ja.Variant(mask="none", score_mod=lambda s, b, h, q_idx, kv_idx: s + q_idx.div(
            3, rounding_mode="trunc"))
    with pytest.raises(ja.SpecError, match=r"div\(\) got an unexpected keyword argument 'out'"):
        ja.Variant(mask="none", score_mod=lambda s, b, h, q_idx, kv_idx: s + torch.div(
            q_idx, 2, out=None))
