"""The static check of a score_mod's non-finite values: which of +inf, -inf and NaN its
infinite constants can make the score (through the signs of what multiplies or divides them),
so that a Variant refuses a mod whose rows would come out NaN (Variant.__post_init__)."""

from __future__ import annotations

import math

from .dsl import Expr, SpecError
from .emit import FLOAT32_MAX, FLOAT32_TINY, int_range

_POS, _NEG, _NAN = "+inf", "-inf", "NaN"


def _flip(values: frozenset) -> frozenset:
    return frozenset({_POS: _NEG, _NEG: _POS}.get(v, v) for v in values)


_ANY_SIGN = frozenset({"-", "0", "+"})
_NEGATED = {"-": "+", "0": "0", "+": "-"}


_ROUNDING = 2.0 ** -22  # relative: above float32's rounding of one operation (2 ** -24)


def _float32_bounds(lo: float, hi: float) -> tuple[float, float] | None:
    """[lo, hi], a float32 result's exact bounds, widened by its rounding (operands' bounds
    hold their own, so a difference of rounded operands that cancels may be 0), with 0
    included where an end may flush to 0 (below float32's normal range), or None where it may
    overflow."""
    lo, hi = lo - _ROUNDING * abs(lo), hi + _ROUNDING * abs(hi)
    if max(abs(lo), abs(hi)) >= FLOAT32_MAX:
        return None
    if 0 < lo < FLOAT32_TINY:
        lo = 0.0
    if -FLOAT32_TINY < hi < 0:
        hi = 0.0
    return lo, hi


def _range(e: Expr) -> tuple[float, float] | None:
    """Bounds of an expression built from constants, comparisons (0 or 1) and ints of known
    range (emit.int_range) by +, -, *, /, **, negation, where(), min and max, as the kernels
    compute it in float32: each result widened by its rounding, 0 included where it may
    flush to 0, None where it may overflow or divide by 0 (and otherwise). So
    2.0 - (kv_idx > 2) * 1.0 lies in [1, 2] (never 0), while (1 + 1e-8) - 1 may be 0."""
    op, a = e.op, e.args
    if op == "const":
        c = float(a[0])
        return _float32_bounds(c, c)
    if e.kind == "bool":
        return 0.0, 1.0
    if e.kind == "int":  # (converted to float32 where it meets a float)
        r = int_range(e)
        return None if r is None else _float32_bounds(r[0], r[1])
    if op not in ("neg", "+", "-", "*", "/", "**", "where", "min", "max"):
        return None
    x = [_range(y) for y in (a[1:] if op == "where" else a)]
    if None in x:
        return None
    if op == "neg":
        return -x[0][1], -x[0][0]
    if op in ("min", "max", "where"):  # (exact: one of the operands)
        pick = {"min": min, "max": max}.get(op)
        return (pick(x[0][0], x[1][0]), pick(x[0][1], x[1][1])) if pick else \
            (min(x[0][0], x[1][0]), max(x[0][1], x[1][1]))
    (u0, u1), (w0, w1) = x
    if op in ("+", "-"):
        ends = (u0 + w0, u1 + w1) if op == "+" else (u0 - w1, u1 - w0)
        return _float32_bounds(*ends)
    if op == "/" and w0 <= 0 <= w1 or op == "**" and (u0 <= 0 or max(-w0, w1) > 1e4):
        return None  # (a power: of a positive base, by an exponent of modest size)
    try:
        ends = [u ** w if op == "**" else u * w if op == "*" else u / w
                for u in (u0, u1) for w in (w0, w1)]
    except OverflowError:
        return None
    return _float32_bounds(min(ends), max(ends))


def _signs(e: Expr) -> frozenset:
    """The signs ("-", "0", "+") a factor or divisor of an infinity can take: those of its
    range where _range bounds it (a constant's own; a bool expression's 0 and +: torch and the
    kernels multiply it as 0 / 1, so inf * (kv_idx > q_idx) is NaN where the comparison is
    false; an int's by emit.int_range: h + 1 is positive); else the score's every sign; a
    scalar parameter (a temperature) positive; exp and sigmoid 0 or positive (they underflow
    to 0 in float32: -inf * exp(score) is NaN at a score below -104); a float table read 0 or
    positive (a table of 0 / 1 times -inf is NaN where it holds 0); arithmetic, where(), min /
    max, tanh and ** by their operands' signs, a positive base's powers 0 or positive (so
    (1 - keep[kv_idx]) * -inf, HF's additive mask, can be 0 * -inf: NaN). Products and
    quotients of runtime values (parameters, the score) are taken not to flush to 0, and a
    zero as +0 (a -0 divisor would turn -inf / 0 to +inf)."""
    op, a = e.op, e.args
    r = _range(e)
    if r is not None:
        return frozenset(v for v, holds in (("-", r[0] < 0), ("0", r[0] <= 0 <= r[1]),
                                            ("+", r[1] > 0)) if holds)
    if e.kind in ("int", "bool") or op == "sym":
        return _ANY_SIGN
    if op == "scalar":
        return frozenset({"+"})
    if op in ("exp", "sigmoid"):
        return frozenset({"0", "+"})
    if op == "index":
        return frozenset({"0", "+"})
    x = [_signs(y) if isinstance(y, Expr) else _ANY_SIGN for y in a]
    if op == "**":  # (a positive base's powers are positive or flush to 0; 0's are 0 or inf)
        return frozenset({"0", "+"}) if x[0] <= {"0", "+"} else _ANY_SIGN
    if op in ("where", "min", "max"):
        return frozenset().union(*x[1 if op == "where" else 0:])
    if op in ("neg", "tanh", "tanh_approx"):
        return frozenset(_NEGATED[v] for v in x[0]) if op == "neg" else x[0]
    if op == "abs":
        return frozenset("0" if v == "0" else "+" for v in x[0])
    if op in ("*", "/"):
        if op == "/" and "0" in x[1]:
            return _ANY_SIGN
        return frozenset("0" if "0" in (u, w) else "+" if u == w else "-"
                         for u in x[0] for w in x[1])
    if op in ("+", "-"):
        y = x[1] if op == "+" else frozenset(_NEGATED[v] for v in x[1])
        for side in ("+", "-"):  # (both of one sign or 0: that sign, 0 where both can be)
            if x[0] <= {side, "0"} and y <= {side, "0"}:
                return frozenset({side} if side in x[0] | y else ()) | (
                    {"0"} if "0" in x[0] and "0" in y else frozenset())
        return _ANY_SIGN
    return _ANY_SIGN


def _nonfinite(e: Expr, memo: dict, constants: set) -> frozenset:
    """The non-finite values ("+inf", "-inf", "NaN") float expression ``e`` can take through its
    infinite constants (each added to ``constants`` as Python shows it: "inf", "-inf"), its
    other leaves (score, symbols, parameters, table reads) taken as finite, a factor or
    divisor of an infinity signed as _signs says, and a division by a constant 0 as any of
    them. So -inf stays -inf through where, +, positive factors, min and max; inf - inf, inf * 0
    and inf * (a comparison) are NaN. Int and bool expressions take none (a comparison with an
    infinity decides as in torch)."""
    if id(e) in memo:
        return memo[id(e)]
    op, a = e.op, e.args
    if e.kind != "float" or op in ("sym", "scalar", "index"):
        out = frozenset()
    elif op == "const":
        out = frozenset({_POS if a[0] > 0 else _NEG} if math.isinf(a[0]) else ())
        if out:
            constants.add(repr(a[0]))
    else:
        x = [_nonfinite(y, memo, constants) if isinstance(y, Expr) else frozenset() for y in a]
        nan = frozenset({_NAN}) & frozenset().union(*x)
        if op == "neg":
            out = _flip(x[0])
        elif op == "abs":
            out = frozenset({_POS} if x[0] - nan else ()) | nan
        elif op in ("+", "-"):
            y = x[1] if op == "+" else _flip(x[1])
            opposed = _POS in x[0] and _NEG in y or _NEG in x[0] and _POS in y
            out = x[0] | y | frozenset({_NAN} if opposed else ())
        elif op in ("*", "/") and x[0] and x[1]:  # (inf * inf: either sign; inf / inf: NaN)
            out = x[0] | x[1] | {_POS, _NEG} if op == "*" else x[0] | {_NAN}
        elif op in ("*", "/") and (x[0] or x[1] and op == "*"):
            inf, other = (x[0], a[1]) if x[0] else (x[1], a[0])
            signs = _signs(other)  # (inf / 0 is inf: the zero is +0)
            out = (inf if "+" in signs or "0" in signs and op == "/" else frozenset()) | (
                _flip(inf) if "-" in signs else frozenset()) | (
                {_NAN} if "0" in signs and op == "*" else frozenset())
        elif op in ("/", "//", "%") and a[1].op == "const" and float(a[1].args[0]) == 0:
            constants.add(repr(float(a[1].args[0])))  # (x / 0: +-inf, 0 / 0 and x % 0 NaN)
            out = frozenset({_POS, _NEG, _NAN})
        elif op == "where":
            out = x[1] | x[2]
        elif op in ("min", "max"):  # (min: +inf only where both are; max: -inf likewise)
            both, either = (_POS, _NEG) if op == "min" else (_NEG, _POS)
            out = frozenset({both} if both in x[0] and both in x[1] else ()) | nan | (
                {either} & (x[0] | x[1]))
        elif op in ("exp", "log"):  # (exp(-inf) is 0, log(-inf) NaN)
            out = ({_POS} & x[0]) | nan | ({_NAN} if op == "log" and _NEG in x[0] else set())
        elif op in ("tanh", "tanh_approx", "sigmoid", "/"):  # ("/": finite / inf is 0)
            out = nan
        else:  # (**, float // and %)
            out = frozenset({_POS, _NEG, _NAN} if any(x) else ())
    memo[id(e)] = out
    return out


def refuse_nonfinite(score, reduction: str) -> None:
    """Raises SpecError where a traced score_mod's (tracing.Traced) infinite constants can make
    its score NaN, or +inf under a softmax (_nonfinite): the row's output and lse are NaN then
    (a sigmoid weighs a +inf score 1). -inf hides a key."""
    constants: set = set()
    values = _nonfinite(score.expr, {}, constants)
    made = " or ".join(v for v in (_POS, _NAN) if v in values and (
        v == _NAN or reduction == "softmax"))
    if made:
        raise SpecError(f"score_mod {score.fn_name!r} (defined at {score.source}): its "
                        f"constant{'s' * (len(constants) > 1)} {' and '.join(sorted(constants))} "
                        f"can make the score {made}, which makes the row's output and lse NaN; "
                        f"expected finite constants (no division by 0), and -inf only where it "
                        f"hides a key (torch.where(cond, score, -inf), not -inf * cond: "
                        f"-inf * 0 is NaN)")
