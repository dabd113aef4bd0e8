"""jitattn as an attention implementation of Hugging Face transformers (its AttentionInterface).

    from jitattn.integrations.transformers import register
    register()                                   # name "jitattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="jitattn")

The Variant comes from what the model passes each call: causal or not (the module's
``is_causal``), ``sliding_window`` and ``softcap`` (Gemma 2 style), ``scaling`` as sm_scale;
RoPE has already been applied by the model.

Batches: without padding, the mask function registered with the attention (transformers' sdpa
mask) returns no mask, and jitattn runs the batch as a ragged batch of equal requests, queries
aligned to the end of the keys (as in decoding with a KV cache). With padding (left or right,
prefill or decode with a cache; cross-attention over a padded encoder batch), the mask is
turned into a ragged batch once per forward (the model passes the same mask to every layer):
each request keeps its real queries and keys, and the mask is checked to be exactly what the
variant computes on them; padding rows (and queries that see no key) give 0. A mask of batch
1 covers every request. A mask that is not padding-shaped (e.g. packed sequences), or additive
with values other than 0 and a large negative (a bias), raises ValueError. Under torch.compile
the layout is built outside the graph (a graph break per layer with a padded mask).
Attention sinks (gpt-oss's ``s_aux``) renormalise the output by the lse, as transformers'
flex_attention does. No attention weights are returned (output_attentions=True warns, as with
transformers' sdpa), and a position_bias (T5's relative bias) raises ValueError rather than
being dropped.
"""

from __future__ import annotations

import warnings
import weakref

import torch

import jitattn as ja
from jitattn.args import host_only


_VARIANTS: dict = {}  # (causal, sliding_window, softcap) -> Variant


def variant_for(causal: bool, sliding_window: int | None, softcap: float | None) -> ja.Variant:
    """The Variant of one attention layer's settings (kept: one kernel per distinct set). A
    plain dict lookup, which torch.compile traces as one once a call outside it (or the first
    compiled call's graph break) has built the Variant: functools.lru_cache is not honoured
    there, and building a Variant cannot be traced (fullgraph failed in every layer with an
    error about json's encoder), so it is built eagerly (args.host_only)."""
    variant = _VARIANTS.get((causal, sliding_window, softcap))
    if variant is not None:
        return variant
    return host_only(_VARIANT_REASON)(_build_variant, causal, sliding_window, softcap)


_VARIANT_REASON = ("jitattn builds a layer's Variant on the layer's first call: run the model "
                   "once outside torch.compile(fullgraph=True) first")


def _build_variant(causal: bool, sliding_window: int | None, softcap: float | None):
    name = "hf" + ("_causal" if causal else "") + \
        (f"_window{sliding_window}" if sliding_window else "") + \
        (f"_softcap{softcap:g}" if softcap else "")
    # transformers' sliding_window counts the query's own token; window_left does not
    variant = ja.Variant(name, mask="causal" if causal else "none",
                         window_left=None if not sliding_window else sliding_window - 1,
                         score_mod=ja.soft_cap(float(softcap)) if softcap else None)
    return _VARIANTS.setdefault((causal, sliding_window, softcap), variant)


class _Unpadding:
    """A padded batch as a ragged one: rows of q [batch * q_len] and of k/v [batch * kv_len]
    that are real, in order, with their indptrs."""

    def __init__(self, allowed: torch.Tensor, variant: ja.Variant):
        """allowed: [batch, q_len, kv_len] bool, True where a query may see a key. A key is
        real if some query sees it. Where positions matter (causal or windowed), a query is
        real if its own token (key kv_len - q_len + i; none before the first key) is;
        otherwise (cross-attention, whose keys are another sequence, and encoders) if it sees
        a key. Only real queries' rows are checked and computed. Keys after the last one any
        query sees, and after the queries' q_len (a static cache's unused slots: its mask
        spans max_cache_len keys), are left out first, so that the queries' own tokens end
        the keys (they were taken from the unused slots: every row came out 0)."""
        batch, q_len, kv_len = allowed.shape
        # query i's own token is q_len - 1 - i keys before the last used one, and the last key
        # a query row sees is at most its own (a padding row sees less, or nothing): the
        # largest of last + (q_len - i) over the rows is the keys in use (the last key anyone
        # sees was wrong when the chunk ended in padding in every request)
        last = torch.where(allowed, torch.arange(kv_len, device=allowed.device), -1).amax(2)
        own_end = torch.where(last >= 0, last + q_len - torch.arange(q_len, device=last.device),
                              0)
        kv_used = min(kv_len, max(q_len, int(own_end.max())))  # (a host sync)
        allowed = allowed[:, :, :kv_used]
        key_real = allowed.any(dim=1)
        if variant.mask == "none" and variant.window_left is None:
            q_real = allowed.any(dim=2)
        else:
            q_real = torch.zeros(allowed.shape[:2], dtype=torch.bool, device=allowed.device)
            q_real[:, max(0, q_len - kv_used):] = key_real[:, max(0, kv_used - q_len):]
        n, m = key_real.sum(1), q_real.sum(1)
        key_rank, q_rank = key_real.cumsum(1) - 1, q_real.cumsum(1) - 1
        # what the variant computes on the real rows: query rank r sits at position
        # n - m + r among the request's n real keys (bottom-right alignment)
        expected = q_real[:, :, None] & key_real[:, None, :]
        q_pos = (n - m)[:, None, None] + q_rank[:, :, None]
        if variant.mask == "causal":
            expected &= key_rank[:, None, :] <= q_pos
        if variant.window_left is not None:
            expected &= q_pos - key_rank[:, None, :] <= variant.window_left
        if not torch.equal(expected[q_real], allowed[q_real]):
            raise ValueError(
                "the attention mask is not a padding mask of this layer's attention (each "
                "request: real queries seeing real keys, causal / window aligned to the end); "
                "jitattn's transformers integration takes unpadded or padded batches, not "
                "packed sequences or arbitrary masks")
        self.q_rows = q_real.reshape(-1).nonzero().squeeze(1)
        # rows of k / v [batch * kv_len] (the unused slots are not rows of any request)
        self.kv_rows = (torch.arange(batch, device=allowed.device)[:, None] * kv_len +
                        torch.arange(kv_used, device=allowed.device))[key_real]
        counts = torch.stack([m, n]).cpu()  # one host sync per forward
        zero = torch.zeros(1, dtype=torch.int32)
        self.qo_indptr = torch.cat([zero, counts[0].cumsum(0).to(torch.int32)])
        self.kv_indptr = torch.cat([zero, counts[1].cumsum(0).to(torch.int32)])


# the last masks seen (the model passes the same mask tensor to every layer of one forward;
# an encoder-decoder's decoder layers alternate two: self- and cross-attention), held weakly
# and identified by `is`, with their ragged layouts per variant
_RECENT: list = []  # [weakref to the mask, its version, {variant: _Unpadding}, the ids of
#                       the attention modules it served], latest first
_RECENT_MASKS = 4
# an additive mask's values at or below this hide a key (transformers writes its dtype's
# minimum; older models -10000.0)
ADDITIVE_HIDDEN = -1e4


# the per-forward cache below must not be traced (host_only): under torch.compile (without
# fullgraph) the first mask's layout was baked into the graph and reused for later masks of the
# same shape
_UNPADDING_REASON = ("jitattn lays out an attention mask on the host, and transformers passes "
                     "one for padding, for a sliding window shorter than the keys and for a "
                     "prefill in chunks over a cache: compile without fullgraph=True (one graph "
                     "break per layer), or pass unpadded batches without those")


def _unpadding(attention_mask: torch.Tensor, variant: ja.Variant, batch: int, q_len: int,
               kv_len: int, module_id: int | None = None) -> _Unpadding:
    # transformers builds a new mask per forward; a mask changed in place is seen by its
    # version counter, which inference tensors lack: those are reused only as the latest mask
    # and within one forward, where each attention module (module_id: its id) runs once; a
    # module seen again starts a forward, where a mask buffer the caller refills in place
    # between forwards gets a new layout (layer 0 started one: CLIP's modules have no
    # layer_idx, and kept a stale layout; ALBERT's one shared module lays out every layer)
    inference = attention_mask.is_inference()
    version = None if inference else attention_mask._version
    entry = next((e for e in _RECENT if e[0]() is attention_mask), None)
    if entry is None or entry[1] != version or (inference and (
            entry is not _RECENT[0] or module_id is None or module_id in entry[3])):
        # (by identity: weak references compare their tensors)
        kept = [e for e in _RECENT if e is not entry and e[0]() is not None]
        entry = [weakref.ref(attention_mask), version, {}, set()]
        _RECENT[:] = [entry] + kept[:_RECENT_MASKS - 1]
    entry[3].add(module_id)
    layouts = entry[2]
    if (variant, batch) not in layouts:
        shape = tuple(attention_mask.shape)
        if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] != 1 or \
                shape[2:] != (q_len, kv_len):
            raise ValueError(f"attention_mask has shape {shape}; expected [batch, 1, q_len, "
                             f"kv_len] = [{batch} (or 1), 1, {q_len}, {kv_len}]")
        allowed = attention_mask[:, 0].expand(batch, q_len, kv_len)  # (a mask of one: all)
        if allowed.dtype != torch.bool:  # additive: 0 where allowed, a large negative elsewhere
            hidden = allowed <= ADDITIVE_HIDDEN
            if not torch.all(hidden | (allowed == 0)):
                bad = allowed[~hidden & (allowed != 0)][0].item()
                raise ValueError(f"attention_mask is additive with a value ({bad!r}) other than "
                                 f"0 (attend) and a large negative (<= {ADDITIVE_HIDDEN:g}, "
                                 f"hidden): a bias, which jitattn's integration does not take "
                                 f"(a bias is a Variant's score_mod)")
            allowed = ~hidden
        layouts[(variant, batch)] = _Unpadding(allowed, variant)
    return layouts[(variant, batch)]


def jitattn_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              sliding_window: int | None = None, softcap: float | None = None,
                              **kwargs):
    """transformers' attention signature: query [batch, heads, q_len, head_dim], key / value
    [batch, kv_heads, kv_len, head_dim], attention_mask None or [batch, 1, q_len, kv_len]
    (bool, True = attend, or additive float), cast to torch.autocast's 16-bit dtype where it
    is on (as sdpa); returns (out [batch, q_len, heads, head_dim],
    None; with output_attentions=True it warns, as transformers' sdpa does). Raises
    ValueError for dropout, a position_bias (T5's relative bias: a bias is a Variant's
    score_mod) or a mask that is not padding-shaped; RuntimeError for a module in training
    mode whose inputs require grad (no backward: eval mode without no_grad warns)."""
    if dropout:
        raise ValueError(f"dropout={dropout}: jitattn is for inference (dropout 0)")
    if getattr(module, "training", False) and torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad):
        # (a warning let a training step run with no gradient for q, k, v's projections)
        raise RuntimeError("the model is in training mode with gradients on, and jitattn's "
                           "attention has no backward (inference only): its projections would "
                           "get no gradient; train with attn_implementation='sdpa' or "
                           "'eager', or call model.eval() / run under torch.no_grad()")
    if kwargs.get("position_bias") is not None:  # (dropped, it would give wrong outputs)
        raise ValueError("position_bias: jitattn's attention takes no bias tensor (a bias is "
                         "a Variant's score_mod); run this model with attn_implementation="
                         "'eager'")
    if kwargs.get("output_attentions"):
        warnings.warn("jitattn attention returns no attention weights (output_attentions="
                      "True gives () for them, as with 'sdpa'); use attn_implementation="
                      "'eager' for them", stacklevel=2)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # (as transformers' sdpa under autocast: its
        #  inputs in the autocast dtype; q and k arrive float32 after RoPE, v in that dtype)
        low = torch.get_autocast_dtype(device_type)
        if low in (torch.float16, torch.bfloat16):  # (float64 stays: refused below)
            query, key, value = (x.to(low) if x.dtype == torch.float32 else x
                                 for x in (query, key, value))
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the model runs attention in {query.dtype}; jitattn's kernels take "
                        f"float16 or bfloat16: load or cast the model to one of them (e.g. "
                        f"from_pretrained(..., dtype=torch.bfloat16) or model.half())")
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks, [num_qo_heads]
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or
                              tuple(sinks.shape) != (query.shape[1],)):
        raise ValueError(f"s_aux (attention sinks) has shape "
                         f"{tuple(getattr(sinks, 'shape', ()))}; expected one logit per query "
                         f"head, ({query.shape[1]},)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    variant = variant_for(bool(causal), sliding_window, softcap)
    batch, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * q_len, hq, d)
    k = key.transpose(1, 2).reshape(batch * kv_len, key.shape[1], d)
    v = value.transpose(1, 2).reshape(batch * kv_len, value.shape[1], d)
    if attention_mask is None:
        if causal and 1 < q_len < kv_len:
            # transformers passes no mask here only for a prefill into an empty static cache,
            # relying on SDPA's is_causal (upper-left aligned): the keys after the q_len
            # queries' own are the cache's unused slots (all were read: 0 from their zeros)
            kv_len = q_len
            k, v = (x[:, :, :q_len].transpose(1, 2).reshape(batch * q_len, x.shape[1], d)
                    for x in (key, value))
        qo = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
        kv = torch.arange(0, batch * kv_len + 1, kv_len, dtype=torch.int32)
        out = ja.attention(q.contiguous(), k.contiguous(), v.contiguous(), variant,
                           qo_indptr=qo, kv_indptr=kv, sm_scale=scaling,
                           return_lse=sinks is not None)
        return _with_sinks(out, sinks).reshape(batch, q_len, hq, d), None
    layout = host_only(_UNPADDING_REASON)(_unpadding, attention_mask, variant, batch, q_len,
                                          kv_len, id(module))
    out = torch.zeros(batch * q_len, hq, d, dtype=query.dtype, device=query.device)
    out[layout.q_rows] = _with_sinks(ja.attention(
        q[layout.q_rows], k[layout.kv_rows], v[layout.kv_rows], variant,
        qo_indptr=layout.qo_indptr, kv_indptr=layout.kv_indptr, sm_scale=scaling,
        return_lse=sinks is not None), sinks)
    return out.reshape(batch, q_len, hq, d), None


def _with_sinks(result, sinks):
    """The output with attention sinks (gpt-oss's ``s_aux``: one logit per query head that
    joins every row's softmax with no value): out x exp(lse) / (exp(lse) + exp(sink)) =
    out x sigmoid(lse - sink), lse the row's natural-log sum over its keys (-inf where it sees
    none: out stays 0); ``result`` is out alone when sinks is None, else (out, lse)."""
    if sinks is None:
        return result
    out, lse = result
    return (out.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(out.dtype)


def register(name: str = "jitattn") -> str:
    """Register the attention function and its mask function (transformers' sdpa mask: empty
    for unpadded causal batches, [batch, 1, q_len, kv_len] bool with padding) under ``name``;
    returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(name, jitattn_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
