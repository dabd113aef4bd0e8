"""CUDA kernels against the reference on the GPU (run on the device: ``pytest -m gpu``).

Every built-in variant x {fp16, bf16} x head_dim {32, 64, 128, 256} x GQA {1, 4, 7} x layouts whose
lengths are not multiples of the tiles, including q_len > kv_len under causal masks (fully masked
rows: out 0, lse -inf), empty and one-token requests; both the prefill and the decode kernels.
"""

import math

import pytest
import torch

import jitattn as ja
from jitattn import catalog, env, reference

from helpers import (check, check_nan_key_rows, check_rope_before_the_first_key,
                     every_feature_variant, make_batch, wrapping_mask_case)

pytestmark = pytest.mark.gpu

BUILTIN = catalog.builtin()
HEADS = [(4, 4), (8, 2), (7, 1)]
LAYOUTS = [
    ([45], [30]),                              # q_len > kv_len: first 15 rows fully masked
    ([129], [257]),                            # prefill, odd lengths
    ([1], [1000]),                             # decode kernel, one request
    ([1, 1, 1, 1], [0, 1, 77, 300]),           # decode kernel, ragged, empty KV, one key
    ([0, 1, 33, 70], [5, 9, 100, 70]),         # prefill kernel, ragged, empty query
    ([4], [2]),                                # q_len x GQA <= 16 (but for GQA 7): decode
    ([3, 2, 0, 4], [3, 700, 5, 40]),           #   kernel's 16-row tiles; masked rows, ragged
]


@pytest.fixture(scope="module", autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_builtin_variant_matches_reference(name, dtype, head_dim):
    for i, (hq, hkv) in enumerate(HEADS):
        for j, (qo_lens, kv_lens) in enumerate(LAYOUTS):
            variant, params = BUILTIN[name].example(len(qo_lens), hq, hkv, max(qo_lens),
                                                    max(kv_lens), "cuda")
            q, k, v, qo, kv = make_batch(qo_lens, kv_lens, hq, hkv, head_dim, dtype, "cuda",
                                         seed=hash((name, head_dim, i, j)) % 2**31)
            if len(qo_lens) == 1:
                check(variant, params, q, k, v)
            else:
                check(variant, params, q, k, v, qo, kv)


def test_a_nan_key_makes_out_and_lse_nan_on_the_rows_that_see_it_gpu():
    """The wgmma prefill (head_dim 128, fp16: 192-key tiles), the mma.sync prefill (64), and the
    decode kernel with its warps splitting the keys (one query over 5000 keys)."""
    for head_dim in (64, 128):
        check_nan_key_rows("cuda", [(300, 500, 250), (45, 30, 0), (1, 5000, 4321)], head_dim)


def test_custom_variant_with_every_feature_gpu():
    variant, params = every_feature_variant("cuda")
    for qo_lens, kv_lens in (([3, 50], [60, 50]), ([1, 1], [90, 3])):
        q, k, v, qo, kv = make_batch(qo_lens, kv_lens, 8, 2, 128, torch.bfloat16, "cuda", 7)
        check(variant, params, q, k, v, qo, kv)


def test_integer_powers_are_exact_on_the_gpu():
    """kv_idx ** 2 past 4096 keys (float32 before: the parity mask hid keys) and a fifth power
    past 2**53 (where float64 rounds too), on the prefill and decode kernels."""
    torch.manual_seed(4)
    k, v = (torch.randn(6000, 2, 128, device="cuda").half() for _ in range(2))
    parity = ja.Variant("pow_parity", mask="none",
                        mask_mod=lambda b, h, qi, ki: (ki ** 2) % 2 == ki % 2)
    fifth = ja.Variant("pow_fifth", mask="none",
                       mask_mod=lambda b, h, qi, ki: ((ki % 5000) ** 5 + (qi % 999) ** 3) % 11 < 6)
    for rows in (1, 300):
        q = torch.randn(rows, 8, 128, device="cuda").half()
        torch.testing.assert_close(ja.attention(q, k, v, parity),
                                   ja.attention(q, k, v, ja.Variant("none", mask="none")),
                                   atol=1e-3, rtol=1e-3)
        check(fifth, {}, q, k, v)


def test_int64_arithmetic_wraps_on_the_gpu():
    """nvcc folded the signed overflow of k * C >= 0 to true for every key: the kernels now
    wrap through unsigned helpers, as the reference's torch int64 does."""
    variant, q, k, v, kept = wrapping_mask_case("cuda")
    none = ja.Variant("none", mask="none")
    for x in (q, torch.randn(300, 4, 64, device="cuda").half()):  # decode, prefill kernels
        torch.testing.assert_close(ja.attention(x, k, v, variant),
                                   ja.attention(x, k[kept], v[kept], none), rtol=0, atol=2e-3)


def test_long_sequence_and_repeatability():
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    q, k, v, _, _ = make_batch([3000], [4097], 16, 4, 128, torch.float16, "cuda", seed=11)
    out, _ = check(variant, {}, q, k, v)
    for _ in range(3):
        assert torch.equal(ja.attention(q, k, v, variant), out)


def test_runs_on_current_stream():
    variant = ja.Variant("plain", mask="none")
    q, k, v, _, _ = make_batch([200], [300], 8, 8, 64, torch.float16, "cuda", seed=2)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = ja.attention(q, k, v, variant)
    s.synchronize()
    torch.testing.assert_close(out, ja.attention(q, k, v, variant))


def test_gpu_tanh_is_within_its_documented_bound():
    """ja_tanh in the CUDA kernels (ja_tanh_ex2: 1 - 2 / (1 + e^(2x)) on ex2 and rcp): absolute
    error below 5e-7 against float64 tanh over [-40, 40], and the limits at +-inf exact."""
    cupy = pytest.importorskip("cupy")
    src = ('#include "jitattn_math.h"\n'
           'extern "C" __global__ void f(const float* x, float* y, int n) {\n'
           '  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
           '  if (i < n) y[i] = ja_tanh(x[i]);\n}\n')
    kernel = cupy.RawKernel(src, "f", options=(f"-I{env.templates_dir() / 'common'}",))
    inf = float("inf")
    x = torch.cat([torch.linspace(-40, 40, (1 << 22) + 1, device="cuda"),
                   torch.randn(1 << 20, device="cuda") * 1e-3,
                   torch.tensor([inf, -inf, 0.0, 1e-30, -1e-30], device="cuda")])
    y = torch.empty_like(x)
    n = x.numel()
    torch.cuda.synchronize()
    kernel(((n + 255) // 256,), (256,), (cupy.asarray(x), cupy.asarray(y), cupy.int32(n)))
    cupy.cuda.Device().synchronize()
    err = (y.double() - torch.tanh(x.double())).abs()
    assert not y.isnan().any() and err.max().item() < 5e-7, err.max().item()
    assert y[-5].item() == 1.0 and y[-4].item() == -1.0


def test_approximate_soft_cap_is_close_and_only_where_asked():
    """soft_cap(approx=True) runs tanh.approx.f32 (relative error about 2^-11 on the capped
    score): close to the exact reference within a looser budget, and a different kernel."""
    exact, approx = (ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0, approx=a))
                     for a in (False, True))
    assert exact.key != approx.key
    q, k, v, _, _ = make_batch([300], [300], 8, 2, 128, torch.float16, "cuda", seed=12)
    ref_out, ref_lse = reference.attention(q, k, v, exact, return_lse=True)
    out, lse = ja.attention(q, k, v, approx, return_lse=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out.to(out.dtype), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("approx", [False, True])
def test_soft_cap_folded_into_the_softmax_equals_its_traced_form(approx):
    """soft_cap(cap) runs in the scaled form (emit.scaled_form: cap and 1 / cap folded into the
    softmax's scales), cap * tanh(score / cap) + 0.0 in the traced form: the same outputs and
    lse within rounding, over prefill, a request with fully masked rows and a split-KV decode."""
    folded = ja.Variant("softcap_folded", mask="causal", score_mod=ja.soft_cap(20.0, approx))
    traced = ja.Variant("softcap_traced", mask="causal",
                        score_mod=lambda s, b, h, qi, ki: 20.0 * ja.tanh(s / 20.0, approx) + 0.0)
    for qo, kv, dtype, d in (([300, 40], [300, 20], torch.float16, 128),
                             ([1, 1], [5000, 3], torch.bfloat16, 64)):
        q, k, v, qo_indptr, kv_indptr = make_batch(qo, kv, 8, 2, d, dtype, "cuda", seed=31)
        outs = [ja.attention(q, k, v, var, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                             return_lse=True) for var in (folded, traced)]
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=4e-3, rtol=0)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=0)


def test_fullgraph_inductor_compile_on_gpu():
    """torch.compile(fullgraph=True) with the default (inductor) backend around jitattn on the
    GPU: projections compiled by inductor, attention one custom op, same result as eager."""
    variant = ja.Variant("compiled_softcap", mask="causal", score_mod=ja.soft_cap(20.0))
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 4 * 64, dtype=torch.float16, device="cuda")
    indptr = torch.tensor([0, 17, 40], dtype=torch.int32)

    def layer(x):
        q, k, v = (t.reshape(-1, 4, 64).contiguous() for t in proj(x).chunk(3, -1))
        return ja.attention(q, k, v, variant, qo_indptr=indptr, kv_indptr=indptr).sum(-1)

    x = torch.randn(40, 64, dtype=torch.float16, device="cuda")
    with torch.inference_mode():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)


def test_in_place_pair_merge_equals_stacked_merge_gpu():
    from test_merge import check_in_place_pair_merge
    check_in_place_pair_merge("cuda")


def test_pair_merge_addresses_past_2_to_the_31_elements():
    """merge_state_in_place over 2**24 + 64 rows of 128 (over 2**31 elements): the second
    state's rows are addressed in 64 bits (a 32-bit product faulted there)."""
    rows, d = (1 << 24) + 64, 128
    o_a = torch.zeros(rows, d, dtype=torch.float16, device="cuda")
    o_b = torch.ones(rows, d, dtype=torch.float16, device="cuda")
    lse_a = torch.zeros(rows, device="cuda")
    lse_b = torch.zeros(rows, device="cuda")
    lse_a[-64:] = -math.inf
    ja.merge_state_in_place(o_a, lse_a, o_b, lse_b)
    torch.cuda.synchronize()
    assert (o_a[-64:] == 1).all() and (lse_a[-64:] == 0).all()
    assert (o_a[:64] == 0.5).all()


def test_rope_rotates_queries_before_the_first_key_gpu():
    check_rope_before_the_first_key("cuda")
