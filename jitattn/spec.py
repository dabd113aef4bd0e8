"""What an attention variant computes: the frozen :class:`Variant` and :class:`RoPE`.

A Variant says only what the attention computes; dtypes, head_dim and tiles come from the
tensors and join the cache key at specialisation time (render.py). Its :attr:`Variant.key`
covers everything that changes generated code, and nothing else (captured tensor values are
runtime data).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import difflib
import hashlib
import json
import numbers
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np
import torch

from . import dsl, nonfinite, tracing
from .args import int_arg, shown_value
from .dsl import SpecError
from .params import ScalarParam, TensorParam
from .emit import FLOAT32_MAX
from .porting import CALL_KEYWORDS_ELSEWHERE, unexpected_variant_keywords
from .rope import RoPE

# captured tensors as a torch.compile graph passed them to a jitattn op (ops.py), by parameter
# name: their current values, where the Variant's own tensor may not have received an in-place
# change the graph made before the op yet (functionalization writes it back after the graph)
_CAPTURED: contextvars.ContextVar = contextvars.ContextVar("jitattn_captured", default={})
# the keywords of attention() and the wrappers' run(), which a misspelling turns into an
# unexpected variant parameter
_CALL_KEYWORDS = ("return_lse", "sm_scale", "out", "lse", "qo_indptr", "kv_indptr", "k_scale",
                  "v_scale")

MASKS = ("none", "causal", "custom", "multi_item")
# the shape symbol a table's dimension indexed directly by b, h, q_idx or kv_idx must be
_INDEX_SIZE = {"b": "batch_size", "h": "num_qo_heads", "q_idx": "kv_len", "kv_idx": "kv_len"}
#: Called with every new Variant, and with a copy or an unpickled one (ops.py gives each the
#: handle by which its torch custom op finds it).
ON_CREATE: list = []
#: Attributes the ON_CREATE hooks set on one Variant object: a copy or a pickle leaves them out
#: (the hooks set its own).
PER_OBJECT: set = set()
REDUCTIONS = ("softmax", "sigmoid")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # (fullmatch: "$" takes a final newline)


class _DefaultMask(str):
    """mask= not given: "causal", with a warning where mods alone would mean no mask."""


_CAUSAL_BY_DEFAULT = _DefaultMask("causal")


class _DerivedName(str):
    """A Variant's name made from its mods' function names, not given: a Variant made from it
    by dataclasses.replace (which passes the name on) derives its own again."""


# a function given positionally (Variant(f), Variant("name", f)): where the mods go
_MOD_HINT = (" (the positional arguments are name, then mask: pass a function as score_mod= "
             "or mask_mod=)")


@dataclass(frozen=True, eq=False)
class Variant:
    """An attention variant: what the attention computes (dtypes and shapes come at call time).

    name: identifier used in kernel and cache names ([A-Za-z0-9][A-Za-z0-9_.-]*); by default
        the mods' function names joined by "_" (a lambda's is not one), else "variant", and
        derived again for a Variant made from it by dataclasses.replace (or given it). The
        kernels of two variants never mix: their cache keys hash what they compute.
    mask: ``"none"``; ``"causal"`` (the default; bottom-right aligned: query i of a request sees
        keys j <= kv_len - qo_len + i); ``"custom"`` (an explicit boolean mask per request, given to
        BatchPrefill.plan); ``"multi_item"`` (a shared prefix seen causally plus items that see
        the prefix and, causally, only their own item; metadata given to BatchPrefill.plan).
        None is refused (FlexAttention's and SDPA's None, no mask, is ``"none"`` here).
    window_left: sliding window, keys with q_idx - kv_idx > window_left are hidden; None or -1
        means unlimited. Inclusive: window_left=0 keeps only the diagonal.
    score_mod: ``f(score, b, h, q_idx, kv_idx) -> float``; score is q.k * sm_scale. Returning
        -inf hides the key. A NaN or +inf score (in float32: e.g. log of a negative score, an
        exp that overflows) makes its row's output and lse NaN, as in torch (and a merge of that
        row's states NaN too); a constant that makes it so (score + inf) is refused.
    mask_mod: ``f(b, h, q_idx, kv_idx) -> bool``; False hides the key (ANDed with mask/window).
        Given without ``mask``, it is ANDed with the default causal mask and a UserWarning
        says so (FlexAttention's mask_mod alone is ``mask="none"`` here). A score_mod given
        without ``mask`` is causal too (FlexAttention's sees every key), and warns so.
    pos_encoding: :class:`RoPE` applied to q and k on load, or None.
    reduction: ``"softmax"``, or ``"sigmoid"``: out = sum_j sigmoid(s_j) v_j, unnormalised;
        lse then reports log(sum_j sigmoid(s_j)), and partial states merge by addition. The
        sum is float32: where every visible score is below about -88 it underflows to 0 and
        lse is -inf, as for a row that sees no key (out is 0 to float32's precision either
        way, and the merge adds nothing for such a state).
    Raises SpecError for anything that cannot be compiled.
    """

    name: str | None = None
    mask: Literal["none", "causal", "custom", "multi_item"] = _CAUSAL_BY_DEFAULT
    window_left: int | None = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    pos_encoding: RoPE | None = None
    reduction: Literal["softmax", "sigmoid"] = "softmax"
    _score: tracing.Traced | None = field(init=False, repr=False, default=None)
    _mask: tracing.Traced | None = field(init=False, repr=False, default=None)
    _params: tuple = field(init=False, repr=False, default=())
    _key: str = field(init=False, repr=False, default="")
    _direct_index: tuple = field(init=False, repr=False, default=())

    def __post_init__(self):
        if torch.compiler.is_compiling():  # (dynamo failed inside the tracer, naming only an
            #                                 AttributeError there)
            raise SpecError("a Variant is built while torch.compile (or torch.export) traces, "
                            "by the code or by a wrapper's constructor: build Variants and "
                            "wrappers outside the compiled function (at model construction) "
                            "and pass or capture them; their tracing is Python that "
                            "torch.compile does not follow")
        # None: from the mods (FlexAttention has no name to give); a derived name that
        # dataclasses.replace passed on: from this Variant's mods again
        if self.name is None or isinstance(self.name, _DerivedName):
            named = [getattr(fn, "__name__", "") for fn in (self.score_mod, self.mask_mod)]
            object.__setattr__(self, "name", _DerivedName("_".join(
                n for n in named if isinstance(n, str) and _NAME.fullmatch(n))[:64] or
                "variant"))
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise SpecError(f"Variant name={self.name!r}: expected [A-Za-z0-9][A-Za-z0-9_.-]*, "
                            f"at most 64 characters" + _MOD_HINT * callable(self.name))
        if self.mask is None:  # (FlexAttention's and SDPA's None: no mask)
            raise SpecError("Variant mask=None: expected one of " + str(MASKS) + "; no mask is "
                            "mask='none' (FlexAttention's block_mask=None, SDPA's "
                            "attn_mask=None), and leaving mask= out gives the default, 'causal'")
        if type(self.mask) is _DefaultMask:
            # (FlexAttention's mods alone mean no other mask: a port that keeps jitattn's
            # default would silently hide the keys after the diagonal)
            if self.mask_mod is not None:
                warnings.warn(
                    f"Variant {self.name!r}: mask_mod is ANDed with the default mask='causal'; "
                    f"pass mask='causal' to keep that (and silence this warning), or "
                    f"mask='none' for the mask_mod alone, as in FlexAttention", UserWarning,
                    stacklevel=4)
            elif self.score_mod is not None:
                warnings.warn(
                    f"Variant {self.name!r}: score_mod without mask= is causal (jitattn's "
                    f"default); pass mask='causal' to keep that (and silence this warning), "
                    f"or mask='none' to see every key, as FlexAttention's score_mod alone "
                    f"does", UserWarning, stacklevel=4)
            object.__setattr__(self, "mask", "causal")
        if self.mask not in MASKS:
            raise SpecError(f"Variant mask={self.mask!r}: expected one of {MASKS}" +
                            _MOD_HINT * callable(self.mask))
        if self.reduction not in REDUCTIONS:
            raise SpecError(f"Variant reduction={self.reduction!r}: expected one of {REDUCTIONS}")
        w = self.window_left
        if w is not None:
            try:  # (the kernels compare positions in int32)
                w = int_arg("window_left", w, minimum=-1, maximum=2**31 - 1)
            except (TypeError, ValueError):
                raise SpecError(f"Variant window_left={shown_value(w)}: expected None, -1 or an "
                                f"int in 0 .. 2**31 - 1") from None
        object.__setattr__(self, "window_left", None if w == -1 else w)
        if self.pos_encoding is not None and not isinstance(self.pos_encoding, RoPE):
            raise SpecError(f"Variant pos_encoding={self.pos_encoding!r}: expected ja.RoPE(...)")
        score = tracing.trace(self.score_mod, "score_mod") if self.score_mod is not None else None
        mask = tracing.trace(self.mask_mod, "mask_mod") if self.mask_mod is not None else None
        object.__setattr__(self, "_score", score)
        object.__setattr__(self, "_mask", mask)
        exprs = [t.expr for t in (score, mask) if t is not None]
        try:  # (trace bounds the depth; this is for a caller already deep in the stack)
            if score is not None:
                nonfinite.refuse_nonfinite(score, self.reduction)
            object.__setattr__(self, "_params", tuple(tracing.params_of(*exprs)))
            object.__setattr__(self, "_key", self._compute_key())
            object.__setattr__(self, "_direct_index", tuple(_direct_indices(*exprs)))
        except RecursionError:
            raise SpecError(f"Variant {self.name!r}: Python's recursion limit was reached "
                            f"walking its score_mod / mask_mod (called from deep in the stack); "
                            f"raise sys.setrecursionlimit or build the variant higher up") from None
        for hook in ON_CREATE:  # e.g. ops.py registers the variant for its torch custom op
            hook(self)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in PER_OBJECT}

    def __setstate__(self, state):
        self.__dict__.update(state)
        for hook in ON_CREATE:
            hook(self)

    # -- identity ---------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """``"<name>-<mask>-<hash>"``: a content hash of everything that changes generated code."""
        return self._key

    def _compute_key(self) -> str:
        blob = json.dumps({
            "name": self.name, "mask": self.mask, "window_left": self.window_left,
            "score_mod": self._score.cpp if self._score else None,
            "mask_mod": self._mask.cpp if self._mask else None,
            "params": [p.code_signature if isinstance(p, TensorParam) else f"{p.name}:scalar"
                       for p in self._params],
            "rope": repr(self.pos_encoding), "reduction": self.reduction,
        }, sort_keys=True)
        return f"{self.name}-{self.mask}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"

    def __eq__(self, other):
        return isinstance(other, Variant) and other.key == self.key and all(
            a.captured is b.captured for a, b in zip(self.tensor_params, other.tensor_params))

    def __hash__(self):
        return hash(self.key)

    # -- parameters -------------------------------------------------------------------------------
    @property
    def score(self) -> tracing.Traced | None:
        return self._score

    @property
    def mask_pred(self) -> tracing.Traced | None:
        return self._mask

    @property
    def params(self) -> tuple:
        """All runtime parameters (ScalarParam / TensorParam), in kernel-argument order."""
        return self._params

    @property
    def tensor_params(self) -> tuple:
        return tuple(p for p in self._params if isinstance(p, TensorParam))

    @property
    def runtime_param_names(self) -> tuple:
        """Names the caller must pass (captured tensors are bound automatically)."""
        return tuple(p.name for p in self._params
                     if not (isinstance(p, TensorParam) and p.captured is not None))

    def check_param_names(self, params: dict) -> None:
        """Raises ValueError unless ``params`` names exactly the runtime parameters (a missing
        one, or an unexpected one: a misspelt keyword of the call lands here and is named)."""
        expected = set(self.runtime_param_names)
        extra, missing = set(params) - expected, expected - set(params)
        if extra:
            hint = " (the softmax scale is the sm_scale= argument)" if "scale" in extra else ""
            for name in sorted(extra - {"scale"}):
                if name in CALL_KEYWORDS_ELSEWHERE:  # SDPA's is_causal=, FlashInfer's causal=
                    hint += f"; {name}= is {CALL_KEYWORDS_ELSEWHERE[name]}"
                    continue
                if name in _CALL_KEYWORDS:  # a keyword of another call (ja.attention(v_scale=))
                    hint += f"; {name}= is not a keyword of this call"
                    continue
                if torch.compiler.is_compiling():  # (difflib is not traceable: eager's hint)
                    continue
                close = difflib.get_close_matches(name, _CALL_KEYWORDS + tuple(expected), n=1)
                hint += f"; did you mean {close[0]}=?" if close else ""
            raise ValueError(f"unexpected parameter(s) {sorted(extra)} for variant "
                             f"{self.name!r} (a keyword the call does not take is read as the "
                             f"variant's runtime parameter); it takes "
                             f"{sorted(expected) or 'none'}{hint}")
        if missing:
            raise ValueError(f"missing parameter(s) {sorted(missing)} for variant "
                             f"{self.name!r}; it takes {sorted(expected)}")

    def bind(self, params: dict, *, device: torch.device, sizes: dict) -> dict:
        """Check and bind runtime parameters. ``sizes`` maps SHAPE_SYMBOLS to ints.

        Returns name -> float (scalars) or contiguous tensor. Raises ValueError (missing, extra,
        wrong shape) or TypeError (wrong type or dtype) naming the parameter.
        """
        if not params and not self._params:  # most variants: nothing to bind (host time)
            return {}
        self.check_param_names(params)
        bound, stand_ins = {}, set()
        for p in self._params:
            if isinstance(p, ScalarParam):
                val = params[p.name]
                if isinstance(val, (bool, np.bool_)) or not isinstance(val, numbers.Real):
                    hint = " (read a tensor once with .item(): a tensor here would cost a " \
                        "device sync per call)" if isinstance(val, torch.Tensor) else ""
                    raise TypeError(f"parameter {p.name!r} must be a Python number, got "
                                    f"{type(val).__name__}{hint}")
                try:  # the kernels take float32: a larger value would become inf there
                    val = float(val)
                    finite = abs(val) <= FLOAT32_MAX
                except OverflowError:
                    finite = False
                if not finite:
                    raise ValueError(f"parameter {p.name!r} is {shown_value(params[p.name])}; "
                                     f"expected a finite number that float32 holds (|x| <= "
                                     f"3.4e38)")
                bound[p.name] = val
                continue
            t = params[p.name] if p.captured is None else _CAPTURED.get().get(p.name, p.captured)
            what = "captured tensor" if p.captured is not None else "parameter"
            shown = p.display
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} {shown!r} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
            want = tuple(sizes[s] if isinstance(s, str) else s for s in p.shape)
            if tuple(t.shape) != want:
                raise ValueError(f"{what} {shown!r} has shape {tuple(t.shape)}, expected "
                                 f"{want} (declared {p.shape})")
            empty = 0 in t.shape
            if empty and not any(isinstance(s, str) and sizes[s] == 0 for s in p.shape):
                raise ValueError(f"{what} {shown!r} has an empty dimension (shape "
                                 f"{tuple(t.shape)})")
            if t.dtype != p.dtype:
                raise TypeError(f"{what} {shown!r} has dtype {t.dtype}, expected {p.dtype}")
            if t.device != device:
                raise ValueError(f"{what} {shown!r} is on {t.device}, expected {device} "
                                 f"(the device of q)")
            if not t.is_contiguous():
                raise ValueError(f"{what} {shown!r} must be contiguous (strides "
                                 f"{t.stride()}; pass or capture t.contiguous())")
            # empty because a size it is declared over is 0 (a batch without keys, queries
            # or requests): no score is computed, but the kernels may still read the table
            # where they hoist what one query row needs, so they get one element per dimension
            if empty:
                stand_ins.add(p.name)
                t = t.new_zeros((1,) * t.dim())
            bound[p.name] = t
        extent = {sym: sizes[size] for sym, size in _INDEX_SIZE.items()}
        tensors = {p.name: p for p in self._params if isinstance(p, TensorParam)}
        for name, dim, sym in self._direct_index:
            t = bound[name]
            if t.shape[dim] < extent[sym] and name not in stand_ins:
                # (a dimension declared by another size: "qo_len" for q_idx fits only while
                # qo_len == kv_len, "num_kv_heads" for h only without GQA)
                param = tensors.get(name)
                need, declared = _INDEX_SIZE[sym], param and param.shape[dim]
                hint = f"; declare dimension {dim} {need!r}, not {declared!r}" \
                    if isinstance(declared, str) and declared != need else ""
                hint += " (q_idx is a query's position in its request's KV, kv_len - qo_len + " \
                    "i: end-aligned)" if sym == "q_idx" else " (h is the query head)" \
                    if sym == "h" and hint else ""
                raise ValueError(
                    f"tensor {param.display if param else name!r} (shape {tuple(t.shape)}) is "
                    f"indexed by {sym} in dimension {dim}, which reaches {extent[sym] - 1}: that "
                    f"dimension needs {extent[sym]} entries, it has {t.shape[dim]}{hint}")
        return bound

    def describe(self) -> str:
        """One line naming the variant and what specialises it (mask, window, the mods' names,
        runtime parameters, RoPE, reduction), e.g. ``Variant softcap: mask=causal,
        score_mod=softcap, reduction=softmax``; what ``jitattn compile`` prints."""
        parts = [f"mask={self.mask}"]
        if self.window_left is not None:
            parts.append(f"window_left={self.window_left}")
        if self._score:
            parts.append(f"score_mod={self._score.fn_name}")
        if self._mask:
            parts.append(f"mask_mod={self._mask.fn_name}")
        if self._params:
            parts.append("params=" + ",".join(p.name for p in self._params))
        if self.pos_encoding:
            parts.append(f"rope={self.pos_encoding}")
        parts.append(f"reduction={self.reduction}")
        return f"Variant {self.name}: " + ", ".join(parts)


def _direct_indices(*exprs):
    """(tensor name, dim, symbol) for every tensor dimension indexed by a bare symbol, so that
    binding can check the tensor covers the symbol's whole range (other indices are clamped)."""
    found = set()

    def walk(e):
        if e.op == "index":
            for dim, ix in enumerate(e.args[1:]):
                if ix.op == "sym":
                    found.add((e.args[0].name, dim, ix.args[0]))
        for a in e.args:
            if isinstance(a, dsl.Expr):
                walk(a)
    for e in exprs:
        walk(e)
    return sorted(found)


_dataclass_init = Variant.__init__


@functools.wraps(_dataclass_init)
def _variant_init(self, *args, **kwargs):
    """Variant's own __init__ (the dataclass's), with a hint for keywords that are another
    library's way of saying a field (causal=, sliding_window=, logits_soft_cap=, ...)."""
    unknown = set(kwargs) - _VARIANT_FIELDS
    if unknown:
        raise unexpected_variant_keywords(unknown, _FIELD_ORDER)
    _dataclass_init(self, *args, **kwargs)


_FIELD_ORDER = [f.name for f in dataclasses.fields(Variant) if f.init]
_VARIANT_FIELDS = frozenset(_FIELD_ORDER)
Variant.__init__ = _variant_init
