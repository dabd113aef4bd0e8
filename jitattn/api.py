"""Public entry points: validate arguments, get the kernel, launch. No planning, no syncs beyond
reading indptr tensors that live on the GPU (pass them on the CPU to avoid that copy)."""

from __future__ import annotations

import numpy as np
import torch

from . import dtypes, jit, launch, ops, render
from .args import bool_arg, not_a_variant, warn_no_grad
from .plan import check_seq_lens
from .render import HEAD_DIMS
from .run_inputs import q_strides_error, q_strides_fit
from .spec import Variant

_MAX_GRID_Y = 65535


def _qkv_fine(q, k, v) -> bool:
    """_check_qkv's conditions, tested the fast way for the usual call (host time: each torch
    attribute read costs 0.1-0.3 us); False sends the call through _check_qkv."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and
            isinstance(v, torch.Tensor)):
        return False
    index, dtype = q.get_device(), q.dtype
    if not (dtype in dtypes.QKV_DTYPES and k.dtype == dtype and v.dtype == dtype and
            k.get_device() == index and v.get_device() == index and
            (q.is_cuda and k.is_cuda and v.is_cuda if index >= 0 else
             q.is_cpu and k.is_cpu and v.is_cpu)):  # (other devices have indices too)
        return False
    qs, ks = q.size(), k.size()
    if len(qs) != 3 or len(ks) != 3 or v.size() != ks or qs[2] != ks[2] or \
            qs[2] not in HEAD_DIMS or not ks[1] or not qs[1] or qs[1] % ks[1]:
        return False
    for t in (q, k, v):
        s0, s1, s2 = t.stride()
        if s2 != 1 or s0 % 8 or s1 % 8 or t.data_ptr() % 16:
            return False
    return True


def _check_qkv(q, k, v) -> None:
    """Raises TypeError / ValueError naming the first of q, k, v that attention() cannot
    take (after _qkv_fine, which tests the same conditions, said no)."""
    for name, t, shape in (("q", q, "[total_q, num_qo_heads, head_dim]"),
                           ("k", k, "[total_kv, num_kv_heads, head_dim]"),
                           ("v", v, "[total_kv, num_kv_heads, head_dim]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            hint = (f" (from SDPA's [batch, heads, seq, head_dim]: {name}.transpose(1, 2)"
                    f".reshape(-1, heads, head_dim); from flash-attn's or transformers' "
                    f"[batch, seq, heads, head_dim]: {name}.reshape(-1, heads, head_dim); "
                    f"with qo_indptr / kv_indptr marking the requests)") if t.dim() == 4 else ""
            raise ValueError(f"{name} must have 3 dimensions {shape}, got shape "
                             f"{tuple(t.shape)}{hint}")
        if t.dtype not in dtypes.QKV_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16 or "
                            f"torch.bfloat16")
        if t.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name} is on {t.device}; expected a cuda or cpu tensor")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    head_dim = q.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim (q.shape[2]) is {head_dim}; expected one of {HEAD_DIMS}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k/v head_dim is {k.shape[2]} but q's is {head_dim}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        # (the layout hint only where transposed shapes would be valid: it misled otherwise)
        swapped = q.shape[0] > 0 and k.shape[0] > 0 and q.shape[0] % k.shape[0] == 0
        raise ValueError(f"num_qo_heads (q.shape[1] = {hq}) must be a positive multiple of "
                         f"num_kv_heads (k.shape[1] = {hkv}); q, k, v are [tokens, heads, "
                         f"head_dim] (got q {tuple(q.shape)}, k {tuple(k.shape)}" +
                         ("; if they are [heads, tokens, head_dim], .transpose(0, 1) them)"
                          if swapped else ")"))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not q_strides_fit(t):  # (16-byte vector loads)
            raise q_strides_error(name, t)


def _host_indptr(name: str, indptr, total: int, rows_of: str) -> list[int]:
    if not isinstance(indptr, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got "
                        f"{type(indptr).__name__}")
    if indptr.dim() != 1 or indptr.numel() < 1:
        raise ValueError(f"{name} must be a non-empty 1-D tensor [batch_size + 1] (a batch of "
                         f"none is [0]), got shape {tuple(indptr.shape)}")
    if indptr.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} has dtype {indptr.dtype}; expected torch.int32 or torch.int64")
    host = [int(x) for x in indptr.tolist()]
    if host[0] != 0:
        raise ValueError(f"{name}[0] is {host[0]}; expected 0")
    bad = next((i for i in range(len(host) - 1) if host[i + 1] < host[i]), None)
    if bad is not None:
        raise ValueError(f"{name} must be non-decreasing; {name}[{bad}] = {host[bad]} > "
                         f"{name}[{bad + 1}] = {host[bad + 1]}")
    if host[-1] != total:
        raise ValueError(f"{name}[-1] is {host[-1]} but {rows_of} has {total} rows (dim 0); "
                         f"expected {name}[-1] == {total}")
    return host


# keywords of FlexAttention's and SDPA's calls that make a Variant here (attention()'s hint)
_VARIANT_KEYWORDS = {"score_mod", "mask_mod", "block_mask", "causal", "is_causal"}


def _variant_hint(params: dict) -> str:
    """The TypeError message of attention() given no Variant but FlexAttention's score_mod= /
    mask_mod= / block_mask=, or SDPA's is_causal= (FlashInfer's causal=): the Variant to make."""
    given = sorted(params.keys() & _VARIANT_KEYWORDS)
    fields = [f"{name}=f" for name in ("score_mod", "mask_mod") if name in params]
    if "block_mask" in params and "mask_mod" not in params:
        fields.append("mask_mod=f (the block mask's mask_mod)")
    causal = [params[name] for name in ("causal", "is_causal") if name in params]
    if fields:
        fields.append("mask='none'" if not any(causal) else "mask='causal'")
    else:
        fields.append("mask='causal'" if any(causal) else "mask='none'")
    return (f"attention() takes a Variant, not {'= / '.join(given)}=: attention(q, k, v, "
            f"jitattn.Variant({', '.join(fields)}))")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              variant: Variant | None = None, *, qo_indptr: torch.Tensor | None = None,
              kv_indptr: torch.Tensor | None = None,
              sm_scale: float | None = None, return_lse: bool = False,
              out: torch.Tensor | None = None, lse: torch.Tensor | None = None, **params):
    """Attention of one request, or a ragged batch, under ``variant``; no paging.

    q: [total_q, num_qo_heads, head_dim]; k, v: [total_kv, num_kv_heads, head_dim]; fp16 or
        bf16, on one CUDA device (CUDA kernels) or on the CPU (CPU backend). head_dim 32, 64,
        128 or 256; num_qo_heads a multiple of num_kv_heads (GQA: query head h reads kv head
        h // (num_qo_heads // num_kv_heads)). Last dim contiguous, the other strides multiples
        of 8 elements, 16-byte aligned data (16-byte vector loads).
    qo_indptr, kv_indptr: [batch_size + 1] int32 (or int64) offsets of each request's rows in
        q and k/v; both or neither (then q, k, v are one request). Read on the host: pass CPU
        tensors to avoid a device sync.
    sm_scale: > 0, multiplies q.k before score_mod; default 1 / sqrt(head_dim).
    out, lse: optional preallocated outputs (contiguous, shapes and dtypes as returned below;
        out 16-byte aligned, sharing no memory with k, v or each other, and none with q
        unless it is q itself: in place); every element is written.
    variant: the Variant (required: None only so that FlexAttention's call, attention(q, k,
        v, score_mod=f), gets a TypeError saying where f goes).
    params: the variant's runtime parameters by name (``variant.runtime_param_names``).
    Returns out [total_q, num_qo_heads, head_dim] (q's dtype), and with return_lse also lse
    [total_q, num_qo_heads] float32, natural log; rows that see no key give out 0, lse -inf.
    Queries are aligned to the end of their request's KV (query i sits at position
    kv_len - qo_len + i; FlashInfer's convention).

    Under torch.compile the call is one custom op (jitattn.ops), checked when it runs.
    Raises TypeError / ValueError naming the argument before any launch; CompileError or
    SpecError if the variant cannot be built. One launch; when every request has one query, or
    at most 16 packed query rows (qo_len x num_qo_heads / num_kv_heads), it runs on the decode
    kernel (warps split the KV range; render.query_kind), else on the prefill kernel.
    Algorithm: FlashAttention-2 style online softmax (Dao 2023, section 3.1) with GQA
    head-group fusion (FlashInfer, arXiv 2501.01005, section 3.2).
    """
    if not isinstance(variant, Variant):
        if variant is None and params.keys() & _VARIANT_KEYWORDS:  # (FlexAttention's, SDPA's)
            raise TypeError(_variant_hint(params))
        raise not_a_variant(variant)
    return_lse = bool_arg("return_lse", return_lse)
    if torch.compiler.is_compiling():  # one opaque custom op: no host reads, no graph break
        if isinstance(sm_scale, torch.Tensor):  # (the op's float argument: torch's own error)
            raise ValueError("sm_scale is a tensor; expected a Python float > 0 (pass "
                             "sm_scale=t.item() outside the compiled code)")
        if isinstance(sm_scale, (bool, np.bool_)):  # (the op's float() would take it as 1.0)
            raise ValueError(f"sm_scale={sm_scale!r}: expected a finite number > 0 (as "
                             f"float32)")
        o, s = ops.attention_traced(q, k, v, variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                    sm_scale=sm_scale, return_lse=True, params=params)
        return launch.into_outputs(o, s, out, lse, return_lse)
    if variant.mask in ("custom", "multi_item"):
        raise ValueError(f"variant {variant.name!r} has mask={variant.mask!r}, whose data is "
                         f"given to BatchPrefill.plan(); attention() takes none or causal")
    if not _qkv_fine(q, k, v):
        _check_qkv(q, k, v)
    if q.requires_grad or k.requires_grad or v.requires_grad:  # (attribute reads first)
        warn_no_grad("jitattn.attention", q, k, v)
    total_q, hq, head_dim = q.shape
    hkv = k.shape[1]
    if (qo_indptr is None) != (kv_indptr is None):
        raise ValueError("qo_indptr and kv_indptr must be given together (or neither)")
    if qo_indptr is None:
        qo_host, kv_host = [0, total_q], [0, k.shape[0]]
    else:
        qo_host = _host_indptr("qo_indptr", qo_indptr, total_q, "q")
        kv_host = _host_indptr("kv_indptr", kv_indptr, k.shape[0], "k")
        if len(qo_host) != len(kv_host):
            raise ValueError(f"qo_indptr has {len(qo_host)} entries but kv_indptr has "
                             f"{len(kv_host)}; both must be [batch_size + 1]")
    batch = len(qo_host) - 1
    if batch > _MAX_GRID_Y:
        raise ValueError(f"batch_size {batch} exceeds {_MAX_GRID_Y} requests per call")
    qo_lens = [qo_host[i + 1] - qo_host[i] for i in range(batch)]
    kv_lens = [kv_host[i + 1] - kv_host[i] for i in range(batch)]
    max_qo, max_kv = max(qo_lens, default=0), max(kv_lens, default=0)
    check_seq_lens(max_qo, max_kv)
    sizes = dict(batch_size=batch, num_qo_heads=hq, num_kv_heads=hkv, qo_len=max_qo,
                 kv_len=max_kv)
    bound = variant.bind(params, device=q.device, sizes=sizes)
    sm_scale = launch.resolve_sm_scale(sm_scale, head_dim)

    # a caller's out sharing memory with k or v, or partly with q, would be written while
    # other rows' products still read it: refused, as for lse (out=q itself is in place)
    if out is None and type(q) is torch.Tensor and q.is_contiguous():  # (empty_like: 2-3 us
        #                                 less than torch.empty's; it keeps a subclass, though)
        out = torch.empty_like(q)
    else:
        out = launch.output_buffer("out", out, (total_q, hq, head_dim), q.dtype, q.device,
                                   apart_from=None if out is None else {
                                       "k": k, "v": v, **({} if launch.same_view(out, q) else
                                                          {"q": q})})
    if lse is not None or return_lse:  # (else the kernels store no lse: one allocation less)
        lse = launch.output_buffer("lse", lse, (total_q, hq), torch.float32, q.device, align=4,
                                   apart_from={"out": out, "q": q, "k": k, "v": v})
    if total_q > 0:
        _launch(q, k, v, out, lse, variant, bound, qo_indptr is not None, qo_host, kv_host,
                batch, max_qo, float(sm_scale))
    return (out, lse) if return_lse else out


def _device_indptr(host: list[int] | None, device):
    """The validated host copy, as a fresh contiguous int32 tensor on the device."""
    if host is None:
        return None
    t = torch.tensor(host, dtype=torch.int32)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


# one request's launches (launch.Launcher, in jit.LAUNCHERS) by variant, shapes, dtype and
# device: what they resolve follows from those alone (a ragged batch's indptrs are new tensors
# every call)
_MAX_LAUNCHERS = 64


def _launch(q, k, v, out, lse, variant, bound, ragged, qo_host, kv_host, batch, max_qo,
            sm_scale):
    key = None if ragged else (variant.key, q.shape, k.shape, q.dtype, q.device)
    launcher = jit.LAUNCHERS.get(key)
    if launcher is not None:
        launcher(q, k, v, out, lse, launch.kv_strides(k, "ragged"),
                 launch.kv_strides(v, "ragged"), sm_scale, variant, bound)
        return
    launcher = launch.run_attention(
        q, launch.KVView.ragged(k, v), out, lse, variant, bound, num_kv_heads=k.shape[1],
        kind=render.query_kind(max_qo, q.shape[1] // k.shape[1], q.shape[2]),
        qo_indptr=_device_indptr(qo_host, q.device) if ragged else None,
        kv_indptr=_device_indptr(kv_host, q.device) if ragged else None,
        batch=batch, max_qo_len=max_qo, single_qo_len=qo_host[-1], single_kv_len=kv_host[-1],
        sm_scale=sm_scale)
    if key is not None:
        if len(jit.LAUNCHERS) >= _MAX_LAUNCHERS:
            jit.LAUNCHERS.clear()
        jit.LAUNCHERS[key] = launcher
