"""07: a Llama model whose requests share a prompt, with jitattn's shared-prefix attention in
every layer, checked against transformers' own eager attention.

The model is a transformers LlamaForCausalLM built from Llama-3.2-1B's configuration (hidden
2048, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 128256, RoPE theta 500000 with Llama 3.1
frequency scaling, RMSNorm eps 1e-5) cut to 2 layers, with seeded random weights (nothing is
downloaded). On a GPU it runs that configuration in fp16; on the CPU a narrower one (hidden 256,
4 / 2 heads of 64, vocabulary 1000) in float32, so that the example takes seconds.

(a) Multi-item scoring: one prompt of P tokens and N short candidate items; each item's logits
    given [prompt + item]. The model runs once over the deduplicated tokens [P, item_0, ...,
    item_{N-1}], item tokens at positions P, P + 1, ... (as if each item followed the prompt
    alone), and every layer's attention is one ``ja.SharedPrefixPrefill(strategy="auto")`` call
    (cascade for a long prompt shared by many short items, else ragged: SharedPrefixPrefill.choose).
(b) Parallel sampling: N continuations of one prompt decoded together. The prompt's K/V is
    prefilled once into a paged cache shared by all N sequences; each step ``ja.CascadeDecode``
    reads the prompt's pages once for every sequence (level 0) and each sequence's own pages
    (level 1), merging the two by log-sum-exp.

Both are compared with transformers running the same weights with attn_implementation="eager":
(a) on each [prompt + item] alone, (b) as a batch of N prompts decoded with its own KV cache.

RoPE is applied by the model (transformers' rotary embedding at each token's own position,
before attention), so the jitattn variant is plain causal. Fused RoPE would not do here:
multi_item / cascade move tokens to other positions inside their launches, so they refuse
variants that read positions (``jitattn.shared_prefix.check_strategy``), and so does
CascadeDecode.

Sources: the shared-prefix survey (docs/sources.md) (scheme 5a, multi-item scoring;
"Decode (scenario 3): cascade is the method", parallel sampling), and FlashInfer's cascade
attention (Ye et al. 2025, arXiv 2501.01005: attention states merged by log-sum-exp).
"""

import inspect
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import jitattn as ja

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
# the model's dtype, and the dtype of the q / k / v that jitattn takes (fp16 or bf16 only)
MODEL_DTYPE = torch.float16 if GPU else torch.float32
ATTN_DTYPE = torch.float16
# Logits must agree within TOLERANCE x the largest reference logit. On the CPU the model runs in
# float32 and only attention's q / k / v and output are rounded to fp16 (relative error 2^-11
# each), which moves the logits by about 1e-3 of their scale (bf16, 2^-8: about 4e-3); an item
# token placed one position off moves them by 0.2. On the GPU both sides run in fp16 throughout,
# each rounding in its own order.
TOLERANCE = 1e-2 if not GPU else 2e-2
VARIANT = ja.Variant("llama_causal", mask="causal")   # RoPE is applied by the model
PAGE_SIZE = 16


def llama_config() -> LlamaConfig:
    """Llama-3.2-1B's config.json, 2 layers; narrower on the CPU."""
    size = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256) if GPU else \
        dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)
    return LlamaConfig(
        **size, head_dim=64, num_hidden_layers=2, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        # weights ~ N(0, 1 / hidden): attention scores spread by about 1, as in a trained model,
        # instead of the near-uniform attention of transformers' default 0.02
        initializer_range=size["hidden_size"] ** -0.5,
        attn_implementation="eager")    # the reference; our forward() bypasses it


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).to(DEVICE, MODEL_DTYPE).eval()


def forward(model, ids, positions, attend) -> torch.Tensor:
    """The model over a flat list of tokens at the given positions, with every layer's attention
    replaced by ``attend(layer, q, k, v)``: q [tokens, q heads, head_dim], k / v [tokens, kv
    heads, head_dim], RoPE applied; it returns [tokens, q heads, head_dim]. Everything else
    (embedding, norms, projections, RoPE, MLP) is transformers' modules. Returns the final
    (normed) hidden states [tokens, hidden]."""
    body = model.model
    h = body.embed_tokens(ids)[None]                                   # [1, tokens, hidden]
    cos, sin = body.rotary_emb(h, positions[None])
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        heads = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(x).view(heads).transpose(1, 2)                 # [1, heads, tokens, d]
        k = attn.k_proj(x).view(heads).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        v = attn.v_proj(x).view(heads)[0]                              # [tokens, heads, d]
        o = attend(i, q[0].transpose(0, 1), k[0].transpose(0, 1), v)
        h = h + attn.o_proj(o.reshape(*x.shape[:-1], -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return body.norm(h)[0]


def jitattn_inputs(*tensors):
    return [t.to(ATTN_DTYPE).contiguous() for t in tensors]


def timed(fn):
    """fn()'s result and its wall time in seconds, after one warm-up call (which also builds
    jitattn's kernels)."""
    fn()
    if GPU:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if GPU:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    tol = TOLERANCE * scale
    print(f"    {name}: max |jitattn - eager| = {diff:.2e} (tolerance {tol:.2e}, "
          f"largest logit {scale:.1f})")
    assert diff <= tol, f"{name}: {diff} > {tol}"


# -- (a) multi-item scoring -------------------------------------------------------------------

def score_items(model, prompt, items):
    """Each item's logits given [prompt + item], from one pass over [prompt, item_0, ...]
    with SharedPrefixPrefill in every layer. Returns (strategy, [item logits])."""
    p, lens = len(prompt), [len(it) for it in items]
    ids = torch.cat([prompt, *items])
    positions = torch.cat([torch.arange(p)] + [p + torch.arange(n) for n in lens]).to(DEVICE)
    cfg = model.config
    sp = ja.SharedPrefixPrefill(VARIANT, strategy="auto", device=DEVICE)
    strategy = sp.plan(p, lens, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       q_dtype=ATTN_DTYPE)   # once; every layer reuses the plan

    def attend(layer, q, k, v):
        return sp.run(*jitattn_inputs(q, k, v)).to(MODEL_DTYPE)

    with torch.inference_mode():
        hidden = forward(model, ids, positions, attend)
        return strategy, model.lm_head(hidden[p:]).split(lens)


def score_items_eager(model, prompt, items):
    """transformers on each [prompt + item] alone (the head only on the item's tokens)."""
    with torch.inference_mode():
        return [model.lm_head(model.model(torch.cat([prompt, it])[None])
                              .last_hidden_state[0, len(prompt):]) for it in items]


def multi_item_scoring(model, prompt_len: int, num_items: int) -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).to(DEVICE)
    items = [torch.randint(0, vocab, (2 + i % 3,), generator=gen).to(DEVICE)   # 2-4 tokens
             for i in range(num_items)]
    (strategy, ours), t_ours = timed(lambda: score_items(model, prompt, items))
    ref, t_ref = timed(lambda: score_items_eager(model, prompt, items))
    print(f"(a) multi-item scoring: prompt {prompt_len} tokens + {num_items} items of 2-4 "
          f"tokens; SharedPrefixPrefill chose {strategy!r}")
    check("item logits", torch.cat(ours), torch.cat(ref))
    print(f"    time: jitattn {t_ours * 1e3:.1f} ms (one pass over "
          f"{prompt_len + sum(map(len, items))} tokens) | eager {t_ref * 1e3:.1f} ms "
          f"({num_items} passes over [prompt + item])")


# -- (b) parallel sampling --------------------------------------------------------------------

class PagedKV:
    """Every layer's K/V pages [num_pages, PAGE_SIZE, kv heads, head_dim]: the prompt on pages
    0 .. prompt_pages - 1, then each sequence's own pages."""

    def __init__(self, config, prompt_len: int, num_seqs: int, steps: int):
        self.prompt_len = prompt_len
        self.prompt_pages = -(-prompt_len // PAGE_SIZE)
        own = -(-steps // PAGE_SIZE)
        self.own_pages = self.prompt_pages + torch.arange(num_seqs * own).view(num_seqs, own)
        shape = (self.prompt_pages + num_seqs * own, PAGE_SIZE, config.num_key_value_heads,
                 config.head_dim)
        self.k = [torch.zeros(shape, dtype=ATTN_DTYPE, device=DEVICE)
                  for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros_like(c) for c in self.k]

    def write(self, layer: int, slots, k, v) -> None:
        """Store k / v [tokens, kv heads, head_dim] at token slots (page * PAGE_SIZE + offset)."""
        self.k[layer].view(-1, *k.shape[1:])[slots] = k
        self.v[layer].view(-1, *v.shape[1:])[slots] = v

    def own_slots(self, step: int):
        """Each sequence's slot for its token of this step."""
        return self.own_pages[:, step // PAGE_SIZE] * PAGE_SIZE + step % PAGE_SIZE

    def plan(self, cascade: ja.CascadeDecode, step: int, config) -> None:
        """Plan the cascade for this step: level 0 the prompt's pages, level 1 each sequence's
        tokens 0 .. step."""
        i32 = dict(dtype=torch.int32)
        used = step // PAGE_SIZE + 1
        n = len(self.own_pages)
        cascade.plan(torch.arange(self.prompt_pages, **i32),
                     self.prompt_len - (self.prompt_pages - 1) * PAGE_SIZE,
                     torch.arange(0, n * used + 1, used, **i32),
                     self.own_pages[:, :used].reshape(-1).to(torch.int32),
                     torch.full((n,), step % PAGE_SIZE + 1, **i32),
                     config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                     q_dtype=ATTN_DTYPE, sm_scale=config.head_dim ** -0.5)


def decode_step(model, kv: PagedKV, cascade: ja.CascadeDecode, tokens, step: int):
    """Every sequence's next-token logits [num_seqs, vocab] after feeding tokens [num_seqs]
    at position prompt_len + step; their K/V go to each sequence's own pages."""
    kv.plan(cascade, step, model.config)        # on the host, once per step for all layers
    slots = kv.own_slots(step).to(DEVICE)

    def attend(layer, q, k, v):
        q, k, v = jitattn_inputs(q, k, v)
        kv.write(layer, slots, k, v)
        return cascade.run(q, (kv.k[layer], kv.v[layer])).to(MODEL_DTYPE)

    positions = torch.full((len(tokens),), kv.prompt_len + step, device=DEVICE)
    return model.lm_head(forward(model, tokens, positions, attend))


def prefill_prompt(model, prompt, kv: PagedKV) -> None:
    """The prompt through the model once (causal ja.attention), its K/V into the shared pages."""
    p = len(prompt)

    def prefill(layer, q, k, v):
        q, k, v = jitattn_inputs(q, k, v)
        kv.write(layer, torch.arange(p, device=DEVICE), k, v)
        return ja.attention(q, k, v, VARIANT).to(MODEL_DTYPE)

    forward(model, prompt, torch.arange(p, device=DEVICE), prefill)


def new_cascade() -> ja.CascadeDecode:
    # strategy "cascade" to show it; "auto" would take one plain paged decode where the prompt
    # bytes saved do not pay for the cascade's extra launches (CascadeDecode.choose)
    return ja.CascadeDecode(VARIANT, page_size=PAGE_SIZE, strategy="cascade", device=DEVICE)


def sample_jitattn(model, prompt, num_seqs: int, steps: int, first_tokens):
    """Prefill the prompt once into the shared pages, then decode num_seqs sequences with
    CascadeDecode: step 0 feeds first_tokens, later steps the argmax.
    Returns (tokens [num_seqs, steps], logits [steps, num_seqs, vocab])."""
    kv = PagedKV(model.config, len(prompt), num_seqs, steps)
    cascade = new_cascade()
    tokens, logits = [first_tokens], []
    with torch.inference_mode():
        prefill_prompt(model, prompt, kv)
        for step in range(steps):
            logits.append(decode_step(model, kv, cascade, tokens[-1], step))
            tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens[:steps], 1), torch.stack(logits)


def sample_graphed(model, prompt, tokens):
    """sample_jitattn's decode with the whole step (every layer's projections, K/V writes,
    CascadeDecode and the LM head) captured once in a CUDA graph and replayed each step, as a
    serving engine runs it: per step only plan() (host) and the copies of this step's token,
    position and cache slots into the graph's static inputs. Feeds the given tokens
    [num_seqs, steps]; returns the logits [steps, num_seqs, vocab]."""
    num_seqs, steps = tokens.shape
    p, cfg = len(prompt), model.config
    kv = PagedKV(cfg, p, num_seqs, steps)
    cascade = new_cascade()
    token_in = tokens[:, 0].clone()
    slots_in = kv.own_slots(0).to(DEVICE)
    position_in = torch.full((num_seqs,), p, device=DEVICE)

    def step():
        def attend(layer, q, k, v):
            q, k, v = jitattn_inputs(q, k, v)
            kv.write(layer, slots_in, k, v)
            return cascade.run(q, (kv.k[layer], kv.v[layer])).to(MODEL_DTYPE)
        return model.lm_head(forward(model, token_in, position_in, attend))

    logits = []
    with torch.inference_mode():
        prefill_prompt(model, prompt, kv)
        kv.plan(cascade, 0, cfg)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up off the capture (writes step 0's slots)
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits_out = step()
        for i in range(steps):
            kv.plan(cascade, i, cfg)
            token_in.copy_(tokens[:, i])
            slots_in.copy_(kv.own_slots(i))
            position_in.fill_(p + i)
            graph.replay()
            logits.append(logits_out.clone())
    return torch.stack(logits)


def sample_eager(model, prompt, tokens):
    """transformers' eager attention with its own KV cache: the prompt prefilled for each of
    the sequences (a batch of num_seqs copies), then the same tokens fed step by step."""
    # transformers 5 names the argument `cache`, earlier versions `past_key_values`
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    cache, logits = {arg: DynamicCache()}, []
    with torch.inference_mode():
        model.model(prompt.expand(len(tokens), -1), use_cache=True, **cache)   # no head
        for step in range(tokens.shape[1]):
            out = model(tokens[:, step:step + 1], use_cache=True, **cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


def parallel_sampling(model, prompt_len: int, num_seqs: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).to(DEVICE)
    # N different first tokens (fixed draws), so that the greedy continuations differ
    first = torch.randperm(vocab, generator=gen)[:num_seqs].to(DEVICE)
    (tokens, ours), t_ours = timed(lambda: sample_jitattn(model, prompt, num_seqs, steps, first))
    ref, t_ref = timed(lambda: sample_eager(model, prompt, tokens))
    print(f"(b) parallel sampling: prompt {prompt_len} tokens ({-(-prompt_len // PAGE_SIZE)} "
          f"shared pages of {PAGE_SIZE}), {num_seqs} sequences x {steps} greedy steps; "
          f"CascadeDecode")
    check("step logits", ours, ref)
    print(f"    time (prefill + {steps} steps): jitattn {t_ours * 1e3:.1f} ms (prompt once, "
          f"cascade decode) | eager {t_ref * 1e3:.1f} ms ({num_seqs} copies of the prompt, "
          f"transformers' KV cache)")
    if GPU:
        graphed, t_graph = timed(lambda: sample_graphed(model, prompt, tokens))
        diff = (graphed.float() - ours.float()).abs().max().item()
        print(f"    each decode step replayed from one CUDA graph: max |graph - jitattn| = "
              f"{diff:.2e}; time {t_graph * 1e3:.1f} ms (prefill + capture + {steps} steps)")
        assert diff <= TOLERANCE * ours.float().abs().max().item(), diff


def main() -> None:
    model = build_model()
    cfg = model.config
    print(f"[{DEVICE}] Llama: hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} / "
          f"{cfg.num_key_value_heads} x {cfg.head_dim}, {cfg.num_hidden_layers} layers, vocab "
          f"{cfg.vocab_size}; model {str(MODEL_DTYPE)[6:]}, jitattn q/k/v "
          f"{str(ATTN_DTYPE)[6:]}")
    multi_item_scoring(model, prompt_len=2048 if GPU else 1024, num_items=16 if GPU else 8)
    # 20 steps: each sequence's own tokens fill one page and start a second
    parallel_sampling(model, prompt_len=2040 if GPU else 1000, num_seqs=16 if GPU else 8,
                      steps=20)


if __name__ == "__main__":
    main()
