"""Checks of the plain Python arguments the public API shares (counts, sizes), so that every
wrapper refuses a bad one alike: TypeError for the wrong type, ValueError for the wrong value,
each naming the argument and its value; and ``planner``, the wrappers' plan() decorator (hints
for FlashInfer's keywords, eager under torch.compile)."""

from __future__ import annotations

import functools
import inspect
import operator

import numpy as np
import torch


def int_arg(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as a Python int: a Python or numpy int (not a bool, not a float that happens to
    be whole) in minimum .. maximum. Raises TypeError / ValueError naming ``name``."""
    expected = f"an int >= {minimum}" if maximum is None else f"an int in {minimum} .. {maximum}"
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r}: expected {expected}") from None
    if n < minimum or (maximum is not None and n > maximum):
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return n


def bool_arg(name: str, value) -> bool:
    """``value`` as a Python bool: True / False, or numpy's. Raises TypeError naming ``name``
    for anything else (a string such as "no" would otherwise count as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: expected True or False")
    return bool(value)


# what a batch needs of each capacity the constructor takes, as plan()'s errors say it
_NEEDS = {"max_batch_size": "batch of {n} requests exceeds",
          "max_num_pages": "the batch uses {n} pages, more than",
          "max_mask_bytes": "the custom mask has {n} bytes, more than",
          "max_item_tokens": "{n} item tokens exceed"}


def over_capacity(capacity: dict, name: str, needed: int) -> str | None:
    """The error message when a batch needs ``needed`` of capacity ``name`` (max_batch_size,
    max_num_pages, max_mask_bytes or max_item_tokens) and ``capacity[name]`` is less, else
    None: the one wording of BatchPrefill / BatchDecode.plan() and of SharedPrefixPrefill's
    early checks."""
    if needed <= capacity[name]:
        return None
    return f"{_NEEDS[name].format(n=needed)} {name}={capacity[name]} given to the constructor"


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
    "page_size": "the constructor's ({cls}(variant, page_size=16))",
    "custom_mask": "BatchPrefill.plan()'s, with Variant(..., mask='custom')",
}


def planner(plan):
    """A wrapper's plan(): host work that torch.compile must not trace (dynamo traced the
    planner's numpy and failed inside it), and that raises, for a keyword it does not take that
    FlashInfer's plan() does, a TypeError saying where that setting lives here (Python's own
    error named only the keyword). Other calls are plan's own."""
    signature = inspect.signature(plan)

    @functools.wraps(plan)
    def checked(*args, **kwargs):
        return host_only(_PLAN_REASON)(_plan_with_hints, plan, signature, args, kwargs)
    return checked


_PLAN_REASON = ("jitattn's plan() is host work between steps: call it outside the compiled "
                "function")
_HOST_ONLY: dict = {}  # reason -> trampoline


def host_only(reason: str):
    """A trampoline that torch.compile does not trace: ``host_only(reason)(fn, *args)`` calls
    fn(*args) with dynamo off (a graph break; under fullgraph=True, an error that gives
    ``reason``). jitattn's one way of keeping host work (planning, building a Variant) out of
    compiled graphs. Made at first use, not at import: torch.compiler.disable imports dynamo
    (1.3 s of `import jitattn` on the CI machine), and its reason= needs torch 2.8."""
    trampoline = _HOST_ONLY.get(reason)
    if trampoline is None:
        def call(fn, *args):
            return fn(*args)
        try:
            trampoline = torch.compiler.disable(call, reason=reason)
        except TypeError:  # (torch before 2.8: no reason=)
            trampoline = torch.compiler.disable(call)
        trampoline = _HOST_ONLY.setdefault(reason, trampoline)
    return trampoline


def _plan_with_hints(plan, signature, args, kwargs):
    """plan(*args, **kwargs), its TypeError for a FlashInfer keyword given a hint."""
    try:
        return plan(*args, **kwargs)
    except TypeError as e:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            cls = type(args[0]).__name__ if args else "BatchDecode"
            hints = [f"{name}= is {where.format(cls=cls)}"
                     for name, where in _FLASHINFER_PLAN.items()
                     if name in kwargs and name not in signature.parameters]
            if hints:
                raise TypeError(f"{e}: {'; '.join(hints)} (README: porting from "
                                f"FlashInfer)") from None
        raise
