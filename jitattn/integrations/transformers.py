"""jitattn as an attention implementation of Hugging Face transformers (its AttentionInterface).

    from jitattn.integrations.transformers import register
    register()                                   # name "jitattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="jitattn")

The Variant comes from what the model passes each call: causal or not (the module's
``is_causal``), ``sliding_window`` and ``softcap`` (Gemma 2 style), ``scaling`` as sm_scale;
RoPE has already been applied by the model. Batches without padding are supported: the mask
function registered with the attention (transformers' sdpa mask) returns no mask for them, and
jitattn runs the batch as a ragged batch of equal requests, queries aligned to the end of the
keys (as in decoding with a KV cache). A batch with padding raises ValueError.
"""

from __future__ import annotations

import functools

import torch

import jitattn as ja


@functools.lru_cache(maxsize=64)
def variant_for(causal: bool, sliding_window: int | None, softcap: float | None) -> ja.Variant:
    """The Variant of one attention layer's settings (cached: one kernel per distinct set)."""
    name = "hf" + ("_causal" if causal else "") + \
        (f"_window{sliding_window}" if sliding_window else "") + \
        (f"_softcap{softcap:g}" if softcap else "")
    # transformers' sliding_window counts the query's own token; window_left does not
    return ja.Variant(name, mask="causal" if causal else "none",
                      window_left=None if not sliding_window else sliding_window - 1,
                      score_mod=ja.soft_cap(float(softcap)) if softcap else None)


def jitattn_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              sliding_window: int | None = None, softcap: float | None = None,
                              **kwargs):
    """transformers' attention signature: query [batch, heads, q_len, head_dim], key / value
    [batch, kv_heads, kv_len, head_dim]; returns (out [batch, q_len, heads, head_dim], None)."""
    if attention_mask is not None:
        raise ValueError("jitattn's transformers integration takes batches without padding "
                         "(the attention mask was not empty); run padded batches one request "
                         "at a time, or use BatchPrefill with ragged lengths")
    if dropout:
        raise ValueError(f"dropout={dropout}: jitattn is for inference (dropout 0)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    variant = variant_for(bool(causal), sliding_window, softcap)
    batch, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * q_len, hq, d).contiguous()
    k = key.transpose(1, 2).reshape(batch * kv_len, key.shape[1], d).contiguous()
    v = value.transpose(1, 2).reshape(batch * kv_len, value.shape[1], d).contiguous()
    qo = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    kv = torch.arange(0, batch * kv_len + 1, kv_len, dtype=torch.int32)
    out = ja.attention(q, k, v, variant, qo_indptr=qo, kv_indptr=kv, sm_scale=scaling)
    return out.reshape(batch, q_len, hq, d), None


def register(name: str = "jitattn") -> str:
    """Register the attention function and its mask function (transformers' sdpa mask, which
    is empty for unpadded causal batches) under ``name``; returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(name, jitattn_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
