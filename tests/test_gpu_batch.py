"""BatchPrefill / BatchDecode on the GPU (``pytest -m gpu``): every built-in variant x fp16/bf16
x NHD/HND x page sizes 1 and 16 against the reference; determinism; CUDA-graph replay across
plans with different lengths; fp8 KV caches, e4m3 and e5m2."""

import pytest
import torch

import jitattn as ja
from jitattn import catalog, launch, reference

from helpers import (TOL, check, check_batch, check_fp8_across_range, check_fp8_every_byte,
                     check_fp8_rope_near_the_format_max, check_linear_partition, check_out_is_q,
                     check_shared_prefix_batch, compare, every_feature_variant, make_batch,
                     make_paged, quantize_fp8)

pytestmark = pytest.mark.gpu
BUILTIN = catalog.builtin()
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


@pytest.fixture(scope="module", autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def _cumsum(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn(), after one call on a side stream (first launches, allocations)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 1), ("NHD", 3)])
def test_batch_matches_reference(name, dtype, layout, page_size):
    for head_dim, (hq, hkv) in ((128, (32, 8)), (64, (7, 1)), (256, (4, 4))):
        # prefill: mixed lengths incl. an empty query, q_len > kv_len, a one-token request
        qo_lens, kv_lens = [0, 1, 45, 130, 7], [5, 600, 30, 130, 2000]
        variant, params = BUILTIN[name].example(len(qo_lens), hq, hkv, max(qo_lens),
                                                max(kv_lens), "cuda")
        cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, head_dim, page_size,
                                                        layout, dtype, "cuda", seed=head_dim)
        q, *_ = make_batch(qo_lens, kv_lens, hq, hkv, head_dim, dtype, "cuda", seed=1)
        qo_indptr = _cumsum(qo_lens)
        w = ja.BatchPrefill(variant, page_size=page_size, kv_layout=layout)
        w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, head_dim, q_dtype=dtype)
        check_batch(w, variant, params, q, cache, qo_indptr, kv_indptr, kv_indices, last, layout)
        # short prefill (speculative verification): at most 16 packed rows per request run on
        # the decode kernel's 16-row tiles
        qo_lens = {32: [0, 4, 1, 3, 2], 7: [2, 0, 1, 2, 1], 4: [16, 0, 1, 5, 3]}[hq]
        variant, params = BUILTIN[name].example(len(qo_lens), hq, hkv, max(qo_lens),
                                                max(kv_lens), "cuda")
        q, *_ = make_batch(qo_lens, kv_lens, hq, hkv, head_dim, dtype, "cuda", seed=3)
        qo_indptr = _cumsum(qo_lens)
        w = ja.BatchPrefill(variant, page_size=page_size, kv_layout=layout)
        plan = w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, head_dim, q_dtype=dtype)
        assert plan.rows_per_cta == 16
        check_batch(w, variant, params, q, cache, qo_indptr, kv_indptr, kv_indices, last, layout)
        # decode: one token per request, a long request split across CTAs
        kv_lens = [1, 5000, 0, 77, 300, 16]
        variant, params = BUILTIN[name].example(len(kv_lens), hq, hkv, 1, max(kv_lens), "cuda")
        cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, head_dim, page_size,
                                                        layout, dtype, "cuda", seed=7)
        q, *_ = make_batch([1] * len(kv_lens), kv_lens, hq, hkv, head_dim, dtype, "cuda", 2)
        d = ja.BatchDecode(variant, page_size=page_size, kv_layout=layout)
        d.plan(kv_indptr, kv_indices, last, hq, hkv, head_dim, q_dtype=dtype)
        check_batch(d, variant, params, q, cache, _cumsum([1] * len(kv_lens)), kv_indptr,
                    kv_indices, last, layout)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_linear_partition_schedule_matches_reference(kind, monkeypatch):
    check_linear_partition(kind, "cuda", monkeypatch)


def test_deterministic_over_runs():
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    kv_lens = [9000, 100, 3000, 1]
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 8, 128, 16, "NHD", torch.float16,
                                                    "cuda", seed=3)
    q, *_ = make_batch([1] * 4, kv_lens, 32, 8, 128, torch.float16, "cuda", seed=3)
    d = ja.BatchDecode(variant, page_size=16)
    plan = d.plan(kv_indptr, kv_indices, last, 32, 8, 128)
    assert len(plan.merge_rows) > 0
    first = d.run(q, cache)
    for _ in range(10):
        assert torch.equal(d.run(q, cache), first)


def test_cuda_graph_replays_across_plans():
    variant = ja.Variant("alibi_like", mask="causal", score_mod=ja.soft_cap(20.0))
    batch, hq, hkv, head_dim, page_size = 8, 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    lengths = [torch.randint(1, 3000, (batch,), generator=gen).tolist() for _ in range(5)]
    lengths[2][0] = 20000  # one plan with a long request: more items and merges
    num_pages = max(sum(-(-n // page_size) for n in lens) for lens in lengths) + 8
    cache = tuple(torch.randn(num_pages, page_size, hkv, head_dim, generator=gen).half().cuda()
                  for _ in range(2))
    q = torch.empty(batch, hq, head_dim, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")
    d = ja.BatchDecode(variant, page_size=page_size)

    def plan_for(lens, seed):
        g = torch.Generator().manual_seed(seed)
        pages = [-(-n // page_size) for n in lens]
        perm = torch.randperm(num_pages, generator=g)[:sum(pages)].to(torch.int32)
        indptr = _cumsum(pages)
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)],
                            dtype=torch.int32)
        d.plan(indptr, perm, last, hq, hkv, head_dim)
        return indptr, perm, last

    plan_for(lengths[0], 0)
    q.copy_(torch.randn(batch, hq, head_dim, generator=gen).half())
    graph = _capture(lambda: d.run(q, cache, out=out, lse=lse))
    for i, lens in enumerate(lengths):
        indptr, indices, last = plan_for(lens, i)
        q.copy_(torch.randn(batch, hq, head_dim, generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        k, v, tok = reference.paged_to_ragged(cache, indptr, indices, last, "NHD")
        ref_o, ref_lse = reference.attention(q, k, v, variant, qo_indptr=_cumsum([1] * batch),
                                             kv_indptr=tok, return_lse=True)
        torch.testing.assert_close(out, ref_o.half(), **TOL[torch.float16])
        torch.testing.assert_close(lse.double(), ref_lse, atol=3e-3, rtol=1e-4)


def test_cuda_graph_keeps_the_captured_query_tile():
    """A BatchPrefill captured on the 16-row tiles of a short plan replays correctly after a
    plan whose requests are longer (later plans keep the captured kernel), and the reverse."""
    variant = ja.Variant("causal", mask="causal")
    hq, hkv, head_dim, page_size = 32, 8, 128, 16
    kv_lens = [700, 33, 2000, 5]
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, head_dim, page_size, "NHD",
                                                    torch.float16, "cuda", seed=51)
    short, long = [4, 4, 4, 4], [13, 1, 1, 1]  # 16 query rows either way
    for first, second, rows in ((short, long, 16), (long, short, 128)):
        w = ja.BatchPrefill(variant, page_size=page_size)
        q = torch.empty(16, hq, head_dim, dtype=torch.float16, device="cuda")
        out = torch.empty_like(q)
        lse = torch.empty(16, hq, dtype=torch.float32, device="cuda")
        assert w.plan(_cumsum(first), kv_indptr, kv_indices, last, hq, hkv,
                      head_dim).rows_per_cta == rows
        graph = _capture(lambda: w.run(q, cache, out=out, lse=lse))
        for seed, qo_lens in enumerate((second, first)):
            assert w.plan(_cumsum(qo_lens), kv_indptr, kv_indices, last, hq, hkv,
                          head_dim).rows_per_cta == rows
            q.copy_(make_batch(qo_lens, kv_lens, hq, hkv, head_dim, torch.float16, "cuda",
                               seed=seed)[0])
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            k, v, tok = reference.paged_to_ragged(cache, kv_indptr, kv_indices, last, "NHD")
            ref_o, ref_lse = reference.attention(q, k, v, variant, qo_indptr=_cumsum(qo_lens),
                                                 kv_indptr=tok, return_lse=True)
            compare(variant, out, lse, ref_o, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("query_tile", ["auto", "short"])
def test_custom_and_multi_item_masks_gpu(dtype, query_tile):
    """Both masks on the prefill kernel's tiles and on the decode kernel's 16-row tiles
    ("short": requests of 280 packed rows in 18 tiles)."""
    qo_lens, kv_lens = [4, 1, 70], [10, 33, 300]
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 128, 16, "NHD", dtype, "cuda",
                                                    seed=31)
    q, *_ = make_batch(qo_lens, kv_lens, 8, 2, 128, dtype, "cuda", seed=32)
    qo_indptr = _cumsum(qo_lens)
    gen = torch.Generator().manual_seed(33)
    flat = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens)), generator=gen) < 0.3
    custom = ja.Variant("tree", mask="custom")
    w = ja.BatchPrefill(custom, page_size=16, query_tile=query_tile)
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 8, 2, 128, q_dtype=dtype, custom_mask=flat)
    check_batch(w, custom, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last, "NHD",
                custom_mask=flat)

    multi = ja.Variant("multi", mask="multi_item")
    prefix, items = 96, [4, 4, 7, 1, 20]
    total = prefix + sum(items)
    pos = torch.tensor([i + 1 for n in items for i in range(n)], dtype=torch.int32)
    cache, kv_indptr, kv_indices, last = make_paged([total], 2, 128, 16, "NHD", dtype, "cuda",
                                                    seed=34)
    q, *_ = make_batch([total], [total], 8, 2, 128, dtype, "cuda", seed=35)
    qo_indptr = _cumsum([total])
    prefix_len = torch.tensor([prefix], dtype=torch.int32)
    w = ja.BatchPrefill(multi, page_size=16, query_tile=query_tile)
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 8, 2, 128, q_dtype=dtype,
           prefix_len=prefix_len, token_pos_in_items=pos,
           max_item_len=torch.tensor([20], dtype=torch.int32))
    check_batch(w, multi, {}, q, cache, qo_indptr, kv_indptr, kv_indices, last, "NHD",
                prefix_len=prefix_len, token_pos_in_items=pos)


def test_gqa_groups_above_16_gpu():
    """32 query heads on one KV head: one query per request stays on the decode kernel (two
    16-row tiles per request), three run on the prefill kernel, and forced 16-row tiles agree."""
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    for qo_lens, kv_lens in (([1, 1, 1], [900, 1, 40]), ([3, 1, 0], [900, 17, 40])):
        q, k, v, qo_indptr, kv_indptr = make_batch(qo_lens, kv_lens, 32, 1, 128,
                                                   torch.float16, "cuda", seed=43)
        check(variant, {}, q, k, v, qo_indptr, kv_indptr)
        for tile in ("auto", "short"):
            w = ja.BatchPrefill(variant, kv_layout="ragged", query_tile=tile)
            plan = w.plan(qo_indptr, kv_indptr, None, None, 32, 1, 128)
            assert plan.rows_per_cta == (16 if tile == "short" or max(qo_lens) == 1 else 128)
            out, lse = w.run(q, (k, v), return_lse=True)
            ref_o, ref_lse = reference.attention(q, k, v, variant, qo_indptr=qo_indptr,
                                                 kv_indptr=kv_indptr, return_lse=True)
            compare(variant, out, lse, ref_o, ref_lse)


def test_ragged_kv_prefill_gpu():
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    qo_lens, kv_lens = [3, 0, 50, 1, 200], [9, 4, 50, 7000, 333]
    q, k, v, qo_indptr, kv_indptr = make_batch(qo_lens, kv_lens, 32, 8, 128, torch.bfloat16,
                                               "cuda", seed=41)
    w = ja.BatchPrefill(variant, kv_layout="ragged")
    w.plan(qo_indptr, kv_indptr, None, None, 32, 8, 128, q_dtype=torch.bfloat16)
    out, lse = w.run(q, (k, v), return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, variant, qo_indptr=qo_indptr,
                                         kv_indptr=kv_indptr, return_lse=True)
    torch.testing.assert_close(out, ref_o.to(out.dtype), **TOL[torch.bfloat16])
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-2, rtol=1e-4)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 128), (torch.bfloat16, 64)],
                         ids=["f16-d128", "bf16-d64"])
def test_tma_copy_equals_the_cp_async_copy(dtype, head_dim, monkeypatch):
    """Ragged K / V on the wgmma prefill: TMA copies the whole tiles (kv_tma = 1 for these
    tensors), cp.async each range's last, partial tile. Outputs are bit-identical to copying
    every tile with cp.async and match the reference; the rows after k / v in memory (NaN
    here) are never read."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA copy is in the sm_90a kernels")
    qo_lens, kv_lens = [3, 0, 300, 1, 700, 129], [9, 4, 300, 1000, 129, 640]
    q, k, v, qo_indptr, kv_indptr = make_batch(qo_lens, kv_lens, 32, 8, head_dim, dtype,
                                               "cuda", seed=43)

    def poisoned(t):  # t, followed in memory by NaN rows
        buf = torch.full((t.shape[0] + 300, *t.shape[1:]), float("nan"), dtype=t.dtype,
                         device=t.device)
        buf[:t.shape[0]] = t
        return buf[:t.shape[0]]

    k, v = poisoned(k), poisoned(v)
    for box_rows in (128, 192):  # the K/V tiles of the two variants below
        assert launch.tma_values(k, v, False, box_rows)[0] == 1
    for variant in (ja.Variant("causal", mask="causal"),
                    ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))):
        check(variant, {}, q, k, v, qo_indptr, kv_indptr)
        out, lse = ja.attention(q, k, v, variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                return_lse=True)
        with monkeypatch.context() as m:
            m.setattr(launch, "tma_values", lambda k, v, paged, box_rows: (0, bytes(256)))
            out_cp, lse_cp = ja.attention(q, k, v, variant, qo_indptr=qo_indptr,
                                          kv_indptr=kv_indptr, return_lse=True)
        assert torch.equal(out, out_cp) and torch.equal(lse, lse_cp)


def test_batch_decode_under_inductor_fullgraph():
    """BatchDecode.run inside torch.compile(fullgraph=True) (inductor) on the GPU: one op on
    the wrapper, the same output as eager, across two plans."""
    variant = ja.Variant("compiled_decode", mask="causal", score_mod=ja.soft_cap(20.0))
    d = ja.BatchDecode(variant, page_size=16)
    gen = torch.Generator().manual_seed(4)
    cache = tuple(torch.randn(64, 16, 8, 128, generator=gen).half().cuda() for _ in range(2))
    q = torch.randn(4, 32, 128, generator=gen).half().cuda()
    compiled = torch.compile(lambda x: d.run(x, cache) * 1.5, fullgraph=True)
    for lens in ([100, 7, 300, 16], [1, 500, 33, 60]):
        pages = [-(-n // 16) for n in lens]
        d.plan(_cumsum(pages), torch.randperm(64, generator=gen)[:sum(pages)].to(torch.int32),
               torch.tensor([n - (p - 1) * 16 for n, p in zip(lens, pages)], dtype=torch.int32),
               32, 8, 128)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(q), d.run(q, cache) * 1.5)


def test_reduce_overhead_compile_replays_cuda_graphs_across_plans():
    """torch.compile(mode="reduce-overhead") (CUDA graph trees) around BatchDecode.run and
    ja.attention: each records one graph (its three non-static inputs counted once: 12 and 4
    calls replay it; no cudagraph skip) and replays equal eager, across plans of other lengths
    (the op reads the wrapper's current plan on the device)."""
    from torch._dynamo.utils import counters
    counters.clear()
    variant = ja.Variant("ro_decode", mask="causal", score_mod=ja.soft_cap(20.0))
    d = ja.BatchDecode(variant, page_size=16)
    gen = torch.Generator().manual_seed(4)
    cache = tuple(torch.randn(64, 16, 8, 128, generator=gen).half().cuda() for _ in range(2))
    compiled = torch.compile(lambda x: d.run(x, cache) * 1.5, mode="reduce-overhead",
                             fullgraph=True)
    for lens in ([100, 7, 300, 16], [1, 500, 33, 60], [9, 9, 9, 700], [100, 7, 300, 16]):
        pages = [-(-n // 16) for n in lens]
        d.plan(_cumsum(pages), torch.randperm(64, generator=gen)[:sum(pages)].to(torch.int32),
               torch.tensor([n - (p - 1) * 16 for n, p in zip(lens, pages)], dtype=torch.int32),
               32, 8, 128)
        for _ in range(3):
            q = torch.randn(4, 32, 128, generator=gen).half().cuda()
            with torch.inference_mode():
                torch.testing.assert_close(compiled(q).clone(), d.run(q, cache) * 1.5,
                                           rtol=0, atol=0)
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] == 3  # q, k / v cache
    causal = ja.Variant("ro_causal", mask="causal")
    f = torch.compile(lambda q, k, v: ja.attention(q, k, v, causal) + 1, mode="reduce-overhead",
                      fullgraph=True)
    for _ in range(4):
        q, k, v = (torch.randn(300, h, 128, device="cuda").half() for h in (8, 2, 2))
        with torch.inference_mode():
            torch.testing.assert_close(f(q, k, v).clone(), ja.attention(q, k, v, causal) + 1,
                                       rtol=0, atol=0)
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] == 6  # + q, k, v
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 1), ("NHD", 3)])
def test_fp8_kv_cache_matches_reference(dtype, layout, page_size, fp8):
    """fp8 K/V, e4m3 or e5m2 (scales 0.5 / 2.0), against the reference over the dequantized
    cache, for decode and prefill, every head_dim, a soft-cap variant."""
    variant = ja.Variant("fp8_softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    scales = dict(k_scale=0.5, v_scale=2.0)
    for head_dim, (hq, hkv) in ((128, (32, 8)), (64, (7, 1)), (256, (4, 4)), (32, (12, 12))):
        for kind in ("decode", "prefill", "short"):  # short: several queries, 16-row tiles
            qo_lens, kv_lens = {"decode": ([1] * 6, [1, 5000, 0, 77, 300, 16]),
                                "prefill": ([0, 1, 45, 130, 7], [5, 600, 30, 130, 2000]),
                                "short": ([0, 1, 3, 4, 2], [5, 600, 3, 130, 2000])}[kind]
            cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, head_dim, page_size,
                                                            layout, dtype, "cuda", seed=head_dim)
            (k8, k_ref), (v8, v_ref) = (quantize_fp8(c, scales[n], fp8) for c, n in
                                        zip(cache, ("k_scale", "v_scale")))
            q, *_ = make_batch(qo_lens, kv_lens, hq, hkv, head_dim, dtype, "cuda", seed=3)
            qo_indptr = _cumsum(qo_lens)
            if kind == "decode":
                w = ja.BatchDecode(variant, page_size=page_size, kv_layout=layout)
                w.plan(kv_indptr, kv_indices, last, hq, hkv, head_dim, q_dtype=dtype,
                       kv_dtype=fp8)
            else:
                w = ja.BatchPrefill(variant, page_size=page_size, kv_layout=layout,
                                    query_tile="short" if kind == "short" else "long")
                w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, head_dim,
                       q_dtype=dtype, kv_dtype=fp8)
            check_batch(w, variant, {}, q, (k8, v8), qo_indptr, kv_indptr, kv_indices, last,
                        layout, ref_kv_cache=(k_ref, v_ref), scales=scales)


def test_fp8_kv_with_rope_beside_the_16_bit_kernel():
    """One variant (fused RoPE, runtime parameters, window, mask_mod) over a 16-bit cache and
    over its fp8 copies, e4m3 and e5m2, in one process: three kernels, each right (RoPE rotates
    the dequantized K tile)."""
    variant, params = every_feature_variant("cuda")
    kv_lens, scales = [1, 900, 0, 77, 300], dict(k_scale=0.25, v_scale=4.0)
    cache, kv_indptr, kv_indices, last = make_paged(kv_lens, 2, 64, 16, "NHD", torch.float16,
                                                    "cuda", seed=21)
    q, *_ = make_batch([1] * len(kv_lens), kv_lens, 8, 2, 64, torch.float16, "cuda", seed=22)
    qo_indptr = _cumsum([1] * len(kv_lens))
    for kv_dtype in (torch.float16, *FP8):
        w = ja.BatchDecode(variant, page_size=16)
        w.plan(kv_indptr, kv_indices, last, 8, 2, 64, kv_dtype=kv_dtype)
        if kv_dtype == torch.float16:
            check_batch(w, variant, params, q, cache, qo_indptr, kv_indptr, kv_indices, last,
                        "NHD")
        else:
            (k8, k_ref), (v8, v_ref) = (quantize_fp8(c, scales[n], kv_dtype) for c, n in
                                        zip(cache, ("k_scale", "v_scale")))
            check_batch(w, variant, params, q, (k8, v8), qo_indptr, kv_indptr, kv_indices,
                        last, "NHD", ref_kv_cache=(k_ref, v_ref), scales=scales)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "short"])
def test_fp8_kv_dequantizes_every_byte_exactly_gpu(fp8, dtype, kind):
    """Every fp8 bit pattern through the decode kernel's register conversion and the prefill
    kernel's dequantized tile (helpers.check_fp8_every_byte)."""
    check_fp8_every_byte("cuda", fp8, dtype, kind)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "short"])
def test_fp8_kv_across_the_formats_range_gpu(fp8, dtype, kind):
    check_fp8_across_range("cuda", fp8, dtype, kind)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_ragged_shared_prefixes_match_reference_gpu(head_dim, dtype):
    """Shared prefixes of 300 / 128 / 129 / 192 / 384 keys: whole tiles of the prefix and of
    the own run (TMA at head_dim 64 / 128), tiles across the prefix's end (per-row copies),
    prefixes that end on a tile's end (128-key tiles of the window and ALiBi kernels, 192-key
    tiles of the causal one), requests without a prefix, empty and one-token requests; the
    prefill tiles, then the 16-row tiles
    (queries of at most 4 packed rows x GQA 4); causal, a sliding window of 100 (ranges that
    start inside the prefix), and ALiBi with fused RoPE (key positions count from the
    prefix)."""
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    alibi_rope = ja.Variant("alibi_rope", mask="causal",
                            score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                            pos_encoding=ja.RoPE(theta=1e4))
    long_queries = [(0, 200, 257), (1, 1, 1), (2, 64, 0), (None, 130, 140), (0, 0, 5),
                    (1, 500, 3), (3, 100, 50), (4, 70, 0), (4, 200, 192)]
    short_queries = [(0, 1, 257), (1, 1, 1), (2, 1, 0), (None, 1, 140), (0, 0, 5), (3, 1, 50),
                     (4, 1, 0)]
    for variant, params in ((ja.Variant("causal", mask="causal"), {}),
                            (ja.Variant("window", mask="causal", window_left=100), {}),
                            (alibi_rope, {"slopes": ja.alibi_slopes(16).cuda()})):
        for requests in (long_queries, short_queries):
            check_shared_prefix_batch(variant, params, "cuda", dtype, 16, 4, head_dim, requests,
                                      prefix_lens=[300, 128, 129, 192, 384], seed=head_dim)


def test_cuda_graph_keeps_the_shared_prefix_build():
    """A BatchPrefill captured after a plan with shared prefixes replays the build that reads
    them, correctly after plans with and without prefixes; one captured on the plain build
    refuses a plan with prefixes (its graph would replay a kernel that reads one run)."""
    hq, hkv, d = 8, 2, 128
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(900, hkv, d, generator=gen).half().cuda() for _ in range(2))
    q = torch.empty(300, hq, d, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32)
    qo, kv = _cumsum([200, 100]), _cumsum([250, 150])
    with_prefix = dict(shared_prefix_start=torch.tensor([500, 500], **i32),
                       shared_prefix_len=torch.tensor([300, 300], **i32))
    variant = ja.Variant("causal", mask="causal")
    w = ja.BatchPrefill(variant, kv_layout="ragged")
    w.plan(qo, kv, None, None, hq, hkv, d, **with_prefix)
    graph = _capture(lambda: w.run(q, (k, v), out=out))
    for prefix in (None, with_prefix, None):
        w.plan(qo, kv, None, None, hq, hkv, d, **(prefix or {}))
        q.copy_(torch.randn(300, hq, d, generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        starts = [500, 500] if prefix else [0, 0]
        lens = [300, 300] if prefix else [0, 0]
        rows = [torch.cat([torch.arange(s, s + n), torch.arange(a, b)])
                for s, n, a, b in zip(starts, lens, kv[:-1].tolist(), kv[1:].tolist())]
        ref = reference.attention(q, k[torch.cat(rows).cuda()], v[torch.cat(rows).cuda()],
                                  variant, qo_indptr=qo,
                                  kv_indptr=_cumsum([len(r) for r in rows]))
        torch.testing.assert_close(out, ref.half(), **TOL[torch.float16])
    plain = ja.BatchPrefill(variant, kv_layout="ragged")
    plain.plan(qo, kv, None, None, hq, hkv, d)
    _capture(lambda: plain.run(q, (k, v), out=out))
    with pytest.raises(ValueError, match="captured run\\(\\) with the kernel built without"):
        plain.plan(qo, kv, None, None, hq, hkv, d, **with_prefix)


def test_out_may_be_q_itself_gpu():
    check_out_is_q("cuda")


def test_fp8_rope_near_the_format_max_gpu():
    check_fp8_rope_near_the_format_max("cuda")
