"""Tanh logit soft-capping (Gemma 2, Team Gemma 2024; Grok-1): cap * tanh(score / cap), causal."""

import jitattn as ja


def make(cap: float = 50.0) -> ja.Variant:
    """Causal attention with logits soft-capped at cap (cap * tanh(score / cap))."""
    return ja.Variant(name=f"softcap{cap:g}", mask="causal", score_mod=ja.soft_cap(cap))


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    """A variant fit for these sizes and the runtime parameters it needs."""
    return make(), {}
