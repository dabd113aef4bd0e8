"""jitattn inside Hugging Face transformers: a Llama-architecture model (Llama-3.2-1B's head
layout and RoPE, fewer and smaller layers, seeded random weights) gives the logits of
transformers' own eager attention, prefill and decode with a KV cache."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jitattn.integrations.transformers import jitattn_attention_forward, register  # noqa: E402


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


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_eager_prefill_and_decode(side, monkeypatch):
    """A batch of prompts of different lengths, padded (left: generation; right: scoring):
    the real tokens' logits match eager attention, prefill and one decode step."""
    import jitattn.integrations.transformers as integration
    calls = []
    real_attention = integration.ja.attention
    monkeypatch.setattr(integration.ja, "attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real_attention(*a, **k))
    name = register()
    model = tiny_llama("eager")
    gen = torch.Generator().manual_seed(2)
    lens, width = [29, 12, 20], 29
    ids = torch.randint(0, 512, (3, width), generator=gen)
    am = torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(lens):
        am[b, width - n:] = 1 if side == "left" else 0
        am[b, :n] = 1 if side == "right" else am[b, :n]
    real = am.bool()
    results = {}
    with torch.inference_mode():
        for attn in ("eager", name):
            model.config._attn_implementation = attn
            pre = model(ids, attention_mask=am, use_cache=True)
            step = None
            if side == "left":  # decode continues every sequence at its end
                nxt = torch.randint(0, 512, (3, 1), generator=torch.Generator().manual_seed(3))
                step = model(nxt, attention_mask=torch.cat([am, torch.ones(3, 1).long()], 1),
                             past_key_values=pre.past_key_values, use_cache=True).logits
            results[attn] = (pre.logits[real], step)
    torch.testing.assert_close(results[name][0], results["eager"][0], atol=2e-2, rtol=2e-2)
    # jitattn ran every layer on the real tokens only: 61 of 87 in prefill, 3 per decode step
    assert calls == [sum(lens)] * 2 + ([3] * 2 if side == "left" else [])
    if side == "left":
        torch.testing.assert_close(results[name][1], results["eager"][1], atol=2e-2, rtol=2e-2)


def test_masks_that_are_not_padding_are_refused():
    from jitattn.integrations.transformers import jitattn_attention_forward
    q = torch.randn(1, 4, 6, 64).half()
    packed = torch.zeros(1, 1, 6, 6, dtype=torch.bool)  # two packed sequences of 3 tokens
    for lo in (0, 3):
        packed[0, 0, lo:lo + 3, lo:lo + 3] = torch.ones(3, 3).tril().bool()
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(ValueError, match="not a padding mask"):
        jitattn_attention_forward(module, q, q, q, packed)
    with pytest.raises(ValueError, match="dropout"):
        jitattn_attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="position_bias: .* takes no bias tensor"):
        jitattn_attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 4, 6, 6))


def test_output_attentions_warns_and_gives_none():
    q = torch.randn(1, 4, 6, 64).half()
    module = torch.nn.Module()
    with pytest.warns(UserWarning, match="no attention weights"):
        out, weights = jitattn_attention_forward(module, q, q, q, None, scaling=0.125,
                                                 output_attentions=True)
    assert weights is None
    torch.testing.assert_close(out.float(), _sdpa(q, q, q, is_causal=True), atol=2e-3,
                               rtol=0)


@pytest.mark.parametrize("q_len", [4, 12])
def test_cross_attention_over_a_padded_encoder_batch_matches_sdpa(q_len):
    """Cross-attention (not causal): request 1's encoder keys 6..9 are padding. A query's "own"
    key means nothing here; taking it to decide which queries are real zeroed request 1's
    queries (q_len 4) or raised IndexError (q_len 12 > kv_len 10)."""
    from jitattn.integrations.transformers import jitattn_attention_forward
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, n, 64, generator=gen).half() for n in (q_len, 10, 10))
    mask = torch.ones(2, 1, q_len, 10, dtype=torch.bool)
    mask[1, :, :, 6:] = False
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = jitattn_attention_forward(module, q, k, v, mask, scaling=0.125, is_causal=False)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)

def test_alternating_masks_keep_their_ragged_layouts():
    """An encoder-decoder's decoder layers alternate the self- and cross-attention masks; each
    keeps its layout (one cached mask rebuilt both, with a host sync, in every layer)."""
    from jitattn.integrations.transformers import _unpadding, variant_for
    causal, full = variant_for(True, None, None), variant_for(False, None, None)
    self_mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    cross_mask = torch.ones(2, 1, 4, 10, dtype=torch.bool)
    cross_mask[1, :, :, 6:] = False
    def unpad(mask, variant, module_id=None):
        return _unpadding(mask, variant, mask.shape[0], *mask.shape[2:], module_id)
    first = unpad(self_mask, causal), unpad(cross_mask, full)
    for _ in range(3):
        assert (unpad(self_mask, causal), unpad(cross_mask, full)) == first
    cross_mask[0, :, :, 8:] = False  # changed in place: rebuilt
    assert unpad(cross_mask, full) is not first[1]
    with torch.inference_mode():  # no version counter: reused only as the latest mask, by
        #                               the other attention modules of one forward
        a, b = torch.ones(1, 1, 4, 4, dtype=torch.bool), torch.ones(1, 1, 4, 10, dtype=torch.bool)
        first_a = unpad(a, full, 10)
        assert unpad(a, full, 11) is first_a and unpad(a, full, 13) is first_a
        assert unpad(a, full, 11) is not first_a  # (a module seen again: a new forward)
        assert unpad(a, full) is not first_a  # (no module named)
        first_a = unpad(a, full, 0)
        unpad(b, full, 1)
        a[0, :, :, 2:] = False
        assert unpad(a, full, 2).kv_rows.tolist() == [0, 1]

def test_a_mask_of_one_covers_the_batch_and_biases_are_refused():
    """A [1, 1, q, k] mask over a batch of 2 laid out one request (the second's rows came out
    0); an additive mask with a bias (-1.0, or +0.5 everywhere) was read as 'hidden where
    not 0', silently."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 6, 64, generator=gen).half() for _ in range(3))
    module = torch.nn.Module()
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    out, _ = jitattn_attention_forward(module, q, k, v, mask, scaling=0.125, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    additive = torch.zeros(2, 1, 6, 6, dtype=torch.float16).masked_fill(~mask, -65504.0)
    out, _ = jitattn_attention_forward(module, q, k, v, additive, scaling=0.125,
                                       is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    for bias in (additive.clone().index_fill_(3, torch.tensor([3]), -1.0), additive + 0.5):
        with pytest.raises(ValueError, match=r"additive with a value \((-1.0|0.5)\) other "):
            jitattn_attention_forward(module, q, k, v, bias, scaling=0.125, is_causal=True)
    with pytest.raises(ValueError, match=r"expected \[batch, 1, q_len, kv_len\] = \[2 \(or "
                                         r"1\), 1, 6, 6\]"):
        jitattn_attention_forward(module, q, k, v, mask[..., :5], scaling=0.125,
                                  is_causal=True)


def test_gemma2_soft_cap_and_sliding_window_from_the_config(monkeypatch):
    """Gemma 2's attention: logit soft-cap 50 and a 16-token sliding window on every other
    layer, taken from what the model passes; prefill and a decode step past the window."""
    import jitattn.integrations.transformers as integration
    variants = []
    real_attention = integration.ja.attention
    monkeypatch.setattr(integration.ja, "attention",
                        lambda *a, **k: variants.append(a[3]) or real_attention(*a, **k))
    name = register()
    config = transformers.Gemma2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64,
        max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).to(torch.float16).eval()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    nxt = ids[:, -1:]
    logits = {}
    with torch.inference_mode():
        for attn in ("eager", name):
            model.config._attn_implementation = attn
            pre = model(ids, use_cache=True)
            step = model(nxt, past_key_values=pre.past_key_values, use_cache=True)
            logits[attn] = (pre.logits, step.logits)
    for ours, eager in zip(logits[name], logits["eager"]):
        torch.testing.assert_close(ours, eager, atol=2e-2, rtol=2e-2)
    windows = [(v.window_left, v.score is not None) for v in variants]
    assert windows == [(15, True), (None, True)] * 2  # sliding then global layer, both capped


def test_a_float32_model_gets_a_clear_error():
    from jitattn.integrations.transformers import jitattn_attention_forward
    q = torch.randn(1, 4, 5, 64)
    with pytest.raises(TypeError, match="float16 or bfloat16: load or cast the model"):
        jitattn_attention_forward(torch.nn.Module(), q, q, q, None)


def _sdpa(q, k, v, mask=None, is_causal=False):
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=is_causal, scale=0.125,
        enable_gqa=True).transpose(1, 2)


def test_a_static_cache_prefill_and_decode_match_sdpa():
    """A static cache's keys span max_cache_len slots, the unused ones last: with a mask their
    slots were taken for the queries' own tokens (every row 0), and without one (transformers
    passes none for a prefill into an empty static cache, relying on SDPA's upper-left is_causal)
    every slot was read."""
    from jitattn.integrations.transformers import jitattn_attention_forward
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen).half() for h, n in ((4, 5), (2, 16),
                                                                          (2, 16)))
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    with torch.inference_mode():
        out, _ = jitattn_attention_forward(module, q, k, v, None, scaling=0.125)
        want = _sdpa(q, k[:, :, :5], v[:, :, :5], is_causal=True)  # the cache's first 5 slots
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
        for q_len, first in ((5, 0), (1, 7)):  # a prefill, then a decode step at position 7
            mask = (torch.arange(16)[None, :] <= torch.arange(first, first + q_len)[:, None])
            out, _ = jitattn_attention_forward(module, q[:, :, :q_len], k, v, mask[None, None],
                                               scaling=0.125)
            want = _sdpa(q[:, :, :q_len], k, v, mask=mask[None, None])
            torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


def test_a_chunk_that_ends_in_padding_in_every_request():
    """A second prefill chunk over a cache (kv_len > q_len) whose last keys are padding in
    every request: taking the last key any query sees as the last query's own token (for
    static caches) misaligned the queries and refused the mask."""
    from jitattn.integrations.transformers import jitattn_attention_forward
    gen = torch.Generator().manual_seed(0)
    past, q_len, kv_len = 6, 4, 10
    q = torch.randn(2, 4, q_len, 64, generator=gen).half()
    k, v = (torch.randn(2, 2, kv_len, 64, generator=gen).half() for _ in range(2))
    real = torch.tensor([8, 9])  # keys 0..7 / 0..8 real, the rest padding
    causal = torch.arange(kv_len)[None, :] <= (past + torch.arange(q_len))[:, None]
    mask = (causal[None] & (torch.arange(kv_len)[None, :] < real[:, None])[:, None, :])[:, None]
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    with torch.inference_mode():
        out, _ = jitattn_attention_forward(module, q, k, v, mask, scaling=0.125)
    want = _sdpa(q, k, v, mask=mask)
    for b in range(2):
        n = int(real[b]) - past
        torch.testing.assert_close(out[b, :n].float(), want[b, :n], atol=2e-3, rtol=2e-3)


def test_static_cache_generate_matches_sdpa():
    register()
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    with torch.inference_mode():
        for impl in ("sdpa", "jitattn"):
            model.set_attn_implementation(impl)
            logits[impl] = torch.stack(model.generate(
                ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                output_logits=True, return_dict_in_generate=True).logits).float()
    # every step's logits (the random model's tokens repeat, so tokens alone say little)
    torch.testing.assert_close(logits["jitattn"], logits["sdpa"], atol=3e-2, rtol=3e-2)


def test_a_mask_buffer_refilled_between_forwards_under_inference_mode():
    """Inference tensors have no version counter: a mask buffer the caller refills in place
    kept its old layout; an attention module seen again starts a new forward, so it is laid
    out again there (layer 0 did, so a pipeline stage's first layer, or CLIP's modules, which
    have no layer_idx, kept the old one)."""
    from jitattn.integrations.transformers import jitattn_attention_forward
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 8, 64, generator=gen).half() for h in (4, 2, 2))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, 0, :, :3] = False  # request 1: 3 tokens of left padding
    padded[1, 0, :3, :] = False
    for layer_idx in (0, 5, None):
        module = torch.nn.Module()
        module.is_causal = True
        if layer_idx is not None:
            module.layer_idx = layer_idx
        with torch.inference_mode():
            buffer = causal[None, None].repeat(2, 1, 1, 1)
            jitattn_attention_forward(module, q, k, v, buffer, scaling=0.125)
            buffer.copy_(padded)
            out, _ = jitattn_attention_forward(module, q, k, v, buffer, scaling=0.125)
        torch.testing.assert_close(out[1, 3:].float(), _sdpa(q, k, v, mask=padded)[1, 3:],
                                   atol=2e-3, rtol=2e-3)


def test_a_model_compiles_fullgraph_after_an_eager_call():
    """variant_for was an lru_cache, which dynamo does not honour: it traced the Variant's
    construction in every layer and fullgraph failed (json's encoder)."""
    name = register()
    model = tiny_llama(name)
    ids = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        eager = model(ids).logits
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
        except torch._dynamo.exc.Unsupported as e:
            # some transformers / torch pairs pass a padding mask while tracing even for an
            # unpadded batch (transformers 5.17, torch 2.11 on the H200); the integration
            # reads a mask on the host, which fullgraph cannot trace
            if "is_inference" not in str(e):
                raise
            pytest.skip(f"transformers {transformers.__version__} with torch {torch.__version__} "
                        f"passes a mask while tracing")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_a_layer_variant_is_built_eagerly_under_compile():
    """A layer's first call inside torch.compile builds its Variant with dynamo off (a graph
    break; jitattn's one trampoline, args.host_only, as plan() uses); under fullgraph=True the
    error says what to do."""
    import jitattn.integrations.transformers as integration
    settings = (True, None, 7.25)  # a soft-cap no other test builds
    integration._VARIANTS.pop(settings, None)

    def layer(x):
        integration.variant_for(*settings)
        return x + 1
    torch._dynamo.reset()
    with pytest.raises(Exception, match="run the model once outside "
                                        "torch.compile\\(fullgraph=True\\) first"):
        torch.compile(layer, backend="aot_eager", fullgraph=True)(torch.ones(3))
    assert settings not in integration._VARIANTS
    torch._dynamo.reset()
    assert torch.compile(layer, backend="aot_eager")(torch.ones(3)).eq(2).all()
    assert integration._VARIANTS[settings].name == "hf_causal_softcap7.25"


def test_compiled_model_follows_each_padding_mask():
    """Under torch.compile (graph breaks allowed) the first padded mask's ragged layout was
    baked into the graph: a later mask of the same shape but other padding gave wrong logits
    (max error 1.7), silently. The layout is now built outside the graph."""
    name = register()
    model = tiny_llama("eager")
    ids = torch.randint(1, 512, (3, 12), generator=torch.Generator().manual_seed(2))
    masks = []
    for pads in ((0, 3, 5), (4, 0, 1)):
        mask = torch.ones(3, 12, dtype=torch.long)
        for b, p in enumerate(pads):
            mask[b, :p] = 0
        masks.append(mask)
    with torch.no_grad():
        eager = [model(ids, attention_mask=m).logits for m in masks]
        model.config._attn_implementation = name
        compiled = torch.compile(model, dynamic=False)
        for mask, want in zip(masks, eager):
            got = compiled(ids, attention_mask=mask).logits
            torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()


def test_rope_takes_transformers_rope_parameters():
    """transformers 5 keeps rope_theta inside config.rope_parameters (and rope_type 'default'
    for an unscaled model): RoPE(scaling=...) refused both ('unexpected rope_theta')."""
    import jitattn as ja
    from jitattn.dsl import SpecError
    scaled = tiny_llama("eager").config.rope_parameters
    rope = ja.RoPE(theta=scaled["rope_theta"], scaling=scaled)
    assert dict(rope.scaling)["type"] == "llama3" and rope.theta == 500000.0
    assert ja.RoPE(theta=1e4, scaling={"rope_type": "default", "rope_theta": 1e4}).scaling is None
    with pytest.raises(SpecError, match=r"rope_theta 500000.0 differs from theta=10000.0"):
        ja.RoPE(scaling=scaled)
    assert ja.RoPE(scaling=transformers.Phi3Config().rope_parameters).scaling is None
    with pytest.raises(SpecError, match=r"partial rotary embeddings are not supported"):
        ja.RoPE(scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(SpecError, match=r"one dict per layer type"):
        ja.RoPE(scaling=transformers.Gemma3TextConfig().rope_parameters)


def test_gpt_oss_attention_sinks_and_window_match_eager():
    """gpt-oss passes its attention sinks as s_aux (one logit per head in every row's
    softmax) and alternates sliding-window and full layers: logits equal eager's, unpadded
    and with left padding (transformers' sdpa drops the sinks: 0.4 off here)."""
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=512,
        hidden_size=128, intermediate_size=128, head_dim=64, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.float16).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)  # (initialised near 0: they would not show)
    name = register()
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, 37, dtype=torch.long)
    padded[1, :5] = 0
    with torch.inference_mode():
        for mask in (None, padded):
            model.config._attn_implementation = "eager"
            eager = model(ids, attention_mask=mask).logits
            model.config._attn_implementation = name
            ours = model(ids, attention_mask=mask).logits
            real = slice(None) if mask is None else mask.bool()
            torch.testing.assert_close(ours[real], eager[real], atol=2e-2, rtol=2e-2)


def test_sinks_of_the_wrong_shape_are_refused():
    q = torch.randn(1, 4, 6, 64).half()
    with pytest.raises(ValueError, match=r"s_aux \(attention sinks\) has shape \(2,\); "
                                         r"expected one logit per query head, \(4,\)"):
        jitattn_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


def test_autocast_runs_attention_in_its_dtype_as_sdpa():
    """A float32 model under torch.autocast(bfloat16) hands attention q and k in float32 (after
    RoPE) and v in bfloat16: it was refused, telling the user to cast the model, while sdpa
    runs it in the autocast dtype; so does jitattn now (out in that dtype)."""
    from jitattn.integrations.transformers import jitattn_attention_forward
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 4, 7, 64, generator=gen), torch.randn(2, 2, 7, 64, generator=gen)
    v = torch.randn(2, 2, 7, 64, generator=gen).bfloat16()
    module = torch.nn.Module()
    module.is_causal = True
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = jitattn_attention_forward(module, q, k, v, None, scaling=0.125)
    assert out.dtype == torch.bfloat16
    ref = _sdpa(q.bfloat16(), k.bfloat16(), v, is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    with pytest.raises(TypeError, match="the model runs attention in torch.float32"):
        jitattn_attention_forward(module, q, k, v.float(), None, scaling=0.125)


def test_training_mode_with_gradients_is_refused():
    """model.train() and a backward pass only warned (once per layer), and the optimizer then
    skipped q, k and v's projections, whose gradients stayed None; eval mode without no_grad
    still warns and runs."""
    name = register()
    model = tiny_llama(name)
    ids = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    model.train()
    with pytest.raises(RuntimeError, match="training mode with gradients on, and jitattn's "
                                           "attention has no backward"):
        model(ids)
    with torch.no_grad():
        model(ids)
    model.eval()
    with pytest.warns(UserWarning, match="has no backward"):
        model(ids)
