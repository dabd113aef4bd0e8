"""Shared-prefix strategies on the GPU (``pytest -m gpu``): every strategy equals each request
run on its own, fp16 / bf16, GQA 16/8 and 32/8, head_dim 128."""

import pytest
import torch

import jitattn as ja
from jitattn.shared_prefix import STRATEGIES, SharedPrefixPrefill

from helpers import TOL

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("hq, hkv", [(16, 8), (32, 8)])
def test_strategies_equal_per_request_attention(strategy, dtype, hq, hkv):
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    for prefix, suffixes in ((96, [4, 4]), (1000, [1] * 9), (333, [130, 7, 1])):
        gen = torch.Generator().manual_seed(prefix)
        n = prefix + sum(suffixes)
        q, k, v = (torch.randn(n, h, 128, generator=gen).to("cuda", dtype)
                   for h in (hq, hkv, hkv))
        sp = SharedPrefixPrefill(variant, strategy)
        sp.plan(prefix, suffixes, hq, hkv, 128, q_dtype=dtype)
        got, got_lse = sp.run(q, k, v, return_lse=True)
        torch.testing.assert_close(sp.run(q, k, v), got, rtol=0, atol=0)
        start = prefix
        for i, s in enumerate(suffixes):
            idx = torch.cat([torch.arange(prefix), torch.arange(start, start + s)]).cuda()
            ref, ref_lse = ja.attention(q[idx], k[idx], v[idx], variant, return_lse=True)
            torch.testing.assert_close(got[start:start + s], ref[prefix:], **TOL[dtype])
            torch.testing.assert_close(got_lse[start:start + s], ref_lse[prefix:], atol=2e-3,
                                       rtol=1e-4)
            if i == 0:
                torch.testing.assert_close(got[:prefix], ref[:prefix], **TOL[dtype])
                torch.testing.assert_close(got_lse[:prefix], ref_lse[:prefix], atol=2e-3,
                                           rtol=1e-4)
            start += s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_cascade_decode_equals_plain_decode_gpu(dtype):
    gen = torch.Generator().manual_seed(0)
    page_size, hq, hkv, d, batch = 16, 32, 8, 128, 16
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    shared = list(range(64))                          # 1024-token prefix
    unique = [list(range(64 + 8 * i, 64 + 8 * i + 8)) for i in range(batch)]  # 128 tokens each
    cache = tuple(torch.randn(64 + 8 * batch, page_size, hkv, d, generator=gen).to("cuda", dtype)
                  for _ in range(2))
    q = torch.randn(batch, hq, d, generator=gen).to("cuda", dtype)
    i32 = dict(dtype=torch.int32)
    cd = ja.CascadeDecode(variant, page_size=page_size)
    cd.plan(torch.tensor(shared, **i32), 16, torch.arange(0, 8 * batch + 1, 8, **i32),
            torch.tensor(sum(unique, []), **i32), torch.full((batch,), 16, **i32), hq, hkv, d,
            q_dtype=dtype)
    plain = ja.BatchDecode(variant, page_size=page_size)
    plain.plan(torch.arange(0, 72 * batch + 1, 72, **i32),
               torch.tensor(sum([shared + u for u in unique], []), **i32),
               torch.full((batch,), 16, **i32), hq, hkv, d, q_dtype=dtype)
    torch.testing.assert_close(cd.run(q, cache), plain.run(q, cache), **TOL[dtype])
