// Types and conversions the generated variant code and the CPU kernel need.
// 16-bit floats are kept as tagged uint16 structs; conversions round to nearest even.
#pragma once

#include <cstdint>
#include <cstring>

#define JA_ROPE_TABLE static const
#include "jitattn_math.h"

struct ja_f16 { uint16_t bits; };
struct ja_bf16 { uint16_t bits; };
struct ja_e4m3 { uint8_t bits; };  // fp8 e4m3 (OCP FP8, "fn": no infinities), KV caches only
struct ja_e5m2 { uint8_t bits; };  // fp8 e5m2 (OCP FP8: infinities and NaNs), KV caches only

inline uint32_t ja_float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float ja_bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float ja_to_float(ja_bf16 x) { return ja_bits_float((uint32_t)x.bits << 16); }
inline float ja_to_float(ja_f16 x) {
  const uint32_t sign = (uint32_t)(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu, man = x.bits & 0x3ffu;
  if (exp == 0x1f) return ja_bits_float(sign | 0x7f800000u | (man << 13));   // inf / nan
  if (exp != 0) return ja_bits_float(sign | ((exp + 112) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24
  const float mag = (float)man * 5.9604644775390625e-08f;
  return sign ? -mag : mag;
}

// e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (man * 2^-9),
// S.1111.111 is NaN; every other pattern is finite (OCP 8-bit floating point spec, 2023).
inline float ja_to_float(ja_e4m3 x) {
  const uint32_t exp = (x.bits >> 3) & 0xfu, man = x.bits & 0x7u;
  const bool neg = x.bits & 0x80u;
  if (exp == 0xfu && man == 0x7u) return ja_bits_float(0x7fc00000u);
  const float mag = exp == 0 ? (float)man * 0.001953125f
                             : ja_bits_float(((exp + 120u) << 23) | (man << 20));
  return neg ? -mag : mag;
}

// e5m2: sign, 5 exponent bits (bias 15), 2 mantissa bits: the top byte of an IEEE fp16, so its
// value is exactly that fp16's (exponent 0: man * 2^-16; exponent 31: infinity or NaN).
inline float ja_to_float(ja_e5m2 x) { return ja_to_float(ja_f16{(uint16_t)(x.bits << 8)}); }

template <typename T> T ja_from_float(float f);
template <> inline float ja_from_float<float>(float f) { return f; }
template <> inline ja_bf16 ja_from_float<ja_bf16>(float f) {
  uint32_t u = ja_float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40u)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(uint16_t)(u >> 16)};
}
template <> inline ja_f16 ja_from_float<ja_f16>(float f) {
  const uint32_t u = ja_float_bits(f), sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {(uint16_t)(sign | 0x7e00u)};                 // nan
  if (a >= 0x477ff000u) return {(uint16_t)(sign | 0x7c00u)};                // overflow -> inf
  if (a < 0x38800000u) {                                                   // subnormal / zero
    const float mag = ja_bits_float(a) * 16777216.0f;                        // in units of 2^-24
    uint32_t m = (uint32_t)mag;
    const float rem = mag - (float)m;
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return {(uint16_t)(sign | m)};
  }
  uint32_t r = a - 0x38000000u;                                            // rebias 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return {(uint16_t)(sign | (r >> 13))};
}
