"""Shared-prefix prefill: every strategy equals naive on the CPU backend."""

import random
import re

import pytest
import torch

import jitattn as ja
from jitattn.shared_prefix import STRATEGIES, SharedPrefixPrefill

from helpers import TOL


def _layout(prefix, suffixes, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    n = prefix + sum(suffixes)
    return [torch.randn(n, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]


def _per_request_reference(variant, q, k, v, prefix, suffixes, return_lse=False):
    """Each request [P, S_i] on its own through ja.attention, laid out like the strategies."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    start = prefix
    for i, n in enumerate(suffixes):
        idx = torch.cat([torch.arange(prefix), torch.arange(start, start + n)])
        o, s = ja.attention(q[idx], k[idx], v[idx], variant, return_lse=True)
        out[start:start + n], lse[start:start + n] = o[prefix:], s[prefix:]
        if i == 0:
            out[:prefix], lse[:prefix] = o[:prefix], s[:prefix]
        start += n
    return (out, lse) if return_lse else out


CASES = [(96, [4, 4]), (37, [1]), (0, [5, 3, 9]), (50, [1, 1, 1, 1, 1, 1]), (130, [70, 2, 33])]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("prefix, suffixes", CASES)
def test_every_strategy_equals_naive(strategy, prefix, suffixes):
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    q, k, v = _layout(prefix, suffixes, 16, 8, 128, torch.float16, seed=prefix + len(suffixes))
    sp = SharedPrefixPrefill(variant, strategy, device="cpu")
    assert sp.plan(prefix, suffixes, 16, 8, 128) == strategy
    got, got_lse = sp.run(q, k, v, return_lse=True)
    ref, ref_lse = _per_request_reference(variant, q, k, v, prefix, suffixes, return_lse=True)
    torch.testing.assert_close(got, ref, **TOL[torch.float16])
    torch.testing.assert_close(got_lse, ref_lse, atol=2e-3, rtol=1e-4)
    # without the lse, and into the caller's buffers: the same values
    torch.testing.assert_close(sp.run(q, k, v), got, rtol=0, atol=0)
    out, lse = torch.full_like(q, 7.0), torch.full_like(got_lse, 7.0)
    assert sp.run(q, k, v, out=out, lse=lse) is out
    torch.testing.assert_close((out, lse), (got, got_lse), rtol=0, atol=0)
    # in place (out=q): the cascade's unique level used to overwrite the suffix rows of q
    # before its shared level read them
    q_in_place = q.clone()
    sp.run(q_in_place, k, v, out=q_in_place)
    torch.testing.assert_close(q_in_place, got, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_out_may_be_k_or_v(strategy):
    """With as many query heads as kv heads, out may be k or v itself: the strategies read
    k / v while they write out, so such an out is computed apart and copied (split and the
    cascade gave wrong answers)."""
    q, k, v = _layout(96, [4, 4], 8, 8, 64, torch.float16, seed=7)
    sp = SharedPrefixPrefill(ja.Variant("causal"), strategy, device="cpu")
    sp.plan(96, [4, 4], 8, 8, 64)
    want = sp.run(q, k, v)
    for which in (0, 1):
        kv = [k.clone(), v.clone()]
        assert sp.run(q, *kv, out=kv[which]) is kv[which]
        torch.testing.assert_close(kv[which], want, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_out_may_overlap_q(strategy):
    """An out one row past q in the same buffer is computed apart and copied, as one in k or v
    is (every strategy but naive returned wrong rows)."""
    q, k, v = _layout(40, [20, 30], 4, 2, 64, torch.float16, seed=3)
    sp = SharedPrefixPrefill(ja.Variant("causal"), strategy, device="cpu")
    sp.plan(40, [20, 30], 4, 2, 64)
    want = sp.run(q, k, v)
    buf = torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype)
    buf[:-1] = q
    assert sp.run(buf[:-1], k, v, out=buf[1:]).data_ptr() == buf[1:].data_ptr()
    torch.testing.assert_close(buf[1:], want, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["naive", "split", "ragged"])
def test_position_dependent_variants_on_exact_strategies(strategy):
    slopes = ja.alibi_slopes(8)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    variant = ja.Variant("alibi_rope", mask="causal", score_mod=alibi, pos_encoding=ja.RoPE())
    prefix, suffixes = 45, [3, 17, 1]
    q, k, v = _layout(prefix, suffixes, 8, 2, 64, torch.bfloat16, seed=3)
    sp = SharedPrefixPrefill(variant, strategy, device="cpu")
    sp.plan(prefix, suffixes, 8, 2, 64, q_dtype=torch.bfloat16)
    torch.testing.assert_close(sp.run(q, k, v),
                               _per_request_reference(variant, q, k, v, prefix, suffixes),
                               **TOL[torch.bfloat16])
    with pytest.raises(ValueError, match=r"depend on \['positions'\]"):
        SharedPrefixPrefill(variant, "cascade", device="cpu")


def test_auto_follows_the_selection_guide_and_is_exact():
    variant = ja.Variant("causal", mask="causal")
    sp = SharedPrefixPrefill(variant, device="cpu")
    # the measured grid (heads 16/8): cascade wins at P8196 S4 M32, ragged everywhere else
    assert sp.choose(8196, [4] * 32, 16, 8, 128) == "cascade"
    for prefix, suffixes in ((8196, [256] * 32), (8196, [4] * 2), (96, [4] * 32)):
        assert sp.choose(prefix, suffixes, 16, 8, 128) == "ragged"
    # choose() refuses what plan() refuses (it answered "ragged" for a negative prefix, no
    # suffixes and float lengths)
    for args, error, text in (((-5, [3]), ValueError, "prefix_len=-5"),
                              ((10, []), ValueError, r"suffix_lens=\[\]: expected at least"),
                              ((10, [0, -3]), ValueError, "suffix_lens"),
                              ((1.5, [2]), TypeError, "prefix_len=1.5"),
                              ((10, [2.5]), TypeError, "suffix_lens")):
        with pytest.raises(error, match=text):
            sp.choose(*args)
    rng = random.Random(0)
    for _ in range(3):
        prefix, suffixes = rng.randrange(0, 200), [rng.randrange(1, 20) for _ in range(4)]
        q, k, v = _layout(prefix, suffixes, 4, 4, 64, torch.float16, seed=prefix)
        sp.plan(prefix, suffixes, 4, 4, 64)
        torch.testing.assert_close(sp.run(q, k, v),
                                   _per_request_reference(variant, q, k, v, prefix, suffixes),
                                   **TOL[torch.float16])


def test_bad_arguments():
    variant = ja.Variant("causal")
    # the constructor checks what it passes on to BatchPrefill (plan() used to fail on it)
    for kw, error, text in (({"page_size": 16}, TypeError, r"takes no \['page_size'\]"),
                            ({"max_batch": 4}, TypeError, r"takes no \['max_batch'\]"),
                            ({"max_batch_size": 0}, ValueError,
                             "max_batch_size=0: expected an int"),
                            ({"query_tile": "huge"}, ValueError, "query_tile='huge'")):
        with pytest.raises(error, match=text):
            SharedPrefixPrefill(variant, "ragged", device="cpu", **kw)
    with pytest.raises(ValueError, match="strategy"):
        SharedPrefixPrefill(variant, "magic", device="cpu")
    with pytest.raises(ValueError, match="causal"):
        SharedPrefixPrefill(ja.Variant("n", mask="none"), device="cpu")
    sp = SharedPrefixPrefill(variant, "ragged", device="cpu")
    with pytest.raises(ValueError, match="suffix_lens"):
        sp.plan(10, [3, 0], 4, 4, 64)
    with pytest.raises(RuntimeError, match="before plan"):
        sp.run(*_layout(10, [3], 4, 4, 64, torch.float16, 0))
    with pytest.raises(TypeError, match="prefix_len=True: expected an int >= 0"):
        sp.plan(True, [3], 4, 4, 64)
    with pytest.raises(TypeError, match="prefix_len=2.5: expected an int >= 0"):
        sp.plan(2.5, [3], 4, 4, 64)
    with pytest.raises(ValueError, match="prefix_len=-1: expected an int >= 0"):
        sp.plan(-1, [3], 4, 4, 64)
    with pytest.raises(TypeError, match=r"suffix_lens=\[2.0\]: expected a sequence of ints"):
        sp.plan(10, [2.0], 4, 4, 64)
    with pytest.raises(TypeError, match=r"suffix_lens=\[True\]"):
        sp.plan(10, [True], 4, 4, 64)
    # a bool tensor's entries, and unordered collections (the layout follows the order)
    for bad in (torch.tensor([True, True]), {3: "x"}, {5, 1}):
        with pytest.raises(TypeError, match="suffix_lens=.*: expected a sequence of ints, in "
                                            "the order"):
            sp.plan(10, bad, 4, 4, 64)
    with pytest.raises(TypeError, match="split_kv='no': expected True or False"):
        SharedPrefixPrefill(variant, device="cpu", split_kv="no")
    # "auto" computes with the head configuration before a strategy's plan checks it (a
    # string there was a TypeError from inside choose())
    for heads, text in ((("8", 2, 64), "num_qo_heads='8'"), ((8, None, 64), "num_kv_heads=None")):
        with pytest.raises(TypeError, match=f"{text}: expected an int >= 1"):
            SharedPrefixPrefill(variant, device="cpu").plan(64, [4, 4], *heads)
    for strategy in ("naive", "ragged", "cascade"):  # errors name run()'s own arguments
        sp = SharedPrefixPrefill(variant, strategy, device="cpu")
        sp.plan(10, [3], 4, 2, 64)
        q, k, v = _layout(10, [3], 4, 2, 64, torch.float16, 0)
        with pytest.raises(ValueError, match=r"q has shape \(14, 4, 64\); the plan expects "
                                             r"\(13, 4, 64\) \(13 rows"):
            sp.run(*_layout(10, [4], 4, 2, 64, torch.float16, 0))
        with pytest.raises(ValueError, match=r"k has shape \(13, 4, 64\); the plan expects "
                                             r"\(13, 2, 64\)"):
            sp.run(q, q, v)
        with pytest.raises(TypeError, match=r"v has dtype torch.float32"):
            sp.run(q, k, v.float())


def test_cascade_merges_sigmoid_states_by_addition():
    variant = ja.Variant("sig", mask="causal", reduction="sigmoid")
    prefix, suffixes = 64, [5, 9]
    q, k, v = _layout(prefix, suffixes, 8, 8, 64, torch.float16, seed=8)
    sp = SharedPrefixPrefill(variant, "cascade", device="cpu")
    sp.plan(prefix, suffixes, 8, 8, 64)
    torch.testing.assert_close(sp.run(q, k, v),
                               _per_request_reference(variant, q, k, v, prefix, suffixes),
                               atol=2e-2, rtol=2e-2)  # unnormalised sums of up to 73 terms


def test_variants_reading_the_request_index_are_refused_where_renumbered():
    temp = torch.tensor([0.5, 1.0, 2.0])

    def per_request_temperature(score, b, h, q_idx, kv_idx):
        return score * temp[b]
    variant = ja.Variant("temp", mask="causal", score_mod=per_request_temperature)
    for strategy in ("split", "cascade", "multi_item", "custom_mask"):
        with pytest.raises(ValueError, match="request"):
            SharedPrefixPrefill(variant, strategy, device="cpu")
    prefix, suffixes = 20, [3, 5, 2]
    q, k, v = _layout(prefix, suffixes, 4, 4, 64, torch.float16, seed=9)
    for strategy in ("naive", "ragged", "auto"):
        sp = SharedPrefixPrefill(variant, strategy, device="cpu")
        sp.plan(prefix, suffixes, 4, 4, 64)
        ref = torch.empty_like(q)
        start = prefix
        for i, n in enumerate(suffixes):  # request i with its own temperature, on its own
            idx = torch.cat([torch.arange(prefix), torch.arange(start, start + n)])
            one = ja.Variant("temp1", mask="causal",
                             score_mod=lambda s, b, h, qi, ki, t=float(temp[i]): s * t)
            o = ja.attention(q[idx], k[idx], v[idx], one)
            ref[start:start + n] = o[prefix:]
            if i == 0:
                ref[:prefix] = o[:prefix]
            start += n
        torch.testing.assert_close(sp.run(q, k, v), ref, **TOL[torch.float16])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sm_scale_reaches_every_strategy(strategy):
    variant = ja.Variant("causal", mask="causal")
    prefix, suffixes = 40, [3, 9]
    q, k, v = _layout(prefix, suffixes, 4, 2, 64, torch.float16, seed=5)
    sp = SharedPrefixPrefill(variant, strategy, device="cpu")
    sp.plan(prefix, suffixes, 4, 2, 64, sm_scale=0.3)
    scaled = _per_request_reference(variant, q * 0.3 * 8, k, v, prefix, suffixes)  # 1/sqrt(64)
    torch.testing.assert_close(sp.run(q, k, v), scaled, **TOL[torch.float16])


def test_oversized_plans_are_refused_before_their_arrays_are_built():
    """P = 2**30 built 8 GiB of token ids before BatchPrefill's length check refused it, and
    custom_mask a dense (P + S)**2 mask (3.35 GiB at P = 60000) before max_mask_bytes did;
    both are now refused first (tracemalloc counts numpy's allocations)."""
    import tracemalloc
    causal = ja.Variant("causal")
    for strategy, prefix_len, text in (
            ("ragged", 2**30, r"a request has 1073741827 query tokens; expected fewer than"),
            ("custom_mask", 60000, r"strategy 'custom_mask': the custom mask has 450090005 "
                                   r"bytes, more than max_mask_bytes=16777216 given to the "
                                   r"constructor"),
            ("naive", 2**20, r"strategy 'naive': the batch uses 4194308 pages, more than "
                             r"max_num_pages=")):
        sp = SharedPrefixPrefill(causal, strategy, device="cpu")
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match=text):
                sp.plan(prefix_len, [1, 2, 3] if strategy != "naive" else [1] * 4, 4, 2, 64)
            assert tracemalloc.get_traced_memory()[1] < 1 << 24, strategy
        finally:
            tracemalloc.stop()


def test_capacity_errors_read_the_same_from_every_planner():
    """SharedPrefixPrefill refuses a strategy before building its arrays with the message that
    BatchPrefill.plan() gives for the same capacity (one wording, args.over_capacity): the two
    copies had drifted (masks.py's mask-bytes and item-tokens messages lacked " given to the
    constructor")."""
    p, suffixes, hq, hkv, d = 40, [3, 5], 4, 2, 64
    n = p + sum(suffixes)
    for strategy, name, needed in (("custom_mask", "max_mask_bytes", -(-n * n // 8)),
                                   ("multi_item", "max_item_tokens", sum(suffixes))):
        text = re.escape(f"{name}={needed - 1} given to the constructor")
        sp = SharedPrefixPrefill(ja.Variant("causal"), strategy, device="cpu",
                                 **{name: needed - 1})
        with pytest.raises(ValueError, match=text) as early:
            sp.plan(p, suffixes, hq, hkv, d)
        SharedPrefixPrefill(ja.Variant("causal"), strategy, device="cpu",
                            **{name: needed}).plan(p, suffixes, hq, hkv, d)  # just fits
        # the wrapper's own check, on the same batch
        wrapper = ja.BatchPrefill(ja.Variant(f"w_{strategy}", mask=strategy.split("_mask")[0]),
                                  kv_layout="ragged", device="cpu", **{name: needed - 1})
        i32 = dict(dtype=torch.int32)
        kwargs = (dict(custom_mask=torch.ones(n * n, dtype=torch.bool))
                  if strategy == "custom_mask" else
                  dict(prefix_len=torch.tensor([p], **i32), max_item_len=torch.tensor([5], **i32),
                       token_pos_in_items=torch.tensor([1, 2, 3, 1, 2, 3, 4, 5], **i32)))
        with pytest.raises(ValueError) as late:
            wrapper.plan(torch.tensor([0, n], **i32), torch.tensor([0, n], **i32), None, None,
                         num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, **kwargs)
        assert str(early.value).endswith(str(late.value)), (early.value, late.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_q_k_and_v_strides_are_named_as_given(strategy):
    """q / k / v with strides the kernels cannot address are refused as "q" / "k" / "v" in the
    caller's layout (a strategy's inner wrapper named k_cache, with its own layout's strides;
    naive took a q that every other strategy refused, since it gathers q's rows)."""
    sp = SharedPrefixPrefill(ja.Variant("strided_kv", mask="causal"), strategy, device="cpu")
    sp.plan(20, [5, 3], 4, 2, 64)
    q, k = torch.randn(28, 4, 64).half(), torch.randn(28, 2, 64).half()
    strided = torch.randn(28, 2, 128).half()[:, :, ::2]
    with pytest.raises(ValueError, match=r"^k has strides \(256, 128, 2\) \(data pointer "
                                         r"0x[0-9a-f]+\); expected the last dim contiguous"):
        sp.run(q, strided, k)
    with pytest.raises(ValueError, match=r"^v has strides \(256, 128, 2\)"):
        sp.run(q, k, strided)
    with pytest.raises(ValueError, match=r"^q has strides \(512, 128, 2\) \(data pointer "
                                         r"0x[0-9a-f]+\); expected the last dimension "
                                         r"contiguous, the other strides multiples of 8 elements"):
        sp.run(torch.randn(28, 4, 128).half()[:, :, ::2], k, k)
    sp.run(q, k, k)  # (run() keeps whether these strides fit; pointers are read every call)
    shifted = torch.randn(28 * 2 * 64 + 8).half()[1:1 + 28 * 2 * 64].view(28, 2, 64)
    with pytest.raises(ValueError, match=r"^k has strides \(128, 64, 1\) \(data pointer "
                                         r"0x[0-9a-f]+\); expected .* a 16-byte aligned pointer"):
        sp.run(q, shifted, k)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_run_with_and_without_output_buffers_agree(strategy):
    """run() without out / lse (for a single launch over the whole layout: the inner
    wrapper's own outputs), with the caller's, and with a strided q give the same rows."""
    gen = torch.Generator().manual_seed(5)
    sp = SharedPrefixPrefill(ja.Variant("bufs", mask="causal"), strategy, device="cpu")
    sp.plan(37, [5, 1, 9], 4, 2, 64)
    q, k, v = (torch.randn(52, h, 64, generator=gen).half() for h in (4, 2, 2))
    out, lse = sp.run(q, k, v, return_lse=True)
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    assert sp.run(q, k, v, out=out2, lse=lse2, return_lse=True)[0] is out2
    strided = torch.randn(52, 8, 64, generator=gen).half()[:, ::2].copy_(q)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert torch.equal(sp.run(strided, k, v), out) and not lse.isnan().any()


def test_auto_takes_the_next_strategy_when_a_schedule_exceeds_the_work_items():
    """auto planned its pick (ragged, 10 work items) and raised for max_work_items=6, though
    other strategies' schedules fit; the work items depend on the schedule, which only a plan
    knows, so auto now plans its candidates in turn."""
    variant = ja.Variant("auto_items", mask="causal")
    sp = SharedPrefixPrefill(variant, "auto", device="cpu", max_work_items=6)
    assert sp.choose(64, [3, 5, 2], 8, 2, 64) == "ragged"
    chosen = sp.plan(64, [3, 5, 2], 8, 2, 64)
    assert chosen != "ragged"
    with pytest.raises(ja.CapacityError, match=r"strategy 'ragged': the plan has \d+ work "
                                               r"items, more than max_work_items=6"):
        SharedPrefixPrefill(variant, "ragged", device="cpu", max_work_items=6).plan(
            64, [3, 5, 2], 8, 2, 64)
    q, k, v = _layout(64, [3, 5, 2], 8, 2, 64, torch.float16, seed=5)
    torch.testing.assert_close(sp.run(q, k, v),
                               _per_request_reference(variant, q, k, v, 64, [3, 5, 2]),
                               **TOL[torch.float16])
    with pytest.raises(ja.CapacityError, match=r"strategy 'auto': no strategy fits .*strategy "
                                               r"'ragged': .*strategy 'cascade': "):
        SharedPrefixPrefill(variant, "auto", device="cpu", max_work_items=1).plan(
            64, [3, 5, 2], 8, 2, 64)
