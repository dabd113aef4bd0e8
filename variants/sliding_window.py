"""Sliding-window causal attention (Mistral 7B, Jiang et al. 2023; Longformer's local band).

Query at position i sees keys j with i - window_left <= j <= i.
"""

import jitattn as ja


def make(window_left: int = 1024) -> ja.Variant:
    """Causal attention over the window_left keys before each query and itself."""
    return ja.Variant(name=f"sliding_window{window_left}", mask="causal", window_left=window_left)


def example(batch, num_qo_heads, num_kv_heads, qo_len, kv_len, device):
    # a window shorter than the test sequences, so that it hides keys
    return make(window_left=max(1, kv_len // 3)), {}
