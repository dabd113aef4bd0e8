"""03: batch decode over a paged KV cache: plan once per step, run per layer. On a GPU the
scheduler splits the one long request across CTAs and merges the pieces (plan.describe()
shows it); the CPU backend has few "CTAs" and splits less."""

import torch

import jitattn as ja
from jitattn import reference

device = "cuda" if torch.cuda.is_available() else "cpu"
page_size, hq, hkv, d = 16, 32, 8, 128
kv_lens = [4000, 17, 300, 1]
pages = [-(-n // page_size) for n in kv_lens]
kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
kv_indices = torch.randperm(sum(pages), dtype=torch.int32)          # pages anywhere in the cache
last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
cache = tuple(torch.randn(sum(pages), page_size, hkv, d, dtype=torch.float16, device=device)
              for _ in range(2))
q = torch.randn(len(kv_lens), hq, d, dtype=torch.float16, device=device)

variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
decode = ja.BatchDecode(variant, page_size=page_size, device=device)
plan = decode.plan(kv_indptr, kv_indices, last, hq, hkv, d)
print(plan.describe())
out = decode.run(q, cache)

k, v, token_indptr = reference.paged_to_ragged(cache, kv_indptr, kv_indices, last)
ref = reference.attention(q, k, v, variant, qo_indptr=torch.arange(5, dtype=torch.int32),
                          kv_indptr=token_indptr)
err = ((out.double() - ref).norm() / ref.norm()).item()
print(f"{device}: relative error {err:.1e}")
assert err < 2e-3
