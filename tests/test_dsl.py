"""The DSL: tracing, C++ emission, torch evaluation, and the errors for unsupported Python."""

import math
import re
import threading
import warnings

import numpy as np
import pytest
import torch

import jitattn as ja
from jitattn import dsl, params, reference, tracing
from jitattn.evaluate import evaluate
from jitattn.dsl import SpecError

from helpers import wrapping_mask_case


def trace_score(fn):
    return tracing.trace(fn, "score_mod")


def test_softcap_emits_tanh_with_constant():
    t = trace_score(ja.soft_cap(50.0))
    assert t.cpp == "(50.0f * ja_tanh((float)((float)score / (float)50.0f)))"
    assert t.expr.kind == "float"


def test_scalar_and_tensor_params_are_collected_once():
    cap = ja.scalar("cap")
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")

    def mod(score, b, h, q_idx, kv_idx):
        return cap * ja.tanh(score / cap) + slopes[h] * (kv_idx - q_idx)
    t = trace_score(mod)
    names = [p.name for p in tracing.params_of(t.expr)]
    assert names == ["cap", "slopes"]
    assert "ja_clampi(h, p.jap_slopes_d0)" in t.cpp


def test_python_semantics_of_floordiv_and_mod_match_in_cpp_and_torch():
    def mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) // 3 + (q_idx - kv_idx) % 3
    t = trace_score(mod)
    assert "ja_floordiv" in t.cpp and "ja_mod" in t.cpp
    q = torch.arange(-5, 6)
    env = dict(score=torch.zeros(11, dtype=torch.float64), b=0, h=0, q_idx=q, kv_idx=0)
    got = evaluate(t.expr, env, {})
    assert got.tolist() == [float(x // 3 + x % 3) for x in range(-5, 6)]


def test_evaluate_matches_direct_python_on_floats():
    def mod(score, b, h, q_idx, kv_idx):
        return ja.where(score > 0, ja.exp(-score), ja.sigmoid(score)) * ja.maximum(
            ja.abs(q_idx - kv_idx), 1) ** 0.5 - ja.log(ja.minimum(score * score + 1.0, 4.0))
    t = trace_score(mod)
    for s, qi, ki in [(0.7, 3, 1), (-1.3, 0, 4), (2.5, 9, 9)]:
        env = dict(score=torch.tensor(s, dtype=torch.float64), b=torch.tensor(0),
                   h=torch.tensor(0), q_idx=torch.tensor(qi), kv_idx=torch.tensor(ki))
        direct = (math.exp(-s) if s > 0 else 1 / (1 + math.exp(-s))) * max(abs(qi - ki), 1) ** 0.5 \
            - math.log(min(s * s + 1.0, 4.0))
        assert float(evaluate(t.expr, env, {})) == pytest.approx(direct, rel=1e-12)


def test_captured_torch_tensor_becomes_runtime_param():
    table = torch.randn(4, 9)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, ja.minimum(ja.maximum(kv_idx - q_idx, -4), 4) + 4]
    t = trace_score(mod)
    (p,) = tracing.params_of(t.expr)
    assert p.captured is table and p.shape == (4, 9) and p.name == "score_captured0"
    assert p.display == "table (score_captured0)"  # the user's name, in messages


def test_a_non_contiguous_captured_tensor_is_refused_when_traced():
    """It used to pass the variant's construction and fail at every call."""
    column = torch.randn(8, 2)[:, 1]
    with pytest.raises(SpecError, match=r"captured tensor 'column' of shape \(8,\) has strides "
                                        r"\(2,\); .* capture t.contiguous\(\), made outside"):
        trace_score(lambda s, b, h, q, k: s + column[h])
    dense = column.contiguous()  # (made in the mod, the copy would keep its values: refused)
    (p,) = tracing.params_of(trace_score(lambda s, b, h, q, k: s + dense[h]).expr)
    assert p.captured is dense
    with pytest.raises(SpecError, match="computed while it was traced"):
        trace_score(lambda s, b, h, q, k: s + column.contiguous()[h])


def test_mask_mod_must_return_bool():
    """An int is refused; a product of two comparisons, FlexAttention's (q >= k) * (k % 2 == 0)
    (bool in torch, an int in Python), is told to write &."""
    with pytest.raises(SpecError, match=r"must return a bool expression \(a comparison\), got "
                                        r"int$"):
        tracing.trace(lambda b, h, q, k: q - k, "mask_mod")
    for fn in (lambda b, h, q, k: (q >= k) * (k % 2 == 0),
               lambda b, h, q, k: (q >= k) * (k % 2 == 0) * (k > 3)):
        with pytest.raises(SpecError, match=r"got int; a product of bools is an int in Python "
                                            r"\(torch keeps bool\): write a & b"):
            tracing.trace(fn, "mask_mod")


def test_data_dependent_if_points_to_where():
    def mod(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return -score
    with pytest.raises(SpecError, match="ja.where"):
        trace_score(mod)


def test_python_and_min_are_rejected():
    with pytest.raises(SpecError, match="ja.where"):
        tracing.trace(lambda b, h, q, k: (q >= k) and (q - k < 4), "mask_mod")
    with pytest.raises(SpecError):
        trace_score(lambda s, b, h, q, k: s + min(q, k))


def test_unknown_function_is_a_spec_error():
    with pytest.raises(SpecError, match="ja"):
        trace_score(lambda s, b, h, q, k: math.tanh(s))
    with pytest.raises(SpecError, match=r"torch function erf cannot be traced; the torch "
                                        r"functions that trace are \['abs'"):
        trace_score(lambda s, b, h, q, k: torch.erf(s))


def test_wrong_arity():
    with pytest.raises(SpecError, match="5 positional arguments"):
        trace_score(lambda s, b, h: s)
    with pytest.raises(SpecError, match="4 positional arguments"):
        tracing.trace(lambda s, b, h, q, k: True, "mask_mod")


def test_tensor_indexed_by_float_or_wrong_rank():
    t = ja.tensor("bias", (16,), "float32")
    with pytest.raises(SpecError, match="indexed by a float"):
        trace_score(lambda s, b, h, q, k: s + t[s])
    with pytest.raises(SpecError, match="1 dimensions"):
        trace_score(lambda s, b, h, q, k: s + t[h, q])


def test_bad_param_declarations():
    with pytest.raises(SpecError, match="identifier"):
        ja.scalar("1cap")
    with pytest.raises(SpecError, match="shape entry"):
        ja.tensor("x", ("heads",))
    with pytest.raises(SpecError, match="dtype"):
        ja.tensor("x", (4,), "float64")
    with pytest.raises(SpecError, match="NaN"):
        trace_score(lambda s, b, h, q, k: s + float("nan"))


def test_same_name_for_two_params_is_rejected():
    a, b2 = ja.tensor("x", (4,), "float32"), ja.tensor("x", (8,), "float32")
    with pytest.raises(SpecError, match="two different"):
        ja.Variant("clash", mask="causal", score_mod=lambda s, b, h, q, k: s + a[h] + b2[h])


def test_a_name_taken_by_a_tensor_size_is_rejected():
    """The generated struct holds tensor x's sizes as x_d0, x_d1...: a scalar x_d0 failed to
    compile (a redeclaration) instead of being named."""
    x, x_d0 = ja.tensor("x", ("num_qo_heads",)), ja.scalar("x_d0")
    with pytest.raises(SpecError, match="parameter name 'x_d0' is taken by the size of "
                                        "dimension 0 of tensor 'x'"):
        ja.Variant("taken", mask="causal", score_mod=lambda s, b, h, q, k: s + x[h] + x_d0)


def test_errors_name_the_function_and_its_arguments():
    def my_mod(score, b, h):
        return score
    with pytest.raises(SpecError, match=r"score_mod 'my_mod' .*it takes \(score, b, h\)"):
        trace_score(my_mod)

    def branchy(b, h, q_idx, kv_idx):
        near = q_idx - kv_idx
        return q_idx >= kv_idx if near > 3 else True
    line = branchy.__code__.co_firstlineno + 2  # the `if`, not the `def`
    with pytest.raises(SpecError, match=rf"mask_mod 'branchy' \(defined at .*test_dsl.py:\d+; "
                                        rf"failing line test_dsl.py:{line} `return q_idx >= kv_idx "
                                        rf"if near > 3 else True`\)"):
        tracing.trace(branchy, "mask_mod")


def test_float32_overflow_constant_is_rejected():
    with pytest.raises(SpecError, match="float32"):
        trace_score(lambda s, b, h, q, k: s * 1e300)


def test_int_expressions_are_64_bit_in_cpp_and_torch():
    def mod(score, b, h, q_idx, kv_idx):
        return score + ((q_idx + 100000) * (kv_idx + 100000)) % 7
    t = trace_score(mod)
    # the sums fit in 32 bits, their product does not: widened before the multiply
    assert "ja_mul(((long long)(q_idx + (100000))), ((long long)(kv_idx + (100000))))" in t.cpp
    env = dict(score=torch.zeros(1, dtype=torch.float64), b=0, h=0, q_idx=torch.tensor([5]),
               kv_idx=torch.tensor([9]))
    assert float(evaluate(t.expr, env, {})) == float((100005 * 100009) % 7)


def test_int_powers_are_exact_and_int_results_beyond_int64_warn_and_wrap():
    """Python's int ** int (a constant exponent >= 0) is an int: it was float32, so masks on
    kv_idx ** 2 past 4096 keys came out wrong in the kernels (and differed from the reference).
    An int result whose range over the symbols leaves int64 warns; it wraps, in the kernels as
    in the reference (C++'s signed overflow made them differ). INT64_MIN // -1 wraps too (it
    killed the process with SIGFPE); a huge exponent is no bigint computation (it hung)."""
    torch.manual_seed(3)
    q = torch.randn(1, 2, 64).half()
    k, v = torch.randn(6000, 1, 64).half(), torch.randn(6000, 1, 64).half()
    parity = ja.Variant("pow_parity", mask="none",
                        mask_mod=lambda b, h, qi, ki: (ki ** 2) % 2 == ki % 2)  # always true
    assert parity.mask_pred.expr.args[0].args[0].kind == "int"
    assert "ja_ipow(((long long)kv_idx), (2LL))" in parity.mask_pred.cpp
    torch.testing.assert_close(ja.attention(q, k, v, parity),
                               ja.attention(q, k, v, ja.Variant("none", mask="none")),
                               rtol=0, atol=0)
    fifth = ja.Variant("pow_fifth", mask="none",
                       mask_mod=lambda b, h, qi, ki: ((ki % 5000) ** 5 + (qi % 999) ** 3) % 11 < 6)
    kv = torch.arange(6000)
    env = dict(b=0, h=0, q_idx=torch.tensor([5999]), kv_idx=kv)
    want = torch.tensor([((i % 5000) ** 5 + (5999 % 999) ** 3) % 11 < 6 for i in range(6000)])
    assert torch.equal(evaluate(fifth.mask_pred.expr, env, {}), want)
    ref = ja.attention(q, k[want], v[want], ja.Variant("none", mask="none"))
    torch.testing.assert_close(ja.attention(q, k, v, fifth), ref, atol=2e-3, rtol=2e-3)
    for text, wide in ((r"'\*' ranges over \[0, 1073751486705398058212029221\]",
                        lambda b, h, qi, ki: (ki * 1000003**3) % 5 == 0),
                       (r"'\*\*' ranges over .*a float exponent \(x \*\* 3.0\)",
                        lambda b, h, qi, ki: ki ** 3 > 5),
                       (r"'\*\*' ranges over beyond 2\*\*126",
                        lambda b, h, qi, ki: (ki % 3) ** 10**11 < 1)):
        with pytest.warns(dsl.IntOverflowWarning, match=text):
            tracing.trace(wide, "mask_mod")
    big = 2**62 - 1
    with pytest.warns(dsl.IntOverflowWarning):
        wraps = ja.Variant("wraps", mask="none", score_mod=lambda s, b, h, qi, ki: s + (
            (ki * 2**40 * 2**40) % 1000 + ((ki - big - big - 2) // (h - 1)) % 7) * 0.01)
    small = q[:1, :1], k[:9, :1], v[:9, :1]
    torch.testing.assert_close(ja.attention(*small, wraps).double(),
                               reference.attention(*small, wraps), atol=2e-3, rtol=2e-3)
    bounded = tracing.trace(lambda b, h, qi, ki: (ki % 1000) ** 3 % 7 < 4, "mask_mod")
    assert bool(evaluate(bounded.expr, dict(env, kv_idx=torch.tensor([1999])), {})) == \
        (999 ** 3 % 7 < 4)
    assert trace_score(lambda s, b, h, qi, ki: s + 2 ** (ki % 4)).expr.args[1].kind == "float"


def test_int64_arithmetic_wraps_as_torch_does():
    """Beyond int64 the kernels wrap as torch's int64 in the reference: C++'s signed overflow
    was undefined (nvcc folded k * C >= 0 to true, g++ could differ from both)."""
    with pytest.warns(dsl.IntOverflowWarning):
        variant, q, k, v, kept = wrapping_mask_case("cpu")
    assert not kept.all() and kept.any()
    want = ja.attention(q, k[kept], v[kept], ja.Variant("none", mask="none"))
    torch.testing.assert_close(ja.attention(q, k, v, variant), want, rtol=0, atol=2e-3)
    torch.testing.assert_close(reference.attention(q, k, v, variant).half(), want, rtol=0,
                               atol=2e-3)


def test_alibi_positions_are_32_bit():
    """ALiBi's kv_idx - q_idx fits in int32 for every position the planners accept: no 64-bit
    subtraction or conversion per score."""
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    t = trace_score(lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx))
    assert "long long" not in t.cpp
    assert "(kv_idx - q_idx)" in t.cpp


def test_tanh_approx_is_its_own_op_and_exact_on_the_cpu():
    """approx=True changes the kernel (a different key) but not the reference's semantics."""
    exact = ja.Variant("c", mask="causal", score_mod=ja.soft_cap(20.0))
    approx = ja.Variant("c", mask="causal", score_mod=ja.soft_cap(20.0, approx=True))
    assert exact.key != approx.key and "ja_tanh_approx" in approx.score.cpp
    q, k, v = (torch.randn(9, 2, 64, dtype=torch.float16) for _ in range(3))
    torch.testing.assert_close(ja.attention(q, k, v, approx), ja.attention(q, k, v, exact))


def test_deep_expressions_are_a_spec_error():
    """Hundreds of chained additions passed tracing and then hit Python's recursion limit in
    a walk over the expression (building the Variant, rendering or the reference: a raw
    RecursionError). The depth is bounded when traced; a chain just inside the bound runs and
    matches the reference."""
    from jitattn import reference
    bias = torch.randn(64)

    def chain(n):
        def score_mod(s, b, h, q_idx, kv_idx):
            for i in range(n):
                s = s + bias[(kv_idx + i) % 64]
            return s
        return score_mod
    variant = ja.Variant("chain", mask="causal", score_mod=chain(tracing.MAX_DEPTH - 5))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 64, generator=gen).half() for n in (3, 5, 5))
    torch.testing.assert_close(ja.attention(q, k, k, variant),
                               reference.attention(q, k, k, variant).half(), atol=2e-3, rtol=2e-3)
    for n in (tracing.MAX_DEPTH + 1, 600):
        with pytest.raises(SpecError, match=f"at most {tracing.MAX_DEPTH} deep"):
            ja.Variant("chain", mask="causal", score_mod=chain(n))

    def doubled(n):  # s + s, n times: n + 1 deep, 2**(n + 1) - 1 operations written out
        def score_mod(s, b, h, q_idx, kv_idx):
            for _ in range(n):
                s = s + s
            return s
        return score_mod
    ja.Variant("doubled", mask="causal", score_mod=doubled(12))
    with pytest.raises(SpecError, match=r"15 operations deep and has 32767 .* "
                                        r"10000 in all"):
        ja.Variant("doubled", mask="causal", score_mod=doubled(14))


def test_minimum_and_maximum_carry_nan_as_torch_does():
    """ja.maximum(log(score), c): a negative score's NaN reaches the row as in torch (and the
    reference); the kernels' fmaxf had returned c."""
    torch.manual_seed(2)
    q = torch.randn(6, 2, 64).half()
    for fn in (ja.maximum, ja.minimum):
        v = ja.Variant(f"nan_{fn.__name__}", mask="none",
                       score_mod=lambda s, b, h, qi, ki, fn=fn: fn(ja.log(s), -5.0))
        got, want = ja.attention(q, q, q, v), reference.attention(q, q, q, v)
        assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()


def test_tensor_shape_entries_are_ints_or_symbols():
    """numpy ints are ints (refused, as "must be a positive int"); a bool is not a size (True
    was a dimension of 1)."""
    assert params.tensor("t", (np.int64(5), "kv_len")).shape == (5, "kv_len")
    for bad in (True, 0, 2.0, "len", None):
        with pytest.raises(SpecError, match=re.escape(f"shape entry {bad!r} must be a positive "
                                                      f"int")):
            params.tensor("t", (bad,))


def test_variants_traced_in_two_threads_capture_their_own_tensors():
    """The trace in progress was a module global: a tensor captured in one thread while the
    other's trace was current went into the other's variant, and the first thread's variant
    failed with a clash of parameter names. Events force that interleaving."""
    ta, tb, tc = torch.arange(8.0), torch.arange(8.0) * 2, torch.arange(8.0) * 3
    a_started, b_started, a_captured, b_done = (threading.Event() for _ in range(4))
    built = {}

    def mod_a(s, b, h, q, k):
        a_started.set()
        b_started.wait(10)
        x = s + ta[k]  # while thread B's trace is in progress
        a_captured.set()
        b_done.wait(10)
        return x + tc[k]

    def mod_b(s, b, h, q, k):
        b_started.set()
        a_captured.wait(10)
        return s + tb[k]

    def build_b():
        a_started.wait(10)
        built["B"] = ja.Variant("B", mask="causal", score_mod=mod_b)
        b_done.set()
    threads = [threading.Thread(target=lambda: built.update(A=ja.Variant("A", mask="causal",
                                                                         score_mod=mod_a))),
               threading.Thread(target=build_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built) == ["A", "B"]  # (a thread that raised built nothing)
    assert [id(p.captured) for p in built["A"].tensor_params] == [id(ta), id(tc)]
    assert [id(p.captured) for p in built["B"].tensor_params] == [id(tb)]


def test_a_subexpression_reused_in_a_loop_traces_in_linear_time():
    """emit.int_range, asked of every new int node while tracing, walked a shared
    subexpression once per use: 22 rounds of this loop took 30 s before the size error."""
    import time

    def bucketed(b, h, q_idx, kv_idx):
        x = kv_idx - q_idx
        for _ in range(24):  # (without the memo: over a minute, not forever)
            x = ja.where(x > 7, x - 7, x + 1)
        return x < 3
    start = time.perf_counter()
    with pytest.raises(ja.SpecError, match="operations deep"):
        ja.Variant("bucketed", mask="none", mask_mod=bucketed)
    assert time.perf_counter() - start < 5


def test_numpy_scalars_on_either_side_and_bool_flags():
    """A numpy scalar on the left of an operator (np.float32(2.0) * score, soft_cap of a numpy
    cap, np.int64(5) > kv_idx) traces as the Python number does (numpy's operator reached
    Expr.__array__ and was refused as a numpy function); numpy functions and arrays are still
    refused, and approx= must be a bool ("False" picked the hardware tanh)."""
    from jitattn import emit
    pairs = [(lambda s, b, h, q, k: np.float32(2.0) * s, lambda s, b, h, q, k: 2.0 * s),
             (ja.soft_cap(np.float64(30.0)), ja.soft_cap(30.0)),
             (lambda s, b, h, q, k: s + np.int64(3) * (k - q),
              lambda s, b, h, q, k: s + 3 * (k - q))]
    for with_numpy, plain in pairs:
        got, want = (emit.emit_cpp(ja.Variant("v", mask="causal", score_mod=f).score.expr)
                     for f in (with_numpy, plain))
        assert got == want
    mask = ja.Variant("m", mask="none", mask_mod=lambda b, h, q, k: np.int64(5) > k)
    assert emit.emit_cpp(mask.mask_pred.expr) == "(kv_idx < (5))"
    for bad, text in ((lambda s, b, h, q, k: np.tanh(s), "numpy's tanh cannot be traced"),
                      (lambda s, b, h, q, k: np.ones(3) * s, "numpy's multiply cannot be")):
        with pytest.raises(ja.SpecError, match=text):
            ja.Variant("bad", mask="causal", score_mod=bad)
    with pytest.raises(ja.SpecError, match=r"soft_cap: approx='False': expected True or False"):
        ja.soft_cap(30.0, approx="False")
    with pytest.raises(ja.SpecError, match=r"tanh: approx=0\.0: expected True or False"):
        ja.Variant("t", mask="causal", score_mod=lambda s, b, h, q, k: ja.tanh(s, approx=0.0))
    with pytest.raises(ja.SpecError, match=r"soft_cap: cap=True must be finite and > 0"):
        ja.soft_cap(True)


def _flex_eager(q, k, v, score_mod, mask_mod):
    """What FlexAttention computes for one request (qo_len == kv_len), the mods called on real
    broadcast tensors in float64: the torch semantics the traced mods must keep."""
    L, H = q.shape[0], q.shape[1]
    group = H // k.shape[1]
    kk, vv = (x.double().repeat_interleave(group, 1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) / math.sqrt(q.shape[2])
    b = torch.zeros(1, 1, 1, dtype=torch.long)
    h, qi, ki = (torch.arange(n).view(*shape) for n, shape in
                 ((H, (H, 1, 1)), (L, (1, L, 1)), (L, (1, 1, L))))
    s = score_mod(s, b, h, qi, ki) if score_mod else s
    visible = mask_mod(b, h, qi, ki).expand(s.shape) if mask_mod else torch.ones_like(s, dtype=bool)
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, -1).nan_to_num()  # (rows that see nothing: 0)
    return torch.einsum("hqk,khd->qhd", p, vv)


def test_flex_attention_mods_trace_unchanged():
    """FlexAttention's mods, as its users write them: torch functions, tensor methods, torch's
    and_masks / or_masks / noop_mask (b.new_ones(()) inside), a 0-d tensor captured by closure,
    shifts. Were refused ("torch function tanh cannot be traced", "'Expr' object has no
    attribute 'new_ones'"); each now gives what FlexAttention's eager semantics give."""
    from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 6

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < 5

    temperature, flag = torch.tensor(0.75), torch.tensor(True)
    cases = {
        "softcap": (lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0), None),
        "where": (lambda s, b, h, q, k: torch.where(q >= k, s, -float("inf")), None),
        "methods": (lambda s, b, h, q, k: s - (k - q).abs().clamp(max=6).float() * 0.1 +
                    s.sigmoid() ** 0.5 + torch.square(s) * 0.01, None),
        "minmax": (lambda s, b, h, q, k: torch.maximum(s, torch.min(s * 2, (q - k).to(
            torch.float32))) + torch.clamp(s, -0.5, 0.5) + torch.zeros_like(s), None),
        "temperature": (lambda s, b, h, q, k: temperature * s + s / temperature +
                        (temperature ** (k % 3)) * 0.1 + (k + 1).to(s) ** 2 * 1e-3, None),
        "flag": (None, lambda b, h, q, k: (flag & (q >= k)) | (flag ^ (k < 3))),
        "and_masks": (None, and_masks(causal, window)),
        "or_masks": (None, or_masks(prefix, window)),
        "noop": (None, noop_mask),
        "blocks": (None, lambda b, h, q, k: ((q >> 3) == (k >> 3)) | (k << 1 < q)),
        "logical": (None, lambda b, h, q, k: torch.logical_or(
            torch.logical_and(q >= k, k % 2 == 0), torch.logical_not(k > 3))),
        # the operators' functional and method forms
        "functional": (lambda s, b, h, q, k: torch.add(torch.mul(s, 0.5), torch.neg(torch.sub(
            k, q).abs().float()).mul(0.01)), lambda b, h, q, k: torch.ge(q, k) | torch.eq(k, 0)),
        "method_forms": (lambda s, b, h, q, k: s.mul(0.5).sub(k.remainder(3).float().neg()),
                         lambda b, h, q, k: q.ge(k).logical_or(k.floor_divide(4).eq(0))),
    }
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(27, n, 64, generator=gen).half() for n in (4, 2, 2))
    for name, (score_mod, mask_mod) in cases.items():
        variant = ja.Variant(name, mask="none", score_mod=score_mod, mask_mod=mask_mod)
        want = _flex_eager(q, k, v, score_mod, mask_mod)
        assert (ja.attention(q, k, v, variant).double() - want).abs().max() < 4e-3, name
    temperature.fill_(1.5)  # read per call, as other captured tensors
    variant = ja.Variant("t", mask="none", score_mod=cases["temperature"][0])
    want = _flex_eager(q, k, v, cases["temperature"][0], None)
    assert (ja.attention(q, k, v, variant).double() - want).abs().max() < 4e-3


def test_torch_forms_that_do_not_trace_say_what_does():
    table, temperature = torch.ones(4, 8), torch.tensor(0.5)
    for fn, text in (
            (lambda s, b, h, q, k: torch.max(s, 1), r"torch.max over a dimension"),
            (lambda s, b, h, q, k: s.to(torch.float16), r"to\(\): dtype torch.float16"),
            (lambda s, b, h, q, k: s.long(), r"float expression cannot be converted to an int"),
            (lambda s, b, h, q, k: s + (k * k * 4).int(), r"can leave int32"),
            (lambda s, b, h, q, k: s + (k >> q), r"constant int shift"),
            (lambda s, b, h, q, k: torch.where(s > 0), r"indices form"),
            (lambda s, b, h, q, k: torch.tanh(s, out=s), r"torch.tanh with arguments"),
            (lambda s, b, h, q, k: s * 1e-50, r"constant 1e-50 rounds to 0 in float32"),
            (lambda s, b, h, q, k: s + table[h][k],
             r"tensor 'table \(score_captured0\)' has 2 dimensions .* t\[h, kv_idx\]"),
            (lambda s, b, h, q, k: s * table, r"captured tensor of shape \(4, 8\) is used whole"),
            (lambda s, b, h, q, k: s + [1.0, 2.0][h], r"index into a list"),
            (lambda s, b, h, q, k: s + np.ones(4)[h], r"torch.from_numpy"),
            # computed from a captured 0-d tensor while tracing: its value would never change
            (lambda s, b, h, q, k: s * (1 / temperature), r"0-d tensor \(2.0\) that the mod "
                                                            r"computed while it was traced"),
            (lambda s, b, h, q, k: torch.sqrt(s), r"torch function sqrt cannot be traced; "
                                                   r"x \*\* 0.5 traces"),
            (lambda s, b, h, q, k: s + q.item(), r"a traced value has no method 'item'; those "
                                                 r"that trace are \['abs', 'add', "),
            # a literal negative index where the size is only known per call (torch wraps)
            (lambda s, b, h, q, k: s + ja.tensor("x", ("kv_len",))[-1], r"dimension 0 \(size "
                                                                        r"'kv_len'\) is indexed "
                                                                        r"by the constant -1"),
            # torch's bool + bool is a logical or, Python's a count
            (lambda s, b, h, q, k: s + ((k > 4) + (k > 9)) * 1.0, r"bool \+ bool: torch "
                                                                  r"computes a logical or"),
            # a table computed from a captured one while tracing: its values would be frozen
            (lambda s, b, h, q, k: s + (table * 4.0)[h, k], r"a tensor of shape \(4, 8\) that "
                                                           r"the mod computed while it was "
                                                           r"traced"),
            (lambda s, b, h, q, k: s + (table * 4.0).view(8, 4)[k, h], r"a tensor of shape "
                                                                      r"\(8, 4\) that the mod "
                                                                      r"computed")):
        with pytest.raises(SpecError, match=text):
            trace_score(fn)
    with pytest.raises(ValueError, match=r"sm_scale=tensor\(0.1250\).*t.item\(\)"):
        ja.attention(*(torch.randn(3, 2, 64).half() for _ in range(3)), ja.Variant("p"),
                     sm_scale=torch.tensor(0.125))


def test_infinite_constants_that_make_a_score_nan_are_refused():
    """A +inf constant in a score_mod (score + inf, torch.where(c, score, inf)) was accepted and
    its rows came out NaN; so were -inf constants made +inf or NaN (a negative factor, * 0,
    inf - inf, a comparison or int as a factor: -inf * (k > q) is NaN where it is false, as in
    torch; the score, a difference or a table read as a factor: HF's additive mask (1 - keep)
    * -inf), exp, sigmoid and powers (they underflow to 0: 2 ** -(h + 1) at h >= 149), a
    product or quotient of constants that float32 flushes to 0, a difference that cancels in
    float32 or overflows, and a division (/, //, %) by a constant 0; int factors count by
    their range (h + 1 is positive), and factors of constants, comparisons and ints by their
    float32 bounds (2 - (k > 2) is never 0). -inf that hides keys (also through a runtime
    divisor, a nonzero where() or a comparison as divisor, or negated twice), bounds
    (clamp(max=inf)), comparisons and a sigmoid's +inf (a weight of 1) stay; a NaN constant
    names itself and what is expected."""
    inf, temperature, keep = float("inf"), torch.tensor(0.5), torch.tensor([1.0, 0.0, 1.0])
    masked = 1.0 - keep
    for fn, text in (
            (lambda s, b, h, q, k: s + inf, r"constant inf can make the score \+inf"),
            (lambda s, b, h, q, k: torch.where(k <= q, s, inf), r"constant inf can make the "
                                                                r"score \+inf"),
            (lambda s, b, h, q, k: torch.where(k <= q, s, -inf) * -2.0, r"constant -inf can "
                                                                        r"make the score \+inf"),
            (lambda s, b, h, q, k: torch.where(k <= q, s, -inf) * 0.0, r"constant -inf can "
                                                                       r"make the score NaN"),
            (lambda s, b, h, q, k: torch.where(k <= q, s, -inf) + torch.where(k > 2, s, inf),
             r"constants -inf and inf can make the score \+inf or NaN"),
            (lambda s, b, h, q, k: s - inf * (k > q), r"constant inf can make the score NaN"),
            (lambda s, b, h, q, k: s + -inf * torch.where(k > q, 1.0, 0.0),
             r"constant -inf can make the score NaN"),
            (lambda s, b, h, q, k: s + inf * (q - k), r"constant inf can make the score \+inf "
                                                      r"or NaN"),
            (lambda s, b, h, q, k: s / 0.0, r"constant 0.0 can make the score \+inf or NaN"),
            (lambda s, b, h, q, k: s + (1.0 - keep[k]) * -inf, r"constant -inf can make the "
                                                               r"score \+inf or NaN"),
            (lambda s, b, h, q, k: s * -inf, r"constant -inf can make the score \+inf or NaN"),
            (lambda s, b, h, q, k: s + masked[k % 3] * -inf, r"constant -inf can make the "
                                                             r"score NaN"),
            (lambda s, b, h, q, k: s + k // 0.0, r"constant 0.0 can make the score \+inf or "
                                                 r"NaN"),
            (lambda s, b, h, q, k: s - inf * torch.exp(s), r"constant inf can make the score "
                                                           r"NaN"),
            (lambda s, b, h, q, k: s - inf * torch.sigmoid(s), r"constant inf can make the "
                                                               r"score NaN"),
            (lambda s, b, h, q, k: s - inf * (((k > q) + 1.0) * 1e-30 * 1e-20),
             r"constant inf can make the score NaN"),
            (lambda s, b, h, q, k: s - inf * (((k > q) + 1.0) / 1e30 / 1e20),
             r"constant inf can make the score NaN"),
            (lambda s, b, h, q, k: s - inf * ((((k > 2) * 0.0 + 1.0) + 1e-8) -
                                              ((k > 2) * 0.0 + 1.0)),
             r"constant inf can make the score .*NaN"),
            (lambda s, b, h, q, k: s - inf * (16777217 - (k > 2) * 16777216.0),
             r"constant inf can make the score .*NaN"),
            (lambda s, b, h, q, k: s - inf * (((k > 2) + 10.0) * 1e38 - ((k > 2) + 5.0) * 1e38),
             r"constant inf can make the score .*NaN"),
            (lambda s, b, h, q, k: s - inf * (2.0 - (k > 2) * 1.5) ** 200.0,
             r"constant inf can make the score NaN"),
            (lambda s, b, h, q, k: torch.where(k <= q, s, -inf) / (h + 1) * 2.0 ** -(h + 1),
             r"constant -inf can make the score .*NaN")):
        with pytest.raises(SpecError, match=r"score_mod '<lambda>' \(defined at .*test_dsl.py:"
                                            r"\d+\): its " + text + r", which makes the row's "
                                            r"output and lse NaN; expected finite constants "
                                            r"\(no division by 0\), and -inf only where it "
                                            r"hides a key \(torch.where\(cond, score, -inf\), "
                                            r"not -inf \* cond: -inf \* 0 is NaN\)"):
            ja.Variant("inf", mask="none", score_mod=fn)
    with pytest.raises(SpecError, match=r"score_mod '<lambda>' .*: constant nan in a variant "
                                        r"expression: expected a number"):
        ja.Variant("nan", mask="none", score_mod=lambda s, b, h, q, k: s + float("nan"))
    ja.Variant("sig", mask="none", reduction="sigmoid", score_mod=lambda s, b, h, q, k: s + inf)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 2, 64, generator=gen).half() for _ in range(3))
    for fn in (lambda s, b, h, q, k: torch.where(k <= q, s, -inf),
               lambda s, b, h, q, k: s * 0 - math.inf,
               lambda s, b, h, q, k: -torch.where(k <= q, -s, inf),
               lambda s, b, h, q, k: torch.where(k <= q, s, -inf) / temperature,
               lambda s, b, h, q, k: torch.clamp(s, max=inf) + ja.tanh(s + inf),
               lambda s, b, h, q, k: torch.where(s < inf, s, 0.0),
               lambda s, b, h, q, k: s - inf * torch.where(k > q + 20, 1.0, 2.0),
               lambda s, b, h, q, k: s - inf / (k > q),
               lambda s, b, h, q, k: torch.where(k <= q, s, -inf) * (1.0 + keep[k % 3]),
               lambda s, b, h, q, k: torch.where(k <= q, s, -inf) / (h + 1) *
               2.0 ** -((h % 8) + 1),
               lambda s, b, h, q, k: torch.where(k <= q, s, -inf) / (keep[k % 3] + 1.0) ** 0.5,
               lambda s, b, h, q, k: s + (2.0 - (k > 2) * 1.0) * -inf,
               lambda s, b, h, q, k: s - inf * torch.where(k > q, 3.0 - (h > 0), 1.0) ** 2,
               lambda s, b, h, q, k: s + torch.minimum(-inf * (0.5 + (k > q)), s)):
        out = reference.attention(q, k, v, ja.Variant("kept", mask="none", score_mod=fn))
        assert not out.isnan().any()


def test_subnormal_constants_that_float32_rounds_warn():
    """A float constant below float32's normal range became a subnormal that float32 rounds
    (1e-45 is held as 1.4e-45) in silence: it warns, naming the constant and the value the
    kernels use, at the mod's line; a subnormal float32 holds exactly, and normal constants,
    do not warn."""
    with pytest.warns(UserWarning, match=r"constant 1e-45 is below float32's normal range "
                                         r"\(about 1.2e-38\): the kernels compute with "
                                         r"1.401298464324817e-45") as caught:
        trace_score(lambda s, b, h, q, k: s * 1e-45)
    assert [w.filename for w in caught] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for c in (2.0 ** -140, 1e-30, np.float32(1e-40)):
            trace_score(lambda s, b, h, q, k: s + c)


def test_a_0d_tensor_reached_otherwise_than_by_closure_is_read_per_call():
    """A 0-d tensor given through functools.partial, an object's attribute, a dict or a default
    argument was refused as 'computed while tracing' (only closures and globals were known);
    what torch computes during the trace (1 / t) still is."""
    import functools
    t = torch.tensor(0.5)

    def scaled(s, b, h, q, k, factor):
        return s * factor

    class Scaled:
        factor = t

        def __call__(self, s, b, h, q, k):
            return s * self.factor

    table = {"t": t}
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(11, 2, 64, generator=gen).half() for _ in range(3))
    for mod in (functools.partial(scaled, factor=t), Scaled(),
                lambda s, b, h, q, k: s * table["t"], lambda s, b, h, q, k, f=t: s * f):
        variant = ja.Variant(mask="none", score_mod=mod)
        t.fill_(3.0)
        want = _flex_eager(q, k, v, lambda s, *_: s * 3.0, None)
        assert (ja.attention(q, k, v, variant).double() - want).abs().max() < 4e-3
        t.fill_(0.5)


def test_a_literal_negative_index_wraps_as_in_torch():
    """tab[-1, kv_idx] read row 0 (indices clamp), where torch reads the last row."""
    tab = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    last = ja.Variant(mask="none", score_mod=lambda s, b, h, q, k: s + tab[-1, k])
    row2 = ja.Variant(mask="none", score_mod=lambda s, b, h, q, k: s + tab[2, k])
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(9, 2, 64, generator=gen).half(), torch.randn(11, 2, 64, generator=gen).half()
    torch.testing.assert_close(ja.attention(q, k, k, last), ja.attention(q, k, k, row2),
                               rtol=0, atol=0)


def test_views_and_constants_made_in_a_mod_are_not_refused_as_computed():
    """A review's cases, refused by the first version of the computed-table check: what
    aliases a captured tensor reads its live data; what is made from constants alone is a
    constant. Each is checked against its plain form after the captured tensor changes."""
    bias, tab = torch.tensor([1.0, 2.0]), torch.randn(3)
    param = torch.nn.Parameter(bias.clone())
    mods = {
        "float_identity": lambda s, b, h, q, k: s + bias.float()[h] + bias[h],
        "detach": lambda s, b, h, q, k: s + bias.detach()[h] + param.detach()[h] + param.data[h],
        "view": lambda s, b, h, q, k: s + bias.view(2, 1)[h, 0] + s * bias[0],
        "last": lambda s, b, h, q, k: ja.where(k < tab[-1], s, -s),
        "constants": lambda s, b, h, q, k: s + (torch.arange(8) * 2)[h] +
        ja.alibi_slopes(8)[h] * (k - q),
    }
    variants = {name: ja.Variant(name, mask="none", score_mod=fn) for name, fn in mods.items()}
    bias.fill_(3.0)
    with torch.no_grad():
        param.fill_(3.0)
    tab.fill_(4.5)
    slopes = ja.alibi_slopes(8)
    plain = {
        "float_identity": lambda s, b, h, q, k: s + 6.0,
        "detach": lambda s, b, h, q, k: s + 9.0,
        "view": lambda s, b, h, q, k: s + 3.0 + s * 3.0,
        "last": lambda s, b, h, q, k: ja.where(k < 4.5, s, -s),
        "constants": lambda s, b, h, q, k: s + h * 2 + slopes[h] * (k - q),
    }
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(9, 2, 64, generator=gen).half(), torch.randn(11, 2, 64, generator=gen).half()
    for name, variant in variants.items():
        want = ja.attention(q, k, k, ja.Variant(name, mask="none", score_mod=plain[name]))
        torch.testing.assert_close(ja.attention(q, k, k, variant), want, atol=2e-3, rtol=0,
                                   msg=name)


def test_values_read_at_trace_time_are_refused():
    """A captured table indexed by a captured 0-d tensor (table[layer], one Variant for every
    layer) kept the row of the trace; bool(flag), t.item() on captured tensors were baked into
    the kernel too, and later in-place changes were ignored in silence."""
    table, layer = torch.tensor([0.0, 1.0, -1.0, 2.0]), torch.tensor(1)
    flag, temp = torch.tensor(True), torch.tensor(0.5)
    for mod, text in ((lambda s, b, h, q, kv: s + table[layer] * kv, r"table\[i \+ 0 \* h\]"),
                      (lambda s, b, h, q, kv: s * 2 if flag else s, r"__bool__ of a tensor"),
                      (lambda s, b, h, q, kv: s + kv * temp.item(), r"item of a tensor"),
                      (lambda s, b, h, q, kv: s + table[layer:layer + 1][0] * kv, "0-d tensor")):
        with pytest.raises(SpecError, match=text):
            ja.Variant("read_once", mask="none", score_mod=mod)
    # what reads them per call still traces: the index inside the symbolic expression, the
    # 0-d tensor itself, a literal index, and values of constants made in the mod
    v = ja.Variant("read_per_call", mask="none",
                   score_mod=lambda s, b, h, q, kv: s + table[layer + 0 * h] * kv * temp +
                   table[1] + torch.tensor(2.0).item())
    assert len(v.tensor_params) == 4  # table, layer, temp, and table[1] (a live 0-d view)


def test_untraceable_python_names_its_failing_line():
    """An AttributeError or TypeError in the mod named only the def line."""
    def mod(score, b, h, q_idx, kv_idx):
        x = score + 1.0
        return x.sqrt()
    with pytest.raises(SpecError, match=r"failing line test_dsl\.py:\d+ `return x\.sqrt\(\)`\) "
                                        r"could not be traced: AttributeError"):
        ja.Variant("unrooted", mask="none", score_mod=mod)


def test_a_symbol_turned_into_a_string_is_refused():
    """str(kv_idx) == "3" traced as a constant (the repr's text), in silence."""
    for mod in (lambda s, b, h, q, kv: s + 5.0 * (str(kv) == "3"),
                lambda s, b, h, q, kv: s + 0.1 * len(f"{kv}")):
        with pytest.raises(SpecError, match="cannot be turned into a string"):
            ja.Variant("stringly", mask="none", score_mod=mod)
