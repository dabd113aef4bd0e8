"""Traced expressions (dsl.Expr) -> C++ expressions for the generated Variant struct.

Integer arithmetic runs in 32 bits where interval arithmetic proves every intermediate value
fits (int_range), else in 64 bits through wrapping helpers (ja_add, ja_mul...: the value beyond
int64 wraps, as torch's int64 in the reference; dsl warns where a range can leave int64, and
Python's ints would not wrap). Python's // and % become ja_floordiv / ja_mod (floor semantics, 0
on division by zero); parameters are read through a struct ``p`` under prefixed names (c_name)
so that they never meet generated identifiers; tensor indices are clamped with ja_clampi. The
helpers live in templates/common/jitattn_math.h.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def c_name(name: str) -> str:
    """The C++ identifier of a parameter: prefixed, so that it never meets generated code."""
    return f"jap_{name}"


def float_literal(x: float) -> str:
    if math.isinf(x):
        return "JA_INF" if x > 0 else "(-JA_INF)"
    return repr(float(np.float32(x))) + "f"  # Python's repr always has '.' or 'e'


_CPP_FN = {"tanh": "ja_tanh", "tanh_approx": "ja_tanh_approx", "exp": "ja_exp", "log": "ja_log",
           "sigmoid": "ja_sigmoid"}


ROW_SYMBOLS = frozenset({"b", "h", "q_idx"})
_CTYPE = {"float": "float", "int": "long long", "bool": "bool"}
_WRAPPING = {"+": "ja_add", "-": "ja_sub", "*": "ja_mul"}  # 64-bit ops that wrap (math.h)

# The generated code's contract with the planners, which reject longer requests: q_len and
# kv_len below MAX_SEQ_LEN. The CUDA kernels also evaluate the mods on a tile's lanes past the
# end (keys up to one K/V tile beyond kv_len, padding rows up to one row tile beyond q_len;
# their results are discarded), so the symbols' ranges carry POSITION_MARGIN more: kv_idx in
# [0, 2**30), q_idx (kv_len - q_len + the query's index) in (-MAX_SEQ_LEN, 2**30); b and h are
# non-negative ints.
POSITION_MARGIN = 1 << 10  # > the largest K/V tile (192 keys) and row tile (128 rows)
MAX_SEQ_LEN = (1 << 30) - POSITION_MARGIN
_SYMBOL_RANGE = {"q_idx": (1 - MAX_SEQ_LEN, (1 << 30) - 1), "kv_idx": (0, (1 << 30) - 1),
                 "b": (0, (1 << 31) - 1), "h": (0, (1 << 31) - 1)}
_I32 = (-(1 << 31), (1 << 31) - 1)
_NARROW_OPS = {"const", "sym", "index", "neg", "+", "-", "*", "abs", "min", "max", "where"}


_UNKNOWN = object()


def int_range(e) -> tuple[int, int] | None:
    """(lowest, highest) value of an int expression by interval arithmetic over the symbols'
    ranges (_SYMBOL_RANGE), int constants, int32 tensor reads, // and % by constants and **;
    None where not known (other ops, int64 tensors, non-int expressions). Kept on the node:
    tracing asks it of every new int node, and without the memo a subexpression reused in a
    loop was walked once per use (22 rounds of x = where(x > 7, x - 7, x + 1): 30 s)."""
    if getattr(e, "kind", None) != "int":
        return None
    r = getattr(e, "int_range", _UNKNOWN)
    if r is _UNKNOWN:
        r = e.int_range = _int_range(e)
    return r


def _int_range(e) -> tuple[int, int] | None:
    op, a = e.op, e.args
    if op == "const":
        return (a[0], a[0])
    if op == "sym":
        return _SYMBOL_RANGE[a[0]]
    if op == "index":
        return _I32 if a[0].dtype == torch.int32 else None
    if op in ("neg", "abs"):
        r = int_range(a[0])
        if r is None:
            return None
        if op == "neg":
            return (-r[1], -r[0])
        return (max(r[0], -r[1], 0), max(-r[0], r[1]))
    if op in ("//", "%") and a[1].op == "const":  # (Python's floor semantics; by 0: 0)
        c = a[1].args[0]
        if c == 0:
            return (0, 0)
        if op == "%":
            return (0, c - 1) if c > 0 else (c + 1, 0)
        r = int_range(a[0])
        return None if r is None else (min(r[0] // c, r[1] // c), max(r[0] // c, r[1] // c))
    if op == "**":  # an int base, a constant exponent >= 0 (dsl._binary)
        r, n = int_range(a[0]), a[1].args[0]
        if r is None:
            return None
        if n > 128 and max(-r[0], r[1]) > 1:  # (beyond int64 either way: no bigint of n bits)
            return (-(2**127), 2**127)
        ends = [r[0] ** n, r[1] ** n] + ([0] if r[0] <= 0 <= r[1] else [])
        return (min(ends), max(ends))
    if op in ("+", "-", "*", "min", "max", "where"):
        x, y = int_range(a[-2]), int_range(a[-1])  # (where: the two values)
        if x is None or y is None:
            return None
        if op in ("min", "max", "where"):
            if op == "where":
                return (min(x[0], y[0]), max(x[1], y[1]))
            f = min if op == "min" else max
            return (f(x[0], y[0]), f(x[1], y[1]))
        if op == "+":
            return (x[0] + y[0], x[1] + y[1])
        if op == "-":
            return (x[0] - y[1], x[1] - y[0])
        products = [u * w for u in x for w in y]
        return (min(products), max(products))
    return None


def narrow(e) -> bool:
    """Whether an int expression is emitted in 32 bits: its own value and every int operand
    below it provably fit in int32 (a 64-bit I2F per score costs the GPU's conversion unit,
    and 64-bit adds take two instructions each: ALiBi's kv_idx - q_idx, session 7)."""
    if getattr(e, "kind", None) != "int" or e.op not in _NARROW_OPS:
        return False
    r = int_range(e)
    if r is None or r[0] < _I32[0] or r[1] > _I32[1]:
        return False
    if e.op in ("const", "sym", "index"):
        return True
    return all(narrow(y) for y in (e.args[1:] if e.op == "where" else e.args))


def _symbols(e, memo: dict) -> frozenset:
    """The symbols (score, b, h, q_idx, kv_idx) an expression reads."""
    if id(e) not in memo:
        memo[id(e)] = frozenset({e.args[0]}) if e.op == "sym" else frozenset().union(
            *(_symbols(y, memo) for y in e.args if hasattr(y, "op")))
    return memo[id(e)]


# where a value only feeds arithmetic (the score), a division may round once more; below a
# comparison, a where's condition, // or % (and in a mask) one rounding can flip a decision
_DECIDING = {"<", "<=", ">", ">=", "==", "!=", "//", "%"}


def _exact_reciprocal(v: float) -> bool:
    """Whether 1 / v is exact in float32 (v a power of two, its reciprocal a normal float)."""
    m, _ = math.frexp(v)
    r = float(np.float32(1.0 / v))
    return abs(m) == 0.5 and r != 0 and math.isfinite(r) and abs(r) >= 2.0 ** -126


def divisions_as_products(score, mask) -> tuple:
    """The traced score and mask expressions (either may be None) with divisions whose divisor
    reads neither score nor kv_idx rewritten as ``x * (1 / y)``: a constant divisor's
    reciprocal folded (rounded to float32), any other left as a subexpression that
    hoist_row_invariants then computes once per query row. Each (row, key) element then costs
    a multiply instead of a division (on the GPU a reciprocal on the special-function unit,
    which the softmax's exp2 and tanh also use, plus a correction and a slow-path test).
    The result differs from x / y by at most about 1.5 float32 roundings, so the rewrite is
    made only where the value feeds arithmetic: not in the mask, nor below a comparison, a
    where's condition, // or % (where one rounding could decide whether a key is seen),
    except for power-of-two constants, whose reciprocal is exact. A zero or non-finite
    constant divisor is left as a division."""
    memo, sym_memo = {}, {}

    def rewrite(e, smooth):
        if not hasattr(e, "op"):
            return e
        if (id(e), smooth) in memo:
            return memo[id(e), smooth]
        deciding = e.op in _DECIDING
        args = tuple(rewrite(y, smooth and not deciding and not (e.op == "where" and i == 0))
                     for i, y in enumerate(e.args))
        out = e if all(x is y for x, y in zip(args, e.args)) else type(e)(e.op, args, e.kind)
        if e.op == "/" and _symbols(args[1], sym_memo) <= ROW_SYMBOLS:
            num, den = args
            if den.op == "const":
                v = float(den.args[0])
                r = float(np.float32(1.0 / v)) if v != 0 and math.isfinite(v) else 0.0
                if r != 0 and math.isfinite(r) and (smooth or _exact_reciprocal(v)):
                    out = type(e)("*", (num, type(e)("const", (r,), "float")), "float")
            elif smooth:
                one = type(e)("const", (1.0,), "float")
                out = type(e)("*", (num, type(e)("/", (one, den), "float")), "float")
        memo[id(e), smooth] = out
        return out
    return (None if score is None else rewrite(score, True),
            None if mask is None else rewrite(mask, False))


def _is_sym(e, name: str) -> bool:
    return hasattr(e, "op") and e.op == "sym" and e.args[0] == name


def kv_linear(score):
    """The score_mod as ``score + coef * (sign * kv_idx + off) [+ cst]`` with coef, off and cst
    row-invariant (they read only b, h and q_idx), off an int, ``sign * kv_idx + off`` an int
    expression that provably fits in 32 bits (ALiBi: coef = slopes[h], sign 1, off = -q_idx):
    returns (coef, sign, off, cst) as expressions (off and cst may be None), or None for any
    other form.

    The CUDA kernels then evaluate the bias per tile and row as coef * (sign * kv0 + off) + cst
    at the thread's first key kv0 (an exact int before one conversion), and per score add only
    coef * sign * c for the key's constant column offset c: one fused multiply-add per score
    on the raw product (the bias and sm_scale join the softmax's per-row terms; two at head_dim
    256 and in sigmoid variants) instead of the traced form's index arithmetic, int-to-float
    conversion, multiply and add (ncu, session 9: ALiBi's score_mod was 284 of its 739
    instructions per tile and warp)."""
    def row_invariant(e):
        return hasattr(e, "op") and _symbols(e, {}) <= ROW_SYMBOLS

    def linear(e):  # (sign, off) with e == sign * kv_idx + off, off an int expression or None
        if _is_sym(e, "kv_idx"):
            return 1, None
        if e.op == "neg":
            inner = linear(e.args[0])
            if inner is None:
                return None
            return -inner[0], None if inner[1] is None else type(e)("neg", (inner[1],), "int")
        if e.op in ("+", "-"):
            x, y = e.args
            if row_invariant(y) and y.kind == "int" and (lx := linear(x)) is not None:
                o = y if e.op == "+" else type(e)("neg", (y,), "int")
                return lx[0], o if lx[1] is None else type(e)("+", (lx[1], o), "int")
            if row_invariant(x) and x.kind == "int" and (ly := linear(y)) is not None:
                sign = ly[0] if e.op == "+" else -ly[0]
                o = ly[1] if ly[1] is None or e.op == "+" else type(e)("neg", (ly[1],), "int")
                return sign, x if o is None else type(e)("+", (x, o), "int")
        return None

    if score is None or score.op != "+":
        return None
    bias = score.args[1] if _is_sym(score.args[0], "score") else \
        score.args[0] if _is_sym(score.args[1], "score") else None
    if bias is None or "score" in _symbols(bias, {}):
        return None
    cst = None  # (a float bias only: an int one is exact in the traced form, and is kept whole
    #             in off, so that the kernels convert one exact int, not two that cancel)
    if bias.kind == "float" and bias.op == "+":
        if row_invariant(bias.args[1]) and not row_invariant(bias.args[0]):
            bias, cst = bias.args
        elif row_invariant(bias.args[0]) and not row_invariant(bias.args[1]):
            cst, bias = bias.args
    coef, term = None, bias
    if bias.op == "*":
        x, y = bias.args
        coef, term = (x, y) if row_invariant(x) else (y, x) if row_invariant(y) else (None, None)
        if term is None:
            return None
    if term.kind != "int" or not narrow(term):
        return None
    lin = linear(term)
    if lin is None or (lin[1] is not None and not narrow(lin[1])):
        return None
    one = type(score)("const", (1.0,), "float")
    return (coef if coef is not None else one), lin[0], lin[1], cst


_LOG2E = math.log2(math.e)
_TWO_LOG2E = 2.0 * _LOG2E  # ja_tanh_ex2 takes 2 log2(e) x
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def scaled_form(score):
    """The score_mod as ``outer * F(inner * score)`` with F tanh or the hardware tanh, outer a
    positive and inner a finite constant (soft-cap: cap * tanh(score / cap)): returns (outer,
    the factor of the score in F's argument as F's C++ call takes it, that call on ``x``), or
    None. For ja.tanh the call is ja_tanh_ex2, whose argument carries ja_tanh's 2 log2(e):
    inner times it, rounded once to float32 (a product that overflows or underflows to 0
    keeps the traced form).

    The CUDA softmax then folds the factor into its score scale and outer into its exponent's
    scale (a positive outer keeps the row maxima), and per score computes F alone: exact
    soft-cap five instructions instead of eight, the hardware tanh two instead of four. F's
    argument rounds three times in either form (about an ulp apart; the CPU backend keeps the
    traced form)."""
    def const(e):  # (a float or int constant: soft_cap(30) traces an int cap)
        return hasattr(e, "op") and e.op == "const" and e.kind in ("float", "int") and \
            not isinstance(e.args[0], bool) and math.isfinite(float(e.args[0]))

    if score is None or score.op != "*":
        return None
    outer, fn = score.args if const(score.args[0]) else score.args[::-1]
    if not const(outer) or float(outer.args[0]) <= 0 or fn.op not in ("tanh", "tanh_approx"):
        return None
    arg = fn.args[0]
    if _is_sym(arg, "score"):
        inner = 1.0
    elif arg.op == "*" and (_is_sym(arg.args[0], "score") or _is_sym(arg.args[1], "score")):
        inner_e = arg.args[1] if _is_sym(arg.args[0], "score") else arg.args[0]
        if not const(inner_e):
            return None
        inner = float(inner_e.args[0])
    else:
        return None
    call = "ja_tanh_approx(x)"
    if fn.op == "tanh":
        wide = inner * _TWO_LOG2E
        folded = float(np.float32(wide)) if abs(wide) <= FLOAT32_MAX else math.inf
        if not math.isfinite(folded) or (folded == 0) != (inner == 0):
            return None
        inner, call = folded, "ja_tanh_ex2(x)"
    # the softmax's exponent factor is outer x log2(e) in float32, and a subnormal factor in
    # F's argument would flush to 0 under the kernels' fast math: both keep the traced form
    if float(outer.args[0]) * _LOG2E > FLOAT32_MAX or 0 < abs(inner) < FLOAT32_TINY:
        return None
    return float(outer.args[0]), inner, call


def hoist_row_invariants(roots) -> tuple[list, dict]:
    """Loop-invariant code motion for the mods: the largest subexpressions that read only b, h
    and q_idx (the same for every key of a query row, e.g. ALiBi's slopes[h]) are computed once
    per row into a generated ``Row`` struct instead of once per (row, key) pair.

    roots: the traced expressions. Returns (fields, hoisted): fields as (ctype, name, C++
    expression over p, b, h, q_idx), equal expressions sharing one field; hoisted maps id(node)
    to ``row.<name>`` for emit_cpp."""
    memo, fields, by_cpp, hoisted = {}, [], {}, {}

    def visit(e):
        if e.op not in ("const", "sym", "scalar") and _symbols(e, memo) <= ROW_SYMBOLS:
            cpp = emit_cpp(e)
            if cpp not in by_cpp:
                by_cpp[cpp] = f"row.r{len(fields)}"
                fields.append(("int" if narrow(e) else _CTYPE[e.kind], f"r{len(fields)}", cpp))
            hoisted[id(e)] = by_cpp[cpp]
            return
        for y in e.args:
            if hasattr(y, "op"):
                visit(y)
    for root in roots:
        visit(root)
    return fields, hoisted


def emit_cpp(e, hoisted: dict | None = None) -> str:
    """C++ expression for ``e``; parameters are read through a struct named ``p``, hoisted
    subexpressions (hoist_row_invariants) through ``row``."""
    if hoisted and id(e) in hoisted:
        return hoisted[id(e)]
    op, a = e.op, e.args
    if op == "const":
        v = a[0]
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):  # (-2**31 as a literal would be a long: ambiguous overloads)
            if narrow(e):
                return "(-2147483647 - 1)" if v == -(1 << 31) else f"({v})"
            return f"({v}LL)"
        return float_literal(v)
    if op == "sym":  # int symbols (32-bit in the kernels) are widened unless narrow
        return a[0] if a[0] == "score" or narrow(e) else f"((long long){a[0]})"
    if op == "scalar":
        return f"p.{c_name(a[0].name)}"
    if op == "index":
        t, idx = c_name(a[0].name), a[1:]
        lin = f"ja_clampi({emit_cpp(idx[0], hoisted)}, p.{t}_d0)"
        for i in range(1, len(idx)):
            lin = (f"({lin} * (long long)p.{t}_d{i} + "
                   f"ja_clampi({emit_cpp(idx[i], hoisted)}, p.{t}_d{i}))")
        read = f"p.{t}[{lin}]"
        int_read = f"((int){read})" if narrow(e) else f"((long long){read})"
        return {"float": f"ja_to_float({read})", "int": int_read, "bool": f"({read} != 0)"}[e.kind]
    x = [emit_cpp(y, hoisted) for y in a]
    if e.kind == "int" and not narrow(e):  # 64-bit arithmetic: 32-bit and bool operands
        x = [(f"({y.args[0]}LL)" if y.op == "const" and y.kind == "int" else f"((long long){c})")
             if (narrow(y) or y.kind == "bool") and (i > 0 or op != "where") else c
             for i, (c, y) in enumerate(zip(x, a))]
    wide = e.kind == "int" and not narrow(e)  # (64-bit: wrapping helpers, see jitattn_math.h)
    if op == "neg":
        return f"ja_neg({x[0]})" if wide else f"(-{x[0]})"
    if op == "~":
        return f"(!{x[0]})" if e.kind == "bool" else f"(~{x[0]})"
    if op in _CPP_FN:
        return f"{_CPP_FN[op]}((float){x[0]})"
    if op == "abs":
        return f"ja_abs({x[0]})"
    if op in ("min", "max"):
        cast = "(float)" if e.kind == "float" else ""
        return f"ja_{op}({cast}{x[0]}, {cast}{x[1]})"
    if op == "where":
        cast = "(float)" if e.kind == "float" else ""
        return f"({x[0]} ? {cast}{x[1]} : {cast}{x[2]})"
    if op == "/":
        return f"((float){x[0]} / (float){x[1]})"
    if op == "**":
        return f"ja_ipow({x[0]}, {x[1]})" if e.kind == "int" \
            else f"ja_pow((float){x[0]}, (float){x[1]})"
    if op == "//":
        return f"ja_floordiv({x[0]}, {x[1]})" if e.kind == "int" \
            else f"ja_floordivf((float){x[0]}, (float){x[1]})"
    if op == "%":
        return f"ja_mod({x[0]}, {x[1]})" if e.kind == "int" \
            else f"ja_fmod((float){x[0]}, (float){x[1]})"
    if op in ("&", "|", "^"):
        cpp = {"&": "&&", "|": "||", "^": "!="}[op] if e.kind == "bool" else op
        return f"({x[0]} {cpp} {x[1]})"
    if op in ("+", "-", "*") and wide:
        return f"{_WRAPPING[op]}({x[0]}, {x[1]})"
    if op in ("+", "-", "*", "<", "<=", ">", ">=", "==", "!="):
        return f"({x[0]} {op} {x[1]})"
    raise AssertionError(f"unknown op {op}")
