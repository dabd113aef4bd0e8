"""Rotary position embedding as a Variant's pos_encoding: its options (theta, style,
scaling: linear or Llama 3) checked, and its inverse frequencies per head_dim."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .dsl import SpecError
from .emit import FLOAT32_MAX


def _finite_number(x) -> bool:
    """A finite int or float (numpy's too), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and \
        not isinstance(x, (bool, np.bool_)) and math.isfinite(x)


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding fused into the Q/K load path (Su et al. 2021, RoFormer).

    theta: base of the frequencies, inv_freq[i] = theta ** (-2i / head_dim).
    style: ``"neox"`` rotates the halves (x[i], x[i + D/2]) (HF Llama's ``rotate_half``);
        ``"gptj"`` rotates interleaved pairs (x[2i], x[2i+1]).
    scaling: None, ``{"type": "linear", "factor": f}`` (positions divided by f), or
        ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`` (Llama 3.1 frequency scaling, as in HF's
        ``rope_scaling``; ``"rope_type"`` is accepted for ``"type"``). transformers 5's
        ``config.rope_parameters`` is taken as it is: its ``"rope_theta"`` must equal theta,
        and ``{"rope_type": "default"}`` is no scaling.
    Positions are logical token positions: key j has position j, query i of a request with
    qo_len queries and kv_len keys has position kv_len - qo_len + i. Rotary dim = head_dim.
    The rotated q and k are rounded to q's dtype (as HF rotates in the model's dtype) on both
    backends and in jitattn.reference (which rotates in float64). Over an fp8 cache the kernels
    rotate the cache's values before k_scale applies (it joins the softmax scale): the same
    rounding as the reference's of k_scale * value when k_scale is a power of two (outside
    fp16's subnormal and overflow ranges).
    """

    theta: float = 1e4
    style: Literal["neox", "gptj"] = "neox"
    scaling: tuple | dict | None = None

    def __post_init__(self):
        if not (_finite_number(self.theta) and self.theta > 1):
            raise SpecError(f"RoPE theta={self.theta!r}: expected a finite number > 1")
        if self.style not in ("neox", "gptj"):
            raise SpecError(f"RoPE style={self.style!r}: expected 'neox' or 'gptj'")
        sc = None
        if self.scaling is not None:
            try:  # (a tuple of pairs: the form stored below, for copies)
                sc = dict(self.scaling) if isinstance(self.scaling, (Mapping, tuple)) else False
            except (TypeError, ValueError):
                sc = False
            if sc is False:
                raise SpecError(f"RoPE scaling={self.scaling!r}: expected None or a dict such "
                                f"as {{'type': 'linear', 'factor': 2.0}}")
        if sc and all(isinstance(x, Mapping) for x in sc.values()):
            raise SpecError(f"RoPE scaling has one dict per layer type ({sorted(sc)}); pass "
                            f"the one of this layer's type, e.g. scaling=rope_parameters"
                            f"[{next(iter(sc))!r}]")
        if sc and sc.get("partial_rotary_factor", 1.0) == 1.0:  # (Phi-3's: all rotated)
            sc.pop("partial_rotary_factor", None)
        if sc and "rope_theta" in sc:  # (transformers 5's config.rope_parameters)
            base = sc.pop("rope_theta")
            if not _finite_number(base) or float(base) != float(self.theta):
                raise SpecError(f"RoPE scaling's rope_theta {base!r} differs from theta="
                                f"{self.theta!r}: pass theta=rope_parameters['rope_theta'] too")
        if sc and (sc.get("type") or sc.get("rope_type")) == "default" and len(sc) == 1:
            sc = None  # (rope_parameters of an unscaled model)
        if sc:
            kind = sc.pop("type", None) or sc.pop("rope_type", None)
            need = {"linear": {"factor"},
                    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings"}}
            if kind == "default":  # (what rope_type 'default' came with)
                raise SpecError(f"RoPE scaling {self.scaling!r}: rope_type 'default' takes no "
                                f"other field but rope_theta (partial_rotary_factor 1.0: "
                                f"partial rotary embeddings are not supported)")
            if kind not in need:
                raise SpecError(f"RoPE scaling type {kind!r}: expected 'linear' or 'llama3'")
            missing, extra = need[kind] - set(sc), set(sc) - need[kind]
            if missing or extra:
                raise SpecError(f"RoPE scaling {kind!r}: missing {sorted(missing)}, "
                                f"unexpected {sorted(extra)}")
            if any(not _finite_number(v) or v <= 0 for v in sc.values()):
                raise SpecError(f"RoPE scaling {kind!r}: values must be finite numbers > 0 "
                                f"(the generated code's constants): {sc}")
            sc = tuple(sorted({"type": kind, **{k: float(v) for k, v in sc.items()}}.items()))
        object.__setattr__(self, "scaling", sc or None)
        object.__setattr__(self, "theta", float(self.theta))
        # the largest frequency (pair 0's, at any head_dim) goes into the kernels as float32
        if self.inv_freq(2).max() > FLOAT32_MAX:
            raise SpecError(f"RoPE scaling {dict(sc)}: frequencies up to "
                            f"{self.inv_freq(2).max():.3g} do not fit float32 (the kernels' "
                            f"frequency table)")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Per-pair angular frequencies (radians per position), float64, shape [head_dim // 2]."""
        inv = 1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        sc = dict(self.scaling) if self.scaling else {}
        if sc.get("type") == "linear":
            return inv / sc["factor"]
        if sc.get("type") == "llama3":  # HF transformers _compute_llama3_parameters
            factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
            old = sc["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old / lo, inv / factor, inv)
            with np.errstate(divide="ignore", invalid="ignore"):  # (hi <= lo, which HF allows:
                smooth = (old / wavelen - lo) / (hi - lo)  # then no entry is medium)
                smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            return np.where(medium, smoothed, scaled)
        return inv
