"""torch.library custom ops for jitattn's entry points, so that torch.compile(fullgraph=True)
traces a model that calls jitattn without graph breaks.

``jitattn.attention``: one op, ``jitattn::attention``, that runs the Variant named by an
integer handle, checked against the variant key the graph recorded (its runtime parameters are
op arguments; the handles map to Variants weakly, so a Variant and the tensors it captured are
freed with the caller's last reference). The
planned wrappers (BatchPrefill, BatchDecode, SharedPrefixPrefill, the cascades): one op,
``jitattn::wrapper_run``, that calls the run() of the wrapper named by an integer handle, so the
graph holds the handle and the wrapper's current plan is used at every call (re-planning needs
no recompile). Each op has a fake implementation that only produces output shapes. While
torch.compile traces, the entry points route through the ops; eagerly they run directly.
"""

from __future__ import annotations

import itertools
import math
import numbers
import weakref

import numpy as np
import torch

from .args import drops_grad, no_backward_warning
from .params import ScalarParam
from .spec import _CAPTURED, ON_CREATE, PER_OBJECT, Variant

_VARIANTS: "weakref.WeakValueDictionary[int, Variant]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count()


def register_variant(variant: Variant) -> None:
    """Give ``variant`` the handle by which the attention op finds it (spec.ON_CREATE: every
    new Variant, a copy and an unpickled one too; kept weakly)."""
    handle = next(_NEXT_HANDLE)
    _VARIANTS[handle] = variant
    object.__setattr__(variant, "_op_handle", handle)


ON_CREATE.append(register_variant)
PER_OBJECT.add("_op_handle")


def _split_params(variant: Variant, params: dict) -> tuple[list, list]:
    """The variant's runtime parameters as the ops pass them: tensors (the caller's, then the
    captured ones: graph inputs, so that an in-place change the graph makes before the op is
    seen by it), then floats. Raises as the eager call would for a missing or unexpected name
    (the ops pass scalars by position: a gap would shift them) or a scalar that is not a
    number."""
    variant.check_param_names(params)
    tensors, scalars = [], []
    captured = [p.captured.detach() for p in variant.params  # (an nn.Parameter captured:
                if not isinstance(p, ScalarParam) and p.captured is not None]  # no backward)
    for p in variant.params:
        if p.name not in params:
            continue  # captured: passed after the caller's
        x = params[p.name]
        if isinstance(p, ScalarParam):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, torch.SymFloat,
                                                                     torch.SymInt)):
                raise TypeError(f"parameter {p.name!r} must be a Python number, got "
                                f"{type(x).__name__}")
            scalars.append(float(x))
        else:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"parameter {p.name!r} must be a torch.Tensor, got "
                                f"{type(x).__name__}")
            tensors.append(x)
    return tensors + captured, scalars


def _traced_key(obj) -> str:
    """What a graph records of the object it names by handle: a Variant's key; a wrapper's
    class and its variant's key."""
    return obj.key if isinstance(obj, Variant) else f"{type(obj).__name__} {obj.variant.key}"


def _traced_with(table: dict, handle: int, key: str, what: str):
    """The object a graph's handle names, checked against what the graph recorded of it
    (_traced_key): handles count per process, so a graph exported from another process could
    otherwise run whatever this process numbered alike."""
    found = table.get(handle)
    if found is None:
        raise RuntimeError(f"jitattn {what} {handle} does not exist in this process (a compiled "
                           f"graph outlived the {what} it was traced with, or an exported graph "
                           f"is run in another process)")
    if _traced_key(found) != key:
        raise RuntimeError(f"jitattn {what} {handle} is {_traced_key(found)!r} in this process; "
                           f"the graph was traced with {key!r} (an exported graph run in "
                           f"another process: build its Variants and wrappers in the same "
                           f"order first)")
    return found


def _attention_impl(handle, key, q, k, v, qo_indptr, kv_indptr, sm_scale, tensors, scalars,
                    grad_dropped=False):
    variant = _traced_with(_VARIANTS, handle, key, "Variant")
    if grad_dropped:  # (the traced call's inputs required grad: the eager call's warning)
        no_backward_warning("jitattn.attention")
    from .api import attention  # (api imports this module)
    kw = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr) if qo_indptr is not None else {}
    params, captured = _params_of(variant, tensors, scalars)
    token = _CAPTURED.set(captured)
    try:
        return attention(q, k, v, variant, sm_scale=sm_scale, return_lse=True, **kw, **params)
    finally:
        _CAPTURED.reset(token)


def _attention_fake(handle, key, q, k, v, qo_indptr, kv_indptr, sm_scale, tensors, scalars,
                    grad_dropped=False):
    return _fresh_outputs(q)


_attention = torch.library.custom_op(
    "jitattn::attention", _attention_impl, mutates_args=(),
    schema="(int variant, str key, Tensor q, Tensor k, Tensor v, Tensor? qo_indptr, "
           "Tensor? kv_indptr, float sm_scale, Tensor[] tensors, float[] scalars, "
           "bool grad_dropped=False) -> (Tensor, Tensor)")
_attention.register_fake(_attention_fake)


def _fresh_outputs(q) -> list:
    """What the ops return, as the fake kernels describe it: contiguous out in q's shape and
    dtype (whatever q's strides) and lse [tokens, heads] float32."""
    return [torch.empty(q.shape, dtype=q.dtype, device=q.device),
            q.new_empty(q.shape[:2], dtype=torch.float32)]


def attention_traced(q, k, v, variant, *, qo_indptr, kv_indptr, sm_scale, return_lse, params):
    """``jitattn.attention`` while torch.compile traces: no host reads, one custom op.
    Raises as the eager call does for indptrs given alone and for parameter names."""
    if (qo_indptr is None) != (kv_indptr is None):  # (impl would drop a lone kv_indptr)
        raise ValueError("qo_indptr and kv_indptr must be given together (or neither)")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    tensors, scalars = _split_params(variant, params)
    out, lse = _attention(variant._op_handle, _traced_key(variant), *_no_grad(q, k, v),
                          qo_indptr, kv_indptr, float(sm_scale), _no_grad(*tensors), scalars,
                          drops_grad(q, k, v))
    return (out, lse) if return_lse else out


def _no_grad(*tensors) -> list:
    """The ops' inputs detached: jitattn has no backward, so, as in eager mode, outputs do
    not track gradients (an input requiring grad made compiling fail in torch's autograd,
    which names no autograd formula for the op); the ops' kernels warn as the eager calls do
    (their grad_dropped argument)."""
    return [t.detach() for t in tensors]


# -- the planned wrappers ----------------------------------------------------------------------
_WRAPPERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register_wrapper(wrapper) -> int:
    """A handle for ``wrapper`` (kept weakly), used by wrapper_run to find it."""
    handle = next(_NEXT_HANDLE)
    _WRAPPERS[handle] = wrapper
    return handle


def _wrapper_run_impl(handle, key, q, inputs, tensors, scalars, num_outputs,
                      grad_dropped=False):
    wrapper = _traced_with(_WRAPPERS, handle, key, "wrapper")
    if grad_dropped:
        no_backward_warning(f"{getattr(wrapper, 'run_owner', None) or type(wrapper).__name__}"
                            f".run")
    n = sum(isinstance(p, ScalarParam) for p in wrapper.variant.params)
    params, captured = _params_of(wrapper.variant, tensors, scalars[:n])
    token = _CAPTURED.set(captured)
    try:
        # scalars past the variant's: the wrapper's own run() arguments (BatchPrefill: k/v_scale)
        return list(wrapper._run_eager(q, inputs, params, *scalars[n:]))[:num_outputs]
    finally:
        _CAPTURED.reset(token)


def _wrapper_run_fake(handle, key, q, inputs, tensors, scalars, num_outputs,
                      grad_dropped=False):
    return _fresh_outputs(q)[:num_outputs]


_wrapper_run = torch.library.custom_op(
    "jitattn::wrapper_run", _wrapper_run_impl, mutates_args=(),
    schema="(int handle, str key, Tensor q, Tensor[] inputs, Tensor[] tensors, float[] scalars, "
           "int num_outputs, bool grad_dropped=False) -> Tensor[]")
_wrapper_run.register_fake(_wrapper_run_fake)


def _params_of(variant: Variant, tensors, scalars) -> tuple[dict, dict]:
    """_split_params' lists back as (the caller's parameters by name, the captured tensors'
    current values by parameter name: spec._CAPTURED)."""
    scalar_names = [p.name for p in variant.params if isinstance(p, ScalarParam)]
    tensor_params = [p for p in variant.params if not isinstance(p, ScalarParam)]
    names = [p.name for p in tensor_params if p.captured is None]
    names += [p.name for p in tensor_params if p.captured is not None]
    given = dict(zip(names, tensors))
    captured = {p.name: given.pop(p.name) for p in tensor_params if p.captured is not None}
    return given | dict(zip(scalar_names, scalars)), captured


def wrapper_traced(wrapper, q, inputs, params, *, num_outputs: int, extra_scalars=()):
    """A wrapper's run() while torch.compile traces: one wrapper_run op on its handle.
    extra_scalars: floats passed after the params to the wrapper's _run_eager. Raises as the
    eager run() would when params miss one of the variant's or add another."""
    tensors, scalars = _split_params(wrapper.variant, params)
    return _wrapper_run(wrapper._handle, _traced_key(wrapper), q.detach(), _no_grad(*inputs),
                        _no_grad(*tensors), list(scalars) + [float(x) for x in extra_scalars],
                        num_outputs, drops_grad(q, *inputs))
