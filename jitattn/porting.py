"""What FlashInfer's users pass that jitattn takes elsewhere: the hints of the wrappers'
TypeErrors for FlashInfer's constructor and plan() keywords and positional arguments (README:
porting from FlashInfer). args.planner and the wrappers' constructors raise them."""

from __future__ import annotations

import inspect


# keywords of FlashInfer's plan() that are something else here (README, porting from FlashInfer)
_FLASHINFER_PLAN = {
    "causal": "the Variant's mask (Variant(..., mask='causal'), the default, or mask='none')",
    "window_left": "the Variant's (Variant(..., window_left=W))",
    "logits_soft_cap": "the Variant's score_mod (score_mod=ja.soft_cap(cap))",
    "pos_encoding_mode": "the Variant's pos_encoding (pos_encoding=ja.RoPE(...))",
    "rope_theta": "ja.RoPE(theta=)'s, the Variant's pos_encoding",
    "rope_scale": "ja.RoPE(scaling={'type': 'linear', 'factor': f})'s",
    "q_data_type": "q_dtype= here",
    "kv_data_type": "kv_dtype= here",
    "page_size": "the constructor's ({ctor})",
    "custom_mask": "BatchPrefill.plan()'s, with Variant(..., mask='custom')",
    "data_type": "q_dtype= / kv_dtype= here",
    "non_blocking": "not needed: plan() copies its schedule to the device asynchronously",
    "head_dim_qk": "head_dim= here (one head_dim for q, k and v)",
    "head_dim_vo": "head_dim= here (one head_dim for q, k and v)",
}


# FlashInfer's names of plan()'s page-table arguments (its prefill, decode and multi-level
# cascade wrappers) -> this plan()'s (MultiLevelCascade's: one tensor per level, a list)
_FLASHINFER_PLAN_RENAMED = {
    "paged_kv_indptr": "kv_indptr", "paged_kv_indices": "kv_indices",
    "paged_kv_last_page_len": "kv_last_page_len", "indptr": "kv_indptr",
    "indices": "kv_indices", "last_page_len": "kv_last_page_len",
    "qo_indptr_arr": "qo_indptr", "paged_kv_indptr_arr": "kv_indptr",
    "paged_kv_indices_arr": "kv_indices",
}


# the same for a plan() without kv_dtype= (the cascades': caches in q's dtype)
_FLASHINFER_PLAN_Q_DTYPE_ONLY = {
    "data_type": "q_dtype= here (the caches are read in q's dtype)",
    "kv_data_type": "not taken here: the caches are read in q's dtype (q_dtype=)",
}


# keywords of FlashInfer's wrapper constructors that jitattn's do not take, and why
_FLASHINFER_CTOR = {
    "use_cuda_graph": "not needed: run() can always be captured in a CUDA graph (the "
                      "constructor's capacities size the wrapper's buffers)",
    "use_tensor_cores": "chosen per device: the kernels always run on tensor cores",
    "backend": "chosen per device (wgmma on sm_90a, mma.sync elsewhere)",
    "jit_args": "the Variant's (Variant(..., score_mod=, mask_mod=))",
}


# flash-attn's window_size in a Variant's fields (said by attention()'s and Variant()'s hints)
_WINDOW_SIZE = ("flash-attn's window_size=(left, 0) is mask='causal', window_left=left; "
                "(left, -1) is mask='none', window_left=left")


# keywords of SDPA's, FlexAttention's or FlashInfer's attention calls that reach a jitattn call's
# variant parameters (spec.Variant.check_param_names): where each lives here
CALL_KEYWORDS_ELSEWHERE = {
    **{name: _FLASHINFER_PLAN[name] for name in ("causal", "window_left", "logits_soft_cap")},
    "is_causal": _FLASHINFER_PLAN["causal"],
    "attn_mask": "the Variant's mask_mod, or mask='custom' with BatchPrefill.plan(custom_mask=)",
    "block_mask": "the Variant's mask_mod (Variant(mask_mod=block_mask.mask_mod, "
                  "mask='none'))",
    "score_mod": "the Variant's (Variant(score_mod=f, mask='none')), not the call's",
    "mask_mod": "the Variant's (Variant(mask_mod=f, mask='none')), not the call's",
    "enable_gqa": "not needed: q's heads may be a multiple of k's",
    "dropout_p": "not taken: jitattn is inference only",
    "sm_scale": "plan()'s for a planned wrapper (plan(..., sm_scale=))",
    "q_scale": "not taken: fold q's scale into sm_scale",
    "pos_encoding_mode": _FLASHINFER_PLAN["pos_encoding_mode"],
    "kv_layout": "the batch wrappers' (BatchPrefill(variant, kv_layout=...)); attention() "
                 "takes k and v as [total_kv, num_kv_heads, head_dim]",
    "cu_seqlens_q": "qo_indptr= here ([batch_size + 1] int32 offsets of each request's rows)",
    "cu_seqlens_k": "kv_indptr= here ([batch_size + 1] int32 offsets of each request's rows)",
    "max_seqlen_q": "not needed: read from qo_indptr",
    "max_seqlen_k": "not needed: read from kv_indptr",
    "softmax_scale": "sm_scale= here",
    "softcap": _FLASHINFER_PLAN["logits_soft_cap"],
    "window_size": f"the Variant's window_left ({_WINDOW_SIZE})",
    "alibi_slopes": "the Variant's score_mod (README: a captured slopes tensor)",
    "return_softmax_lse": "return_lse= here",
    "return_attn_probs": "not taken: jitattn returns out and, with return_lse=True, lse",
}


# what a wrapper's constructor is given that its plan() or its Variant takes
_CTOR_ELSEWHERE = {
    **{name: _FLASHINFER_PLAN[name] for name in ("causal", "window_left", "logits_soft_cap",
                                                  "pos_encoding_mode")},
    **{name: f"plan()'s (plan(..., {name}=))" for name in ("sm_scale", "q_dtype", "kv_dtype")},
    "q_data_type": "plan()'s q_dtype=", "kv_data_type": "plan()'s kv_dtype=",
}


# keywords of FlexAttention's, SDPA's and FlashInfer's calls given to Variant(...): its fields
VARIANT_KEYWORDS_ELSEWHERE = {
    "causal": "mask='causal' (the default) or mask='none'",
    "is_causal": "mask='causal' (the default) or mask='none'",
    "sliding_window": "window_left= (keys with q_idx - kv_idx > window_left are hidden): "
                      "transformers' sliding_window counts the query's own key, so it is "
                      "window_left=sliding_window - 1; attention-gym's sliding window W "
                      "(q_idx - kv_idx <= W) is window_left=W",
    "window_size": f"window_left= ({_WINDOW_SIZE})",
    "logits_soft_cap": "score_mod=ja.soft_cap(cap)",
    "softcap": "score_mod=ja.soft_cap(cap)",
    "block_mask": "mask_mod= (the function, not a BlockMask)",
    "scale": "the call's sm_scale= (attention(..., sm_scale=), plan(..., sm_scale=))",
    "sm_scale": "the call's sm_scale= (attention(..., sm_scale=), plan(..., sm_scale=))",
}


def unexpected_variant_keywords(unknown, fields) -> TypeError:
    """The TypeError for Variant() keywords that are not among its ``fields`` (in order), with
    a hint for those that are another library's way of saying a field (causal=,
    sliding_window=, logits_soft_cap=, ...)."""
    unknown = sorted(unknown)
    hints = "".join(f"; {name}= is {VARIANT_KEYWORDS_ELSEWHERE[name]}" for name in unknown
                    if name in VARIANT_KEYWORDS_ELSEWHERE)
    return TypeError(f"Variant() got unexpected keyword arguments {unknown}; it takes "
                     f"{list(fields)}{hints}")


def unexpected_keywords(owner: str, unknown, accepted, kv_dtype: bool = True,
                        also: dict | None = None) -> TypeError:
    """The TypeError for constructor keywords ``owner`` does not take, listing ``accepted`` and
    saying where FlashInfer's constructor keywords (buffers, use_cuda_graph, ...) and plan()'s
    or the Variant's went. kv_dtype: whether owner's plan() takes kv_dtype= (the cascades'
    read their caches in q's dtype). also: owner's own hints, {keyword: where it goes}."""
    unknown = sorted(unknown)
    elsewhere = (_CTOR_ELSEWHERE if kv_dtype else
                 _CTOR_ELSEWHERE | {"kv_dtype": _FLASHINFER_PLAN_Q_DTYPE_ONLY["kv_data_type"],
                                    **_FLASHINFER_PLAN_Q_DTYPE_ONLY}) | (also or {})
    hints = [f"{name}= is {_FLASHINFER_CTOR[name]}" for name in unknown
             if name in _FLASHINFER_CTOR]
    hints += [f"{name}= is {elsewhere[name]}" for name in unknown if name in elsewhere]
    hints += [f"{name}= is the wrapper's own buffer, sized by the capacities (max_batch_size=, "
              f"max_num_pages=, ...)" for name in unknown if name.endswith(("_buf", "_buffer"))]
    hint = f" ({'; '.join(hints)}; README: porting from FlashInfer)" if hints else ""
    return TypeError(f"{owner}() got unexpected keyword arguments {unknown}; it takes "
                     f"{list(accepted)}{hint}")


def plan_hints(signature, args, kwargs) -> list:
    """Hints for a wrapper's plan() call that ``signature`` does not bind: where FlashInfer's
    plan() keywords live here, and its positional page_size / ragged page tables. ``args[0]``
    is the wrapper (its class's _CALL, when it has one, is the constructor's call up to
    page_size, e.g. the cascades')."""
    cls = type(args[0]).__name__ if args else "BatchDecode"
    call = getattr(type(args[0]), "_CALL", "{cls}(variant, ") if args else "{cls}(variant, "
    ctor = call.format(cls=cls) + "page_size=16)"
    table = _FLASHINFER_PLAN if "kv_dtype" in signature.parameters else \
        _FLASHINFER_PLAN | _FLASHINFER_PLAN_Q_DTYPE_ONLY
    unknown = [name for name in kwargs if name not in signature.parameters]
    hints = []
    for name in unknown:  # (in the call's order)
        if name in table:
            hints.append(f"{name}= is {table[name].format(cls=cls, ctor=ctor)}")
        elif name in _FLASHINFER_PLAN_RENAMED:
            ours = _FLASHINFER_PLAN_RENAMED[name]
            per_level = bool(args) and getattr(type(args[0]), "PLAN_PER_LEVEL", False)
            if ours in signature.parameters:
                hints.append(f"{name}= is {ours}= here" +
                             (" (a list: one tensor per level)" if per_level else ""))
            elif f"unique_{ours}" in signature.parameters:  # (CascadeDecode's own pages)
                hints.append(f"{name}= is unique_{ours}= here (each request's own pages; "
                             f"the shared prefix's are shared_kv_indices=)")
            else:
                takes = [n for n, p in signature.parameters.items()
                         if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]
                hints.append(f"{name}= is FlashInfer's; {cls}.plan() takes {', '.join(takes)}")
    return hints + _positional_hints(signature, args, kwargs, ctor)


def _positional_hints(signature, args, kwargs, ctor: str) -> list:
    """Hints for FlashInfer's positional plan() calls over page tables: page_size after
    head_dim (the constructor's here, ``ctor``), and a ragged plan without the page-table
    arguments (None here)."""
    names = [n for n, p in signature.parameters.items()
             if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    ragged = bool(args) and getattr(args[0], "kv_layout", None) == "ragged"
    hints = []
    heads_at = names.index("num_qo_heads") if "num_qo_heads" in names else None
    if "qo_indptr" not in names and "kv_indptr" in names and heads_at is not None and \
            len(args) > heads_at and hasattr(args[heads_at], "shape"):  # (a tensor there: one
        #                                          more before, a prefill plan's qo_indptr)
        return [f"{type(args[0]).__name__}.plan() takes no qo_indptr (one query per request): "
                f"plan({', '.join(names[1:])})"]
    if "kv_indptr" in names and len(args) > len(names) and names[-1] == "head_dim" and \
            not ragged:  # (a ragged plan has no page_size: FlashInfer's next is head_dim_vo)
        hints.append(f"the argument after head_dim ({args[len(names)]!r}) would be FlashInfer's "
                     f"page_size, which is the constructor's here ({ctor})")
    at = names.index("kv_indices") if "kv_indices" in names else None
    if at is not None and ragged and \
            "kv_indices" not in kwargs and (len(args) <= at or isinstance(args[at], int)):
        pages = ", ".join(n for n in names[1:names.index("num_qo_heads")]
                          if n.startswith(("qo_", "kv_indptr")))
        hints.append(f"a ragged plan takes kv_indices=None and kv_last_page_len=None: "
                     f"plan({pages}, None, None, num_qo_heads, num_kv_heads, head_dim)")
    return hints


def positional_binding(signature, args) -> str | None:
    """For a plan() call missing an argument: the parameters its positional arguments were
    taken as (one argument left out, e.g. qo_indptr, shifts the rest: Python's error names
    only the last parameter); None without positional arguments past the wrapper."""
    names = [n for n, p in signature.parameters.items()
             if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if len(args) < 2:
        return None
    taken = ", ".join(f"{n}={_brief(a)}" for n, a in zip(names[1:], args[1:]))
    return f"the positional arguments were taken as {taken}"


def _brief(value) -> str:
    """A plan() argument in a few characters (a tensor by its shape)."""
    shape = getattr(value, "shape", None)
    return f"<tensor of shape {tuple(shape)}>" if shape is not None else repr(value)[:40]
