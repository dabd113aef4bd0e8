"""jitattn inside Hugging Face transformers: a Llama-architecture model (Llama-3.2-1B's head
layout and RoPE, fewer and smaller layers, seeded random weights) gives the logits of
transformers' own eager attention, prefill and decode with a KV cache."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jitattn.integrations.transformers import register  # noqa: E402


def tiny_llama(attn):
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float16).eval()
    model.config._attn_implementation = attn
    return model


def test_llama_logits_match_eager_prefill_and_decode(monkeypatch):
    import jitattn.integrations.transformers as integration
    calls = []
    real = integration.ja.attention
    monkeypatch.setattr(integration.ja, "attention",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    name = register()
    model = tiny_llama("eager")
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        eager = model(ids, use_cache=True)
        model.config._attn_implementation = name
        ours = model(ids, use_cache=True)
        torch.testing.assert_close(ours.logits, eager.logits, atol=2e-2, rtol=2e-2)
        # one decode step on top of the cache (queries aligned to the end of the keys)
        nxt = ids[:, -1:]
        ours_step = model(nxt, past_key_values=ours.past_key_values, use_cache=True)
        model.config._attn_implementation = "eager"
        eager_step = model(nxt, past_key_values=eager.past_key_values, use_cache=True)
    torch.testing.assert_close(ours_step.logits, eager_step.logits, atol=2e-2, rtol=2e-2)
    # jitattn ran every layer: 2 layers x (prefill of 2 x 37 tokens, decode of 2 x 1)
    assert calls == [(74, 4, 64)] * 2 + [(2, 4, 64)] * 2


def test_padded_batches_are_refused():
    from jitattn.integrations.transformers import jitattn_attention_forward
    q = torch.randn(1, 4, 5, 64).half()
    with pytest.raises(ValueError, match="without padding"):
        jitattn_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 5, 5))
