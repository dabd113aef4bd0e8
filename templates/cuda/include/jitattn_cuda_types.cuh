// Types and conversions the generated variant code and the kernels need on the CUDA backend.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

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


// Two fp8 e4m3 values (low byte first) as two 16-bit DType values packed in 32 bits (low first).
// Exact: every e4m3 value is representable in fp16 and in bf16.
template <typename DType> __device__ __forceinline__ unsigned ja_e4m3x2_to(unsigned short x);
template <> __device__ __forceinline__ unsigned ja_e4m3x2_to<half>(unsigned short x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)x, __NV_E4M3);
  return (unsigned)h.x | ((unsigned)h.y << 16);
}
template <> __device__ __forceinline__ unsigned ja_e4m3x2_to<__nv_bfloat16>(unsigned short x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)x, __NV_E4M3);
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(h)));
  return *reinterpret_cast<const unsigned*>(&b);
}
