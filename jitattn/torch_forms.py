"""FlexAttention's torch forms in a traced mod: the torch functions and tensor methods its mods
call (torch.where, torch.tanh, .abs(), .clamp(), .float(), b.new_ones(()) inside torch's
and_masks, ...), each as the dsl node the ja.* function makes. dsl.Expr's methods and its
__torch_function__ (TORCH_FUNCTIONS) call here; what is not here is refused, naming what is.
"""

from __future__ import annotations

import operator

import torch

from .dsl import (Expr, SpecError, _binary, _compare, _lift, _logic, abs_, exp, log, maximum,
                  minimum, sigmoid, tanh, where)
from .emit import emit_cpp, int_range


def shift(x, n, right: bool) -> Expr:
    """x >> n, x << n for an int x and a constant int 0 <= n < 63: Python's (floor) semantics,
    as x // 2**n and x * 2**n."""
    x, n = _lift(x), _lift(n)
    if x.kind == "float" or n.op != "const" or n.kind != "int" or not 0 <= n.args[0] < 63:
        raise SpecError(f"'{'>>' if right else '<<'}' takes an int expression and a constant "
                        f"int shift 0 .. 62 (x // 2**n, x * 2**n); got {emit_cpp(x)} ({x.kind}) "
                        f"and {emit_cpp(n)}")
    return _binary("//" if right else "*", x, 2 ** n.args[0])


def clamp(x, lo, hi) -> Expr:
    """torch.clamp: min(max(x, lo), hi); either bound may be None."""
    if lo is None and hi is None:
        raise SpecError("clamp needs min= or max=")
    x = _lift(x)
    x = x if lo is None else maximum(x, lo)
    return x if hi is None else minimum(x, hi)


def to_kind(x, kind: str, what: str) -> Expr:
    """x as a float, int or bool expression, as torch converts: bool -> 0 / 1, a number -> bool
    by != 0. A float cannot become an int (torch truncates; the DSL has no truncation)."""
    x = _lift(x)
    if x.kind == kind:
        return x
    if kind == "bool":
        return _compare("!=", x, 0)
    if x.kind == "bool":
        return where(x, 1.0 if kind == "float" else 1, 0.0 if kind == "float" else 0)
    if kind == "float":
        return _binary("+", x, 0.0)
    raise SpecError(f"{what}: a float expression cannot be converted to an int in a variant "
                    f"(keep indices integer: q_idx, kv_idx and int arithmetic on them)")


def to_int32(x) -> Expr:
    """.int(): an int expression whose every value fits int32 (emit.int_range), else refused
    (torch would wrap it; the DSL keeps int64)."""
    x = to_kind(x, "int", "int()")
    r = int_range(x)
    if r is None or not -(2**31) <= r[0] <= r[1] < 2**31:
        raise SpecError("int(): the expression can leave int32, where torch's conversion would "
                        "wrap; ints are exact within int64 here: drop the .int() (or use "
                        ".long())")
    return x


_DTYPE_KIND = {torch.float32: "float", torch.float64: "float", torch.int64: "int",
               torch.bool: "bool"}


def _kind_of(dtype, what: str) -> str | None:
    if dtype is None:
        return None
    if dtype is torch.int32:
        return "int32"
    if dtype not in _DTYPE_KIND:
        raise SpecError(f"{what}: dtype {dtype} cannot be traced; a variant computes in float32, "
                        f"int64 and bool (torch.float32, torch.int64, torch.bool; float64 is "
                        f"float32 here)")
    return _DTYPE_KIND[dtype]


def to(x, *args, dtype=None, **kwargs) -> Expr:
    """Tensor.to(dtype) or .to(other) (other's dtype, or a traced value's kind): the dtype's
    kind (_kind_of); devices and copy= flags are ignored."""
    for a in args:
        if isinstance(a, Expr):
            return to_kind(x, a.kind, "to()")
        if isinstance(a, (torch.dtype, torch.Tensor)):
            dtype = a if isinstance(a, torch.dtype) else a.dtype
    kind = _kind_of(dtype, "to()")
    if kind is None:
        return _lift(x)
    return to_int32(x) if kind == "int32" else to_kind(x, kind, "to()")


def filled(like, size, value, dtype) -> Expr:
    """Tensor.new_ones / new_zeros / new_full and torch.*_like of a traced value: the constant
    ``value`` as a 0-d value of dtype's kind (like's kind without one)."""
    if isinstance(size, int) or tuple(size) not in ((), (1,)):
        raise SpecError(f"a traced value is one element: new_ones / new_zeros / new_full take "
                        f"size () (got {size!r})")
    kind = _kind_of(dtype, "new_ones / new_zeros / new_full / *_like") or _lift(like).kind
    return to_kind(_lift(value), "int" if kind == "int32" else kind,
                    f"a fill value of {value!r} for an {kind} value")


def logical(op, a, b) -> Expr:
    return _logic(op, to_kind(a, "bool", "logical"), to_kind(b, "bool", "logical"))


def _where(condition, input=None, other=None) -> Expr:  # noqa: A002 (torch's names)
    if input is None or other is None:
        raise SpecError("torch.where(condition) (the indices form) cannot be traced; use "
                        "torch.where(condition, a, b)")
    return where(condition, input, other)


def _two(fn):
    """torch.min / torch.max of two values (their elementwise form only)."""
    def pair(input, other=None, *rest, **kwargs):  # noqa: A002 (torch's names)
        if not isinstance(other, Expr) or rest or kwargs:
            raise SpecError(f"torch.{fn.__name__[:3]} over a dimension cannot be traced; the "
                            f"elementwise torch.{fn.__name__[:3]}(a, b) of two traced values "
                            f"can, and ja.{fn.__name__}(a, number)")
        return fn(input, other)
    return pair


def _binary_op(op):
    """torch's functional / method form of an operator, named as torch names it (its errors
    name it: s.add(x, alpha=2) is 'add() got an unexpected keyword argument')."""
    def form(input, other):  # noqa: A002 (torch's names)
        return op(_lift(input), other)
    form.__name__ = form.__qualname__ = _TORCH_NAME.get(op.__name__, op.__name__)
    return form


_TORCH_NAME = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder"}


def _div(input, other, *, rounding_mode=None):  # noqa: A002 (torch's names)
    """torch.div / Tensor.div: true division, or floor division with rounding_mode="floor"."""
    if rounding_mode is None:
        return operator.truediv(_lift(input), other)
    if rounding_mode == "floor":
        return operator.floordiv(_lift(input), other)
    raise SpecError(f"div(..., rounding_mode={rounding_mode!r}) cannot be traced; "
                    f"rounding_mode='floor' (or //) can, and a truncating division of ints "
                    f"is torch.where((a < 0) != (b < 0), -(abs(a) // abs(b)), a // b)")


_div.__name__ = _div.__qualname__ = "div"  # (torch's name, in Python's errors about its call)


_T = torch.Tensor
# torch function or tensor method -> what it traces to (Expr.__torch_function__; the methods a
# traced value is called with are Expr's own, above)
TORCH_FUNCTIONS = {
    torch.where: _where, torch.tanh: tanh, _T.tanh: tanh, torch.exp: exp, _T.exp: exp,
    torch.log: log, _T.log: log, torch.sigmoid: sigmoid, _T.sigmoid: sigmoid,
    torch.abs: abs_, torch.absolute: abs_, _T.abs: abs_,
    torch.square: lambda x: _binary("*", x, x),
    torch.minimum: minimum, torch.maximum: maximum, torch.min: _two(minimum),
    torch.max: _two(maximum),
    torch.clamp: lambda x, min=None, max=None: clamp(x, min, max),  # noqa: A002
    torch.clip: lambda x, min=None, max=None: clamp(x, min, max),  # noqa: A002
    torch.clamp_min: lambda x, min: clamp(x, min, None),  # noqa: A002
    torch.clamp_max: lambda x, max: clamp(x, None, max),  # noqa: A002
    torch.logical_and: lambda a, b: logical("&", a, b),
    torch.logical_or: lambda a, b: logical("|", a, b),
    torch.logical_xor: lambda a, b: logical("^", a, b),
    torch.logical_not: lambda x: ~to_kind(x, "bool", "logical_not"),
    torch.zeros_like: lambda x, *, dtype=None, **k: filled(x, (), 0, dtype),
    torch.ones_like: lambda x, *, dtype=None, **k: filled(x, (), 1, dtype),
    torch.full_like: lambda x, fill_value, *, dtype=None, **k: filled(x, (), fill_value, dtype),
    # a 0-d tensor captured by closure on the left of an operator (temperature * score)
    _T.add: _binary_op(operator.add), _T.sub: _binary_op(operator.sub),
    _T.mul: _binary_op(operator.mul), _T.div: _div,
    _T.floor_divide: _binary_op(operator.floordiv), _T.remainder: _binary_op(operator.mod),
    _T.pow: _binary_op(operator.pow), _T.lt: _binary_op(operator.lt),
    _T.le: _binary_op(operator.le), _T.gt: _binary_op(operator.gt),
    _T.ge: _binary_op(operator.ge), _T.eq: _binary_op(operator.eq),
    _T.ne: _binary_op(operator.ne), _T.__floordiv__: _binary_op(operator.floordiv),
    _T.__pow__: _binary_op(operator.pow), _T.__and__: _binary_op(operator.and_),
    _T.__or__: _binary_op(operator.or_), _T.__xor__: _binary_op(operator.xor),
}
# torch's functional forms of the operators (torch.eq(q_idx, kv_idx), torch.add(score, bias))
TORCH_FUNCTIONS.update({getattr(torch, name): _binary_op(op) for name, op in (
    ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
    ("floor_divide", operator.floordiv),
    ("remainder", operator.mod), ("pow", operator.pow), ("lt", operator.lt),
    ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge), ("eq", operator.eq),
    ("ne", operator.ne))})
TORCH_FUNCTIONS[torch.neg] = TORCH_FUNCTIONS[_T.neg] = operator.neg
TORCH_FUNCTIONS[torch.div] = _div
TORCH_NAMES = {f.__name__ for f in TORCH_FUNCTIONS  # (what the refusal lists)
               if getattr(torch, f.__name__, None) is f}
# tensor methods a traced value takes through Expr.__getattr__ (q_idx.eq(kv_idx), s.mul(2))
METHODS = {name: fn for name, fn in ((f.__name__, fn) for f, fn in TORCH_FUNCTIONS.items())
           if getattr(_T, name, None) in TORCH_FUNCTIONS and not name.startswith("__")}
