"""Prefix-LM (T5 / UniLM, Raffel et al. 2020 section 3.2.3): the first prefix_len[b] tokens of
request b attend to each other bidirectionally; later tokens are causal."""

import torch

import jitattn as ja

PREFIX_LEN = ja.tensor("prefix_len", ("batch_size",), "int32")


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < PREFIX_LEN[b])


def make() -> ja.Variant:
    """Prefix-LM mask; run() / attention() take prefix_len [batch_size] int32."""
    return ja.Variant(name="prefix_lm", mask="none", mask_mod=prefix_lm)


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    gen = torch.Generator().manual_seed(batch * 7919 + kv_len)
    lens = torch.randint(0, kv_len + 1, (batch,), generator=gen, dtype=torch.int32)
    return make(), {"prefix_len": lens.to(device)}
