"""Learned relative position bias (T5, Raffel et al. 2020; Shaw et al. 2018 clipped distances):
score + table[h, clip(kv_idx - q_idx, -max_distance, max_distance) + max_distance], causal.

The table, shape [num_qo_heads, 2 * max_distance + 1], is captured by closure.
"""

import torch

import jitattn as ja


def make(table: torch.Tensor) -> ja.Variant:
    """Causal attention plus table[h, clipped relative position + max_distance]; table:
    [num_qo_heads, 2 * max_distance + 1] of floats, read at run time."""
    max_distance = (table.shape[1] - 1) // 2

    def relative_bias(score, b, h, q_idx, kv_idx):
        rel = ja.minimum(ja.maximum(kv_idx - q_idx, -max_distance), max_distance)
        return score + table[h, rel + max_distance]
    return ja.Variant(name=f"relative_position_bias{max_distance}", mask="causal",
                      score_mod=relative_bias)


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    gen = torch.Generator().manual_seed(num_qo_heads)
    table = torch.randn(num_qo_heads, 2 * 64 + 1, generator=gen)
    return make(table.to(device)), {}
