"""02: every ready-made variant in variants/, each checked against the reference."""

import torch

from jitattn import attention, catalog, reference

device = "cuda" if torch.cuda.is_available() else "cpu"
for name, module in catalog.builtin().items():
    variant, params = module.example(1, 8, 2, 64, 200, device)
    q = torch.randn(64, 8, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(200, 2, 64, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    out = attention(q, k, v, variant, **params)
    ref = reference.attention(q, k, v, variant, **params)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"{name:24s} relative error {err:.1e}  {variant.describe()}")
    assert err < 1e-2
