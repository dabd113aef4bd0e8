"""08: beam search over three levels of shared KV with MultiLevelCascade: a system prompt that
every beam of every request shares (level 0), each request's own prompt that its beams share
(level 1), and each beam's own generated tokens (level 2). Every level's pages are read once by
all the queries that share them, and the levels' attention states merge by LSE (FlashInfer's
multi-level cascade). One decode step, planned once and run for two layers, checked against
each beam attending to its whole sequence on its own.

Level 0 and 1 end on partial pages here (45 and 21-token pieces): a level is a sequence of
its own, so nothing needs to line up on page boundaries.
"""

import torch

import jitattn as ja
from jitattn import reference

device = "cuda" if torch.cuda.is_available() else "cpu"
page_size, hq, hkv, d = 16, 32, 8, 128
num_requests, beams = 2, 4
system_len, prompt_lens, generated = 45, [21, 70], [3, 9, 1, 16, 5, 2, 12, 7]  # tokens
i32 = dict(dtype=torch.int32)
gen = torch.Generator().manual_seed(0)


def pages_for(n):
    return -(-n // page_size)


# one paged cache per layer; pages handed out in order: the system prompt, each request's
# prompt, each beam's own tokens
lengths = [system_len] + prompt_lens + generated
first_page = torch.tensor([0, *torch.tensor([pages_for(n) for n in lengths]).cumsum(0)])
num_pages = int(first_page[-1])
layers = [tuple(torch.randn(num_pages, page_size, hkv, d, generator=gen).half().to(device)
                for _ in range(2)) for _ in range(2)]


def level(pieces):
    """kv_indptr, kv_indices, kv_last_page_len of a level whose requests read `pieces` (indices
    into `lengths`)."""
    counts = [pages_for(lengths[i]) for i in pieces]
    indices = torch.cat([torch.arange(int(first_page[i]), int(first_page[i]) + c, **i32)
                         for i, c in zip(pieces, counts)])
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], **i32)
    last = torch.tensor([lengths[i] - (pages_for(lengths[i]) - 1) * page_size for i in pieces],
                        **i32)
    return indptr, indices, last


batch = num_requests * beams  # query row r: beam r % beams of request r // beams
levels = [level([0]), level([1, 2]), level(list(range(3, 3 + batch)))]
qo_indptr = [torch.tensor([0, batch], **i32),                               # all rows at once
             torch.arange(0, batch + 1, beams, **i32),                      # per request
             torch.arange(0, batch + 1, **i32)]                             # per beam
variant = ja.Variant("causal", mask="causal")
cascade = ja.MultiLevelCascade(variant, num_levels=3, page_size=page_size, device=device)
cascade.plan(qo_indptr, *[[lv[i] for lv in levels] for i in range(3)], num_qo_heads=hq,
             num_kv_heads=hkv, head_dim=d)                                 # once per step

worst = 0.0
for layer, cache in enumerate(layers):                                     # every layer
    q = torch.randn(batch, hq, d, generator=gen).half().to(device)
    out = cascade.run(q, cache)
    # the same step without sharing: each beam over [system, its prompt, its tokens]
    k, v, tokens = reference.paged_to_ragged(cache, *level(list(range(len(lengths)))), "NHD")
    starts = tokens.tolist()
    rows = [torch.cat([torch.arange(starts[0], starts[1]),
                       torch.arange(starts[1 + r // beams], starts[2 + r // beams]),
                       torch.arange(starts[3 + r], starts[4 + r])]) for r in range(batch)]
    kv_indptr = torch.tensor([0, *torch.tensor([len(x) for x in rows]).cumsum(0).tolist()],
                             **i32)
    ref = reference.attention(q, k[torch.cat(rows)], v[torch.cat(rows)], variant,
                              qo_indptr=torch.arange(batch + 1, **i32), kv_indptr=kv_indptr)
    err = (out.double() - ref).abs().max().item()
    worst = max(worst, err)
    print(f"{device} layer {layer}: {batch} beams, max |cascade - each beam alone| = {err:.1e}")
assert worst < 5e-3
