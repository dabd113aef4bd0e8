"""Python mods -> traced expressions: ``trace`` calls a ``score_mod`` / ``mask_mod`` once on the
symbols of dsl.py, bounds what it built (depth and size: the walks over an expression recurse)
and names the line it could not trace; ``params_of`` lists the runtime parameters an expression
reads.
"""

from __future__ import annotations

import inspect
import os
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from . import dtypes
from .dsl import SYMBOLS, Expr, SpecError, _lift
from .emit import emit_cpp
from .params import TensorParam


def _offending_line(error: BaseException) -> str:
    """'; file:line: `code`' of the innermost frame of user code (outside jitattn, torch and
    numpy) in the error's traceback: the line whose construct could not be traced. '' when
    there is none."""
    libraries = tuple(str(Path(m.__file__).resolve().parent) + os.sep  # (not jitattn_mods/)
                      for m in (dtypes, torch, np))
    user = [f for f in traceback.extract_tb(error.__traceback__)
            if not str(Path(f.filename).resolve()).startswith(libraries)]
    if not user:
        return ""
    f = user[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f"; failing line {Path(f.filename).name}:{f.lineno}{code}"


@dataclass
class _Tracer:
    prefix: str = "captured"
    captured: list = field(default_factory=list)
    names: dict = field(default_factory=dict)  # id(tensor) -> the Python name it was found by
    made: list = field(default_factory=list)  # frozen tensors of the trace (_Computed)

    def _frozen(self, t: torch.Tensor) -> bool:
        """Whether t (or what it views) is data torch computed from a captured tensor while
        the mod was traced (_Computed)."""
        base = t if t._base is None else t._base
        return any(m is t or m is base for m in self.made)

    def capture(self, t: torch.Tensor) -> TensorParam:
        for p in self.captured:
            if p.captured is t:
                return p
        name = self.names.get(id(t))
        if self._frozen(t):
            raise SpecError(f"a tensor of shape {tuple(t.shape)} that the mod computed while "
                            f"it was traced (from a captured one: (t * 4.0)[h], t.float()[h], "
                            f"t.T.contiguous()[h, k], t[i][h] with i a captured tensor) would "
                            f"keep the values it had then, "
                            f"where a captured tensor is read per call: compute it outside the "
                            f"mod and capture that, or write the arithmetic on the indexed "
                            f"value (t[h] * 4.0)")
        if t.dtype not in dtypes.TAG or t.dim() == 0:
            raise SpecError(f"captured tensor{f' {name!r}' if name else ''} of dtype {t.dtype} "
                            f"and shape {tuple(t.shape)} cannot be indexed in a variant; "
                            f"expected one of {list(dtypes.FROM_NAME)} with at least one "
                            f"dimension")
        if not t.is_contiguous():  # (bind() would refuse it at every call)
            raise SpecError(f"captured tensor{f' {name!r}' if name else ''} of shape "
                            f"{tuple(t.shape)} has strides {t.stride()}; a variant reads "
                            f"captured tensors contiguous: capture t.contiguous(), made "
                            f"outside the mod")
        p = TensorParam(f"{self.prefix}{len(self.captured)}", tuple(t.shape), t.dtype, t,
                        label=self.names.get(id(t)))
        self.captured.append(p)
        return p


    def capture_scalar(self, t: torch.Tensor) -> Expr:
        """A 0-d tensor captured by closure, read at call time as a one-element tensor (a view:
        in-place changes reach the next call, as for other captured tensors)."""
        for p in self.captured:
            if p.scalar_of is t:
                return p[0]
        name = self.names.get(id(t))
        if self._frozen(t):  # (1 / t, t.exp(), table[i]: torch computed it once, here)
            with torch._C.DisableTorchFunction():  # (a value read _Computed would refuse)
                value = t.item()
            raise SpecError(f"a 0-d tensor ({value!r}) that the mod computed while it was "
                            f"traced would keep that value at every call (a captured 0-d "
                            f"tensor is read per call): write the arithmetic on the traced "
                            f"value (score / t, not score * (1 / t)), a Python number for a "
                            f"constant (float('-inf'), not torch.tensor(...)), or ja.scalar "
                            f"for a runtime parameter; a table indexed by a captured tensor i "
                            f"(table[i]) is read per call indexed by a symbol too "
                            f"(table[i + 0 * h])")
        if t.dtype not in dtypes.TAG:
            raise SpecError(f"captured 0-d tensor{f' {name!r}' if name else ''} has dtype "
                            f"{t.dtype}; expected one of {list(dtypes.FROM_NAME)} (or a Python "
                            f"number: .item())")
        p = TensorParam(f"{self.prefix}{len(self.captured)}", (1,), t.dtype, t.reshape(1),
                        label=name, scalar_of=t)
        self.captured.append(p)
        return p[0]


def _tensor_names(fn) -> dict:
    """id(tensor) -> name for the tensors fn reaches by closure or as globals, so that errors
    about a captured tensor use the user's name for it."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    found = {}
    for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), var)
    for var in code.co_names:
        value = getattr(fn, "__globals__", {}).get(var)
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), var)
    return found


# each thread's trace in progress (captured tensors get its parameter names): a global one
# took another thread's captures, whose names then clashed in its own variant
_LOCAL = threading.local()


def current() -> _Tracer:
    """This thread's trace in progress, which dsl.Expr asks to capture a tensor indexed by
    symbols."""
    tracer = getattr(_LOCAL, "tracer", None)
    if tracer is None:
        tracer = _LOCAL.tracer = _Tracer()
    return tracer


def _storage(t: torch.Tensor) -> int | None:
    """The address of t's storage (views share it), or None for a tensor without one."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


# torch functions that read a tensor's value into Python (_Computed refuses them on tensors
# that are not constants)
_VALUE_READS = frozenset((torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__float__,
                          torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.tolist,
                          torch.Tensor.numpy, torch.Tensor.__complex__))


class _Computed(TorchFunctionMode):
    """Sorts the tensors torch computes while a mod is traced. Frozen: new data computed from
    a tensor that existed before the trace (a captured one: 1 / t, t * 4.0, t.T.contiguous())
    or from a frozen one, or a view of a frozen one; capture / capture_scalar refuse these,
    whose values would be the trace's where a captured tensor is read per call. Constant: new
    data from no tensor, or from constants only (torch.arange(8), ja.alibi_slopes(8)), or a
    view of one: captured as they are. Anything else aliases a tensor from before the trace
    (t.float() of a float32 t, t.detach(), t.view(2, 1), t[0]) and reads its live data; a
    view whose other tensor inputs are not constants (t[i], i a captured tensor: where it
    views was decided by i's value now) is frozen. Reads of a non-constant tensor's value
    into Python (bool(t), t.item(), float(t), t.tolist(), ...) are refused: the kernel would
    keep the value of the trace."""

    def __init__(self, made: list):
        super().__init__()
        self.made, self.constants = made, []

    def _is(self, group: list, t) -> bool:
        return any(m is t for m in group)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and \
                not self._is(self.constants, args[0]):
            raise SpecError(f"{getattr(func, '__name__', func)} of a tensor (shape "
                            f"{tuple(args[0].shape)}) that existed before the trace, or was "
                            f"computed from one, reads its value once, while the mod is "
                            f"traced: the kernel would keep that value at every call. Keep "
                            f"the tensor in the expression (torch.where(flag, a, b), "
                            f"score * t, t[h]), or pass a Python number")
        out = func(*args, **kwargs)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if outs:
            leaves = tree_leaves((args, kwargs))  # (tensors in slices too: t[i:i + 1])
            ins = [x for leaf in leaves for x in ((leaf.start, leaf.stop, leaf.step)
                                                  if isinstance(leaf, slice) else (leaf,))
                   if isinstance(x, torch.Tensor)]
            for o in outs:
                if any(o is x for x in ins):
                    continue  # (the input itself: its kind stays)
                at = _storage(o)
                shared = [x for x in ins if at is not None and _storage(x) == at]
                sources = shared or ins  # (a view follows what it views)
                placed_by = [x for x in ins if not any(x is s for s in shared)]  # (indices)
                if any(self._is(self.made, x) for x in sources) or (
                        not shared and any(not self._is(self.constants, x) for x in ins)) or (
                        shared and any(not self._is(self.constants, x) for x in placed_by)):
                    self.made.append(o)
                elif all(self._is(self.constants, x) for x in sources):
                    self.constants.append(o)
        return out


# bounds on one traced mod: walks over an expression (building the Variant, rendering, the
# reference) recurse once or twice per level, and visit a shared subexpression once per use
MAX_DEPTH = 100
MAX_OPERATIONS = 10_000


def _depth_and_size(root: Expr) -> tuple:
    """How many operations deep ``root`` is, and how many it has with every shared
    subexpression counted once per use (as code generation writes it out), without
    recursion."""
    seen: dict = {}  # id -> (depth, size)
    stack = [root]
    while stack:
        e = stack[-1]
        pending = [a for a in e.args if isinstance(a, Expr) and id(a) not in seen]
        if pending:
            stack += pending
            continue
        stack.pop()
        subs = [seen[id(a)] for a in e.args if isinstance(a, Expr)]
        seen[id(e)] = (1 + max((d for d, _ in subs), default=0), 1 + sum(n for _, n in subs))
    return seen[id(root)]


@dataclass(frozen=True, eq=False)
class Traced:
    """A traced mod: its expression, the function's name and where it was defined."""

    expr: Expr
    fn_name: str
    source: str  # "file.py:line" of the Python definition, for error reports

    @property
    def cpp(self) -> str:
        return emit_cpp(self.expr)


def trace(fn, kind: str) -> Traced:
    """Trace ``fn`` as a ``"score_mod"`` (5 args, float result) or ``"mask_mod"`` (4 args,
    bool result). Raises SpecError for anything the DSL cannot express."""
    names = SYMBOLS if kind == "score_mod" else SYMBOLS[1:]
    if not callable(fn):
        hint = " (a FlexAttention BlockMask: pass its function, mask_mod=block_mask.mask_mod" + \
            (", a mask, not a score_mod)" if kind == "score_mod" else ")") \
            if hasattr(fn, "mask_mod") and hasattr(fn, "kv_indices") else ""
        raise SpecError(f"{kind} must be callable, got {type(fn).__name__}{hint}")
    label = f"{kind} {getattr(fn, '__name__', fn)!r}"
    try:
        inspect.signature(fn).bind(*names)
    except TypeError:
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        # (ja.soft_cap itself, not its result: the factory's own parameters)
        factory = getattr(fn, "__module__", None) == "jitattn.mods" and \
            getattr(fn, "__name__", None) == "soft_cap"
        call = "; ja.soft_cap makes a score_mod: pass its result, e.g. " \
               "score_mod=ja.soft_cap(30.0)" if factory else ""
        raise SpecError(f"{label} must accept {len(names)} positional arguments "
                        f"({', '.join(names)}); it takes ({', '.join(params)}){call}") from None
    except ValueError:
        pass  # builtins without signatures: try the call
    args = [Expr("sym", (n,), "float" if n == "score" else "int") for n in names]
    outer = current()
    _LOCAL.tracer = _Tracer(prefix=kind.split("_")[0] + "_captured", names=_tensor_names(fn))
    try:
        src = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        src = "<unknown>"
    returned = None
    try:
        with _Computed(_LOCAL.tracer.made):
            out = fn(*args)
            try:  # (under this trace's tracer: a returned 0-d tensor is captured, or refused
                out = _lift(out)  # as computed, here, not by the thread's default tracer)
            except SpecError as e:  # e.g. the mod returned None
                returned = e
    except SpecError as e:
        raise SpecError(f"{label} (defined at {src}{_offending_line(e)}): {e}") from None
    except RecursionError:
        raise SpecError(f"{label} (defined at {src}): expression too deeply nested") from None
    except Exception as e:  # noqa: BLE001 -- any failure inside user code is a spec problem
        raise SpecError(f"{label} (defined at {src}{_offending_line(e)}) could not be traced: "
                        f"{type(e).__name__}: {e}. Only arithmetic, comparisons, &|~ and the "
                        f"ja.* functions are supported") from e
    finally:
        _LOCAL.tracer = outer
    if returned is not None:
        none = " (None: is its return statement missing?)" if out is None else ""
        raise SpecError(f"{label} (defined at {src}) returned something other than an "
                        f"expression{none}: {returned}") from None
    depth, size = _depth_and_size(out)
    if depth > MAX_DEPTH or size > MAX_OPERATIONS:
        raise SpecError(f"{label} (defined at {src}): the expression is {depth} operations deep "
                        f"and has {size} (a shared subexpression counted once per use); at most "
                        f"{MAX_DEPTH} deep and {MAX_OPERATIONS} in all (code generation writes "
                        f"it out recursively); a sum of many terms fits as a lookup in a "
                        f"ja.tensor table")
    if kind == "mask_mod" and out.kind != "bool":
        def bools(e):  # (a product of comparisons: (a) * (b) * (c))
            return e.kind == "bool" or e.op == "*" and all(
                isinstance(y, Expr) and bools(y) for y in e.args)
        raise SpecError(f"{label}: a mask_mod must return a bool expression (a comparison), "
                        f"got {out.kind}" + ("; a product of bools is an int in Python (torch "
                                             "keeps bool): write a & b" if out.op == "*" and
                                             bools(out) else ""))
    if kind == "score_mod" and out.kind == "bool":
        raise SpecError(f"{label}: a score_mod must return a number, got a bool expression; "
                        "use mask_mod for visibility")
    return Traced(out, getattr(fn, "__name__", "mod"), src)


def params_of(*exprs: Expr) -> list:
    """Scalar and tensor parameters referenced by ``exprs``, in first-use order, one per name.

    Raises SpecError when one name is used for two different parameters."""
    found: dict = {}

    def walk(e):
        if e.op in ("scalar", "index"):
            p = e.args[0]
            prev = found.setdefault(p.name, p)
            if prev is not p and (type(prev) is not type(p) or isinstance(p, TensorParam)
                                  and (prev.signature != p.signature or prev.captured is not
                                       p.captured)):
                raise SpecError(f"parameter name {p.name!r} is used for two different "
                                f"parameters ({prev} and {p})")
        for a in e.args:
            if isinstance(a, Expr):
                walk(a)
    for e in exprs:
        walk(e)
    for p in found.values():  # (the generated struct holds a tensor's sizes as <name>_d<i>)
        for i in range(len(p.shape) if isinstance(p, TensorParam) else 0):
            if f"{p.name}_d{i}" in found:
                raise SpecError(f"parameter name '{p.name}_d{i}' is taken by the size of "
                                f"dimension {i} of tensor {p.name!r}; rename one of them")
    return list(found.values())
