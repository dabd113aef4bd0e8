"""04: a batch sharing a prefix (the shared-prefix survey's example: P = 96, two 4-token
suffixes), prefilled with every strategy; all equal naive."""

import torch

import jitattn as ja
from jitattn.shared_prefix import STRATEGIES

device = "cuda" if torch.cuda.is_available() else "cpu"
prefix, suffixes, hq, hkv, d = 96, [4, 4], 16, 8, 128
n = prefix + sum(suffixes)                      # the deduplicated layout [P, S0, S1]
q = torch.randn(n, hq, d, dtype=torch.float16, device=device)
k = torch.randn(n, hkv, d, dtype=torch.float16, device=device)
v = torch.randn_like(k)
variant = ja.Variant("causal", mask="causal")
outs = {}
for strategy in STRATEGIES:
    sp = ja.SharedPrefixPrefill(variant, strategy, device=device)
    sp.plan(prefix, suffixes, hq, hkv, d)
    outs[strategy] = sp.run(q, k, v)
for strategy, out in outs.items():
    diff = (out.float() - outs["naive"].float()).abs().max().item()
    print(f"{strategy:12s} max |out - naive| = {diff:.1e}")
    assert diff < 5e-3
