"""Eager PyTorch reference for any Variant: the oracle of every test. Readable, not fast.

Computes in float64 on the inputs' device from the traced expression trees (dsl.evaluate), with
the same position convention as the kernels (queries aligned to the end of the KV).
"""

from __future__ import annotations

import math

import torch

from .evaluate import evaluate
from .spec import Variant


def rope(x: torch.Tensor, positions: torch.Tensor, variant: Variant) -> torch.Tensor:
    """Apply the variant's RoPE to x [n, heads, D] (float64) at integer positions [n]."""
    enc = variant.pos_encoding
    d = x.shape[-1]
    inv = torch.as_tensor(enc.inv_freq(d), dtype=torch.float64, device=x.device)
    ang = positions.double()[:, None] * inv[None, :]            # [n, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    if enc.style == "neox":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


# the mask data each mode needs in mask_data (the names BatchPrefill.plan() takes them by)
_MASK_DATA = {"custom": ("custom_mask",), "multi_item": ("prefix_len", "token_pos_in_items")}


def _check_mask_data(variant: Variant, mask_data: dict | None, params: dict) -> None:
    """Raises ValueError when the variant's custom / multi-item mask lacks its mask_data (or
    got it as plan()'s keywords), naming what to pass."""
    needed = _MASK_DATA.get(variant.mask, ())
    if not needed:
        return
    plan_style = sorted(set(params) & {"custom_mask", "packed_custom_mask", "mask_indptr",
                                       "prefix_len", "token_pos_in_items", "max_item_len"}
                        - {p.name for p in variant.params})
    missing = [name for name in needed if (mask_data or {}).get(name) is None]
    if plan_style or missing:
        raise ValueError(
            f"variant {variant.name!r} has mask {variant.mask!r}: the reference takes its mask "
            f"data as mask_data={{{', '.join(repr(n) + ': ...' for n in needed)}}}"
            + (f" (got {plan_style} as keywords, as BatchPrefill.plan() takes them)"
               if plan_style else f" (missing {missing})")
            + ("; custom_mask is flattened bool, row-major [qo_len, kv_len] per request"
               if variant.mask == "custom" else ""))


def _check_indptr(name: str, indptr: list, rows: int, what: str, at_most: bool = False) -> None:
    """ValueError unless indptr starts at 0, never decreases and ends at ``rows`` (at most
    ``rows`` with at_most)."""
    if not indptr or indptr[0] != 0 or any(b < a for a, b in zip(indptr, indptr[1:])) or \
            (indptr[-1] > rows if at_most else indptr[-1] != rows):
        shown = indptr if len(indptr) <= 12 else indptr[:6] + ["..."] + indptr[-3:]
        raise ValueError(f"{name} = {shown}: expected 0 first, never decreasing, ending at "
                         f"{'most ' if at_most else ''}{what} ({rows})")


def attention(q, k, v, variant: Variant, *, qo_indptr=None, kv_indptr=None, sm_scale=None,
              return_lse=False, mask_data: dict | None = None, **params):
    """Reference of :func:`jitattn.attention`; same arguments, outputs in float64.

    mask_data, for mask "custom": {"custom_mask": flattened bool, row-major [qo_len, kv_len] per
    request}; for mask "multi_item": {"prefix_len": [batch], "token_pos_in_items": for every
    token after a request's prefix its 1-based position inside its item, concatenated}.

    q [total_q, Hq, D], k/v [total_kv, Hkv, D]; out [total_q, Hq, D]; lse [total_q, Hq] (natural
    log; -inf for rows that see no key).
    """
    _check_mask_data(variant, mask_data, params)
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    qo = [0, total_q] if qo_indptr is None else [int(x) for x in qo_indptr.tolist()]
    kv = [0, k.shape[0]] if kv_indptr is None else [int(x) for x in kv_indptr.tolist()]
    _check_indptr("qo_indptr", qo, total_q, "q's rows")
    _check_indptr("kv_indptr", kv, k.shape[0], "k's rows")
    if len(qo) != len(kv) or k.shape != v.shape or not hkv or hq % hkv:
        raise ValueError(f"reference.attention: {len(qo) - 1} requests in qo_indptr and "
                         f"{len(kv) - 1} in kv_indptr, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}: expected as many requests in both, k and v of "
                         f"one shape, num_qo_heads a multiple of num_kv_heads")
    g = hq // hkv
    batch = len(qo) - 1
    sizes = dict(batch_size=batch, num_qo_heads=hq, num_kv_heads=hkv,
                 qo_len=max((qo[i + 1] - qo[i] for i in range(batch)), default=0),
                 kv_len=max((kv[i + 1] - kv[i] for i in range(batch)), default=0))
    bound = variant.bind(params, device=q.device, sizes=sizes)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(total_q, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64, device=q.device)
    mask_data = mask_data or {}
    custom_mask = mask_data.get("custom_mask")
    prefix_len = mask_data.get("prefix_len")
    token_pos_in_items = mask_data.get("token_pos_in_items")
    mask_at, pos_at = 0, 0
    for b in range(batch):
        lq_b, lk_b = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        own_mask = own_pos = None
        if variant.mask == "custom":
            own_mask = custom_mask[mask_at:mask_at + lq_b * lk_b].reshape(lq_b, lk_b)
            mask_at += lq_b * lk_b
        if variant.mask == "multi_item":
            p_b = int(prefix_len[b])
            own_pos = token_pos_in_items[pos_at:pos_at + lk_b - p_b].to(q.device).long()
            pos_at += lk_b - p_b
        qi, ki, vi = (q[qo[b]:qo[b + 1]].double(), k[kv[b]:kv[b + 1]].double(),
                      v[kv[b]:kv[b + 1]].double())
        lq, lk = qi.shape[0], ki.shape[0]
        if lq == 0 or lk == 0:
            continue  # no rows, or rows that see no key: out 0, lse -inf
        q_pos = torch.arange(lk - lq, lk, device=q.device)
        kv_pos = torch.arange(lk, device=q.device)
        if variant.pos_encoding is not None:  # rotated, then rounded to q's dtype (as the
            # kernels rotate q and k tiles in that dtype, and HF rotates in the model's dtype)
            qi, ki = (rope(x, pos, variant).to(q.dtype).double()
                      for x, pos in ((qi, q_pos), (ki, kv_pos)))
        ki, vi = ki.repeat_interleave(g, dim=1), vi.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale          # [Hq, Lq, Lk]
        env = dict(score=s, b=torch.tensor(b, device=q.device),
                   h=torch.arange(hq, device=q.device)[:, None, None],
                   q_idx=q_pos[None, :, None], kv_idx=kv_pos[None, None, :])
        if variant.score is not None:
            s = torch.as_tensor(evaluate(variant.score.expr, env, bound)).double()
            s = s.expand(hq, lq, lk)
        visible = torch.ones(hq, lq, lk, dtype=torch.bool, device=q.device)
        if variant.mask in ("causal", "multi_item"):
            visible &= env["kv_idx"] <= env["q_idx"]
        if own_mask is not None:
            visible &= own_mask.to(q.device)[None]
        if own_pos is not None and own_pos.numel() == 0:
            visible &= env["kv_idx"] < p_b
        elif own_pos is not None:  # items see the prefix and, causally, their own item only
            q_in_items = env["q_idx"] >= p_b
            start = env["q_idx"] - own_pos[(env["q_idx"] - p_b).clamp(min=0)] + 1
            visible &= (env["kv_idx"] < p_b) | (q_in_items & (env["kv_idx"] >= start))
        if variant.window_left is not None:
            visible &= env["q_idx"] - env["kv_idx"] <= variant.window_left
        if variant.mask_pred is not None:
            visible &= torch.as_tensor(evaluate(variant.mask_pred.expr, env, bound))
        if variant.reduction == "sigmoid":
            p = torch.where(visible, torch.sigmoid(s), 0.0)
            o, total = torch.einsum("hqk,khd->qhd", p, vi), p.sum(-1).T
            # (a NaN total, from a NaN score, gives a NaN lse, as the kernels do)
            lse[qo[b]:qo[b + 1]] = torch.where(total != 0, total.log(), -math.inf)
        else:
            visible &= s != -math.inf  # a score_mod may mask by returning -inf (NaN stays)
            s = torch.where(visible, s, -math.inf)
            m = s.amax(-1, keepdim=True)
            any_visible = visible.any(-1, keepdim=True)
            p = torch.where(visible, torch.exp(s - torch.where(any_visible, m, 0.0)), 0.0)
            total = p.sum(-1, keepdim=True)
            o = torch.einsum("hqk,khd->qhd", p / torch.where(any_visible, total, 1.0), vi)
            row_lse = (m + total.log()).squeeze(-1).T
            lse[qo[b]:qo[b + 1]] = torch.where(any_visible.squeeze(-1).T, row_lse, -math.inf)
        out[qo[b]:qo[b + 1]] = o
    return (out, lse) if return_lse else out


def paged_to_ragged(kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout="NHD"):
    """Gather a paged KV cache into ragged k, v [total_kv, Hkv, D] and a kv_indptr over tokens.

    kv_cache: (k_cache, v_cache) or one [num_pages, 2, ...] tensor; NHD pages are
    [page_size, Hkv, D], HND pages [Hkv, page_size, D]. Request b owns pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]]; its last page holds kv_last_page_len[b] tokens.
    Raises ValueError for a kv_layout other than "NHD" / "HND", a kv_indptr that does not start
    at 0, decreases or runs past kv_indices, a page outside the cache, or a last_page_len
    outside [1, page_size] (as an HND cache read as NHD usually shows).
    """
    k_cache, v_cache = (kv_cache[:, 0], kv_cache[:, 1]) if isinstance(kv_cache, torch.Tensor) \
        else kv_cache
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout={kv_layout!r}: expected 'NHD' or 'HND'")
    shape = tuple(k_cache.shape)
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    page_size = k_cache.shape[1]
    ks, vs, token_indptr = [], [], [0]
    indptr, indices, last = (x.tolist() for x in (kv_indptr, kv_indices, kv_last_page_len))
    _check_indptr("kv_indptr", indptr, len(indices), "kv_indices' length", at_most=True)
    if len(last) != len(indptr) - 1:
        raise ValueError(f"kv_last_page_len has {len(last)} entries; expected one per request "
                         f"({len(indptr) - 1})")
    for b in range(len(indptr) - 1):
        pages = indices[indptr[b]:indptr[b + 1]]
        if pages and not 1 <= last[b] <= page_size:
            hint = " (an HND cache read as NHD? pass kv_layout='HND')" \
                if kv_layout == "NHD" else ""
            raise ValueError(f"kv_last_page_len[{b}] = {last[b]}: expected 1..page_size "
                             f"({page_size} in k_cache's {kv_layout} pages {shape}){hint}")
        if any(not 0 <= p < k_cache.shape[0] for p in pages):
            raise ValueError(f"kv_indices of request {b} = {pages}: the cache has "
                             f"{k_cache.shape[0]} pages (0..{k_cache.shape[0] - 1})")
        n = (len(pages) - 1) * page_size + last[b] if pages else 0
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n] if pages else k_cache[:0, 0]
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n] if pages else v_cache[:0, 0]
        ks.append(k)
        vs.append(v)
        token_indptr.append(token_indptr[-1] + n)
    return (torch.cat(ks), torch.cat(vs),
            torch.tensor(token_indptr, dtype=torch.int32))
