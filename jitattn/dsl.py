"""The expression language of ``score_mod`` / ``mask_mod``: symbols, parameters, :class:`Expr`
nodes and the ``ja.*`` functions (tracing.py runs a mod on the symbols).

The functions have FlexAttention's signatures, ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)``. They are called once with symbolic arguments; operator
overloading records what they compute as a tree of :class:`Expr`. The tree has two readers:
:func:`emit_cpp` (a C++ expression for the CUDA and CPU templates) and ``evaluate.evaluate``
(torch ops, used by ``reference.py``).

Each node has a kind: ``"float"`` (computed in float32 by the kernels), ``"int"`` (exact as
Python's within int64; emitted in 32 bits where emit.int_range proves the values fit) or
``"bool"``. The torch functions and tensor methods FlexAttention's mods use (torch.where,
torch.tanh, .abs(), .clamp(), b.new_ones(()) as in torch's and_masks, ...) trace to the same
nodes as the ``ja.*`` functions (TORCH_FUNCTIONS).

Python floats become compile-time constants; :func:`scalar` and :func:`tensor` are runtime
parameters; a torch tensor captured by closure and indexed by symbols becomes a runtime
tensor parameter (FlexAttention style), bound at call time, its values never in the cache key.
Tensor indices are clamped into range in every backend, so a kernel never reads out of bounds
(a dimension of size 0 is rejected when binding, except where a size it is declared over is 0:
then nothing is computed, and the kernels get a one-element stand-in).
"""

from __future__ import annotations

import math
import operator
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import dtypes
from .emit import emit_cpp, int_range


class SpecError(ValueError):
    """A variant cannot be compiled: unsupported Python, bad parameter or bad option."""


SYMBOLS = ("score", "b", "h", "q_idx", "kv_idx")
SHAPE_SYMBOLS = ("batch_size", "num_qo_heads", "num_kv_heads", "qo_len", "kv_len")
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,47}")  # (fullmatch: "$" takes a final newline)
# names taken by the keywords of attention() and the wrappers' run(); generated C++ identifiers
# are prefixed (c_name)
_RESERVED = set(SYMBOLS) | {"q", "k", "v", "out", "lse", "sm_scale", "return_lse", "qo_indptr",
                            "kv_indptr", "variant", "mask_data", "kv_cache", "k_scale", "v_scale",
                            "self"}


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _IDENT.fullmatch(name) or name in _RESERVED:
        raise SpecError(f"{what} name {name!r} must be an identifier ([A-Za-z][A-Za-z0-9_]*, "
                        f"at most 48 characters) and not one of {sorted(_RESERVED)}")


@dataclass(frozen=True)
class ScalarParam:
    """A float32 runtime scalar, passed by name at call time."""

    name: str


@dataclass(frozen=True, eq=False)
class TensorParam:
    """A runtime tensor indexed by symbols. ``shape`` holds ints or names from SHAPE_SYMBOLS.

    ``captured`` is the torch tensor when the parameter came from a closure; it is bound
    automatically at call time and never enters the cache key.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    captured: torch.Tensor | None = None
    label: str | None = None  # a captured tensor's Python name, for messages (not the key)
    scalar_of: torch.Tensor | None = None  # the 0-d tensor ``captured`` is a 1-element view of

    @property
    def display(self) -> str:
        return f"{self.label} ({self.name})" if self.label else self.name

    @property
    def signature(self) -> str:
        """Name, dtype and shape: what makes two declarations the same parameter."""
        return f"{self.name}:{dtypes.tag(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def code_signature(self) -> str:
        """What generated code depends on: name, dtype and rank (sizes are runtime arguments)."""
        return f"{self.name}:{dtypes.tag(self.dtype)}:rank{len(self.shape)}"

    def __getitem__(self, idx) -> "Expr":
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != len(self.shape):
            hint = " (index every dimension at once: t[h, kv_idx], not t[h][kv_idx])" \
                if len(idx) < len(self.shape) else ""
            raise SpecError(f"tensor {self.display!r} has {len(self.shape)} dimensions "
                            f"{self.shape} but was indexed with {len(idx)} indices{hint}")
        nodes = []
        for i, ix in enumerate(idx):
            node = _lift(ix)
            if node.kind != "int":
                raise SpecError(f"tensor {self.display!r} dimension {i} is indexed by a "
                                f"{node.kind} expression ({emit_cpp(node)}); indices must be "
                                f"integer expressions of b, h, q_idx, kv_idx and int constants")
            nodes.append(node)
        tag = dtypes.tag(self.dtype)
        kind = "float" if dtypes.is_float_tag(tag) else ("bool" if tag == "bool" else "int")
        return Expr("index", (self, *nodes), kind)


def scalar(name: str) -> "Expr":
    """A runtime float32 scalar, e.g. ``cap = ja.scalar("cap")``; passed as ``cap=50.0``."""
    _check_name(name, "scalar")
    return Expr("scalar", (ScalarParam(name),), "float")


def _shape_entry(name: str, s):
    """A ja.tensor shape entry: a symbol of SHAPE_SYMBOLS, or a positive int (numpy's too; not
    a bool, which was taken as a size of 1)."""
    if isinstance(s, str):
        if s in SHAPE_SYMBOLS:
            return s
    elif not isinstance(s, (bool, np.bool_)):
        try:
            if operator.index(s) > 0:
                return operator.index(s)
        except TypeError:
            pass
    raise SpecError(f"tensor {name!r}: shape entry {s!r} must be a positive int or one of "
                    f"{SHAPE_SYMBOLS}")


def tensor(name: str, shape, dtype="float32") -> TensorParam:
    """A runtime tensor parameter, e.g. ``ja.tensor("slopes", ("num_qo_heads",), "float32")``.

    shape: ints or symbolic sizes ``"batch_size" | "num_qo_heads" | "num_kv_heads" | "qo_len" |
    "kv_len"`` (qo_len / kv_len: the longest request of the batch). dtype: ``"float32" |
    "float16" | "bfloat16" | "int32" | "int64" | "bool"`` or the torch dtype. The tensor must be
    contiguous and on the device of q when bound.
    """
    _check_name(name, "tensor")
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if not shape:
        raise SpecError(f"tensor {name!r}: shape must have at least one dimension")
    shape = tuple(_shape_entry(name, s) for s in shape)
    if isinstance(dtype, str):
        if dtype not in dtypes.FROM_NAME:
            raise SpecError(f"tensor {name!r}: dtype {dtype!r} must be one of "
                            f"{list(dtypes.FROM_NAME)}")
        dtype = dtypes.FROM_NAME[dtype]
    elif dtype not in dtypes.TAG:
        raise SpecError(f"tensor {name!r}: dtype {dtype} is not supported")
    return TensorParam(name, shape, dtype)


class Expr:
    """A node of a traced expression: ``op`` with ``args``, of kind float / int / bool."""

    # (int_range: emit.int_range's memo; a node never changes after it is made)
    __slots__ = ("op", "args", "kind", "int_range")

    def __init__(self, op: str, args: tuple, kind: str):
        self.op, self.args, self.kind = op, args, kind

    # -- arithmetic ---------------------------------------------------------------------------
    def __add__(self, o): return _binary("+", self, o)
    def __radd__(self, o): return _binary("+", o, self)
    def __sub__(self, o): return _binary("-", self, o)
    def __rsub__(self, o): return _binary("-", o, self)
    def __mul__(self, o): return _binary("*", self, o)
    def __rmul__(self, o): return _binary("*", o, self)
    def __truediv__(self, o): return _binary("/", self, o)
    def __rtruediv__(self, o): return _binary("/", o, self)
    def __floordiv__(self, o): return _binary("//", self, o)
    def __rfloordiv__(self, o): return _binary("//", o, self)
    def __mod__(self, o): return _binary("%", self, o)
    def __rmod__(self, o): return _binary("%", o, self)
    def __pow__(self, o): return _binary("**", self, o)
    def __rpow__(self, o): return _binary("**", o, self)
    def __neg__(self): return _checked(Expr("neg", (self,), "int" if self.kind == "bool" else
                                            self.kind))
    def __pos__(self): return self
    def __abs__(self): return abs_(self)
    # -- comparisons and logic ----------------------------------------------------------------
    def __lt__(self, o): return _compare("<", self, o)
    def __le__(self, o): return _compare("<=", self, o)
    def __gt__(self, o): return _compare(">", self, o)
    def __ge__(self, o): return _compare(">=", self, o)
    def __eq__(self, o): return _compare("==", self, o)  # noqa: E704  (symbolic, not identity)
    def __ne__(self, o): return _compare("!=", self, o)
    def __and__(self, o): return _logic("&", self, o)
    def __rand__(self, o): return _logic("&", o, self)
    def __or__(self, o): return _logic("|", self, o)
    def __ror__(self, o): return _logic("|", o, self)
    def __xor__(self, o): return _logic("^", self, o)
    def __rxor__(self, o): return _logic("^", o, self)
    def __invert__(self):
        if self.kind == "float":
            raise SpecError("'~' needs a bool or int expression, got a float one")
        return Expr("~", (self,), self.kind)
    def __rshift__(self, o): return _shift(self, o, right=True)
    def __lshift__(self, o): return _shift(self, o, right=False)

    # -- torch's tensor methods that FlexAttention's mods call (TORCH_FUNCTIONS) --------------
    def abs(self): return abs_(self)
    def exp(self): return exp(self)
    def log(self): return log(self)
    def sigmoid(self): return sigmoid(self)
    def tanh(self): return tanh(self)
    def clamp(self, min=None, max=None): return _clamp(self, min, max)  # noqa: A002
    clip = clamp
    def clamp_min(self, min): return _clamp(self, min, None)  # noqa: A002
    def clamp_max(self, max): return _clamp(self, None, max)  # noqa: A002
    def float(self): return _to_kind(self, "float", "float()")
    def bool(self): return _to_kind(self, "bool", "bool()")
    def long(self): return _to_kind(self, "int", "long()")
    def int(self): return _to_int32(self)
    def to(self, *args, **kwargs): return _to(self, *args, **kwargs)
    def new_ones(self, size=(), *, dtype=None, **kwargs): return _filled(self, size, 1, dtype)
    def new_zeros(self, size=(), *, dtype=None, **kwargs): return _filled(self, size, 0, dtype)
    def new_full(self, size, fill_value, *, dtype=None, **kwargs):
        return _filled(self, size, fill_value, dtype)
    def logical_and(self, o): return _logical("&", self, o)
    def logical_or(self, o): return _logical("|", self, o)
    def logical_xor(self, o): return _logical("^", self, o)
    def logical_not(self): return ~_to_kind(self, "bool", "logical_not")

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of this kind: float32, int64 or bool."""
        return {"float": torch.float32, "int": torch.int64, "bool": torch.bool}[self.kind]

    @property
    def device(self):
        """None: a traced value lives in the kernel (torch's noop_mask passes b.device)."""
        return None

    __hash__ = None  # symbolic __eq__: not usable as a dict key

    # -- what tracing cannot follow -------------------------------------------------------------
    def __bool__(self):
        raise SpecError("data-dependent Python control flow (`if`, `and`, `or`, `not`, chained "
                        "comparisons, min()/max() of symbols) cannot be traced; use "
                        "ja.where(cond, a, b), `&`, `|`, `~`, ja.minimum / ja.maximum")

    def __float__(self):
        raise SpecError("a traced value was converted to a Python float (math.* or float()); "
                        "use the ja.* functions (ja.tanh, ja.exp, ...) instead")

    def __int__(self):
        raise SpecError("a traced value was converted to a Python int (int(), range(), or an "
                        "index into a list, tuple or numpy array); keep it symbolic: a table "
                        "indexed by symbols is a captured torch tensor (torch.tensor(values))")

    __index__ = __int__

    def __iter__(self):
        raise SpecError("a traced value cannot be iterated over")

    def __array__(self, *a, **k):
        raise SpecError("numpy functions and arrays cannot be traced; use the ja.* or torch "
                        "functions, and for a table a captured torch tensor "
                        "(torch.from_numpy(a)) indexed by symbols")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # numpy's operators reach here with a numpy scalar on the left (np.float32(2.0) * score,
        # soft_cap(np.float64(30.0))): the operator on Python numbers, which the DSL takes;
        # numpy functions (np.tanh) and numpy arrays are not traceable
        # (numpy passes a scalar as itself, or for comparisons as a 0-d array)
        op = _NUMPY_OPERATORS.get(ufunc)
        if op is None or method != "__call__" or kwargs or \
                any(isinstance(x, np.ndarray) and x.ndim for x in inputs):
            raise SpecError(f"numpy's {getattr(ufunc, '__name__', ufunc)} cannot be traced; use "
                            f"the ja.* functions, and Python numbers or numpy scalars")
        return op(*(x.item() if isinstance(x, (np.generic, np.ndarray)) else x for x in inputs))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor):
            from .tracing import current  # (tracing imports this module)
            return current().capture(args[0])[args[1]]
        name = getattr(func, "__name__", str(func))
        fn = TORCH_FUNCTIONS.get(func)
        if fn is None:
            raise SpecError(f"torch function {name} cannot be traced; the torch functions "
                            f"that trace are {sorted(_TORCH_NAMES)}, with Python's operators "
                            f"and the ja.* functions (ja.where, ja.tanh, ...)")
        try:  # (a 0-d tensor the mod reads is a runtime scalar: temperature * score)
            return fn(*(_lift(a) if _scalar_tensor(a) else a for a in args), **(kwargs or {}))
        except TypeError as e:  # (out=, alpha=, a wrong arity: the call's own message)
            raise SpecError(f"torch.{name} with arguments the DSL does not take: {e}") from None

    def __repr__(self):
        return f"Expr<{self.kind}>({emit_cpp(self)})"


_NUMPY_OPERATORS = {
    np.add: operator.add, np.subtract: operator.sub, np.multiply: operator.mul,
    np.true_divide: operator.truediv, np.floor_divide: operator.floordiv,
    np.remainder: operator.mod, np.power: operator.pow, np.less: operator.lt,
    np.less_equal: operator.le, np.greater: operator.gt, np.greater_equal: operator.ge,
    np.equal: operator.eq, np.not_equal: operator.ne, np.bitwise_and: operator.and_,
    np.bitwise_or: operator.or_, np.bitwise_xor: operator.xor}


def _scalar_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _lift(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if _scalar_tensor(x):  # a 0-d tensor the mod reads: a runtime scalar, read per call
        from .tracing import current  # (tracing imports this module)
        return current().capture_scalar(x)
    if isinstance(x, (bool, np.bool_)):
        return Expr("const", (bool(x),), "bool")
    if isinstance(x, (int, np.integer)):
        if not -(2**62) <= int(x) < 2**62:
            raise SpecError(f"integer constant {x} is out of range: the DSL takes integer "
                            f"constants of magnitude below 2**62")
        return Expr("const", (int(x),), "int")
    if isinstance(x, (float, np.floating)):
        if math.isnan(x):
            raise SpecError("NaN constant in a variant expression")
        if math.isfinite(x) and abs(x) > float(np.finfo(np.float32).max):
            raise SpecError(f"constant {x!r} does not fit in float32 (the kernels' float type)")
        if x != 0 and np.float32(x) == 0:  # (1e-50 became 0: a division by it, inf)
            raise SpecError(f"constant {x!r} rounds to 0 in float32 (the kernels' float type, "
                            f"whose smallest positive value is about 1.4e-45)")
        return Expr("const", (float(np.float32(x)),), "float")
    if isinstance(x, torch.Tensor):
        raise SpecError(f"a captured tensor of shape {tuple(x.shape)} is used whole in a variant "
                        f"expression; index it by symbols (t[h], t[b, kv_idx]): a variant "
                        f"computes one score at a time")
    if isinstance(x, np.ndarray):
        raise SpecError(f"a numpy array of shape {x.shape} cannot be read in a variant; capture "
                        f"a torch tensor (torch.from_numpy(a)) and index it by symbols")
    raise SpecError(f"cannot use {type(x).__name__} {x!r} in a variant expression; expected a "
                    f"number, a symbol, ja.scalar(...) or an indexed ja.tensor(...)")


def _num_kind(a: Expr, b: Expr) -> str:
    return "float" if "float" in (a.kind, b.kind) else "int"


class IntOverflowWarning(UserWarning):
    """An integer expression of a variant can leave int64 (it wraps there, in the kernels and
    the reference alike, where Python's ints would not)."""


def _outside_int64(e) -> bool:
    r = int_range(e)
    return r is not None and not -(2**63) <= r[0] <= r[1] < 2**63


def _checked(e: Expr) -> Expr:
    """``e``, after a warning (IntOverflowWarning) if its int range over the symbols'
    (emit.int_range) leaves int64 while its operands' stay inside (one warning per overflow,
    not one per enclosing operation)."""
    if _outside_int64(e) and not any(_outside_int64(y) for y in e.args if isinstance(y, Expr)):
        r = int_range(e)
        shown = "beyond 2**126" if max(-r[0], r[1]) > 2**126 else f"[{r[0]}, {r[1]}]"
        fix = "; a float exponent (x ** 3.0) computes it in float32" if e.op == "**" else ""
        warnings.warn(f"the integer result of '{e.op}' ranges over {shown} for q_idx, kv_idx up "
                      f"to 2**30, b and h up to 2**31 and int32 table values: beyond int64, "
                      f"where it wraps (Python's ints would not); bound the operands (kv_idx "
                      f"% n, ja.minimum(kv_idx, n)) if such values can occur{fix}",
                      IntOverflowWarning, stacklevel=4)
    return e


def _binary(op, a, b) -> Expr:
    """a op b. Kinds as Python's: / is float, and ** is int only for an int base and a
    constant int exponent >= 0. Warns (IntOverflowWarning) for an int result whose range over
    the symbols' (emit.int_range) leaves int64."""
    a, b = _lift(a), _lift(b)
    if op == "**":
        exact = a.kind != "float" and b.op == "const" and b.kind == "int" and b.args[0] >= 0
        kind = "int" if exact else "float"
    else:
        kind = "float" if op == "/" else _num_kind(a, b)
    return _checked(Expr(op, (a, b), kind))


def _compare(op, a, b) -> Expr:
    return Expr(op, (_lift(a), _lift(b)), "bool")


def _logic(op, a, b) -> Expr:
    a, b = _lift(a), _lift(b)
    if "float" in (a.kind, b.kind):
        raise SpecError(f"'{op}' needs bool or int operands; got {a.kind} and {b.kind}")
    return Expr(op, (a, b), "bool" if a.kind == b.kind == "bool" else "int")


def _float_fn(name):
    def fn(x) -> Expr:
        return Expr(name, (_lift(x),), "float")
    fn.__name__ = name
    fn.__doc__ = f"Traced elementwise {name} (float32 in the kernels)."
    return fn


exp, log, sigmoid = (_float_fn(n) for n in ("exp", "log", "sigmoid"))


def tanh(x, approx: bool = False) -> Expr:
    """Traced elementwise tanh (float32 in the kernels). The CUDA kernels compute
    1 - 2 / (1 + e^(2x)) on the special-function unit's ex2 and rcp: absolute error below 5e-7
    (tanhf's is about 1 ulp; five instructions against about 19). approx=True uses the hardware
    tanh instead (PTX tanh.approx.f32, relative error about 2^-11). The CPU backend and the
    reference run tanhf either way."""
    if not isinstance(approx, (bool, np.bool_)):  # ("False" would count as true)
        raise SpecError(f"tanh: approx={approx!r}: expected True or False")
    return Expr("tanh_approx" if approx else "tanh", (_lift(x),), "float")


def abs_(x) -> Expr:
    """Traced absolute value; keeps int or float kind."""
    x = _lift(x)
    return _checked(Expr("abs", (x,), "int" if x.kind == "bool" else x.kind))


def minimum(a, b) -> Expr:
    """Traced elementwise minimum (int if both are int, else float)."""
    a, b = _lift(a), _lift(b)
    return Expr("min", (a, b), _num_kind(a, b))


def maximum(a, b) -> Expr:
    """Traced elementwise maximum (int if both are int, else float)."""
    a, b = _lift(a), _lift(b)
    return Expr("max", (a, b), _num_kind(a, b))


def where(cond, a, b) -> Expr:
    """Traced ``cond ? a : b``; the replacement for data-dependent ``if``."""
    cond, a, b = _lift(cond), _lift(a), _lift(b)
    if cond.kind != "bool":
        raise SpecError(f"ja.where: condition must be a bool expression, got {cond.kind}")
    kind = "bool" if a.kind == b.kind == "bool" else _num_kind(a, b)
    return Expr("where", (cond, a, b), kind)


# -- torch's functions and tensor methods, as FlexAttention's mods call them -----------------

def _shift(x, n, right: bool) -> Expr:
    """x >> n, x << n for an int x and a constant int 0 <= n < 63: Python's (floor) semantics,
    as x // 2**n and x * 2**n."""
    x, n = _lift(x), _lift(n)
    if x.kind == "float" or n.op != "const" or n.kind != "int" or not 0 <= n.args[0] < 63:
        raise SpecError(f"'{'>>' if right else '<<'}' takes an int expression and a constant "
                        f"int shift 0 .. 62 (x // 2**n, x * 2**n); got {emit_cpp(x)} ({x.kind}) "
                        f"and {emit_cpp(n)}")
    return _binary("//" if right else "*", x, 2 ** n.args[0])


def _clamp(x, lo, hi) -> Expr:
    """torch.clamp: min(max(x, lo), hi); either bound may be None."""
    if lo is None and hi is None:
        raise SpecError("clamp needs min= or max=")
    x = _lift(x)
    x = x if lo is None else maximum(x, lo)
    return x if hi is None else minimum(x, hi)


def _to_kind(x, kind: str, what: str) -> Expr:
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


def _to_int32(x) -> Expr:
    """.int(): an int expression whose every value fits int32 (emit.int_range), else refused
    (torch would wrap it; the DSL keeps int64)."""
    x = _to_kind(x, "int", "int()")
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


def _to(x, *args, dtype=None, **kwargs) -> Expr:
    """Tensor.to(dtype) or .to(other) (other's dtype, or a traced value's kind): the dtype's
    kind (_kind_of); devices and copy= flags are ignored."""
    for a in args:
        if isinstance(a, Expr):
            return _to_kind(x, a.kind, "to()")
        if isinstance(a, (torch.dtype, torch.Tensor)):
            dtype = a if isinstance(a, torch.dtype) else a.dtype
    kind = _kind_of(dtype, "to()")
    if kind is None:
        return _lift(x)
    return _to_int32(x) if kind == "int32" else _to_kind(x, kind, "to()")


def _filled(like, size, value, dtype) -> Expr:
    """Tensor.new_ones / new_zeros / new_full and torch.*_like of a traced value: the constant
    ``value`` as a 0-d value of dtype's kind (like's kind without one)."""
    if isinstance(size, int) or tuple(size) not in ((), (1,)):
        raise SpecError(f"a traced value is one element: new_ones / new_zeros / new_full take "
                        f"size () (got {size!r})")
    kind = _kind_of(dtype, "new_ones / new_zeros / new_full / *_like") or _lift(like).kind
    return _to_kind(_lift(value), "int" if kind == "int32" else kind,
                    f"a fill value of {value!r} for an {kind} value")


def _logical(op, a, b) -> Expr:
    return _logic(op, _to_kind(a, "bool", "logical"), _to_kind(b, "bool", "logical"))


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
    return lambda a, b: op(_lift(a), b)


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
    torch.clamp: lambda x, min=None, max=None: _clamp(x, min, max),  # noqa: A002
    torch.clip: lambda x, min=None, max=None: _clamp(x, min, max),  # noqa: A002
    torch.clamp_min: lambda x, min: _clamp(x, min, None),  # noqa: A002
    torch.clamp_max: lambda x, max: _clamp(x, None, max),  # noqa: A002
    torch.logical_and: lambda a, b: _logical("&", a, b),
    torch.logical_or: lambda a, b: _logical("|", a, b),
    torch.logical_xor: lambda a, b: _logical("^", a, b),
    torch.logical_not: lambda x: ~_to_kind(x, "bool", "logical_not"),
    torch.zeros_like: lambda x, *, dtype=None, **k: _filled(x, (), 0, dtype),
    torch.ones_like: lambda x, *, dtype=None, **k: _filled(x, (), 1, dtype),
    torch.full_like: lambda x, fill_value, *, dtype=None, **k: _filled(x, (), fill_value, dtype),
    # a 0-d tensor captured by closure on the left of an operator (temperature * score)
    _T.add: _binary_op(operator.add), _T.sub: _binary_op(operator.sub),
    _T.mul: _binary_op(operator.mul), _T.div: _binary_op(operator.truediv),
    _T.floor_divide: _binary_op(operator.floordiv), _T.remainder: _binary_op(operator.mod),
    _T.pow: _binary_op(operator.pow), _T.lt: _binary_op(operator.lt),
    _T.le: _binary_op(operator.le), _T.gt: _binary_op(operator.gt),
    _T.ge: _binary_op(operator.ge), _T.eq: _binary_op(operator.eq),
    _T.ne: _binary_op(operator.ne), _T.__floordiv__: _binary_op(operator.floordiv),
    _T.__pow__: _binary_op(operator.pow), _T.__and__: _binary_op(operator.and_),
    _T.__or__: _binary_op(operator.or_), _T.__xor__: _binary_op(operator.xor),
}
_TORCH_NAMES = {f.__name__ for f in TORCH_FUNCTIONS if getattr(torch, f.__name__, None) is f}
