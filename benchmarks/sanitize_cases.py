"""A few prefill / decode / ragged launches for compute-sanitizer (memcheck, racecheck) on the GPU:
``compute-sanitizer --tool memcheck python benchmarks/sanitize_cases.py``."""

import torch, jitattn as ja
from jitattn import catalog
torch.manual_seed(0)
mods = catalog.builtin()
for name in ("alibi", "document_mask", "rope_llama"):
    for qo_lens, kv_lens in (([45], [30]), ([1, 1, 1], [0, 1, 77]), ([0, 1, 33], [5, 9, 100])):
        v, params = mods[name].example(len(qo_lens), 8, 2, max(qo_lens), max(kv_lens), "cuda")
        q = torch.randn(sum(qo_lens), 8, 256, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(sum(kv_lens), 2, 256, dtype=torch.bfloat16, device="cuda")
        kw = {}
        if len(qo_lens) > 1:
            kw = dict(qo_indptr=torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32),
                      kv_indptr=torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32))
        ja.attention(q, k, k, v, **kw, **params)
torch.cuda.synchronize()
print("sanitize run done")
