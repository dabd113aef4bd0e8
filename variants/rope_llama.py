"""Llama 3.1 / 3.2 attention: causal, RoPE fused into the Q/K load (neox style), theta 500000 with
Llama 3.1 frequency scaling (factor 32, low 1, high 4, original context 8192; Llama-3.2-1B's
config.json values)."""

import jitattn as ja

LLAMA3_SCALING = {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def make(theta: float = 500000.0, scaling: dict | None = LLAMA3_SCALING) -> ja.Variant:
    """Causal attention with RoPE fused on load (neox style), Llama 3.1 frequency scaling by
    default; no run-time parameters."""
    return ja.Variant(name="rope_llama", mask="causal",
                      pos_encoding=ja.RoPE(theta=theta, style="neox", scaling=scaling))


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    return make(), {}
