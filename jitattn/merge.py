"""Public attention-state merges: combine partial attention results over disjoint key sets.

Attention state (FlashInfer paper, arXiv 2501.01005, section 2.2): for keys split into sets A
and B, with (o_A, lse_A) and (o_B, lse_B) the attention of the same queries over each,
m = max(lse_A, lse_B), a = exp(lse_A - m), b = exp(lse_B - m),
o = (a o_A + b o_B) / (a + b), lse = m + log(a + b). The merge is exact, associative and
commutative; an empty state (o = 0, lse = -inf) is the identity and merging two empty states
gives (0, -inf), never NaN. A state with lse = +inf outweighs every finite one: it takes the
row (the limit of the weights' ratios; lse +inf), where exp(inf - inf) would give NaN; two or
more at +inf have no limit: o is NaN (lse +inf), in any grouping of the merges.
Sigmoid (unnormalised) attention merges by addition:
o = o_A + o_B (lse then reports log(exp(lse_A) + exp(lse_B))).
"""

from __future__ import annotations

import math

import torch

from . import launch
from .args import warn_no_grad

_O_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_state(name: str, o, lse, stacked: bool = False) -> None:
    """stacked: o is [n, rows..., head_dim], n states of the same rows (merge_states)."""
    if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError(f"{name}: o and lse must be torch.Tensors")
    if o.dtype not in _O_DTYPES:
        raise TypeError(f"{name}: o has dtype {o.dtype}; expected float16, bfloat16 or float32")
    if lse.dtype != torch.float32:
        raise TypeError(f"{name}: lse has dtype {lse.dtype}; expected torch.float32")
    if o.dim() < 2 + stacked:
        hint = (" (n states of one row: o[:, None], lse[:, None])" if o.dim() == 2 else "") \
            if stacked else " (one row: o[None], lse[None])"
        raise ValueError(f"{name}: o must be [{'n, ' * stacked}rows..., head_dim] with at least "
                         f"one row dimension, got {tuple(o.shape)}{hint}")
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"{name}: lse must have o's shape without the last dimension; got o "
                         f"{tuple(o.shape)}, lse {tuple(lse.shape)}")
    if o.device != lse.device or o.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: o and lse must be on one cuda or cpu device; got {o.device} "
                         f"and {lse.device}")
    if not (o.is_contiguous() and lse.is_contiguous()):
        raise ValueError(f"{name}: o and lse must be contiguous")


def merge_states(o: torch.Tensor, lse: torch.Tensor, *, reduction: str = "softmax"):
    """Merge n attention states.

    o: [n, ..., head_dim] (e.g. [n, tokens, heads, head_dim]), fp16 / bf16 / fp32;
    lse: [n, ...] float32, natural log. reduction: "softmax" or "sigmoid".
    Returns (o_merged [..., head_dim] in o's dtype, lse_merged [...] float32).
    Raises TypeError / ValueError for wrong dtypes, shapes, devices or strides.
    """
    _check_state("merge_states", o, lse, stacked=True)
    o, lse = warn_no_grad("merge_states", o, lse)
    if reduction not in ("softmax", "sigmoid"):
        raise ValueError(f"reduction={reduction!r}: expected 'softmax' or 'sigmoid'")
    out = torch.empty(o.shape[1:], dtype=o.dtype, device=o.device)
    lse_out = torch.empty(lse.shape[1:], dtype=torch.float32, device=o.device)
    return merge_states_into(o, lse, out, lse_out, reduction)


def merge_states_into(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                      lse_out: torch.Tensor, reduction: str):
    """merge_states writing into out [..., head_dim] (o's dtype) and lse_out [...] (float32),
    contiguous, which the caller has checked (launch.output_buffer) along with o and lse.
    Returns (out, lse_out)."""
    n, rows = o.shape[0], math.prod(lse.shape[1:])  # (n may be 0: the empty merge)
    if rows and n:
        launch.run_merge(o, lse, out, lse_out, sigmoid=reduction == "sigmoid",
                         num_merged=rows, num_states=n, state_stride=rows)
    elif rows:
        out.zero_()
        lse_out.fill_(float("-inf"))
    return out, lse_out


def _merge_pair(o_a, lse_a, o_b, lse_b, out, lse_out, reduction: str, *, caller: str,
                names: tuple) -> None:
    """Checked pair-mode merge of (o_b, lse_b) into (o_a, lse_a), written to (out, lse_out);
    errors name ``caller`` and its two states' argument names."""
    _check_state(f"{caller} ({names[0]})", o_a, lse_a)
    _check_state(f"{caller} ({names[1]})", o_b, lse_b)
    if o_a.shape != o_b.shape or o_a.dtype != o_b.dtype or o_a.device != o_b.device:
        raise ValueError(f"{caller}: states differ: {names[0]} {tuple(o_a.shape)} {o_a.dtype} "
                         f"{o_a.device}, {names[1]} {tuple(o_b.shape)} {o_b.dtype} {o_b.device}")
    if reduction not in ("softmax", "sigmoid"):
        raise ValueError(f"reduction={reduction!r}: expected 'softmax' or 'sigmoid'")
    rows = lse_a.numel()
    if rows and not o_a.shape[-1]:  # (head_dim 0: only lse merges; the kernels' pair mode
        #                                would read an empty o_b's null address as no pair)
        torch.logaddexp(lse_a, lse_b, out=lse_out)
    elif rows:
        launch.run_merge(o_a, lse_a, out, lse_out, sigmoid=reduction == "sigmoid",
                         num_merged=rows, o_second=o_b, lse_second=lse_b)


def merge_state(o_a, lse_a, o_b, lse_b, *, reduction: str = "softmax"):
    """Merge two attention states of the same shape: o [..., head_dim], lse [...] float32.
    Returns (o, lse). See merge_states."""
    _check_state("merge_state (o_a, lse_a)", o_a, lse_a)  # (before empty_like reads them)
    o_a, lse_a, o_b, lse_b = warn_no_grad("merge_state", o_a, lse_a, o_b, lse_b)
    out, lse_out = torch.empty_like(o_a), torch.empty_like(lse_a)
    _merge_pair(o_a, lse_a, o_b, lse_b, out, lse_out, reduction, caller="merge_state",
                names=("o_a, lse_a", "o_b, lse_b"))
    return out, lse_out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a.device == b.device and \
        a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def merge_state_in_place(o, lse, o_other, lse_other, *, reduction: str = "softmax") -> None:
    """Merge (o_other, lse_other) into (o, lse), overwriting o and lse: one pass over the
    states, no copies. Raises ValueError if o_other or lse_other overlaps o or lse, or o
    overlaps lse (the merge would read rows it has overwritten). See merge_states."""
    for name, x, other, y in (("o_other", o_other, "o", o), ("o_other", o_other, "lse", lse),
                              ("lse_other", lse_other, "o", o),
                              ("lse_other", lse_other, "lse", lse), ("o", o, "lse", lse)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and _overlap(x, y):
            raise ValueError(f"merge_state_in_place: {name} overlaps {other}, which the merge "
                             f"overwrites; pass a copy ({name}.clone())")
    for name, t in (("o", o), ("lse", lse)):  # (written without autograd: stale history)
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"merge_state_in_place: {name} requires grad; the merge writes it "
                             f"without autograd (no backward): merge_state returns new tensors")
    o_other, lse_other = warn_no_grad("merge_state_in_place", o_other, lse_other)
    _merge_pair(o, lse, o_other, lse_other, o, lse, reduction, caller="merge_state_in_place",
                names=("o, lse", "o_other, lse_other"))
