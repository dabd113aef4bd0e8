"""Document masking for packed sequences (FlexAttention's document mask): several documents
packed into one sequence; a token sees only earlier tokens of its own document.

The document ids are a torch tensor captured by closure (``doc_ids[pos]``, one id per token
position); the kernel reads them at run time and their values never enter the cache key.
"""

import torch

import jitattn as ja


def make(doc_ids: torch.Tensor) -> ja.Variant:
    """Causal attention within documents; doc_ids: one int id per token position (length
    at least the longest kv_len), read at run time."""
    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]
    return ja.Variant(name="document_mask", mask="causal", mask_mod=same_document)


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    gen = torch.Generator().manual_seed(kv_len)
    lengths = torch.randint(1, max(2, kv_len // 3), (kv_len,), generator=gen)
    ids = torch.repeat_interleave(torch.arange(kv_len), lengths)[:kv_len].to(torch.int32)
    return make(ids.to(device)), {}
