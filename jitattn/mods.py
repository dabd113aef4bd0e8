"""Score-mod factories and helpers that ready-made and user variants share."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from . import dsl
from .args import int_arg


def soft_cap(cap: float, approx: bool = False):
    """Tanh logit soft-capping, ``cap * tanh(score / cap)`` (Gemma 2; Grok-1).

    cap: a Python float (compiled in) or a ``ja.scalar`` (runtime). approx: on the GPU, tanh on
    the hardware approximation (``ja.tanh(x, approx=True)``: faster, scores off by up to about
    cap * 2^-11); by default off by at most cap * 5e-7 (``ja.tanh``)."""
    if isinstance(cap, (bool, np.bool_)) or \
            (isinstance(cap, numbers.Real) and not 0 < cap < math.inf):
        raise dsl.SpecError(f"soft_cap: cap={cap!r} must be finite and > 0")
    if not isinstance(approx, (bool, np.bool_)):  # ("False" would count as true)
        raise dsl.SpecError(f"soft_cap: approx={approx!r}: expected True or False")

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * dsl.tanh(score / cap, approx=approx)
    return softcap


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022, "Train Short, Test Long", section 3), float32.

    For a power-of-two head count n the slopes are 2^(-8 i / n), i = 1..n. Otherwise the first
    2^floor(log2 n) heads take the power-of-two slopes and the rest take every other slope of the
    next power of two, as in the paper's reference code; this keeps non-power-of-two counts
    (e.g. 12, 40) correct.
    """
    num_heads = int_arg("num_heads", num_heads)  # (2.5 and "8" raised deep inside; 4.0 passed)

    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = pow2(closest)
    if closest != num_heads:
        slopes += pow2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
