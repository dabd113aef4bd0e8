"""05: parallel sampling: 8 continuations of one prompt decode with a cascade (the prompt's
pages are read once for all of them) and agree with plain paged decode.

CascadeDecode's default strategy "auto" would take plain decode here: re-reading a 1024-token
prompt 8 times costs less than the cascade's extra launches (see CascadeDecode.choose); this
example asks for the cascade to show it."""

import torch

import jitattn as ja

device = "cuda" if torch.cuda.is_available() else "cpu"
page_size, hq, hkv, d, n = 16, 32, 8, 128, 8
i32 = dict(dtype=torch.int32)
prompt = torch.arange(64, **i32)                                   # 1024 prompt tokens
own = torch.arange(64, 64 + 2 * n, **i32)                          # 2 pages of history each
cache = tuple(torch.randn(64 + 2 * n, page_size, hkv, d, dtype=torch.float16, device=device)
              for _ in range(2))
q = torch.randn(n, hq, d, dtype=torch.float16, device=device)
variant = ja.Variant("causal", mask="causal")

cascade = ja.CascadeDecode(variant, page_size=page_size, device=device, strategy="cascade")
chosen = cascade.plan(shared_kv_indices=prompt, shared_last_page_len=16,
                      unique_kv_indptr=torch.arange(0, 2 * n + 1, 2, **i32),
                      unique_kv_indices=own, unique_kv_last_page_len=torch.full((n,), 16, **i32),
                      num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
plain = ja.BatchDecode(variant, page_size=page_size, device=device)
plain.plan(torch.arange(0, 66 * n + 1, 66, **i32),
           torch.cat([torch.cat([prompt, own[2 * i:2 * i + 2]]) for i in range(n)]),
           torch.full((n,), 16, **i32), hq, hkv, d)
diff = (cascade.run(q, cache).float() - plain.run(q, cache).float()).abs().max().item()
print(f"{device}: strategy {chosen!r}, max |cascade - plain decode| = {diff:.1e}")
assert diff < 5e-3
