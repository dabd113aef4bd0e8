"""The expression language of ``score_mod`` / ``mask_mod``: symbols, :class:`Expr` nodes and
the ``ja.*`` functions (tracing.py runs a mod on the symbols; params.py declares runtime
parameters).

The functions have FlexAttention's signatures, ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)``. They are called once with symbolic arguments; operator
overloading records what they compute as a tree of :class:`Expr`. The tree has two readers:
:func:`emit_cpp` (a C++ expression for the CUDA and CPU templates) and ``evaluate.evaluate``
(torch ops, used by ``reference.py``).

Each node has a kind: ``"float"`` (computed in float32 by the kernels), ``"int"`` (exact as
Python's within int64; emitted in 32 bits where emit.int_range proves the values fit) or
``"bool"``. The torch functions and tensor methods FlexAttention's mods use (torch.where,
torch.tanh, .abs(), .clamp(), b.new_ones(()) as in torch's and_masks, ...) trace to the same
nodes as the ``ja.*`` functions (torch_forms.py).

Python floats become compile-time constants; runtime parameters (``ja.scalar``, ``ja.tensor``,
a torch tensor captured by closure) are declared in params.py.
"""

from __future__ import annotations

import math
import operator
import warnings

import numpy as np
import torch

from .emit import FLOAT32_TINY, emit_cpp, int_range


class SpecError(ValueError):
    """A variant cannot be compiled: unsupported Python, bad parameter or bad option."""


SYMBOLS = ("score", "b", "h", "q_idx", "kv_idx")


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
    def __rshift__(self, o): return torch_forms.shift(self, o, right=True)
    def __lshift__(self, o): return torch_forms.shift(self, o, right=False)

    # -- torch's tensor methods that FlexAttention's mods call (torch_forms.py) --------------
    def abs(self): return abs_(self)
    def exp(self): return exp(self)
    def log(self): return log(self)
    def sigmoid(self): return sigmoid(self)
    def tanh(self): return tanh(self)
    def clamp(self, min=None, max=None): return torch_forms.clamp(self, min, max)  # noqa: A002
    clip = clamp
    def clamp_min(self, min): return torch_forms.clamp(self, min, None)  # noqa: A002
    def clamp_max(self, max): return torch_forms.clamp(self, None, max)  # noqa: A002
    def float(self): return torch_forms.to_kind(self, "float", "float()")
    def bool(self): return torch_forms.to_kind(self, "bool", "bool()")
    def long(self): return torch_forms.to_kind(self, "int", "long()")
    def int(self): return torch_forms.to_int32(self)
    def to(self, *args, **kwargs): return torch_forms.to(self, *args, **kwargs)
    def new_ones(self, size=(), *, dtype=None, **kwargs):
        return torch_forms.filled(self, size, 1, dtype)
    def new_zeros(self, size=(), *, dtype=None, **kwargs):
        return torch_forms.filled(self, size, 0, dtype)
    def new_full(self, size, fill_value, *, dtype=None, **kwargs):
        return torch_forms.filled(self, size, fill_value, dtype)
    def logical_and(self, o): return torch_forms.logical("&", self, o)
    def logical_or(self, o): return torch_forms.logical("|", self, o)
    def logical_xor(self, o): return torch_forms.logical("^", self, o)
    def logical_not(self): return ~torch_forms.to_kind(self, "bool", "logical_not")

    def __getattr__(self, name):  # torch's other tensor methods: .eq(), .mul(), .neg(), ...
        fn = torch_forms.METHODS.get(name)
        if fn is None:
            root = {"sqrt": " (x ** 0.5 traces)", "rsqrt": " (x ** -0.5 traces)"}.get(name, "")
            raise AttributeError(f"a traced value has no method {name!r}{root}; those that "
                                 f"trace are {sorted(set(torch_forms.METHODS) | _OWN_METHODS)}")

        def method(*args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except TypeError as e:  # (alpha=, rounding_mode=: the form's own message)
                raise SpecError(f".{name}() with arguments the DSL does not take: {e}") from None
        return method

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

    def __str__(self):  # (str(kv_idx) == "3" traced as a constant: repr's text)
        raise SpecError("a traced value cannot be turned into a string (str(), format(), an "
                        "f-string, len() of one); compare the values themselves "
                        "(kv_idx == 3)")

    def __format__(self, spec):
        return self.__str__()

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
        fn = torch_forms.TORCH_FUNCTIONS.get(func)
        if fn is None:
            root = {"sqrt": "; x ** 0.5 traces", "rsqrt": "; x ** -0.5 traces"}.get(name, "")
            raise SpecError(f"torch function {name} cannot be traced{root}; the torch functions "
                            f"that trace are {sorted(torch_forms.TORCH_NAMES)}, with Python's "
                            f"operators and the ja.* functions (ja.where, ja.tanh, ...)")
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


_OWN_METHODS = {n for n, f in vars(Expr).items() if callable(f) and not n.startswith("_")}


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
            raise SpecError(f"constant {x!r} in a variant expression: expected a number (a NaN "
                            f"score makes its row's output and lse NaN)")
        if math.isfinite(x) and abs(x) > float(np.finfo(np.float32).max):
            raise SpecError(f"constant {x!r} does not fit in float32 (the kernels' float type)")
        if x != 0 and np.float32(x) == 0:  # (1e-50 became 0: a division by it, inf)
            raise SpecError(f"constant {x!r} rounds to 0 in float32 (the kernels' float type, "
                            f"whose smallest positive value is about 1.4e-45)")
        held = float(np.float32(x))
        if abs(held) < FLOAT32_TINY and held != x:  # (a subnormal: fewer significant bits)
            warnings.warn(f"constant {x!r} is below float32's normal range (about 1.2e-38): the "
                          f"kernels compute with {held!r}, a subnormal with fewer significant "
                          f"bits", UserWarning, stacklevel=4)
        return Expr("const", (held,), "float")
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
    if op == "+" and a.kind == b.kind == "bool":  # (torch: a logical or; Python: a count)
        raise SpecError("bool + bool: torch computes a logical or, Python a count, so a mod "
                        "ported either way would differ; write a | b for the or, or "
                        "a.long() + b.long() for the count")
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


from . import torch_forms  # noqa: E402  (built on Expr and the functions above)
