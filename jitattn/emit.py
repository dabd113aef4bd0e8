"""Traced expressions (dsl.Expr) -> C++ expressions for the generated Variant struct.

Integer symbols are widened to 64 bits; Python's // and % become ja_floordiv / ja_mod (floor
semantics, 0 on division by zero); parameters are read through a struct ``p`` under prefixed
names (c_name) so that they never meet generated identifiers; tensor indices are clamped with
ja_clampi. The helpers live in templates/common/jitattn_math.h.
"""

from __future__ import annotations

import math

import numpy as np


def c_name(name: str) -> str:
    """The C++ identifier of a parameter: prefixed, so that it never meets generated code."""
    return f"jap_{name}"


def _float_literal(x: float) -> str:
    if math.isinf(x):
        return "JA_INF" if x > 0 else "(-JA_INF)"
    return repr(float(np.float32(x))) + "f"  # Python's repr always has '.' or 'e'


_CPP_FN = {"tanh": "ja_tanh", "tanh_approx": "ja_tanh_approx", "exp": "ja_exp", "log": "ja_log",
           "sigmoid": "ja_sigmoid"}


ROW_SYMBOLS = frozenset({"b", "h", "q_idx"})
_CTYPE = {"float": "float", "int": "long long", "bool": "bool"}


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
                fields.append((_CTYPE[e.kind], f"r{len(fields)}", cpp))
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
        return f"({v}LL)" if isinstance(v, int) else _float_literal(v)
    if op == "sym":  # integer symbols are widened: index arithmetic runs in 64 bits
        return "score" if a[0] == "score" else f"((long long){a[0]})"
    if op == "scalar":
        return f"p.{c_name(a[0].name)}"
    if op == "index":
        t, idx = c_name(a[0].name), a[1:]
        lin = f"ja_clampi({emit_cpp(idx[0], hoisted)}, p.{t}_d0)"
        for i in range(1, len(idx)):
            lin = (f"({lin} * (long long)p.{t}_d{i} + "
                   f"ja_clampi({emit_cpp(idx[i], hoisted)}, p.{t}_d{i}))")
        read = f"p.{t}[{lin}]"
        return {"float": f"ja_to_float({read})", "int": f"((long long){read})",
                "bool": f"({read} != 0)"}[e.kind]
    x = [emit_cpp(y, hoisted) for y in a]
    if op == "neg":
        return f"(-{x[0]})"
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
        return f"ja_pow((float){x[0]}, (float){x[1]})"
    if op == "//":
        return f"ja_floordiv({x[0]}, {x[1]})" if e.kind == "int" \
            else f"ja_floorf((float){x[0]} / (float){x[1]})"
    if op == "%":
        return f"ja_mod({x[0]}, {x[1]})" if e.kind == "int" \
            else f"ja_fmod((float){x[0]}, (float){x[1]})"
    if op in ("&", "|", "^"):
        cpp = {"&": "&&", "|": "||", "^": "!="}[op] if e.kind == "bool" else op
        return f"({x[0]} {cpp} {x[1]})"
    if op in ("+", "-", "*", "<", "<=", ">", ">=", "==", "!="):
        return f"({x[0]} {op} {x[1]})"
    raise AssertionError(f"unknown op {op}")
