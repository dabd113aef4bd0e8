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


def emit_cpp(e) -> str:
    """C++ expression for ``e``; parameters are read through a struct named ``p``."""
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
        lin = f"ja_clampi({emit_cpp(idx[0])}, p.{t}_d0)"
        for i in range(1, len(idx)):
            lin = f"({lin} * (long long)p.{t}_d{i} + ja_clampi({emit_cpp(idx[i])}, p.{t}_d{i}))"
        read = f"p.{t}[{lin}]"
        return {"float": f"ja_to_float({read})", "int": f"((long long){read})",
                "bool": f"({read} != 0)"}[e.kind]
    x = [emit_cpp(y) for y in a]
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
