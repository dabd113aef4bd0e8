"""Cascade decode and multi-level cascades equal plain paged decode over the full page tables
(CPU backend); beam-search-style parallel sampling as the example."""

import functools
import gc
import weakref

import numpy as np
import pytest
import torch

import jitattn as ja

from helpers import TOL


def _pages(gen, n_tokens, page_size, next_page):
    n = -(-n_tokens // page_size)
    ids = list(range(next_page, next_page + n))
    last = n_tokens - (n - 1) * page_size if n else 0
    return ids, last


def _plain_decode(variant, page_size, tables, last, hq, hkv, d, q_dtype=torch.float16):
    """The reference: one plain paged decode over each request's full page table."""
    i32 = dict(dtype=torch.int32)
    plain = ja.BatchDecode(variant, page_size=page_size, device="cpu")
    indptr = torch.tensor([0, *torch.tensor([len(x) for x in tables]).cumsum(0).tolist()], **i32)
    plain.plan(indptr, torch.tensor(sum(tables, []), **i32), torch.tensor(last, **i32), hq, hkv,
               d, q_dtype=q_dtype)
    return plain


def test_cascade_decode_equals_plain_decode():
    """Parallel sampling: 6 continuations of one 150-token prompt, each with its own history."""
    gen = torch.Generator().manual_seed(0)
    page_size, hq, hkv, d = 16, 8, 2, 64
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    prompt_pages, prompt_last = _pages(gen, 144, page_size, 0)   # 9 full pages, shared
    unique = [5, 1, 17, 40, 2, 16]
    next_page, uniq_ids, uniq_last = len(prompt_pages), [], []
    for n in unique:
        ids, last = _pages(gen, n, page_size, next_page)
        next_page += len(ids)
        uniq_ids.append(ids)
        uniq_last.append(last)
    cache = tuple(torch.randn(next_page + 2, page_size, hkv, d, generator=gen).half()
                  for _ in range(2))
    q = torch.randn(len(unique), hq, d, generator=gen).half()
    i32 = dict(dtype=torch.int32)

    cd = ja.CascadeDecode(variant, page_size=page_size, device="cpu")
    cd.plan(torch.tensor(prompt_pages, **i32), prompt_last,
            torch.tensor([0, *torch.tensor([len(x) for x in uniq_ids]).cumsum(0).tolist()], **i32),
            torch.tensor(sum(uniq_ids, []), **i32), torch.tensor(uniq_last, **i32), hq, hkv, d)
    got, got_lse = cd.run(q, cache, return_lse=True)

    # plain decode: every request's page table lists the prompt pages, then its own
    full = [prompt_pages + ids for ids in uniq_ids]
    plain = _plain_decode(variant, page_size, full, uniq_last, hq, hkv, d)
    ref, ref_lse = plain.run(q, cache, return_lse=True)
    torch.testing.assert_close(got, ref, **TOL[torch.float16])
    torch.testing.assert_close(got_lse, ref_lse, atol=2e-3, rtol=1e-4)


def test_three_levels_system_prompt_fewshot_history():
    gen = torch.Generator().manual_seed(1)
    page_size, hq, hkv, d = 4, 4, 4, 64
    variant = ja.Variant("causal", mask="causal")
    cache = tuple(torch.randn(40, page_size, hkv, d, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(4, hq, d, generator=gen).bfloat16()
    i32 = dict(dtype=torch.int32)
    system = [0, 1, 2]                        # all 4 requests, 12 tokens
    fewshot = {0: [3, 4], 1: [5]}             # requests 0-1 share [3, 4]; 2-3 share [5]
    history = [[6], [7, 8], [9], []]          # request 3 has no history of its own
    history_last = [3, 4, 1, 0]
    levels = ja.MultiLevelCascade(variant, 3, page_size=page_size, device="cpu")
    levels.plan(
        qo_indptr=[torch.tensor([0, 4], **i32), torch.tensor([0, 2, 4], **i32),
                   torch.arange(5, **i32)],
        kv_indptr=[torch.tensor([0, 3], **i32), torch.tensor([0, 2, 3], **i32),
                   torch.tensor([0, 1, 3, 4, 4], **i32)],
        kv_indices=[torch.tensor(system, **i32), torch.tensor(fewshot[0] + fewshot[1], **i32),
                    torch.tensor(sum(history, []), **i32)],
        kv_last_page_len=[torch.tensor([4], **i32), torch.tensor([4, 4], **i32),
                          torch.tensor(history_last, **i32)],
        num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.bfloat16)
    got = levels.run(q, cache)
    full = [system + fewshot[0] + history[0], system + fewshot[0] + history[1],
            system + fewshot[1] + history[2], system + fewshot[1]]
    last = [3, 4, 1, 4]
    plain = _plain_decode(variant, page_size, full, last, hq, hkv, d, q_dtype=torch.bfloat16)
    torch.testing.assert_close(got, plain.run(q, cache), **TOL[torch.bfloat16])


def test_position_reading_variants_are_refused():
    with pytest.raises(ValueError, match=r"CascadeDecode merges levels .* depend on "
                                         r"\['positions'\] .* use BatchDecode"):
        ja.CascadeDecode(ja.Variant("w", window_left=8), device="cpu")
    with pytest.raises(RuntimeError, match="before plan"):
        ja.MultiLevelCascade(ja.Variant("c"), 2, device="cpu").run(torch.zeros(1, 4, 64), None)


def test_level_rows_are_checked():
    levels = ja.MultiLevelCascade(ja.Variant("c"), 2, page_size=4, device="cpu")
    i32 = dict(dtype=torch.int32)
    args = ([torch.tensor([0, 2], **i32)] * 2, [torch.tensor([0, 1], **i32)] * 2,
            [torch.tensor([0], **i32)] * 2, [torch.tensor([4], **i32)] * 2, 4, 4, 64)
    with pytest.raises(ValueError, match="distinct rows"):
        levels.plan(*args, q_rows=[torch.tensor([0, 0]), None])
    levels.plan(*args, q_rows=[torch.tensor([3, 1]), None])
    cache = tuple(torch.randn(2, 4, 4, 64).half() for _ in range(2))
    with pytest.raises(ValueError, match="uses rows up to 3"):
        levels.run(torch.randn(2, 4, 64).half(), cache)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        levels.run([[0.0]], cache)
    # fractional rows were truncated to other rows; a short list raised IndexError
    for q_rows, error, text in (([[0.2, 1.7], None], TypeError,
                                 r"q_rows\[0\] must hold integer rows of q, got torch.float32"),
                                (["ab", None], TypeError, r"q_rows\[0\] must hold integer rows"),
                                ([None], ValueError, "q_rows must be a list of 2 entries .* "
                                                     "got list of 1"),
                                (torch.tensor([0, 1]), ValueError, "got Tensor")):
        levels.plan(*args)
        with pytest.raises(error, match=text):
            levels.plan(*args, q_rows=q_rows)
        # the failed plan leaves none: run() raised nothing and ran the previous plan
        with pytest.raises(RuntimeError, match="before plan"):
            levels.run(torch.randn(4, 4, 64).half(), cache)
    bad = (args[0], args[1], args[2], [torch.tensor([4], **i32), torch.tensor([9], **i32)]) + \
        args[4:]
    with pytest.raises(ValueError, match=r"level 1: kv_last_page_len\[0\] is 9"):
        levels.plan(*bad)
    with pytest.raises(RuntimeError, match="before plan\\(\\) \\(or after a plan\\(\\) that "
                                           "raised\\)"):
        levels.run(torch.randn(4, 4, 64).half(), cache)
    with pytest.raises(ValueError, match="mask"):
        ja.MultiLevelCascade(ja.Variant("m", mask="custom"), 2, device="cpu")


def test_an_empty_level_takes_an_empty_row_list_and_q_must_be_3d():
    """q_rows=[[], ...] for a level without queries was refused as float32 rows (an empty list
    is a float32 tensor); a 0-dim q raised IndexError from both cascades' run()."""
    i32 = dict(dtype=torch.int32)
    levels = ja.MultiLevelCascade(ja.Variant("c", mask="causal"), 2, page_size=16, device="cpu")
    cache = tuple(torch.randn(4, 16, 2, 64).half() for _ in range(2))
    levels.plan([torch.tensor([0, 0], **i32), torch.tensor([0, 1, 2], **i32)],
                [torch.tensor([0, 1], **i32), torch.tensor([0, 1, 2], **i32)],
                [torch.tensor([0], **i32), torch.tensor([1, 2], **i32)],
                [torch.tensor([5], **i32), torch.tensor([3, 4], **i32)], 4, 2, 64,
                q_rows=[[], [1, 0]])
    q = torch.randn(2, 4, 64).half()
    expected = _plain_decode(ja.Variant("c", mask="causal"), 16, [[2], [1]], [4, 3], 4, 2,
                             64).run(q, cache)
    torch.testing.assert_close(levels.run(q, cache), expected, **TOL[torch.float16])
    with pytest.raises(ValueError, match=r"q has shape \(\); expected \[total_q, "):
        levels.run(torch.tensor(1.0).half(), cache)
    cd = ja.CascadeDecode(ja.Variant("c", mask="causal"), page_size=16, device="cpu")
    cd.plan(torch.tensor([0], **i32), 16, torch.tensor([0, 1, 2], **i32),
            torch.tensor([1, 2], **i32), torch.tensor([3, 4], **i32), 4, 2, 64)
    with pytest.raises(ValueError, match=r"q has shape \(\); the plan expects \(2, 4, 64\)"):
        cd.run(torch.tensor(1.0).half(), cache)


@pytest.mark.parametrize("shared_rows", [[2, 0], [1, 2]], ids=["gathered", "consecutive"])
def test_levels_covering_some_rows(shared_rows):
    """A shared level that only some rows attend to (scattered rows or a consecutive run):
    those rows see shared + own pages, the others only their own."""
    gen = torch.Generator().manual_seed(3)
    page_size, hq, hkv, d = 4, 4, 2, 64
    variant = ja.Variant("plain")
    cache = tuple(torch.randn(12, page_size, hkv, d, generator=gen).half() for _ in range(2))
    q = torch.randn(4, hq, d, generator=gen).half()
    i32 = dict(dtype=torch.int32)
    system, own, own_last = [0, 1], [[2], [3, 4], [5], [6, 7]], [3, 4, 2, 1]
    levels = ja.MultiLevelCascade(variant, 2, page_size=page_size, device="cpu")
    levels.plan(
        qo_indptr=[torch.tensor([0, 2], **i32), torch.arange(5, **i32)],
        kv_indptr=[torch.tensor([0, 2], **i32), torch.tensor([0, 1, 3, 4, 6], **i32)],
        kv_indices=[torch.tensor(system, **i32), torch.tensor(sum(own, []), **i32)],
        kv_last_page_len=[torch.tensor([4], **i32), torch.tensor(own_last, **i32)],
        num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_rows=[torch.tensor(shared_rows), None])
    got, got_lse = levels.run(q, cache, return_lse=True)
    full = [(system if r in shared_rows else []) + own[r] for r in range(4)]
    plain = _plain_decode(variant, page_size, full, own_last, hq, hkv, d)
    ref, ref_lse = plain.run(q, cache, return_lse=True)
    torch.testing.assert_close(got, ref, **TOL[torch.float16])
    torch.testing.assert_close(got_lse, ref_lse, atol=2e-3, rtol=1e-4)
    out, lse = torch.full_like(q, 3.0), torch.full_like(got_lse, 3.0)  # the merge writes them
    levels.run(q, cache, out=out, lse=lse)
    torch.testing.assert_close((out, lse), (got, got_lse), rtol=0, atol=0)


def test_auto_takes_plain_decode_when_the_prefix_is_short():
    """"auto" runs one plain paged decode when the bytes a cascade saves would not pay for its
    extra launches; both choices give the same attention."""
    gen = torch.Generator().manual_seed(4)
    page_size, hq, hkv, d = 4, 8, 2, 64
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    cache = tuple(torch.randn(30, page_size, hkv, d, generator=gen).half() for _ in range(2))
    q = torch.randn(3, hq, d, generator=gen).half()
    i32 = dict(dtype=torch.int32)
    args = (torch.tensor([0, 1, 2], **i32), 4, torch.tensor([0, 2, 2, 5], **i32),
            torch.tensor([3, 4, 5, 6, 7], **i32), torch.tensor([2, 0, 1], **i32), hq, hkv, d)
    results = {}
    for strategy in ("auto", "cascade", "plain"):
        cd = ja.CascadeDecode(variant, page_size=page_size, strategy=strategy, device="cpu")
        assert cd.plan(*args) == (strategy if strategy != "auto" else "plain") == cd.chosen
        results[strategy] = cd.run(q, cache, return_lse=True)
    for strategy in ("auto", "plain"):
        torch.testing.assert_close(results[strategy][0], results["cascade"][0],
                                   **TOL[torch.float16])
        torch.testing.assert_close(results[strategy][1], results["cascade"][1], atol=2e-3,
                                   rtol=1e-4)
    cd = ja.CascadeDecode(variant, page_size=page_size, device="cpu")
    assert cd.choose(64, 32768, 8, 128) == "cascade" and cd.choose(16, 1024, 8, 128) == "plain"
    for bad, error, text in (((-4, 100, 8, 128), ValueError, "batch=-4"),
                             ((4, -100, 8, 128), ValueError, "prefix_len=-100"),
                             ((4, 100, 0, 128), ValueError, "num_kv_heads=0"),
                             ((4, 100.0, 8, 128), TypeError, "prefix_len=100.0")):
        with pytest.raises(error, match=text):  # (it answered "plain")
            cd.choose(*bad)
    # a prefix that ends inside a page cannot be one plain page table: cascade, or an error
    partial = (args[0], 3) + args[2:]
    assert cd.plan(*partial) == "cascade"
    with pytest.raises(ValueError, match="page boundary"):
        ja.CascadeDecode(variant, page_size=page_size, strategy="plain",
                         device="cpu").plan(*partial)
    # plain lists the prefix's 3 pages in each of the 3 tables: 9 + 5 pages, over a capacity
    # of 7 that the cascade's levels fit (auto takes the cascade there)
    small = dict(page_size=page_size, device="cpu", max_num_pages=7)
    with pytest.raises(ValueError, match=r"strategy 'plain': the batch uses 14 pages, more "
                                         r"than max_num_pages=7 .* prefix's 3 pages in each of "
                                         r"the 3 requests' tables, before their own 5"):
        ja.CascadeDecode(variant, strategy="plain", **small).plan(*args)
    assert ja.CascadeDecode(variant, **small).plan(*args) == "cascade"
    # the cascade's first level holds the prefix's 3 pages (the requests' own 2 fit): its
    # error named the batch's
    own2 = args[:2] + (torch.tensor([0, 1, 1, 2], **i32), torch.tensor([3, 4], **i32),
                       torch.tensor([2, 0, 1], **i32)) + args[5:]
    with pytest.raises(ValueError, match=r"strategy 'cascade': the shared prefix "
                                         r"\(shared_kv_indices, 3 pages\) is the first level's "
                                         r"batch, and the batch uses 3 pages, more than "
                                         r"max_num_pages=2"):
        ja.CascadeDecode(variant, page_size=page_size, device="cpu", strategy="cascade",
                         max_num_pages=2).plan(*own2)
    with pytest.raises(ValueError, match=r"strategy 'auto', which took the cascade: the shared "
                                         r"prefix \(shared_kv_indices, 3 pages\)"):
        ja.CascadeDecode(variant, page_size=page_size, device="cpu", max_num_pages=2).plan(*own2)
    # plain's one table per request would hold 2**30 keys or more, each level's fewer: auto
    # takes the cascade (it raised "a request has 1179648000 key tokens")
    n, big = 9000, 1 << 16
    long = (torch.zeros(n, **i32), big, torch.tensor([0, n], **i32), torch.ones(n, **i32),
            torch.tensor([big], **i32), hq, hkv, d)
    assert ja.CascadeDecode(variant, page_size=big, device="cpu").plan(*long) == "cascade"
    with pytest.raises(ValueError, match=r"strategy 'plain': a request's table would hold "
                                         r"1179648000 keys \(the prefix's 589824000 before its "
                                         r"own\); expected fewer than 1073740800"):
        ja.CascadeDecode(variant, page_size=big, device="cpu", strategy="plain").plan(*long)


def test_a_plan_call_refused_before_its_body_leaves_no_plan():
    """A plan() call that Python refuses before plan's body runs (a keyword it does not take,
    one positional argument too many: FlashInfer's page_size) leaves no plan either, for the
    cascades and SharedPrefixPrefill: run() raises until the next plan() (it ran the previous
    plan's pages)."""
    i32 = dict(dtype=torch.int32)
    variant = ja.Variant("c_refused")
    cache = tuple(torch.randn(20, 4, 2, 64).half() for _ in range(2))
    q = torch.randn(2, 4, 64).half()
    decode = (torch.tensor([0, 1], **i32), 4, torch.tensor([0, 1, 3], **i32),
              torch.tensor([2, 3, 4], **i32), torch.tensor([2, 3], **i32), 4, 2, 64)
    for strategy in ("plain", "cascade"):
        cd = ja.CascadeDecode(variant, page_size=4, strategy=strategy, device="cpu")
        for bad_args, bad_kwargs in ((decode, dict(data_type=torch.float16)),
                                     (decode + (4,), {})):
            assert cd.plan(*decode) == strategy
            kept = cd.run  # (under plain: plain's own run())
            with pytest.raises(TypeError):
                cd.plan(*bad_args, **bad_kwargs)
            assert cd.chosen is None
            for run in (cd.run, kept):
                with pytest.raises(RuntimeError, match="before plan"):
                    run(q, cache)
    levels = ja.MultiLevelCascade(variant, 2, page_size=4, device="cpu")
    two = ([torch.tensor([0, 2], **i32)] * 2, [torch.tensor([0, 1], **i32)] * 2,
           [torch.tensor([0], **i32), torch.tensor([1], **i32)], [torch.tensor([4], **i32)] * 2,
           4, 2, 64)
    levels.plan(*two)
    with pytest.raises(TypeError):
        levels.plan(*two, causal=True)
    with pytest.raises(RuntimeError, match="before plan"):
        levels.run(q, cache)
    sp = ja.SharedPrefixPrefill(ja.Variant("c_refused_sp", mask="causal"), "ragged", device="cpu")
    sp.plan(5, [2, 3], 4, 2, 64)
    with pytest.raises(TypeError):
        sp.plan(5, [2, 3], 4, 2, 64, causal=True)
    with pytest.raises(RuntimeError, match="before plan"):
        sp.run(*(torch.randn(10, h, 64).half() for h in (4, 2, 2)))


def test_cascade_decode_errors_name_it_whichever_strategy_runs():
    """CascadeDecode's run() errors are the same under either strategy and name CascadeDecode
    (under plain, run() is BatchDecode's: they named BatchDecode, and a return_lse given
    positionally was called a second cache argument); an out partly inside q is refused by
    both (only plain refused it, so a call that worked could fail when auto switched); the
    layout error lists no 'ragged', and the dtype hints no kv_dtype=, which CascadeDecode does
    not take."""
    i32 = dict(dtype=torch.int32)
    variant = ja.Variant("c_names")
    k, v = (torch.randn(20, 4, 2, 64).half() for _ in range(2))
    buf = torch.randn(3, 4, 64).half()
    decode = (torch.tensor([0, 1], **i32), 4, torch.tensor([0, 1, 3], **i32),
              torch.tensor([2, 3, 4], **i32), torch.tensor([2, 3], **i32), 4, 2, 64)
    for strategy in ("plain", "cascade"):
        cd = ja.CascadeDecode(variant, page_size=4, strategy=strategy, device="cpu")
        cd.plan(*decode)
        with pytest.raises(TypeError, match=r"CascadeDecode\.run\(\) takes the cache as one "
                                            r"argument: .* got 3 positional"):
            cd.run(buf[:2], k, v)
        with pytest.raises(TypeError, match=r"CascadeDecode\.run\(\) takes return_lse as a "
                                            r"keyword: run\(q, kv_cache, return_lse=True\)"):
            cd.run(buf[:2], (k, v), True)
        with pytest.raises(TypeError, match=r"return_lse as a keyword: .*return_lse=True\)"):
            cd.run(buf[:2], (k, v), 1)
        # FlashInfer's run(q, paged_kv_cache=): named, with this wrapper's name (the plain
        # strategy's run is BatchDecode's: it said BatchPrefill.run() missing an argument)
        with pytest.raises(TypeError, match=r"CascadeDecode\.run\(\) needs kv_cache, its "
                                            r"second argument: .*paged_kv_cache= is this"):
            cd.run(buf[:2], paged_kv_cache=(k, v))
        with pytest.raises(TypeError, match=r"CascadeDecode\.run\(\) needs kv_cache"):
            cd.run(buf[:2])
        with pytest.raises(ValueError, match="out shares memory with q"):
            cd.run(buf[:2], (k, v), out=buf[1:3])
        with pytest.raises(TypeError, match="out must be a torch.Tensor, got list"):
            cd.run(buf[:2], (k, v), out=[1])  # (an AttributeError from the overlap check)
        q = buf[:2].clone()
        want = cd.run(q.clone(), (k, v))
        torch.testing.assert_close(cd.run(q, (k, v), out=q), want, rtol=0, atol=0)  # in place
        for name, text in (("data_type", "data_type= is q_dtype= here \\(the caches are read "
                                         "in q's dtype\\)"),
                           ("kv_data_type", "kv_data_type= is not taken here")):
            with pytest.raises(TypeError, match=text):
                cd.plan(*decode, **{name: torch.float16})
    with pytest.raises(ValueError, match="kv_layout='nhd': expected 'NHD' or 'HND'$"):
        ja.CascadeDecode(variant, 16, "nhd", device="cpu")


def test_auto_follows_its_latest_choice_and_fills_output_buffers():
    """A plan that switches auto from plain to the cascade (and back) runs the new choice;
    out / lse buffers are filled whichever it took (the cascade used to raise a duplicate
    keyword TypeError for them while plain took them)."""
    gen = torch.Generator().manual_seed(5)
    page_size, hq, hkv, d = 4, 8, 2, 64
    variant = ja.Variant("causal", mask="causal")
    cache = tuple(torch.randn(30, page_size, hkv, d, generator=gen).half() for _ in range(2))
    q = torch.randn(3, hq, d, generator=gen).half()
    i32 = dict(dtype=torch.int32)
    aligned = (torch.tensor([0, 1, 2], **i32), 4, torch.tensor([0, 2, 2, 5], **i32),
               torch.tensor([3, 4, 5, 6, 7], **i32), torch.tensor([2, 0, 1], **i32), hq, hkv, d)
    partial = (aligned[0], 3) + aligned[2:]  # ends inside a page: the cascade
    auto = ja.CascadeDecode(variant, page_size=page_size, device="cpu")
    for args, chosen in ((aligned, "plain"), (partial, "cascade"), (aligned, "plain")):
        assert auto.plan(*args) == chosen
        fixed = ja.CascadeDecode(variant, page_size=page_size, strategy=chosen, device="cpu")
        fixed.plan(*args)
        want_o, want_lse = fixed.run(q, cache, return_lse=True)
        torch.testing.assert_close(auto.run(q, cache), want_o, rtol=0, atol=0)
        out, lse = torch.full_like(q, 7.0), torch.full((3, hq), 7.0)
        got = auto.run(q, cache, out=out, lse=lse, return_lse=True)
        assert got[0] is out and got[1] is lse
        torch.testing.assert_close((out, lse), (want_o, want_lse), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"lse is \(3, 4\) torch.float32 on cpu; expected "
                                             r"\(3, 8\)"):
            auto.run(q, cache, lse=torch.empty(3, 4))
        with pytest.raises(ValueError, match=r"CascadeDecode.run\(\) takes no k_scale"):
            auto.run(q, cache, k_scale=2.0)
        with pytest.raises(ValueError, match=r"CascadeDecode.run\(\) takes no v_scale"):
            auto.run(q, cache, v_scale=0.5)
        # (1, which changes nothing, is taken whichever strategy runs)
        torch.testing.assert_close(auto.run(q, cache, k_scale=1.0, v_scale=1), want_o,
                                   rtol=0, atol=0)
    # plain's own run() is auto's (no host work on top of plain decode's) ...
    auto.plan(*aligned)
    assert auto.run == auto.plain.run
    kept_plain, kept_partial = auto.run, functools.partial(auto.run, q, cache)
    with torch.inference_mode():
        compiled = torch.compile(auto.run, backend="aot_eager")
        compiled(q, cache)
    auto.plan(*partial)
    kept_cascade = auto.run
    # ... and a reference kept from a plain plan (plain's run(), whose plan is then dropped)
    # runs the cascade once a plan chose it, not plain's stale plan; one kept from a cascade
    # plan follows the latest choice
    want = auto.run(q, cache)
    for kept in (kept_plain, kept_partial):
        torch.testing.assert_close(kept() if kept is kept_partial else kept(q, cache), want,
                                   rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(q, cache), want, rtol=0, atol=0)
    auto.plan(*aligned)
    torch.testing.assert_close(kept_cascade(q, cache), auto.run(q, cache), rtol=0, atol=0)
    torch.testing.assert_close(auto.run(q, cache, k_scale=np.float64(1.0)), want_o, rtol=0,
                               atol=0)
    kept_plain = auto.run
    with pytest.raises(ValueError, match="shared_last_page_len=9"):
        auto.plan(*((aligned[0], 9) + aligned[2:]))
    with pytest.raises(RuntimeError, match=r"CascadeDecode.run\(\) called before plan\(\)"):
        kept_plain(q, cache)  # (plain's run, forwarding to the cascade's: no plan now)


def test_cascade_decode_is_freed_without_the_cycle_collector():
    """The inner plain decode forwards to its CascadeDecode through a weak reference: deleting
    the wrapper frees it (and its workspaces) at once."""
    i32 = dict(dtype=torch.int32)
    args = (torch.tensor([0, 1], **i32), 3, torch.tensor([0, 2, 2, 5], **i32),
            torch.tensor([3, 4, 5, 6, 7], **i32), torch.tensor([2, 0, 1], **i32), 8, 2, 64)
    cd = ja.CascadeDecode(ja.Variant("plain_gc"), page_size=4, device="cpu")
    assert cd.plan(*args) == "cascade"
    kept = cd.plain.run
    alive, plain_alive = weakref.ref(cd), weakref.ref(cd.plain)
    gc.disable()
    try:
        del cd
        assert alive() is None and plain_alive() is not None  # (kept holds the inner plain)
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="belongs to a CascadeDecode that no longer exists"):
        kept(torch.randn(3, 8, 64).half(), tuple(torch.randn(30, 4, 2, 64).half()
                                                 for _ in range(2)))


def test_auto_binds_plain_run_only_over_its_own():
    """A subclass's run() and a run() set on the instance (a profiler's wrapper, a mock) stay
    in place after a plan that chose plain."""
    i32 = dict(dtype=torch.int32)
    args = (torch.tensor([0, 1], **i32), 4, torch.tensor([0, 2, 2, 5], **i32),
            torch.tensor([3, 4, 5, 6, 7], **i32), torch.tensor([2, 0, 1], **i32), 8, 2, 64)
    cache = tuple(torch.randn(30, 4, 2, 64).half() for _ in range(2))
    q = torch.randn(3, 8, 64).half()
    calls = []

    class Counted(ja.CascadeDecode):
        def run(self, *a, **k):
            calls.append("subclass")
            return super().run(*a, **k)
    cd = Counted(ja.Variant("plain_sub"), page_size=4, device="cpu")
    assert cd.plan(*args) == "plain"
    want = cd.run(q, cache)
    assert calls == ["subclass"]
    cd = ja.CascadeDecode(ja.Variant("plain_sub"), page_size=4, device="cpu")
    inner = cd.run
    cd.run = lambda *a, **k: calls.append("instance") or inner(*a, **k)
    assert cd.plan(*args) == "plain"
    torch.testing.assert_close(cd.run(q, cache), want, rtol=0, atol=0)
    assert calls == ["subclass", "instance"]


def test_auto_keeps_the_cascade_when_plain_tables_would_not_fit():
    """Plain decode repeats the prefix's pages in every request's table; with a page capacity
    sized for the cache, "auto" stays on the cascade instead of failing."""
    variant = ja.Variant("plain")
    i32 = dict(dtype=torch.int32)
    batch, prefix_pages = 8, 6
    args = (torch.arange(prefix_pages, **i32), 4, torch.arange(batch + 1, **i32),
            torch.arange(prefix_pages, prefix_pages + batch, **i32), torch.full((batch,), 2, **i32),
            4, 2, 64)
    cd = ja.CascadeDecode(variant, page_size=4, device="cpu", max_num_pages=20)
    assert cd.choose(batch, prefix_pages * 4, 2, 64) == "plain"
    assert cd.plan(*args) == "cascade"


@pytest.mark.parametrize("strategy", ["cascade", "plain", "auto"])
def test_every_strategy_checks_the_plan_arguments_alike(strategy):
    """"plain" (and "auto" when it takes plain) checked nothing itself: a kv_last_page_len one
    entry short was broadcast (a silent wrong answer), int64 indices were converted. Every
    strategy now raises the same errors naming CascadeDecode.plan's arguments; and run()
    refuses a q with more rows than requests (the cascade returned an extra row of zeros)."""
    i32 = dict(dtype=torch.int32)
    hq, hkv, d, page_size = 8, 2, 64, 4
    good = dict(shared_kv_indices=torch.tensor([0, 1], **i32), shared_last_page_len=4,
                unique_kv_indptr=torch.tensor([0, 1, 3], **i32),
                unique_kv_indices=torch.tensor([2, 3, 4], **i32),
                unique_kv_last_page_len=torch.tensor([2, 3], **i32), num_qo_heads=hq,
                num_kv_heads=hkv, head_dim=d)
    bad = [
        (dict(unique_kv_last_page_len=torch.tensor([2], **i32)), ValueError,
         r"unique_kv_last_page_len has 1 entries; unique_kv_indptr's 3 make a batch of 2"),
        (dict(unique_kv_indices=torch.tensor([2, 3, 4])), TypeError,
         r"unique_kv_indices has dtype torch.int64"),
        (dict(unique_kv_indptr=[0, 1, 3]), TypeError, r"unique_kv_indptr must be a torch.Tensor"),
        (dict(unique_kv_indptr=torch.tensor([0, 2, 1], **i32)), ValueError,
         r"unique_kv_indptr must be non-decreasing"),
        (dict(unique_kv_indptr=torch.tensor([1, 2, 3], **i32)), ValueError,
         r"unique_kv_indptr\[0\] is 1; expected 0"),
        (dict(unique_kv_last_page_len=torch.tensor([2, 5], **i32)), ValueError,
         r"unique_kv_last_page_len\[1\] is 5"),
        (dict(shared_kv_indices=torch.tensor([0, -1], **i32)), ValueError,
         r"shared_kv_indices holds a negative page id"),
        (dict(shared_kv_indices=torch.tensor([0, 1])), TypeError,
         r"shared_kv_indices has dtype torch.int64"),
        (dict(shared_last_page_len=5), ValueError, r"shared_last_page_len=5: expected an int in"),
        (dict(shared_last_page_len=2.0), TypeError, r"shared_last_page_len=2.0"),
        (dict(shared_last_page_len=True), TypeError, r"shared_last_page_len=True"),
    ]
    variant = ja.Variant("plain")
    for change, error, message in bad:
        cd = ja.CascadeDecode(variant, page_size=page_size, strategy=strategy, device="cpu")
        with pytest.raises(error, match=message):
            cd.plan(**{**good, **change})
        with pytest.raises(RuntimeError, match=r"CascadeDecode.run\(\) called before plan"):
            cd.run(torch.randn(2, hq, d).half(), (torch.randn(8, page_size, hkv, d).half(),) * 2)
    cd = ja.CascadeDecode(variant, page_size=page_size, strategy=strategy, device="cpu")
    cd.plan(**good)
    cache = tuple(torch.randn(8, page_size, hkv, d).half() for _ in range(2))
    assert cd.run(torch.randn(2, hq, d).half(), cache).shape == (2, hq, d)
    with pytest.raises(ValueError,
                       match=r"q has shape \(3, 8, 64\); the plan expects \(2, 8, 64\)"):
        cd.run(torch.randn(3, hq, d).half(), cache)


def test_cascade_decode_refuses_a_ragged_layout_it_cannot_plan():
    """CascadeDecode(kv_layout="ragged") was built, but its plan() takes page tables, which the
    ragged levels refuse, and a table of None the argument checks refuse: no plan could
    succeed. The constructor now says so and names what works."""
    with pytest.raises(ValueError, match="MultiLevelCascade\\(variant, 2, kv_layout='ragged'\\)"):
        ja.CascadeDecode(ja.Variant("c", mask="causal"), kv_layout="ragged", device="cpu")


def test_each_cascade_checks_its_constructor_keywords_once(monkeypatch):
    """CascadeDecode checked its keywords, then MultiLevelCascade.__init__ checked them again;
    each constructor now checks once, with the same messages."""
    from jitattn.cascade import MultiLevelCascade
    calls, check = [], MultiLevelCascade._refuse_unknown

    def counted(self, capacities):
        calls.append(type(self).__name__)
        check(self, capacities)
    monkeypatch.setattr(MultiLevelCascade, "_refuse_unknown", counted)
    ja.CascadeDecode(ja.Variant("c"), device="cpu", max_batch_size=4)
    ja.MultiLevelCascade(ja.Variant("c"), 2, device="cpu", max_batch_size=4)
    assert calls == ["CascadeDecode", "MultiLevelCascade"]
    with pytest.raises(TypeError, match=r"CascadeDecode\(\) got unexpected keyword arguments "
                                        r"\['num_levels'\]"):
        ja.CascadeDecode(ja.Variant("c"), device="cpu", num_levels=2)


def test_causal_shared_levels_need_their_queries_after_the_shared_keys():
    """A causal variant's shared levels attend without a mask: a request whose queries would
    come before some shared key (fewer than qo_len - 1 keys of its own: query 0 of 3 over one
    own key gave 0.126 off the reference) is refused; with qo_len - 1 own keys the cascade
    equals attention over the whole sequence."""
    from jitattn import reference
    i32 = dict(dtype=torch.int32)
    variant = ja.Variant("causal_levels", mask="causal")
    q = torch.randn(3, 1, 64).half()
    m = ja.MultiLevelCascade(variant, 2, page_size=4, device="cpu")
    levels = ([torch.tensor([0, 3], **i32)] * 2,
              [torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32)],
              [torch.tensor([0, 1], **i32), torch.tensor([2], **i32)])
    with pytest.raises(ValueError, match=r"level 1's request 0 has 3 queries and 1 keys of its "
                                         r"own, and a shared level also holds row 0 of q.* at "
                                         r"least qo_len - 1 = 2 keys"):
        m.plan(*levels, [torch.tensor([4], **i32), torch.tensor([1], **i32)], 1, 1, 64)
    with pytest.raises(RuntimeError, match="before plan"):
        m.run(q, tuple(torch.randn(3, 4, 1, 64).half() for _ in range(2)))
    kc, vc = (torch.randn(3, 4, 1, 64).half() for _ in range(2))
    m.plan(*levels, [torch.tensor([4], **i32), torch.tensor([2], **i32)], 1, 1, 64)
    k, v = (torch.cat([c[0], c[1], c[2, :2]]) for c in (kc, vc))
    torch.testing.assert_close(m.run(q, (kc, vc)).double(), reference.attention(q, k, v, variant),
                               **TOL[torch.float16])


def test_q_rows_are_copied_at_plan():
    """The caller's q_rows tensor may change after plan(): run() keeps the planned rows (a CPU
    tensor was kept by reference, and a later row past q raised inside torch's indexing)."""
    i32 = dict(dtype=torch.int32)
    cache = tuple(torch.randn(12, 4, 2, 64).half() for _ in range(2))
    q = torch.randn(4, 4, 64).half()
    m = ja.MultiLevelCascade(ja.Variant("rows_copied", mask="none"), 2, page_size=4,
                             device="cpu")
    rows = torch.tensor([2, 0])
    m.plan([torch.tensor([0, 2], **i32), torch.arange(5, **i32)],
           [torch.tensor([0, 2], **i32), torch.tensor([0, 1, 3, 4, 6], **i32)],
           [torch.tensor([0, 1], **i32), torch.arange(2, 8, **i32)],
           [torch.tensor([4], **i32), torch.tensor([3, 4, 2, 1], **i32)], 4, 2, 64,
           q_rows=[rows, None])
    before = m.run(q, cache)
    rows[0] = 7
    assert torch.equal(m.run(q, cache), before)


def test_run_names_the_q_the_caller_passed():
    """A level covering some rows of q named its slice of q in the error ((2, 2, 64) for a
    caller's (3, 2, 64)): run() checks q's heads, head_dim and dtype itself."""
    i32 = dict(dtype=torch.int32)

    def t(*x):
        return torch.tensor(list(x), **i32)
    cache = tuple(torch.randn(4, 4, 2, 64).half() for _ in range(2))
    lv = ja.MultiLevelCascade(ja.Variant("c", mask="causal"), 2, page_size=4, device="cpu")
    lv.plan([t(0, 2), t(0, 1, 2, 3)], [t(0, 1), t(0, 1, 2, 3)], [t(0), t(1, 2, 3)],
            [t(4), t(4, 4, 4)], 4, 2, 64, q_rows=[[2, 0], None])
    with pytest.raises(ValueError, match=r"q is \(3, 2, 64\) torch.float16; the plan expects "
                                         r"\[total_q, 4, 64\] torch.float16"):
        lv.run(torch.randn(3, 2, 64).half(), cache)
    with pytest.raises(TypeError, match=r"q is \(3, 4, 64\) torch.float32"):
        lv.run(torch.randn(3, 4, 64), cache)
