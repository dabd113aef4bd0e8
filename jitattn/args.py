"""Checks of the plain Python arguments the public API shares (counts, sizes, devices,
capacities, KV scales), so that every wrapper refuses a bad one alike: TypeError for the wrong
type, ValueError for the wrong value, each naming the argument and its value; and the host-only
trampolines: ``planner``, the wrappers' plan() decorator (with porting.py's hints for
FlashInfer's keywords), and ``host_only``, which keeps host work out of torch.compile's
graphs."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
import struct
import warnings

import numpy as np
import torch

from .porting import plan_hints, positional_binding


def shown_value(value) -> str:
    """``repr(value)`` for a message, but for an int of more than 20 digits its first and last
    digits and how many it has (an error printed every digit of 10**400, and str() refuses an
    int of more than 4300 digits)."""
    if not isinstance(value, int) or isinstance(value, bool) or -10**20 < value < 10**20:
        return repr(value)
    a, digits = abs(value), int(abs(value).bit_length() * math.log10(2))
    while a >= 10 ** digits:  # (the estimate, within one of the count, made exact)
        digits += 1
    while a < 10 ** (digits - 1):
        digits -= 1
    return f"{'-' * (value < 0)}{a // 10 ** (digits - 6)}...{a % 10 ** 6:06d} ({digits} digits)"


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
        raise ValueError(f"{name}={shown_value(value)}: expected {expected}")
    return n


def not_a_variant(value, wrapper: str | None = None) -> TypeError:
    """The TypeError for a ``variant`` argument that is not a jitattn.Variant; for a wrapper
    given a tensor (FlashInfer's wrappers take their workspace buffer first) or an int
    (FlashInfer's cascade wrapper takes num_levels first), and for a function (a
    FlexAttention score_mod / mask_mod), the hints."""
    hint = ""
    if wrapper is not None and isinstance(value, torch.Tensor):
        hint = (f" (FlashInfer's wrappers take a workspace buffer first; jitattn's size their "
                f"own: {wrapper}(variant, ...))")
    elif wrapper == "MultiLevelCascade" and isinstance(value, (int, np.integer)) and \
            not isinstance(value, (bool, np.bool_)):  # (FlashInfer's MultiLevelCascade-
        #                                                 AttentionWrapper(num_levels, ...))
        hint = (" (FlashInfer's cascade wrapper takes num_levels first; jitattn's take the "
                "Variant first: MultiLevelCascade(variant, num_levels, ...))")
    elif callable(value):
        hint = (" (a score_mod or mask_mod goes into a Variant: jitattn.Variant(score_mod=f, "
                "mask='none') or jitattn.Variant(mask_mod=f, mask='none'))")
    elif hasattr(value, "mask_mod") and hasattr(value, "kv_indices"):  # FlexAttention's
        hint = (" (a FlexAttention BlockMask: its function goes into a Variant, "
                "jitattn.Variant(mask_mod=block_mask.mask_mod, mask='none'))")
    return TypeError(f"variant must be a jitattn.Variant, got {type(value).__name__}{hint}")


def bool_arg(name: str, value) -> bool:
    """``value`` as a Python bool: True / False, or numpy's. Raises TypeError naming ``name``
    for anything else (a string such as "no" would otherwise count as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: expected True or False")
    return bool(value)


def resolve_device(device) -> torch.device:
    """The wrappers' device: None picks the current CUDA device when there is one, else the
    CPU backend. Raises ValueError for a CUDA device on a machine without CUDA."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # (torch's int devices are its accelerator's)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: expected a cuda device ('cuda', 'cuda:1') or "
                         f"'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: CUDA is not available to this torch "
                             f"({torch.__version__}); pass device='cpu' for the CPU backend")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device={str(device)!r}: expected a cuda device or 'cpu'")
    else:
        device = torch.device("cpu")  # (cpu:0 is cpu: tensors report no index there)
    return device


def positive_f32(x: float) -> bool:
    """Whether x, rounded to float32 as the kernels take it, is finite and > 0."""
    return 0 < x < 3.4e38 and struct.unpack("f", struct.pack("f", x))[0] > 0


def kv_scales(k_scale, v_scale, sm_scale: float) -> tuple[float, float]:
    """run()'s k_scale / v_scale as Python floats: finite and > 0, numpy's floats too, and
    sm_scale x k_scale (the kernels' softmax scale) finite and > 0 as float32. Raises
    ValueError naming the argument (a tensor gets a hint: reading one per call would sync)."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        try:
            fine = not isinstance(value, (bool, np.bool_)) and \
                isinstance(value, numbers.Real) and 0 < float(value) < math.inf
        except OverflowError:
            fine = False
        if not fine:
            hint = " (read a tensor scale once with .item(): a tensor here would " \
                "cost a device sync per call)" if isinstance(value, torch.Tensor) else ""
            raise ValueError(f"{name}={shown_value(value)}: expected a finite Python float > "
                             f"0{hint}")
    k_scale, v_scale = float(k_scale), float(v_scale)
    scale = sm_scale * k_scale
    if not positive_f32(scale):
        raise ValueError(f"k_scale={k_scale!r}: sm_scale x k_scale = {scale!r} must be "
                         f"finite and > 0 as float32")
    return k_scale, v_scale


_NOT_RUN_KWARGS = {
    "k_scale": "fp8 KV caches and their scales are BatchPrefill's and BatchDecode's",
    "v_scale": "fp8 KV caches and their scales are BatchPrefill's and BatchDecode's"}


def reject_run_kwargs(wrapper, params: dict) -> None:
    """Cascades and shared-prefix prefill plan caches in q's dtype: their run() takes no
    k_scale / v_scale but 1 (which changes nothing), and drops those from ``params``. Raises
    ValueError naming the keyword and ``wrapper`` (its class, or a class name). (Parameter
    names cannot be these: dsl reserves them.)"""
    for name in _NOT_RUN_KWARGS:
        if name in params:
            value = params.pop(name)
            if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)) or \
                    value != 1:
                owner = wrapper if isinstance(wrapper, str) else type(wrapper).__name__
                raise ValueError(f"{owner}.run() takes no {name} (other than 1.0): "
                                 f"{_NOT_RUN_KWARGS[name]}")


def missing_cache(owner: str, params: dict) -> TypeError:
    """The TypeError for ``owner``.run() given no kv_cache; FlashInfer's run(q,
    paged_kv_cache=...) (its keyword in ``params``) is named."""
    hint = " (FlashInfer's paged_kv_cache= is this second argument)" \
        if "paged_kv_cache" in params else ""
    return TypeError(f"{owner}.run() needs kv_cache, its second argument: run(q, (k_cache, "
                     f"v_cache)) or run(q, kv_cache) with one [num_pages, 2, ...] tensor{hint}")


def extra_run_args(owner: str, extra: tuple) -> TypeError:
    """The TypeError for ``owner``.run() given positional arguments after the cache
    (``extra``): FlashInfer's ragged run(q, k, v), or return_lse given positionally."""
    if len(extra) == 1 and (isinstance(extra[0], (bool, np.bool_)) or (
            isinstance(extra[0], numbers.Integral) and extra[0] in (0, 1))):
        return TypeError(f"{owner}.run() takes return_lse as a keyword: "
                         f"run(q, kv_cache, return_lse={bool(extra[0])})")
    return TypeError(f"{owner}.run() takes the cache as one argument: run(q, (k, v)) or "
                     f"run(q, kv_cache); got {2 + len(extra)} positional arguments after self")


# what a batch needs of each capacity the constructor takes, as plan()'s errors say it
_NEEDS = {"max_batch_size": "batch of {n} requests exceeds",
          "max_num_pages": "the batch uses {n} pages, more than",
          "max_mask_bytes": "the custom mask has {n} bytes, more than",
          "max_item_tokens": "{n} item tokens exceed"}


class CapacityError(ValueError):
    """A plan needs more of a capacity given to the wrapper's constructor (max_batch_size,
    max_num_pages, max_work_items, max_partial_rows, max_mask_bytes, max_item_tokens) than it
    holds: construct the wrapper with more (or split the batch)."""


def over_capacity(capacity: dict, name: str, needed: int) -> str | None:
    """The error message when a batch needs ``needed`` of capacity ``name`` (max_batch_size,
    max_num_pages, max_mask_bytes or max_item_tokens) and ``capacity[name]`` is less, else
    None: the one wording of BatchPrefill / BatchDecode.plan() and of SharedPrefixPrefill's
    early checks."""
    if needed <= capacity[name]:
        return None
    return f"{_NEEDS[name].format(n=needed)} {name}={capacity[name]} given to the constructor"


def planner(plan):
    """A wrapper's plan(): host work that torch.compile must not trace (dynamo traced the
    planner's numpy and failed inside it), and that raises, for a keyword it does not take that
    FlashInfer's plan() does, a TypeError saying where that setting lives here (Python's own
    error named only the keyword). Other calls are plan's own. The wrapper's last plan is
    dropped first (its ``_drop_plan()``): after a plan() that raises, run() raises until the
    next plan(), also when the call never reached plan's body (an argument it does not take),
    rather than run the previous plan."""
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
        if torch.compiler.is_compiling():  # (dynamo cannot trace disable(): made eagerly, after
            raise RuntimeError(reason)     # this graph break; fullgraph's error gives reason)

        def call(fn, *args):
            return fn(*args)
        try:
            trampoline = torch.compiler.disable(call, reason=reason)
        except TypeError:  # (torch before 2.8: no reason=, so fullgraph's error would not
            #                give it; raising it while traced does: a graph break otherwise)
            disabled = torch.compiler.disable(call)

            def trampoline(fn, *args):
                if torch.compiler.is_compiling():
                    raise RuntimeError(reason)
                return disabled(fn, *args)
        trampoline = _HOST_ONLY.setdefault(reason, trampoline)
    return trampoline


def _plan_with_hints(plan, signature, args, kwargs):
    """plan(*args, **kwargs), the wrapper's last plan dropped first, its TypeError for a
    FlashInfer keyword or argument given a hint (porting.plan_hints), one for a missing
    argument the parameters its positional arguments went to (porting.positional_binding)."""
    if args:
        args[0]._drop_plan()
    try:
        return plan(*args, **kwargs)
    except TypeError as e:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as bind_error:
            hints = plan_hints(signature, args, kwargs)
            unknown = [name for name in kwargs if name not in signature.parameters]
            message = str(e) if len(unknown) < 2 else (  # (Python's names the first alone)
                f"{plan.__qualname__}() got unexpected keyword arguments {unknown}")
            if hints:
                raise TypeError(f"{message}: {'; '.join(hints)} (README: porting from "
                                f"FlashInfer)") from None
            if len(unknown) > 1:
                raise TypeError(message) from None
            taken = positional_binding(signature, args) if "missing" in str(bind_error) \
                else None
            if taken:
                raise TypeError(f"{e}: {taken}") from None
        raise


def drops_grad(*tensors) -> bool:
    """Whether a call on ``tensors`` would drop gradients: one requires grad, grad mode on."""
    return torch.is_grad_enabled() and \
        any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor))


def no_backward_warning(call: str, stacklevel: int = 2) -> None:
    """The UserWarning that ``call``'s output does not track gradients (jitattn has no
    backward: inference only)."""
    warnings.warn(f"{call} has no backward (inference only): its output does not track "
                  f"gradients; call it under torch.no_grad() or torch.inference_mode()",
                  stacklevel=stacklevel + 1)


def warn_no_grad(call: str, *tensors) -> tuple:
    """The UserWarning of an eager call whose input requires grad (no_backward_warning).
    ``call`` names the entry point; under torch.compile the ops detach their inputs and their
    kernels warn when the traced call dropped gradients (ops.py). Returns the tensors,
    detached after a warning (an entry point that calls others passes them on, and those then
    say nothing more)."""
    if drops_grad(*tensors):
        no_backward_warning(call, stacklevel=3)
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)
    return tensors
