"""BatchPrefill / BatchDecode on the CPU backend against the reference: NHD and HND, page sizes
1, 3 and 16, mixed prefill / decode lengths, empty and one-token requests, split-KV merges."""

import functools

import pytest
import torch

import jitattn as ja
from jitattn import catalog

from helpers import (check_batch, check_linear_partition, check_shared_prefix_batch, make_batch,
                     make_paged)

BUILTIN = catalog.builtin()


def _cumsum(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_batch_prefill_matches_reference(layout, page_size):
    variant = ja.Variant("causal", mask="causal")
    qo_lens, kv_lens = [5, 0, 1, 40, 17], [5, 9, 300, 40, 0]
    kv_cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 64, page_size, layout,
                                                       torch.float16, "cpu", seed=page_size)
    q, *_ = make_batch(qo_lens, kv_lens, 8, 2, 64, torch.float16, "cpu", seed=1)
    qo_indptr = _cumsum(qo_lens)
    w = ja.BatchPrefill(variant, page_size=page_size, kv_layout=layout, device="cpu")
    plan = w.plan(qo_indptr, kv_indptr, kv_indices, last, 8, 2, 64)
    assert plan.num_items > 0
    check_batch(w, variant, {}, q, kv_cache, qo_indptr, kv_indptr, kv_indices, last, layout)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_batch_decode_every_builtin_variant(name, keep_splits):
    kv_lens = [1, 700, 33, 0, 129]
    variant, params = BUILTIN[name].example(len(kv_lens), 8, 2, 1, max(kv_lens), "cpu")
    kv_cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 128, 16, "NHD",
                                                       torch.bfloat16, "cpu", seed=5)
    q, *_ = make_batch([1] * len(kv_lens), kv_lens, 8, 2, 128, torch.bfloat16, "cpu", seed=6)
    w = ja.BatchDecode(variant, page_size=16, device="cpu")
    plan = w.plan(kv_indptr, kv_indices, last, 8, 2, 128, q_dtype=torch.bfloat16)
    if variant.window_left in (None, -1):  # (a window of 233 keys leaves too little to split)
        assert len(plan.merge_rows) > 0  # the 700-key request is split across CTAs and merged
    check_batch(w, variant, params, q, kv_cache, _cumsum([1] * len(kv_lens)), kv_indptr,
                kv_indices, last, "NHD")


def test_plans_in_and_out_of_inference_mode():
    """The first plan() allocates the workspace (and a custom mask's buffer); under
    torch.inference_mode it made inference tensors, which a later plan() outside inference
    mode could not update."""
    i32 = dict(dtype=torch.int32)
    cache = tuple(torch.randn(4, 4, 2, 64).half() for _ in range(2))
    q = torch.randn(2, 8, 64).half()
    w = ja.BatchPrefill(ja.Variant("c_inf", mask="custom"), page_size=4, device="cpu")
    args = (torch.tensor([0, 2], **i32), torch.tensor([0, 2], **i32), torch.tensor([3, 0], **i32),
            torch.tensor([2], **i32), 8, 2, 64)
    mask = torch.tensor([True] * 3 + [False] * 3 + [True] * 6)
    with torch.inference_mode():
        w.plan(*args, custom_mask=mask)
        want = w.run(q, cache)
    w.plan(*args, custom_mask=mask)
    torch.testing.assert_close(w.run(q, cache), want, rtol=0, atol=0)


def test_a_plan_that_raises_leaves_no_plan():
    """After a plan() that raises, run() raises instead of running the previous plan: inputs
    of the previous plan's shapes ran its pages (a serving loop that caught the error got
    silently stale attention). sm_scale is checked before the new plan's shapes are taken
    (run() accepted the new q and launched over the old plan: a crash)."""
    i32 = dict(dtype=torch.int32)
    cache = tuple(torch.randn(6, 4, 2, 64).half() for _ in range(2))
    for wrapper in (ja.BatchDecode(ja.Variant("c_raise"), page_size=4, device="cpu"),
                    ja.BatchPrefill(ja.Variant("c_raise"), page_size=4, device="cpu")):
        plan = functools.partial(wrapper.plan, torch.tensor([0, 1], **i32)) \
            if type(wrapper) is ja.BatchPrefill else wrapper.plan
        plan(torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32), torch.tensor([3], **i32),
             8, 2, 64)
        q = torch.randn(1, 8, 64).half()
        want = wrapper.run(q, cache)
        for bad, text in ((dict(sm_scale=-1.0), "sm_scale=-1.0"),
                          (dict(kv_last_page_len=torch.tensor([5], **i32)),
                           "kv_last_page_len"),
                          (dict(kv_indptr=torch.tensor([0, 2])), "kv_indptr"),  # int64
                          # (refused before plan's body: the previous plan ran on)
                          (dict(causal=True), "causal= is the Variant's mask")):
            args = dict(kv_indptr=torch.tensor([0, 2], **i32),
                        kv_indices=torch.tensor([0, 1], **i32),
                        kv_last_page_len=torch.tensor([3], **i32), num_qo_heads=8,
                        num_kv_heads=2, head_dim=64) | bad
            with pytest.raises((TypeError, ValueError), match=text):
                plan(**args)
            assert wrapper.kernel is None
            with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\) \(or after "
                                                   r"a plan\(\) that raised\)"):
                wrapper.run(q, cache)
            plan(torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32),
                 torch.tensor([3], **i32), 8, 2, 64)
            torch.testing.assert_close(wrapper.run(q, cache), want, rtol=0, atol=0)
        # FlashInfer's run(q, paged_kv_cache=): this wrapper's name and where the cache goes
        # (BatchDecode's said "BatchPrefill.run() missing 1 required positional argument")
        with pytest.raises(TypeError, match=type(wrapper).__name__ + r"\.run\(\) needs "
                                            r"kv_cache, .*paged_kv_cache= is this second"):
            wrapper.run(q, paged_kv_cache=cache)


def test_one_cache_tensor_and_replanning():
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    w = ja.BatchPrefill(variant, page_size=4, device="cpu")
    for seed, (qo_lens, kv_lens) in enumerate((([3, 7], [10, 7]), ([1, 1, 20], [50, 2, 25]))):
        (k, v), kv_indptr, kv_indices, last = make_paged(kv_lens, 4, 64, 4, "NHD",
                                                         torch.float16, "cpu", seed=seed)
        cache = torch.stack([k, v], dim=1)  # [num_pages, 2, page_size, Hkv, D]
        q, *_ = make_batch(qo_lens, kv_lens, 4, 4, 64, torch.float16, "cpu", seed=seed)
        qo_indptr = _cumsum(qo_lens)
        w.plan(qo_indptr, kv_indptr, kv_indices, last, 4, 4, 64)
        check_batch(w, variant, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last, "NHD")
        # a plan's later calls repeat its first launch (launch.Launcher) with each call's own
        # addresses and strides: other data, in separate k / v (half the page stride) and q
        # inside a wider tensor, as a fresh wrapper's first call computes it
        q2, k2, v2 = q.flip(0), v.flip(0), k.flip(0)
        fresh = ja.BatchPrefill(variant, page_size=4, device="cpu")
        fresh.plan(qo_indptr, kv_indptr, kv_indices, last, 4, 4, 64)
        wide = torch.randn(q.shape[0], 8, 64).half()
        wide[:, 2:6] = q2
        got = w.run(wide[:, 2:6], (k2, v2))
        torch.testing.assert_close(got, fresh.run(q2, (k2, v2)), rtol=0, atol=0)
        assert got.is_contiguous()  # (out of a strided q: allocated by shape, not like q)


def _simple():
    kv_cache, kv_indptr, kv_indices, last = make_paged([10, 20], 2, 64, 16, "NHD",
                                                       torch.float16, "cpu", seed=0)
    return kv_cache, kv_indptr, kv_indices, last


def test_run_hints_at_q_given_heads_first():
    """q given [heads, tokens, head_dim] (SDPA's layout without the batch) was refused with the
    two shapes alone; where it is the plan's [tokens, heads, head_dim] with the first two
    dimensions swapped, the wrappers' errors say so, and only there."""
    kv_cache, kv_indptr, kv_indices, last = _simple()
    i32 = dict(dtype=torch.int32)
    hint = r" \(q looks like \[heads, tokens, head_dim\]; run\(\) takes \[tokens, heads, " \
        r"head_dim\]: q.transpose\(0, 1\)\)"
    prefill = ja.BatchPrefill(ja.Variant("c"), page_size=16, device="cpu")
    prefill.plan(torch.tensor([0, 3, 6], **i32), kv_indptr, kv_indices, last, 4, 2, 64)
    decode = ja.BatchDecode(ja.Variant("c"), page_size=16, device="cpu")
    decode.plan(kv_indptr, kv_indices, last, 4, 2, 64)
    cascade = ja.CascadeDecode(ja.Variant("c"), page_size=16, strategy="cascade", device="cpu")
    cascade.plan(torch.tensor([], **i32), 16, kv_indptr, kv_indices, last, 4, 2, 64)
    for w, tokens in ((prefill, 6), (decode, 2), (cascade, 2)):
        q = torch.randn(tokens, 4, 64, dtype=torch.float16)
        with pytest.raises(ValueError, match=rf"^q has shape \(4, {tokens}, 64\); the plan "
                                             rf"expects \({tokens}, 4, 64\){hint}$"):
            w.run(q.transpose(0, 1).contiguous(), kv_cache)
        with pytest.raises(ValueError, match=r"the plan expects \(\d, 4, 64\)$"):  # (no hint)
            w.run(q[:1], kv_cache)
    sp = ja.SharedPrefixPrefill(ja.Variant("c"), "naive", device="cpu")
    sp.plan(4, [3], 4, 2, 64)
    q, k = torch.randn(7, 4, 64).half(), torch.randn(7, 2, 64).half()
    with pytest.raises(ValueError, match=r"^k has shape \(2, 7, 64\); the plan expects \(7, 2, "
                                         r"64\) \(7 rows: P \+ sum\(S_i\)\)" +
                                         hint.replace("q", "k") + "$"):
        sp.run(q, k.transpose(0, 1), k)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: {**a, "kv_indptr": torch.tensor([0, 2, 1], dtype=torch.int32)}, ValueError,
     "non-decreasing"),
    (lambda a: {**a, "kv_indices": torch.tensor([0, -1, 2], dtype=torch.int32)}, ValueError,
     "negative page id"),
    (lambda a: {**a, "kv_last_page_len": torch.tensor([0, 4], dtype=torch.int32)}, ValueError,
     r"kv_last_page_len\[0\] is 0"),
    (lambda a: {**a, "kv_last_page_len": torch.tensor([17, 4], dtype=torch.int32)}, ValueError,
     "page_size"),
    (lambda a: {**a, "qo_indptr": a["qo_indptr"].long()}, TypeError, "expected torch.int32"),
    (lambda a: {**a, "num_qo_heads": 6, "num_kv_heads": 4}, ValueError, "multiple"),
    (lambda a: {**a, "head_dim": 96}, ValueError, "head_dim"),
    (lambda a: {**a, "kv_indptr": torch.tensor([0, 1, 9], dtype=torch.int32)}, ValueError,
     "kv_indices has"),
])
def test_bad_plan_arguments(mutate, exc, match):
    _, kv_indptr, kv_indices, last = _simple()
    args = dict(qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr=kv_indptr,
                kv_indices=kv_indices, kv_last_page_len=last, num_qo_heads=4, num_kv_heads=2,
                head_dim=64)
    w = ja.BatchPrefill(ja.Variant("c"), page_size=16, device="cpu")
    with pytest.raises(exc, match=match):
        w.plan(**mutate(args))


def test_batch_decode_errors_speak_of_decode():
    """BatchDecode refuses masks its plan() cannot take, at construction; a wrong
    kv_last_page_len is reported without mentioning qo_indptr (decode has none)."""
    with pytest.raises(ValueError, match="mask='custom'.*BatchPrefill"):
        ja.BatchDecode(ja.Variant("cm", mask="custom"), device="cpu")
    _, kv_indptr, kv_indices, _ = _simple()
    w = ja.BatchDecode(ja.Variant("c"), page_size=16, device="cpu")
    with pytest.raises(ValueError, match="kv_last_page_len has 1 entries; kv_indptr's 3 make "
                                         "a batch of 2"):
        w.plan(kv_indptr, kv_indices, torch.tensor([4], dtype=torch.int32), 4, 2, 64)


def test_run_checks_against_the_plan():
    kv_cache, kv_indptr, kv_indices, last = _simple()
    w = ja.BatchPrefill(ja.Variant("c"), page_size=16, device="cpu")
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, kv_cache)
    w.plan(torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr, kv_indices, last, 4, 2, 64)
    with pytest.raises(ValueError, match="the plan expects"):
        w.run(q[:1], kv_cache)
    with pytest.raises(TypeError, match="planned|plan was made"):
        w.run(q.bfloat16(), tuple(c.bfloat16() for c in kv_cache))
    with pytest.raises(ValueError, match="k_cache has shape"):
        w.run(q, (kv_cache[0][..., :32].contiguous(), kv_cache[1]))
    with pytest.raises(ValueError, match=r"refers to page \d+ .*kv_indices\) but k_cache has "
                                         r"2 pages"):
        w.run(q, (kv_cache[0][:2].contiguous(), kv_cache[1][:2].contiguous()))
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):  # (was: shape ())
        w.run(q.tolist(), kv_cache)
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor, got NoneType"):
        w.run(q, (kv_cache[0], None))


def test_warm_runs_still_refuse_bad_inputs():
    """After good calls (run()'s fast checks warm, strides remembered), each bad input is
    still refused with its message: a misaligned or strided cache, v_cache alone of the wrong
    dtype, a misaligned q."""
    (k, v), kv_indptr, kv_indices, last = _simple()
    w = ja.BatchPrefill(ja.Variant("c"), page_size=16, device="cpu")
    w.plan(torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr, kv_indices, last, 4, 2, 64)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    good = w.run(q, (k, v))
    torch.testing.assert_close(w.run(q, (k, v)), good)
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape).copy_(k)
    wide = torch.empty(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype)[..., ::2].copy_(k)
    for cache, match in (((shifted, v), "16-byte aligned"), ((k, wide), "strides"),
                         ((k, v.bfloat16()), "v_cache has dtype")):
        with pytest.raises((ValueError, TypeError), match=match):
            w.run(q, cache)
    q_shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    with pytest.raises(ValueError, match="q has strides"):
        w.run(q_shifted, (k, v))
    with pytest.raises(ValueError, match="q is on cpu, k_cache on meta"):  # meta: no data
        w.run(q, (k.to("meta"), v))
    with pytest.raises(ValueError, match="q is on meta, k_cache on meta"):
        w.run(q.to("meta"), (k.to("meta"), v.to("meta")))
    torch.testing.assert_close(w.run(q, (k, v)), good)


def test_capacity_is_enforced():
    kv_cache, kv_indptr, kv_indices, last = _simple()
    w = ja.BatchPrefill(ja.Variant("c"), page_size=16, device="cpu", max_batch_size=1)
    with pytest.raises(ValueError, match="max_batch_size=1"):
        w.plan(torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr, kv_indices, last, 4, 2, 64)


def multi_item_layout(prefix, item_lens):
    """Token positions inside items for one request: [1..n] per item (seed scheme 5a)."""
    return [i + 1 for n in item_lens for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_custom_mask_matches_reference(page_size):
    variant = ja.Variant("tree", mask="custom")
    qo_lens, kv_lens = [4, 1, 9], [10, 33, 9]
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 64, page_size, "HND",
                                                    torch.float16, "cpu", seed=11)
    q, *_ = make_batch(qo_lens, kv_lens, 4, 2, 64, torch.float16, "cpu", seed=12)
    gen = torch.Generator().manual_seed(13)
    flat = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens)), generator=gen) < 0.5
    flat[:10] = False  # the first query row of request 0 sees nothing: 0 / -inf
    qo_indptr = _cumsum(qo_lens)
    w = ja.BatchPrefill(variant, page_size=page_size, kv_layout="HND", device="cpu")
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 4, 2, 64, custom_mask=flat)
    out, lse = check_batch(w, variant, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last,
                           "HND", custom_mask=flat)
    assert (lse[0] == float("-inf")).all() and (out[0] == 0).all()
    # the same mask pre-packed (segment_packbits style) gives the same result
    import numpy as np
    sizes = [a * b for a, b in zip(qo_lens, kv_lens)]
    bounds = np.cumsum([0] + sizes)
    segs = [np.packbits(flat.numpy()[bounds[i]:bounds[i + 1]], bitorder="little")
            for i in range(3)]
    packed = torch.from_numpy(np.concatenate(segs))
    mask_indptr = torch.tensor(np.cumsum([0] + [len(x) for x in segs]), dtype=torch.int32)
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 4, 2, 64, packed_custom_mask=packed,
           mask_indptr=mask_indptr)
    torch.testing.assert_close(w.run(q, cache), out)


def test_multi_item_mask_matches_reference_and_skips_tiles():
    variant = ja.Variant("multi", mask="multi_item")
    prefix, items = 96, [4, 4, 7, 1] * 12  # the seed's items, repeated past a few row tiles
    total = prefix + sum(items)
    pos = torch.tensor(multi_item_layout(prefix, items), dtype=torch.int32)
    # two requests: the seed's layout, and one whose prefix is not a multiple of the page size
    prefix_len = torch.tensor([prefix, 40], dtype=torch.int32)
    pos2 = torch.tensor(multi_item_layout(40, [30, 3]), dtype=torch.int32)
    qo_lens = kv_lens = [total, 40 + 33]
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 64, 16, "NHD", torch.bfloat16,
                                                    "cpu", seed=21)
    q, *_ = make_batch(qo_lens, kv_lens, 8, 2, 64, torch.bfloat16, "cpu", seed=22)
    qo_indptr = _cumsum(qo_lens)
    token_pos = torch.cat([pos, pos2])
    max_item_len = torch.tensor([7, 30], dtype=torch.int32)
    w = ja.BatchPrefill(variant, page_size=16, device="cpu")
    plan = w.plan(qo_indptr, kv_indptr, kv_indices, last, 8, 2, 64, q_dtype=torch.bfloat16,
                  prefix_len=prefix_len, token_pos_in_items=token_pos, max_item_len=max_item_len)
    check_batch(w, variant, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last, "NHD",
                prefix_len=prefix_len, token_pos_in_items=token_pos)
    # tile skipping: rows inside the items never scan keys between the prefix and
    # max_item_len before their first query
    skipped = 0
    for b, hk, row0, lo, hi, *_ in plan.items[plan.items[:, 0] == 0].tolist():
        gap_end = row0 // 4 - 7 + 1  # GQA group 4; max_item_len 7
        if row0 // 4 >= prefix and gap_end > prefix:
            assert hi <= prefix or lo >= gap_end
            skipped += lo >= gap_end
    assert skipped > 0


def test_mask_arguments_are_checked():
    cache, kv_indptr, kv_indices, last = make_paged([10, 20], 2, 64, 16, "NHD", torch.float16,
                                                    "cpu", seed=0)
    qo = torch.tensor([0, 1, 2], dtype=torch.int32)
    custom = ja.BatchPrefill(ja.Variant("c", mask="custom"), device="cpu")
    with pytest.raises(ValueError, match="needs custom_mask"):
        custom.plan(qo, kv_indptr, kv_indices, last, 4, 2, 64)
    with pytest.raises(ValueError, match="expected sum"):
        custom.plan(qo, kv_indptr, kv_indices, last, 4, 2, 64,
                    custom_mask=torch.ones(29, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):  # (the packed one was ignored)
        custom.plan(qo, kv_indptr, kv_indices, last, 4, 2, 64,
                    custom_mask=torch.ones(30, dtype=torch.bool),
                    packed_custom_mask=torch.zeros(4, dtype=torch.uint8),
                    mask_indptr=torch.tensor([0, 2, 4], dtype=torch.int32))
    plain = ja.BatchPrefill(ja.Variant("p"), device="cpu")
    with pytest.raises(ValueError, match="mask is 'causal'"):
        plain.plan(qo, kv_indptr, kv_indices, last, 4, 2, 64,
                   custom_mask=torch.ones(30, dtype=torch.bool))
    multi = ja.BatchPrefill(ja.Variant("m", mask="multi_item"), device="cpu")
    with pytest.raises(ValueError, match=r"token_pos_in_items of request 0 must lie in \[0, "
                                         r"max_item_len\[0\] = 4\]; its entry 0 \(entry 0 of "
                                         r"the tensor\) is 9"):
        multi.plan(qo, kv_indptr, kv_indices, last, 4, 2, 64,
                   prefix_len=torch.tensor([5, 5], dtype=torch.int32),
                   token_pos_in_items=torch.full((20,), 9, dtype=torch.int32),
                   max_item_len=torch.tensor([4, 4], dtype=torch.int32))
    # a negative max_item_len was blamed on token_pos_in_items (or taken, without items)
    with pytest.raises(ValueError, match=r"max_item_len\[1\] = -1: expected >= 0"):
        multi.plan(qo, kv_indptr, kv_indices, last, 4, 2, 64,
                   prefix_len=torch.tensor([5, 5], dtype=torch.int32),
                   token_pos_in_items=torch.zeros(20, dtype=torch.int32),
                   max_item_len=torch.tensor([4, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="BatchPrefill.plan"):
        ja.attention(torch.randn(3, 4, 64, dtype=torch.float16),
                     torch.randn(3, 2, 64, dtype=torch.float16),
                     torch.randn(3, 2, 64, dtype=torch.float16), ja.Variant("c", mask="custom"))


def test_ragged_kv_prefill_matches_reference(keep_splits):
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    qo_lens, kv_lens = [3, 0, 50, 1], [9, 4, 50, 2000]
    q, k, v, qo_indptr, kv_indptr = make_batch(qo_lens, kv_lens, 8, 2, 128, torch.float16,
                                               "cpu", seed=41)
    w = ja.BatchPrefill(variant, kv_layout="ragged", device="cpu")
    plan = w.plan(qo_indptr, kv_indptr, None, None, 8, 2, 128)
    assert len(plan.merge_rows) > 0
    out, lse = w.run(q, (k, v), return_lse=True)
    from jitattn import reference
    ref_o, ref_lse = reference.attention(q, k, v, variant, qo_indptr=qo_indptr,
                                         kv_indptr=kv_indptr, return_lse=True)
    torch.testing.assert_close(out, ref_o.half(), atol=3e-3, rtol=3e-3)
    with pytest.raises(ValueError, match="has no pages"):
        w.plan(qo_indptr, kv_indptr, kv_indptr, None, 8, 2, 128)


def test_batch_at_full_capacity():
    """A batch of exactly max_batch_size requests (the request table is full)."""
    variant = ja.Variant("c", mask="causal")
    qo_lens, kv_lens = [3, 1, 4, 2], [30, 9, 17, 2]
    q, k, v, qo_indptr, kv_indptr = make_batch(qo_lens, kv_lens, 4, 2, 64, torch.float16,
                                               "cpu", seed=51)
    w = ja.BatchPrefill(variant, kv_layout="ragged", device="cpu", max_batch_size=4,
                        max_partial_rows=16)
    w.plan(qo_indptr, kv_indptr, None, None, 4, 2, 64)
    from jitattn import reference
    ref = reference.attention(q, k, v, variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
    torch.testing.assert_close(w.run(q, (k, v)), ref.half(), atol=3e-3, rtol=3e-3)


def test_packed_mask_offsets_must_start_at_zero():
    cache, kv_indptr, kv_indices, last = make_paged([12], 2, 64, 16, "NHD", torch.float16,
                                                    "cpu", seed=0)
    w = ja.BatchPrefill(ja.Variant("c", mask="custom"), device="cpu")
    with pytest.raises(ValueError, match="starting at 0"):
        w.plan(torch.tensor([0, 2], dtype=torch.int32), kv_indptr, kv_indices, last, 4, 2, 64,
               packed_custom_mask=torch.zeros(3, dtype=torch.uint8),
               mask_indptr=torch.tensor([-3, 0], dtype=torch.int32))


def test_workspace_views_are_16_byte_aligned():
    """The CUDA kernels read the request table and the work items as int4: every view of the
    workspace must start on a 16-byte boundary (a misaligned one is a CUDA error 716)."""
    w = ja.BatchDecode(ja.Variant("plain"), page_size=16, device="cpu")
    _, kv_indptr, kv_indices, last = make_paged([3, 40], 2, 64, 16, "NHD", torch.float16, "cpu",
                                                seed=0)
    w.plan(kv_indptr, kv_indices, last, 4, 2, 64)
    for name in w._ws.views:
        assert w._ws.view(name).data_ptr() % 16 == 0, name


def test_device_defaults_to_what_the_machine_has():
    w = ja.BatchDecode(ja.Variant("plain"))
    assert w.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'.*device='cpu'"):
            ja.BatchPrefill(ja.Variant("plain"), device="cuda")
    with pytest.raises(ValueError, match=r"device='gpu': expected a cuda device \('cuda', "
                                         r"'cuda:1'\) or 'cpu'"):  # (torch's error named no
        ja.BatchDecode(ja.Variant("plain"), device="gpu")         # argument)
    if not torch.cuda.is_available():  # an int is a CUDA device's index
        with pytest.raises(ValueError, match="device='cuda:0': CUDA is not available"):
            ja.BatchDecode(ja.Variant("plain"), device=0)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_linear_partition_schedule_matches_reference(kind, monkeypatch):
    check_linear_partition(kind, "cpu", monkeypatch)


def _short_batch(variant, qo_lens, kv_lens, hq, hkv, page_size, query_tile, **mask):
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, 64, page_size, "NHD",
                                                    torch.float16, "cpu", seed=page_size)
    q, *_ = make_batch(qo_lens, kv_lens, hq, hkv, 64, torch.float16, "cpu", seed=61)
    qo_indptr = _cumsum(qo_lens)
    w = ja.BatchPrefill(variant, page_size=page_size, device="cpu", query_tile=query_tile)
    plan = w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, 64, **mask)
    assert w.kernel == ("decode" if plan.rows_per_cta == 16 else "prefill")
    out, _ = check_batch(w, variant, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last,
                         "NHD", **mask)
    return plan, out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", [ja.Variant("causal", mask="causal"),
                                     ja.Variant("window", mask="causal", window_left=5),
                                     ja.Variant("softcap", mask="none",
                                                score_mod=ja.soft_cap(20.0))],
                         ids=lambda v: v.name)
def test_short_queries_take_the_16_row_tiles(variant, page_size):
    """Speculative verification shapes (a few queries per request, GQA 4): every request has
    at most 16 packed rows, so "auto" plans 16-row tiles (the decode kernel's); the 128-row
    tiles ("long") and 16-row tiles forced on longer requests ("short") agree with the
    reference."""
    qo_lens, kv_lens = [4, 0, 1, 3, 2], [300, 7, 1, 45, 2]
    plan, out = _short_batch(variant, qo_lens, kv_lens, 8, 2, page_size, "auto")
    assert plan.rows_per_cta == 16
    assert ja.BatchPrefill(variant, device="cpu").kernel is None  # before plan()
    long_plan, long_out = _short_batch(variant, qo_lens, kv_lens, 8, 2, page_size, "long")
    assert long_plan.rows_per_cta == 128
    torch.testing.assert_close(out, long_out, atol=2e-3, rtol=2e-3)
    # one request past 16 packed rows: "auto" takes the prefill tiles, "short" cuts it into
    # 16-row tiles
    qo_lens[0] = 5
    assert _short_batch(variant, qo_lens, kv_lens, 8, 2, page_size, "auto")[0].rows_per_cta \
        == 128
    qo_lens, kv_lens = [40, 1, 17], [60, 33, 17]
    plan, _ = _short_batch(variant, qo_lens, kv_lens, 8, 2, page_size, "short")
    assert plan.rows_per_cta == 16
    assert plan.items[plan.items[:, 0] == 0, 2].max() == 160 - 16  # 10 row tiles of request 0


def test_short_queries_with_a_custom_mask():
    """Tree attention's draft tokens (a custom mask) on the 16-row tiles, one row seeing no
    key (out 0, lse -inf)."""
    qo_lens, kv_lens = [4, 1, 3], [10, 33, 3]
    gen = torch.Generator().manual_seed(13)
    flat = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens)), generator=gen) < 0.5
    flat[:10] = False
    plan, out = _short_batch(ja.Variant("tree", mask="custom"), qo_lens, kv_lens, 8, 2, 16,
                             "auto", custom_mask=flat)
    assert plan.rows_per_cta == 16 and (out[0] == 0).all()


def test_query_kind_rule():
    """One query per request stays on the decode kernel at any GQA group (32 rows: two
    tiles); several queries take it up to 16 packed rows."""
    from jitattn.render import query_kind
    assert query_kind(1, 32, 128) == "decode" and query_kind(2, 8, 128) == "decode"
    assert query_kind(3, 8, 128) == "prefill" and query_kind(0, 4, 64) == "decode"
    assert query_kind(1, 1, 256, "long") == "prefill" and query_kind(99, 4, 64, "short") == \
        "decode"


def test_a_workspace_buffer_where_page_size_goes_gets_a_hint():
    """FlashInfer's wrappers take a workspace buffer second: the message printed the tensor."""
    with pytest.raises(TypeError, match=r"page_size=<tensor of shape \(131072,\), torch.uint8>: "
                                        r"expected an int >= 1; FlashInfer's wrappers take a "
                                        r"workspace buffer there"):
        ja.BatchDecode(ja.Variant("c"), torch.empty(131072, dtype=torch.uint8), "NHD",
                       device="cpu")


def test_query_tile_is_checked():
    with pytest.raises(ValueError, match="query_tile='tiny'"):
        ja.BatchPrefill(ja.Variant("c"), device="cpu", query_tile="tiny")
    with pytest.raises(TypeError, match="BatchDecode takes no query_tile"):
        ja.BatchDecode(ja.Variant("c"), device="cpu", query_tile="short")
    # a misspelt keyword is BatchDecode's error (Python's named BatchPrefill.__init__)
    with pytest.raises(TypeError, match=r"BatchDecode\(\) got unexpected keyword arguments "
                                        r"\['max_batch'\]; it takes \['page_size', 'kv_layout', "
                                        r"'device', 'max_batch_size'"):
        ja.BatchDecode(ja.Variant("c"), device="cpu", max_batch=8)
    for cls, args, text in ((ja.CascadeDecode, (), r"\['page_size', 'kv_layout', 'strategy', "
                                                  r"'device', 'max_batch_size'"),
                            (ja.MultiLevelCascade, (2,), r"\['page_size', 'kv_layout', 'device', "
                                                        r"'max_batch_size'.*'query_tile'\]")):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got unexpected keyword "
                                            rf"arguments \['page_sise'\]; it takes {text}"):
            cls(ja.Variant("c"), *args, device="cpu", page_sise=8)
    with pytest.raises(TypeError, match=r"CascadeDecode\(\) got unexpected keyword arguments "
                                        r"\['query_tile'\]"):  # (its levels decode)
        ja.CascadeDecode(ja.Variant("c"), device="cpu", query_tile="short")
    with pytest.raises(TypeError, match=r"CascadeDecode\(\) got unexpected keyword arguments "
                                        r"\['num_levels'\].*MultiLevelCascade\(variant, "
                                        r"num_levels\) takes any number"):  # (was a clash
        #                                           with the base class's positional num_levels)
        ja.CascadeDecode(ja.Variant("c"), device="cpu", num_levels=2)
    assert ja.BatchDecode(ja.Variant("c"), device="cpu", max_batch_size=8,
                          split_kv=False).capacity["max_batch_size"] == 8


@pytest.mark.parametrize("split_kv", [True, False], ids=["split", "whole"])
def test_ragged_shared_prefixes_match_reference(split_kv, keep_splits):
    """Requests whose keys begin with a shared prefix (two prefixes, one request without,
    an empty and a one-token request, a prefix without own keys), causal with a position-
    dependent score_mod and fused RoPE: positions count from the prefix's first key."""
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    variant = ja.Variant("alibi_rope", mask="causal",
                         score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                         pos_encoding=ja.RoPE(theta=1e4))
    requests = [(0, 5, 7), (1, 1, 1), (0, 0, 3), (None, 9, 30), (1, 140, 150), (0, 2, 0),
                (1, 1, 0)]
    check_shared_prefix_batch(variant, {"slopes": ja.alibi_slopes(8)}, "cpu", torch.float16,
                              8, 2, 64, requests, prefix_lens=[131, 40], seed=7,
                              split_kv=split_kv)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_ragged_shared_prefixes_over_an_fp8_cache(fp8):
    """Shared prefixes over fp8 K/V, e4m3 or e5m2 (dequantized on load, scales folded in)."""
    requests = [(0, 5, 7), (None, 9, 30), (0, 140, 150), (0, 1, 0)]
    check_shared_prefix_batch(ja.Variant("c", mask="causal"), {}, "cpu", torch.bfloat16, 8, 2,
                              128, requests, prefix_lens=[131], seed=9, fp8_scale=0.5,
                              fp8_dtype=fp8)


def test_shared_prefixes_are_checked():
    q, k, v, qo, kv = make_batch([2, 3], [4, 5], 4, 2, 64, torch.float16, "cpu", seed=1)
    i32 = dict(dtype=torch.int32)
    w = ja.BatchPrefill(ja.Variant("c", mask="causal"), kv_layout="ragged", device="cpu")
    with pytest.raises(ValueError, match="go together"):
        w.plan(qo, kv, None, None, 4, 2, 64, shared_prefix_len=torch.tensor([1, 1], **i32))
    with pytest.raises(ValueError, match=r"shared_prefix_len\[1\] is -2; expected >= 0"):
        w.plan(qo, kv, None, None, 4, 2, 64, shared_prefix_start=torch.tensor([0, 0], **i32),
               shared_prefix_len=torch.tensor([1, -2], **i32))
    with pytest.raises(ValueError, match=r"is 2147483648; expected < 2\*\*31"):
        w.plan(qo, kv, None, None, 4, 2, 64,
               shared_prefix_start=torch.tensor([0, 2 ** 31 - 2], **i32),
               shared_prefix_len=torch.tensor([1, 2], **i32))
    with pytest.raises(ValueError, match="has 1 entries; expected one per request"):
        w.plan(qo, kv, None, None, 4, 2, 64, shared_prefix_start=torch.tensor([0], **i32),
               shared_prefix_len=torch.tensor([1, 1], **i32))
    w.plan(qo, kv, None, None, 4, 2, 64, shared_prefix_start=torch.tensor([0, 6], **i32),
           shared_prefix_len=torch.tensor([1, 4], **i32))
    with pytest.raises(ValueError, match=r"refers to token 9 \(kv_indptr\[-1\] - 1, or the "
                       r"last row of a shared prefix.*\) but k_cache has 9 tokens"):
        w.run(q, (k, v))
    paged = ja.BatchPrefill(ja.Variant("c", mask="causal"), device="cpu")
    with pytest.raises(ValueError, match="need kv_layout='ragged'"):
        paged.plan(qo, kv, torch.arange(9, dtype=torch.int32), torch.ones(2, **i32), 4, 2, 64,
                   shared_prefix_start=torch.tensor([0, 0], **i32),
                   shared_prefix_len=torch.tensor([1, 1], **i32))
