"""01: plain causal attention on a ragged batch, checked against the reference."""

import torch

import jitattn as ja
from jitattn import reference

device = "cuda" if torch.cuda.is_available() else "cpu"
variant = ja.Variant("causal", mask="causal")
qo_lens, kv_lens = [5, 1, 40], [5, 300, 90]          # prefill, decode-like, chunked prefill
q = torch.randn(sum(qo_lens), 8, 128, dtype=torch.float16, device=device)
k = torch.randn(sum(kv_lens), 2, 128, dtype=torch.float16, device=device)
v = torch.randn_like(k)
qo_indptr = torch.tensor([0, 5, 6, 46], dtype=torch.int32)
kv_indptr = torch.tensor([0, 5, 305, 395], dtype=torch.int32)

out, lse = ja.attention(q, k, v, variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                        return_lse=True)
ref = reference.attention(q, k, v, variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
err = ((out.double() - ref).norm() / ref.norm()).item()
print(f"{device}: out {tuple(out.shape)}, relative error {err:.1e}")
assert err < 2e-3
