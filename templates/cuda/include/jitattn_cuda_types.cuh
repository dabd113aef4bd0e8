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


// An fp8 e5m2 KV cache's element: a 1-byte type of its own (an e4m3 cache's is the raw byte,
// __nv_fp8_storage_t), so that the kernels choose the conversion by KVType at compile time. An
// enum over unsigned char rather than cuda_fp8.h's __nv_fp8_e5m2 struct: nvcc then emits an
// e5m2 kernel's PTX as the e4m3 kernel's but for the conversion instruction (with the struct,
// its address arithmetic differed).
enum class ja_e5m2 : unsigned char {};

// The fp8 format of a 1-byte KV element type (16-bit KV types never reach the conversions).
template <typename KVType> struct Fp8Format {
  static constexpr __nv_fp8_interpretation_t F = __NV_E4M3;
};
template <> struct Fp8Format<ja_e5m2> {
  static constexpr __nv_fp8_interpretation_t F = __NV_E5M2;
};

// Two fp16 values (low first) as two 16-bit DType values packed in 32 bits (low first), exactly
// for the fp16 values of an fp8 cache (every e4m3 and e5m2 value is an fp16 and a bf16 value).
template <typename DType> __device__ __forceinline__ unsigned ja_halfraw2_to(__half2_raw h);
template <> __device__ __forceinline__ unsigned ja_halfraw2_to<half>(__half2_raw h) {
  return (unsigned)h.x | ((unsigned)h.y << 16);
}
template <> __device__ __forceinline__ unsigned ja_halfraw2_to<__nv_bfloat16>(__half2_raw h) {
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(h)));
  return *reinterpret_cast<const unsigned*>(&b);
}

// Two fp8 values of KVType's format (low byte first) as two 16-bit DType values packed in 32
// bits (low first). Exact: e5m2 is the top byte of an fp16, and e4m3's values are all fp16's.
template <typename DType, typename KVType>
__device__ __forceinline__ unsigned ja_fp8x2_to(unsigned short x) {
  return ja_halfraw2_to<DType>(
      __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)x, Fp8Format<KVType>::F));
}
