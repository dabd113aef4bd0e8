"""ALiBi (Press et al. 2022, "Train Short, Test Long"): score + slope[h] * (kv_idx - q_idx), causal.

The slopes are a runtime tensor, so one kernel serves every head count; ``ja.alibi_slopes(n)``
gives the paper's slopes, correct for head counts that are not powers of two.
"""

import jitattn as ja

SLOPES = ja.tensor("alibi_slopes", ("num_qo_heads",), "float32")


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def make() -> ja.Variant:
    """Causal ALiBi; run() / attention() take alibi_slopes [num_qo_heads] float32
    (ja.alibi_slopes(n))."""
    return ja.Variant(name="alibi", mask="causal", score_mod=alibi)


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    return make(), {"alibi_slopes": ja.alibi_slopes(num_qo_heads).to(device)}
