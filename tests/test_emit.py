"""Integer width in the emitted C++: expressions run in 32 bits only where interval arithmetic
proves they fit (emit.narrow), so random int expressions compiled with the host C++ compiler
give Python's exact values at the corners of the symbols' ranges."""

import itertools
import math
import random
import shutil
import subprocess
import warnings

import pytest
import torch

import jitattn as ja
from jitattn import dsl, emit, env, tracing

R = emit._SYMBOL_RANGE
CORNERS = dict(b=(0, 5, R["b"][1]), h=(0, 3, R["h"][1]),
               q_idx=(R["q_idx"][0], -1, 0, 7, R["q_idx"][1]), kv_idx=(0, 5, R["kv_idx"][1]))
CONSTS = (0, 1, -1, 3, 1000, 2**20, 2**30, -(2**31), 2**31 - 1, 2**33)
LIMIT = 2**62  # expressions whose values could leave int64 are not generated


def _value(e, env, seen):
    """Python's exact value of an int (or bool) expression; records each node's magnitude."""
    op, a = e.op, e.args
    if op == "const":
        v = a[0]
    elif op == "sym":
        v = env[a[0]]
    elif op == "neg":
        v = -_value(a[0], env, seen)
    elif op == "abs":
        v = abs(_value(a[0], env, seen))
    elif op == "where":
        v = _value(a[1], env, seen) if _value(a[0], env, seen) else _value(a[2], env, seen)
    else:
        x, y = _value(a[0], env, seen), _value(a[1], env, seen)
        v = x ** y if op == "**" else {"+": x + y, "-": x - y, "*": x * y, "min": min(x, y),
                                        "max": max(x, y), ">": x > y}[op]
    seen.append(abs(int(v)))
    return v


def _random_expr(rng, syms, depth):
    if depth == 0 or rng.random() < 0.25:
        return syms[rng.choice(list(syms))] if rng.random() < 0.7 else rng.choice(CONSTS)
    kind = rng.choice(("+", "-", "*", "neg", "abs", "min", "max", "where", "**"))
    x, y = _random_expr(rng, syms, depth - 1), _random_expr(rng, syms, depth - 1)
    if kind == "neg":
        return -dsl._lift(x)
    if kind == "abs":
        return ja.abs(x)
    if kind in ("min", "max"):
        return (ja.minimum if kind == "min" else ja.maximum)(x, y)
    if kind == "where":
        return ja.where(syms["kv_idx"] > syms["q_idx"], x, y)
    if kind == "**":  # (an int power: ja_ipow, 64-bit)
        return dsl._lift(x) ** rng.choice((0, 1, 2, 3))
    return {"+": lambda: dsl._lift(x) + y, "-": lambda: dsl._lift(x) - y,
            "*": lambda: dsl._lift(x) * y}[kind]()


def _fixed(mod):
    """A traced int expression built by mod(b, h, q_idx, kv_idx)."""
    holder = []

    def mask(b, h, q_idx, kv_idx):
        holder.append(dsl._lift(mod(b, h, q_idx, kv_idx)))
        return holder[0] == holder[0]
    tracing.trace(mask, "mask_mod")
    return holder[0]


# -2**31 in 32-bit context (as a C++ literal it would be a long: ja_min(long, long) ambiguous)
FIXED = [lambda b, h, q, k: ja.minimum(k + (-2**31), k + (-2**31)),
         lambda b, h, q, k: ja.abs(k + (-2**31) + 2**30),
         lambda b, h, q, k: ja.minimum(ja.where(q > k, -2**31, 0), k + (-2**31)),
         lambda b, h, q, k: ja.maximum(q, -2**31)]


def _expressions(n, seed=0):
    """n random int expressions (as traced nodes) whose every node stays within LIMIT at every
    corner, with the symbols as the DSL traces them."""
    rng, found = random.Random(seed), []
    points = [dict(zip(CORNERS, p)) for p in itertools.product(*CORNERS.values())]
    while len(found) < n:
        holder = []

        def mod(b, h, q_idx, kv_idx):
            e = dsl._lift(_random_expr(rng, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), 4))
            holder.append(e)
            return e == e
        with warnings.catch_warnings():  # (ranges beyond int64 warn; LIMIT filters them below)
            warnings.simplefilter("ignore", dsl.IntOverflowWarning)
            tracing.trace(mod, "mask_mod")
        e = holder[0]
        if e.kind != "int":
            continue
        seen = []
        values = [_value(e, p, seen) for p in points]
        if max(seen) < LIMIT:
            found.append((e, values))
    for mod in FIXED:
        e = _fixed(mod)
        found.append((e, [_value(e, p, []) for p in points]))
    return points, found


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_random_int_expressions_are_exact_in_cpp(tmp_path):
    points, found = _expressions(300)
    lines = [f'#include "{env.templates_dir() / "common" / "jitattn_math.h"}"', "#include <cstdio>",
             "int main() {"]
    for p in points:
        sym = ", ".join(f"{k} = {v}" for k, v in p.items())
        lines.append(f"  {{ const int {sym};")
        lines += [f'    std::printf("%lld\\n", (long long){emit.emit_cpp(e)});' for e, _ in found]
        lines.append("  }")
    lines.append("}")
    src = tmp_path / "ints.cpp"
    src.write_text("\n".join(lines))
    subprocess.run(["g++", "-O1", "-std=c++17", "-fsanitize=signed-integer-overflow",
                    "-fno-sanitize-recover=all", "-o", str(tmp_path / "ints"), str(src)],
                   check=True)
    got = subprocess.run([str(tmp_path / "ints")], check=True, capture_output=True,
                         text=True).stdout.split()
    want = [str(int(values[i])) for i in range(len(points)) for _, values in found]
    bad = [(emit.emit_cpp(found[k % len(found)][0]), points[k // len(found)], w, g)
           for k, (w, g) in enumerate(zip(want, got)) if w != g]
    assert not bad, bad[:3]
    narrow = sum(emit.narrow(e) for e, _ in found)
    assert 30 < narrow < len(found) - 30  # both widths exercised


def test_int_range_of_alibi_and_of_a_square():
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    alibi = tracing.trace(lambda s, b, h, q, k: s + slopes[h] * (k - q), "score_mod").expr
    diff = alibi.args[1].args[1]
    assert emit.int_range(diff) == (-R["q_idx"][1], R["kv_idx"][1] - R["q_idx"][0])
    assert emit.narrow(diff) and all(emit.narrow(_fixed(mod)) for mod in FIXED)
    square = tracing.trace(lambda s, b, h, q, k: s + k * k, "score_mod").expr.args[1]
    assert not emit.narrow(square) and "ja_mul(((long long)kv_idx), ((long long)kv_idx))" in \
        emit.emit_cpp(square)


def test_planners_reject_requests_past_the_position_bound():
    i32 = dict(dtype=torch.int32)
    v = ja.Variant("causal", mask="causal")
    pages = 2**14  # of 2**16 tokens: 2**30 + 1 keys on one request
    with pytest.raises(ValueError, match=r"2\*\*30"):
        ja.BatchPrefill(v, page_size=2**16, device="cpu", max_num_pages=pages + 1).plan(
            torch.tensor([0, 1], **i32), torch.tensor([0, pages + 1], **i32),
            torch.arange(pages + 1, **i32), torch.tensor([1], **i32), 1, 1, 64)


def test_symbol_ranges_cover_the_lanes_past_the_end_of_a_tile():
    """The CUDA kernels run the mods on a tile's lanes beyond kv_len (up to a K/V tile) and on
    padding rows beyond q_len (up to a row tile): the proven ranges must include them."""
    from jitattn import render
    tiles = [render.tiles_for(kind, d, arch=arch, kv_fp8=fp8)
             for kind in ("prefill", "decode") for d in (32, 64, 128, 256)
             for arch in (None, "sm_90a") for fp8 in (False, True)]
    reach = max(max(t.kv_tile, t.rows_per_cta(kind)) for t, kind in
                zip(tiles, [k for k in ("prefill", "decode") for _ in range(16)]))
    assert reach <= emit.POSITION_MARGIN
    last = emit.MAX_SEQ_LEN - 1 + emit.POSITION_MARGIN
    assert R["kv_idx"][1] >= last and R["q_idx"][1] >= last


_SLOPES = ja.tensor("slopes", ("num_qo_heads",), "float32")
_SHIFT = ja.tensor("shift", ("num_qo_heads",), "float32")
# score_mods with a bias linear in kv_idx, each with its (sign, whether off / cst exist)
_LINEAR = {
    "alibi": (lambda s, b, h, q, k: s + _SLOPES[h] * (k - q), 1),
    "reversed": (lambda s, b, h, q, k: s + _SLOPES[h] * (q - k), -1),
    "negated": (lambda s, b, h, q, k: s + _SLOPES[h] * -(k - q + 7), -1),
    "constant_last": (lambda s, b, h, q, k: s + (_SLOPES[h] * (k - q) + _SHIFT[h]), 1),
    "constant_first": (lambda s, b, h, q, k: (_SHIFT[h] + (k - q + 3) * _SLOPES[h]) + s, 1),
    "unit_slope": (lambda s, b, h, q, k: s + (k - q), 1),
    "keys_only": (lambda s, b, h, q, k: s + _SLOPES[h] * k, 1),
    "int_offset_term": (lambda s, b, h, q, k: s + (k + (-q)), 1),
    "int_offset_first": (lambda s, b, h, q, k: s + (-q + k), 1),
}
_NOT_LINEAR = {
    "soft_cap": ja.soft_cap(30.0),
    "squared": lambda s, b, h, q, k: s + _SLOPES[h] * (k - q) * (k - q),
    "scaled_score": lambda s, b, h, q, k: 2 * s + _SLOPES[h] * (k - q),
    "slope_per_key": lambda s, b, h, q, k: s + _SLOPES[ja.minimum(k, 3)] * (k - q),
    "batch_in_the_offset": lambda s, b, h, q, k: s + _SLOPES[h] * (k - q + b),  # may leave int32
    "wide_offset": lambda s, b, h, q, k: s + (k - 2 * q),  # 64-bit: may leave int32
    "clipped": lambda s, b, h, q, k: s + ja.where(k - q > -8, 1.0, 0.0),
}


def test_kv_linear_finds_biases_linear_in_the_key_and_nothing_else():
    for name, (fn, sign) in _LINEAR.items():
        lin = emit.kv_linear(ja.Variant(name, mask="causal", score_mod=fn).score.expr)
        assert lin is not None and lin[1] == sign, name
    for name, fn in _NOT_LINEAR.items():
        assert emit.kv_linear(ja.Variant(name, mask="causal",
                                         score_mod=fn).score.expr) is None, name
    assert emit.kv_linear(None) is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_kv_linear_form_equals_the_score_mod_in_cpp(tmp_path):
    """The generated Variant::kv_linear coefficients, evaluated as the CUDA kernels do (the
    bias at a tile's first key from an exact int, then two fused multiply-adds per score),
    against the traced score_mod compiled from the same source, over random scores, heads,
    positions up to 2**20 and 2**29 and column offsets 0..31; within a few float32 roundings
    of the bias (an int bias converted once, as the traced form does)."""
    from jitattn import render
    rng = random.Random(5)
    blocks = []
    for i, (name, (fn, _)) in enumerate(_LINEAR.items()):
        code = render.render_variant(ja.Variant(name, mask="causal",
                                                score_mod=fn), backend="cpu", head_dim=64)
        code = code.replace("struct VariantParams", f"namespace v{i} {{\nstruct VariantParams", 1)
        code = code.replace("// RoPE angular", "}\n// RoPE angular", 1)
        code = code.replace("JA_ROPE_TABLE float kRopeInvFreq", f"static const float rope{i}", 1)
        blocks.append(code)
    cases = [(rng.uniform(-30, 30), rng.randrange(8), rng.randint(-top, top), rng.randint(0, top),
              rng.randrange(32)) for top in (1 << 20, 1 << 29) for _ in range(100)]
    cases += [(0.5, 3, q, q, c) for q in ((1 << 25) + 1, 999_999_937) for c in (0, 31)]
    body = []
    for i in range(len(_LINEAR)):
        body.append(f"  {{ v{i}::VariantParams p{{}};")
        for t in ("slopes", "shift"):
            if f"jap_{t};" in blocks[i] or f"jap_{t} " in blocks[i]:
                body.append(f"    p.jap_{t} = {t}; p.jap_{t}_d0 = 8;")
        for s, h, q, kv, c in cases:
            body.append(f"    check<v{i}::Variant>(p, {s!r}f, {h}, {q}, {kv}, {c});")
        body.append("  }")
    src = tmp_path / "linear.cpp"
    src.write_text("\n".join([
        f'#include "{env.templates_dir() / "common" / "jitattn_math.h"}"',
        "#include <cmath>", "#include <cstdio>", *blocks,
        "float slopes[8] = {0.5f, 0.25f, 0.125f, 0.0625f, -0.03125f, 0.7f, 1e-3f, 2.f};",
        "float shift[8] = {1.f, -2.f, 0.5f, 3.f, 0.f, -7.f, 11.f, 0.25f};",
        "template <typename V, typename P>",
        "void check(const P& p, float score, int h, int q, int kv, int c) {",
        "  const auto row = V::row(p, 0, h, q);",
        "  const auto lin = V::kv_linear(p, row, 0, h, q);",
        "  const float want = V::score_mod(p, row, score, 0, h, q, kv);",
        "  const int kv0 = kv - c;",
        "  const float base = std::fmaf(lin.coef, (float)(V::KV_SIGN * kv0 + lin.off), lin.cst);",
        "  const float got = std::fmaf(lin.coef, (float)(V::KV_SIGN * c), score + base);",
        "  const float tol = 4e-7f * (std::fabs(want - score) + std::fabs(score)) + 1e-6f;",
        '  std::printf("%d\\n", V::KV_LINEAR && std::fabs(got - want) <= tol);',
        "}",
        "int main() {", *body, "}"]))
    exe = tmp_path / "linear"
    subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert got == ["1"] * (len(_LINEAR) * len(cases))


def test_scaled_form_finds_soft_cap_and_nothing_else():
    """scaled_form: outer * tanh(inner * score) with constant outer > 0 and inner (soft-cap, in
    either operand order, an int cap too), which the CUDA softmax folds into its scales;
    ja_tanh's 2 log2(e) joins inner. Anything else (a runtime cap, a zero or negative outer, a
    shifted argument or result, a per-head factor, an inner that overflows float32 once
    2 log2(e) joins it, the form under a where) keeps the traced form."""
    cap = ja.scalar("cap")
    found = {
        "softcap": (ja.soft_cap(30.0), (30.0, 2 * math.log2(math.e) / 30, "ja_tanh_ex2(x)")),
        "softcap_approx": (ja.soft_cap(30.0, approx=True), (30.0, 1 / 30, "ja_tanh_approx(x)")),
        "commuted": (lambda s, b, h, q, k: ja.tanh(s / 20.0) * 20.0,
                     (20.0, 2 * math.log2(math.e) / 20, "ja_tanh_ex2(x)")),
        "unscaled": (lambda s, b, h, q, k: 2.0 * ja.tanh(s), (2.0, 2 * math.log2(math.e),
                                                             "ja_tanh_ex2(x)")),
        "int_cap": (ja.soft_cap(30), (30.0, 2 * math.log2(math.e) / 30, "ja_tanh_ex2(x)")),
        "approx_commuted": (lambda s, b, h, q, k: ja.tanh(s * 0.5, approx=True) * 4.0,
                            (4.0, 0.5, "ja_tanh_approx(x)")),
    }
    for name, (fn, want) in found.items():
        score, _ = emit.divisions_as_products(ja.Variant(name, mask="causal",
                                                         score_mod=fn).score.expr, None)
        got = emit.scaled_form(score)
        assert got is not None and got[2] == want[2], name
        assert got[0] == pytest.approx(want[0], rel=1e-7) and \
            got[1] == pytest.approx(want[1], rel=1e-6), (name, got)
    kept = {
        "runtime_cap": lambda s, b, h, q, k: cap * ja.tanh(s / cap),
        "negative_outer": lambda s, b, h, q, k: -30.0 * ja.tanh(s / 30.0),
        "shifted": lambda s, b, h, q, k: 30.0 * ja.tanh(s / 30.0 + 1.0),
        "per_head": lambda s, b, h, q, k: 30.0 * ja.tanh(s * _SLOPES[h]),
        "exp": lambda s, b, h, q, k: 30.0 * ja.exp(s / 30.0),
        "zero_outer": lambda s, b, h, q, k: 0.0 * ja.tanh(s),
        "plus_zero": lambda s, b, h, q, k: 30.0 * ja.tanh(s / 30.0) + 0.0,
        "inner_overflows_with_2log2e": lambda s, b, h, q, k: 2.0 * ja.tanh(s * 3e38),
        "under_where": lambda s, b, h, q, k: ja.where(q >= k, 30.0 * ja.tanh(s / 30.0), s),
    }
    for name, fn in kept.items():
        score, _ = emit.divisions_as_products(ja.Variant(name, mask="causal",
                                                         score_mod=fn).score.expr, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (numpy's overflow warning for the folded 3e38)
            assert emit.scaled_form(score) is None, name
    assert emit.scaled_form(None) is None


def test_scaled_form_keeps_the_traced_form_beyond_float32():
    """A cap above float32's max / log2(e) made the CUDA softmax's exponent factor inf, and a
    subnormal factor of the score flushes to 0 under fast math: both keep the traced form (a
    review found them reading the generated code)."""
    def form(variant):
        score, _ = emit.divisions_as_products(variant.score.expr, None)
        return emit.scaled_form(score)
    assert form(ja.Variant(mask="causal", score_mod=ja.soft_cap(2e38))) is not None
    assert form(ja.Variant(mask="causal", score_mod=ja.soft_cap(3e38))) is None
    assert form(ja.Variant(mask="causal", score_mod=ja.soft_cap(1e38, approx=True))) is None
    assert form(ja.Variant(mask="causal", score_mod=ja.soft_cap(1e37, approx=True))) is not None
