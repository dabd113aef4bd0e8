"""CPU backend numerics for every built-in variant against the reference: odd lengths, GQA
ratios, ragged batches with empty and one-token requests, fully masked rows."""

import math

import pytest
import torch

import jitattn as ja
from jitattn import catalog

from helpers import (check, check_nan_key_rows, check_rope_before_the_first_key,
                     every_feature_variant, make_batch)

BUILTIN = catalog.builtin()
HEADS = [(4, 4), (8, 2), (7, 1)]  # GQA group sizes 1, 4, 7
# (qo_lens, kv_lens): one request with q_len > kv_len (causal rows before the first key are
# fully masked), decode-like rows, and a ragged batch with an empty and a one-token request.
LAYOUTS = [([45], [30]), ([1], [77]), ([1, 1, 1], [0, 1, 40]),
           ([0, 1, 33, 70], [5, 9, 100, 70])]


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_builtin_variant_matches_reference(name, dtype):
    for i, (hq, hkv) in enumerate(HEADS):
        for j, (qo_lens, kv_lens) in enumerate(LAYOUTS):
            head_dim = (32, 64, 128, 256)[(i + j) % 4]
            variant, params = BUILTIN[name].example(len(qo_lens), hq, hkv, max(qo_lens),
                                                    max(kv_lens), "cpu")
            q, k, v, qo, kv = make_batch(qo_lens, kv_lens, hq, hkv, head_dim, dtype, "cpu",
                                         seed=hash((name, i, j)) % 2**31)
            if len(qo_lens) == 1:
                check(variant, params, q, k, v)
            else:
                check(variant, params, q, k, v, qo, kv)


def test_custom_variant_with_every_feature():
    variant, params = every_feature_variant("cpu")
    q, k, v, qo, kv = make_batch([3, 50], [60, 50], 8, 2, 128, torch.float16, "cpu", seed=7)
    check(variant, params, q, k, v, qo, kv)


def test_divisions_match_the_reference():
    """Divisions by a constant, a runtime scalar and a per-head value run as products with a
    reciprocal (render: divisions_as_products); one by kv_idx stays a division."""
    cap = ja.scalar("cap")
    variant = ja.Variant("divisions", mask="causal", score_mod=lambda s, b, h, q, kv: (
        cap * ja.tanh(s / cap) + 30.0 * ja.tanh(s / 30.0) + s / (h + 2) + 3.0 / (kv + 1.0)))
    q, k, v, qo, kv = make_batch([3, 50], [60, 50], 8, 2, 64, torch.float16, "cpu", seed=9)
    check(variant, {"cap": 7.0}, q, k, v, qo, kv)
    # where a division decides visibility it stays exact: kv / (q + 1) < 1 is kv <= q, and
    # 41 * fl(1 / 41) < 1 in float32 would let key 41 through
    for mask_mod in (lambda b, h, q, kv: kv / (q + 1) < 1.0, lambda b, h, q, kv: kv / 41.0 < 1.0):
        check(ja.Variant("decides", mask="none", mask_mod=mask_mod), {}, q, k, v, qo, kv)
    in_score = ja.Variant("decides_in_score", mask="none", score_mod=lambda s, b, h, q, kv:
                          ja.where(kv / 41.0 < 1.0, s / 41.0, -float("inf")))
    check(in_score, {}, q, k, v, qo, kv)


def test_fully_masked_rows_give_zero_and_minus_inf():
    variant = ja.Variant("causal", mask="causal")
    q, k, v, _, _ = make_batch([20], [8], 4, 4, 64, torch.float16, "cpu", seed=3)
    out, lse = ja.attention(q, k, v, variant, return_lse=True)
    assert (out[:12] == 0).all() and (lse[:12] == -math.inf).all()
    assert torch.isfinite(lse[12:]).all() and not out.isnan().any()


def test_sigmoid_states_add_up_over_key_splits():
    variant = ja.Variant("sig", mask="none", reduction="sigmoid")
    q, k, v, _, _ = make_batch([5], [64], 4, 4, 64, torch.bfloat16, "cpu", seed=5)
    whole = ja.attention(q, k, v, variant).float()
    parts = ja.attention(q, k[:20], v[:20], variant).float() + \
        ja.attention(q, k[20:], v[20:], variant).float()
    torch.testing.assert_close(whole, parts, atol=3e-2, rtol=3e-2)


def test_strided_q_from_a_fused_projection():
    variant = ja.Variant("plain", mask="causal")
    qkv = torch.randn(37, 3 * 8, 64, dtype=torch.float16)
    q, k, v = qkv[:, :8], qkv[:, 8:16], qkv[:, 16:]
    assert not q.is_contiguous()
    check(variant, {}, q, k, v)


def test_empty_query_returns_empty():
    variant = ja.Variant("plain")
    q = torch.randn(0, 4, 64, dtype=torch.float16)
    k = torch.randn(10, 4, 64, dtype=torch.float16)
    assert ja.attention(q, k, k, variant).shape == (0, 4, 64)


def test_score_mod_returning_minus_inf_masks_like_flexattention():
    def only_even_keys(score, b, h, q_idx, kv_idx):
        return ja.where(kv_idx % 2 == 0, score, -math.inf)
    variant = ja.Variant("neg_inf", mask="causal", score_mod=only_even_keys)
    q, k, v, _, _ = make_batch([9], [9], 4, 4, 64, torch.float16, "cpu", seed=4)
    out, lse = check(variant, {}, q, k, v)
    # row 0 sees key 0 only; every row has a visible even key: all finite
    assert torch.isfinite(lse).all()
    all_masked = ja.Variant("all_neg_inf", mask="causal",
                            score_mod=lambda s, b, h, qi, ki: s * 0 - math.inf)
    out, lse = ja.attention(q, k, v, all_masked, return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()


def test_a_nan_score_makes_its_row_nan_in_the_kernel_and_the_reference():
    """log of a negative score is NaN: the row's output is NaN, as in torch (the reference
    used to hide NaN scores like -inf ones and return a finite row)."""
    from jitattn import reference
    variant = ja.Variant("log_score", mask="none", score_mod=lambda s, b, h, qi, ki: ja.log(s))
    q, k, v, _, _ = make_batch([3], [4], 2, 2, 64, torch.float16, "cpu", seed=5)
    negative = (torch.einsum("qhd,khd->hqk", q.float(), k.float()) < 0).any(-1).T  # [q, h]
    assert negative.any()
    for out in (ja.attention(q, k, v, variant), reference.attention(q, k, v, variant)):
        nan = out.isnan()
        assert torch.equal(nan.all(-1), negative) and not nan.any(-1)[~negative].any()

def test_a_nan_key_makes_out_and_lse_nan_on_the_rows_that_see_it():
    check_nan_key_rows("cpu", [(7, 20, 5), (1, 40, 39), (30, 30, 0)])
    # the cascade strategy merged such a row's shared-level state (lse -inf: "empty") away
    q, k, v = (torch.randn(10, h, 64).half() for h in (4, 2, 2))
    k[2, 0] = float("nan")
    outs = {}
    for strategy in ("naive", "ragged", "cascade"):
        shared = ja.SharedPrefixPrefill(ja.Variant("causal", mask="causal"), strategy,
                                        device="cpu")
        shared.plan(5, [2, 3], 4, 2, 64)
        outs[strategy] = shared.run(q, k, v).isnan().any(-1)
    assert outs["naive"][2:, :2].all() and torch.equal(outs["cascade"], outs["naive"]) and \
        torch.equal(outs["ragged"], outs["naive"])


def test_strided_indptr_view_is_read_correctly():
    variant = ja.Variant("plain", mask="causal")
    q, k, v, qo, kv = make_batch([3, 5], [4, 6], 4, 4, 64, torch.float16, "cpu", seed=9)
    wide_qo = torch.stack([qo, torch.full_like(qo, 999)], 1).reshape(-1)[::2]
    wide_kv = torch.stack([kv, torch.full_like(kv, 999)], 1).reshape(-1)[::2]
    assert not wide_qo.is_contiguous()
    check(variant, {}, q, k, v, wide_qo, wide_kv)


def test_cache_key_ignores_where_the_mod_is_written():
    first = ja.Variant("where", mask="causal", score_mod=lambda s, b, h, qi, ki: s * 0.5)

    def elsewhere(s, b, h, qi, ki):
        return s * 0.5
    second = ja.Variant("where", mask="causal", score_mod=elsewhere)
    from jitattn import render
    assert render.render_cpu(first, head_dim=64).code == \
        render.render_cpu(second, head_dim=64).code


def test_repeated_calls_take_each_calls_tensors():
    """ja.attention keeps a single request's launch by variant, shapes, dtype and device
    (launch.Launcher); a later call of the same shapes reads its own tensors, strides and
    parameters (a launch that kept the first call's arguments fails here)."""
    variant = ja.Variant("cap_param", mask="causal", score_mod=ja.soft_cap(ja.scalar("cap")))
    gen = torch.Generator().manual_seed(21)
    q1, q2 = (torch.randn(37, 8, 64, generator=gen).half() for _ in range(2))
    k1, v1 = (torch.randn(50, 2, 64, generator=gen).half() for _ in range(2))
    wide = torch.randn(50, 4, 64, generator=gen).half()  # k2, v2: strided views
    check(variant, {"cap": 20.0}, q1, k1, v1)
    check(variant, {"cap": 5.0}, q2, wide[:, :2], wide[:, 2:])


def test_float_floordiv_and_mod_are_pythons():
    """Float // and % floored the float32 quotient: 1 // 0.1, whose quotient 9.99999985 rounds
    to 10.0f, gave 10 where Python and torch give 9, so a mask_mod kv_idx // 0.1 < 29.5 hid key
    3, and kv_idx % 0.1 was about 0 instead of about 0.1 (a trial's report). The kernel and the
    reference now floor the exact remainder's quotient, as Python: the keys each mask keeps are
    Python's, and the output is softmax over them."""
    tenth, third = (float(torch.tensor(c, dtype=torch.float32)) for c in (0.1, 0.3))  # (float32
    #                                                                 constants, as the kernels')
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(n, 2, 64, generator=gen).half() for n in (1, 40, 40))
    for mask_mod, keep in (
            (lambda b, h, qi, ki: ki // 0.1 < 29.5, [j // tenth < 29.5 for j in range(40)]),
            (lambda b, h, qi, ki: ki % 0.1 > 0.05, [j % tenth > 0.05 for j in range(40)]),
            (lambda b, h, qi, ki: (-ki) % -0.3 < -0.15, [(-j) % -third < -0.15
                                                         for j in range(40)])):
        assert 0 < sum(keep) < 40
        out = ja.attention(q, k, v, ja.Variant("fdiv", mask="none", mask_mod=mask_mod))
        s = torch.einsum("hd,khd->hk", q[0].double(), k.double()) / 8.0
        s[:, ~torch.tensor(keep)] = -math.inf
        want = torch.einsum("hk,khd->hd", s.softmax(-1), v.double())
        torch.testing.assert_close(out[0].double(), want, atol=2e-3, rtol=0)


def test_rope_rotates_queries_before_the_first_key():
    check_rope_before_the_first_key("cpu")
