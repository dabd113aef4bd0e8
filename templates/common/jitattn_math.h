// Math helpers that generated variant expressions call; shared by the CUDA and CPU backends.
// Semantics follow Python's for // and % so that a traced mod means what it meant in Python.
#pragma once

#ifdef __CUDACC__
#define JA_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define JA_HD inline
#endif

#ifdef __CUDACC_RTC__
#define JA_INF (__int_as_float(0x7f800000))  // NVRTC: device code only, no builtins
#else
#define JA_INF (__builtin_huge_valf())
#endif

// tanh(y / (2 log2(e))) as 1 - 2 / (1 + 2^y) on the GPU: two special-function ops (ex2, rcp)
// and three others, where CUDA's tanhf takes about 19 (an odd polynomial below |x| = 0.6,
// selects); absolute error below 5e-7 (tests/test_gpu.py measures it through ja_tanh), limits
// exact at +-inf (the relative error near 0 is larger than tanhf's: the soft-cap's score is off
// by cap x 5e-7 at most). The CUDA softmax calls it with the 2 log2(e) folded into the score's
// scale (emit.scaled_form); the CPU backend's kernels never call it (they run the traced
// score_mod), but its variant.h declares the call: the host form is tanhf's.
JA_HD float ja_tanh_ex2(float y) {
#if defined(__CUDA_ARCH__)
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(y));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.0f));
  return fmaf(-2.0f, r, 1.0f);
#else
  return tanhf(y * 0.34657359027997264f);  // ln(2) / 2
#endif
}
// tanh: ja_tanh_ex2 on the GPU; the CPU backend and the reference run tanhf.
JA_HD float ja_tanh(float x) {
#if defined(__CUDA_ARCH__)
  return ja_tanh_ex2(x * 2.8853900817779268f);  // 2 log2(e) x
#else
  return tanhf(x);
#endif
}
// tanh on the special-function unit when compiled for a GPU (variants opt in: approx=True)
JA_HD float ja_tanh_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}
JA_HD float ja_exp(float x) { return expf(x); }
JA_HD float ja_log(float x) { return logf(x); }
JA_HD float ja_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
JA_HD float ja_pow(float a, float b) { return powf(a, b); }
// Python's (and torch's) float // and %, from the exact remainder fmodf (CPython's float_divmod,
// torch's div_floor_floating): floorf(a / b) floored the rounded quotient, so 1 // 0.1f, whose
// quotient 9.99999985 rounds to 10.0f, gave 10 where Python gives 9. By 0: a / b and NaN, and
// a zero remainder keeps a's sign (-2 % 1 is -0.0), as torch (the reference); Python's is +0.0.
JA_HD float ja_floordivf(float a, float b) {
  if (b == 0.0f) return a / b;
  const float mod = fmodf(a, b);
  float div = (a - mod) / b;
  if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) div -= 1.0f;
  if (div == 0.0f) return copysignf(0.0f, a / b);
  const float floordiv = floorf(div);
  return div - floordiv > 0.5f ? floordiv + 1.0f : floordiv;
}
JA_HD float ja_fmod(float a, float b) {
  const float mod = fmodf(a, b);
  return mod != 0.0f && ((b < 0.0f) != (mod < 0.0f)) ? mod + b : mod;
}
// Integer expressions of the DSL are 64-bit, or 32-bit where the emitter proves their values
// fit (emit.narrow); both kinds of operands never meet in one call.
typedef long long ja_int;
// 64-bit + - * and negation wrap, as torch's int64 (the reference) does: computed unsigned,
// where C++ (g++ and nvcc alike) defines the wrap; signed overflow would be undefined, and nvcc
// folds it away (k * C >= 0 became true for every k)
typedef unsigned long long ja_uint;
JA_HD ja_int ja_add(ja_int a, ja_int b) { return (ja_int)((ja_uint)a + (ja_uint)b); }
JA_HD ja_int ja_sub(ja_int a, ja_int b) { return (ja_int)((ja_uint)a - (ja_uint)b); }
JA_HD ja_int ja_mul(ja_int a, ja_int b) { return (ja_int)((ja_uint)a * (ja_uint)b); }
JA_HD ja_int ja_neg(ja_int a) { return (ja_int)(0ULL - (ja_uint)a); }
JA_HD ja_int ja_abs(ja_int x) { return x < 0 ? ja_neg(x) : x; }
JA_HD int ja_abs(int x) { return x < 0 ? -x : x; }
JA_HD float ja_abs(float x) { return fabsf(x); }
JA_HD ja_int ja_min(ja_int a, ja_int b) { return a < b ? a : b; }
JA_HD ja_int ja_max(ja_int a, ja_int b) { return a > b ? a : b; }
JA_HD int ja_min(int a, int b) { return a < b ? a : b; }
JA_HD int ja_max(int a, int b) { return a > b ? a : b; }
// NaN in, NaN out, as torch.minimum / maximum (fminf / fmaxf return the other operand)
JA_HD float ja_min(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
JA_HD float ja_max(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
// Python floor division / modulo on ints; division by zero gives 0 instead of a trap, and
// INT64_MIN // -1 wraps to INT64_MIN (as torch's int64) instead of trapping (SIGFPE on x86).
JA_HD ja_int ja_floordiv(ja_int a, ja_int b) {
  if (b == 0) return 0;
  if (b == -1) return ja_neg(a);
  const ja_int q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
JA_HD ja_int ja_mod(ja_int a, ja_int b) {
  return b == 0 ? 0 : ja_sub(a, ja_mul(ja_floordiv(a, b), b));
}
// Python's int ** int for an exponent n >= 0, by squaring; wraps as ja_mul (a is squared only
// while bits of n remain, so within int64 no intermediate exceeds the result)
JA_HD ja_int ja_ipow(ja_int a, ja_int n) {
  ja_int r = 1;
  for (;;) {
    if (n & 1) r = ja_mul(r, a);
    n >>= 1;
    if (!n) return r;
    a = ja_mul(a, a);
  }
}
// Tensor parameter indices are clamped into [0, size - 1]: a kernel never reads out of bounds.
JA_HD long long ja_clampi(long long i, int size) { return i < 0 ? 0 : (i >= size ? size - 1 : i); }
JA_HD float ja_to_float(float x) { return x; }
JA_HD float ja_to_float(int x) { return (float)x; }
JA_HD float ja_to_float(long long x) { return (float)x; }
JA_HD float ja_to_float(unsigned char x) { return (float)x; }
