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
    variant = ja.Variant("softcap", score_mod=ja.soft_cap(30.0))
    for prefix, suffixes in ((96, [4, 4]), (1000, [1] * 9), (333, [130, 7, 1])):
        gen = torch.Generator().manual_seed(prefix)
        n = prefix + sum(suffixes)
        q, k, v = (torch.randn(n, h, 128, generator=gen).to("cuda", dtype)
                   for h in (hq, hkv, hkv))
        sp = SharedPrefixPrefill(variant, strategy)
        sp.plan(prefix, suffixes, hq, hkv, 128, q_dtype=dtype)
        got = sp.run(q, k, v)
        start = prefix
        for i, s in enumerate(suffixes):
            idx = torch.cat([torch.arange(prefix), torch.arange(start, start + s)]).cuda()
            ref = ja.attention(q[idx], k[idx], v[idx], variant)
            torch.testing.assert_close(got[start:start + s], ref[prefix:], **TOL[dtype])
            if i == 0:
                torch.testing.assert_close(got[:prefix], ref[:prefix], **TOL[dtype])
            start += s
