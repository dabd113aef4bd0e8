"""Sigmoid attention (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention"): out = sum_j sigmoid(score_j + bias) v_j, no normalisation, causal.

The paper sets bias = -log(sequence length); here it is a runtime scalar ``bias``.
"""

import jitattn as ja

BIAS = ja.scalar("bias")


def shifted(score, b, h, q_idx, kv_idx):
    return score + BIAS


def make() -> ja.Variant:
    """Causal sigmoid attention; run() / attention() take the scalar bias (the paper:
    -log(sequence length))."""
    return ja.Variant(name="sigmoid", mask="causal", score_mod=shifted, reduction="sigmoid")


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    import math
    return make(), {"bias": -math.log(max(kv_len, 2))}
