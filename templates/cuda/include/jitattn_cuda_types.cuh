// Types and conversions the generated variant code and the kernels need on the CUDA backend.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define JA_ROPE_TABLE __constant__
#include "jitattn_math.h"

JA_HD float ja_to_float(half x) { return __half2float(x); }
JA_HD float ja_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> struct Pair;
template <> struct Pair<half> {
  using T2 = half2;
  static __device__ __forceinline__ float2 to_float2(T2 x) { return __half22float2(x); }
  static __device__ __forceinline__ T2 from_float2(float2 x) { return __float22half2_rn(x); }
};
template <> struct Pair<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(T2 x) { return __bfloat1622float2(x); }
  static __device__ __forceinline__ T2 from_float2(float2 x) { return __float22bfloat162_rn(x); }
};

