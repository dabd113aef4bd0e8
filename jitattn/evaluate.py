"""Torch semantics of traced expressions (dsl.Expr): what the reference computes. Floats are
float64, ints int64, tensor indices clamped into range, integer // and % by zero give 0, as in
the generated C++."""

from __future__ import annotations

import torch

from .dsl import Expr


def evaluate(e: Expr, env: dict, params: dict):
    """Evaluate ``e`` with torch. ``env`` maps symbol names to broadcastable tensors; ``params``
    maps parameter names to floats (scalars) or tensors."""
    op, a = e.op, e.args
    if op == "const":
        return a[0]
    if op == "sym":
        return env[a[0]]
    if op == "scalar":
        return float(params[a[0].name])
    if op == "index":
        t, idx = params[a[0].name], a[1:]
        lin = None
        for d, ix in enumerate(idx):
            i = torch.as_tensor(evaluate(ix, env, params)).clamp(0, t.shape[d] - 1)
            lin = i if lin is None else lin * t.shape[d] + i
        val = t.reshape(-1)[lin]
        return val.double() if e.kind == "float" else (val.long() if e.kind == "int" else val)
    x = [evaluate(y, env, params) if isinstance(y, Expr) else y for y in a]
    T = torch.as_tensor
    if op == "neg":
        return -T(x[0]).long() if e.kind == "int" else -T(x[0])
    if op == "~":
        return ~T(x[0])
    if op in ("tanh", "tanh_approx", "exp", "log", "sigmoid"):
        fn = torch.tanh if op == "tanh_approx" else getattr(torch, op)
        return fn(T(x[0], dtype=torch.float64).double())
    if op == "abs":
        return T(x[0]).long().abs() if e.kind == "int" else T(x[0]).abs()
    if op in ("min", "max"):
        f = torch.minimum if op == "min" else torch.maximum
        return f(*_promote(e, x))
    if op == "where":
        return torch.where(T(x[0]), *_promote(e, x[1:]))
    if op == "/":
        return T(x[0]).double() / T(x[1]).double()
    if op == "**":
        if e.kind == "int":  # (exact: an int base, a constant exponent >= 0)
            return torch.pow(T(x[0]).long(), int(x[1]))
        return torch.pow(T(x[0]).double(), T(x[1]).double())
    if op in ("//", "%"):
        p, q = _promote(e, x)
        if e.kind == "int":
            safe = torch.where(q == 0, torch.ones_like(q), q)
            r = (torch.div(p, safe, rounding_mode="floor") if op == "//"
                 else torch.remainder(p, safe))
            return torch.where(q == 0, torch.zeros_like(r), r)
        # (torch's float // and %, from the exact remainder: floor(p / q) floors a rounded
        # quotient, which can be the next integer up)
        return torch.div(p, q, rounding_mode="floor") if op == "//" else torch.remainder(p, q)
    if op in ("&", "|", "^"):
        return {"&": torch.bitwise_and, "|": torch.bitwise_or, "^": torch.bitwise_xor}[op](
            *(T(v) for v in x))
    if op in ("+", "-", "*"):
        p, q = _promote(e, x)
        return {"+": p + q, "-": p - q, "*": p * q}[op]
    if op in ("<", "<=", ">", ">=", "==", "!="):
        p, q = (T(v) for v in x)
        if p.is_floating_point() or q.is_floating_point():
            p, q = p.double(), q.double()
        return {"<": p < q, "<=": p <= q, ">": p > q, ">=": p >= q, "==": p == q,
                "!=": p != q}[op]
    raise AssertionError(f"unknown op {op}")


def _promote(e: Expr, xs):
    ts = [torch.as_tensor(v) for v in xs]
    if e.kind == "float":
        return [t.double() for t in ts]
    if e.kind == "int":
        return [t.long() for t in ts]
    return ts
