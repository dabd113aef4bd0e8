// Hopper warpgroup MMA (PTX ISA 8.0+, sm_90a): wgmma.mma_async on operands in shared memory
// described by 64-bit matrix descriptors, 128-byte swizzle (PTX ISA "Matrix Descriptor Format",
// "Shared Memory Matrix Layout"). Four warps (a warpgroup) issue each instruction together; it
// multiplies a 64-row A by an N-column B, k = 16, accumulating into 64 * N / 128 floats per
// thread, laid out per warp as mma.m16n8's C fragments, one 8-column block after another.
#pragma once

namespace ja {

// Descriptor of a shared-memory operand in 128-byte swizzled rows (8-row atoms of 1024 bytes,
// which must start 1024-byte aligned): start address, leading and stride byte offsets.
__device__ __forceinline__ unsigned long long wgmma_desc(const void* p, int lead_bytes,
                                                         int stride_bytes) {
  const unsigned addr = smem_addr(p);
  return (unsigned long long)((addr & 0x3ffff) >> 4) |
         ((unsigned long long)((lead_bytes >> 4) & 0x3fff) << 16) |
         ((unsigned long long)((stride_bytes >> 4) & 0x3fff) << 32) | (1ull << 62);
}
// The descriptor of the operand `bytes` (a multiple of 16) further on: the start address field
// holds address / 16 in its low 14 bits, so the offset is an add that cannot carry out of it
// (shared-memory addresses are below 2^18). Each k-step's descriptor as a base plus a constant
// spares the per-step mask, shift and OR of wgmma_desc (CUTLASS's descriptor iterator).
__device__ __forceinline__ unsigned long long wgmma_desc_add(unsigned long long desc,
                                                             int bytes) {
  return desc + (unsigned long long)(bytes >> 4);
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// TMA (PTX ISA "cp.async.bulk.tensor", "Tensor Map"): one thread copies a box of a tensor
// described by a TmaMap into shared memory (async proxy), the map's swizzle applied, and the
// copy's bytes complete a transaction count on an mbarrier. arrive_expect_tx is one of the
// barrier's arrivals and raises the bytes the phase waits for; the phase completes once all
// arrivals are in and all those bytes have landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// makes mbarrier.init (generic proxy) visible to the TMA unit's transactions on the barriers
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" :::
               "memory");
}
// The box at coordinates (c0, c1, c2), innermost first, of `map` into shared memory at `dst`
// (1024-byte aligned for the 128-byte swizzle), completing its bytes on `bar`
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, int c0, int c1,
                                            int c2, unsigned long long* bar) {
  // L2 evict-last: K / V tiles are read again by the other query tiles of their request (and
  // a shared prefix by every request); the policy constant is CUTLASS's CacheHintSm90::EVICT_LAST
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               ".L2::cache_hint [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
               :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1),
                  "r"(c2), "r"(smem_addr(bar)), "l"(0x14F0000000000000ull) : "memory");
}
// cp.async (generic proxy) writes become visible to wgmma's operand reads (async proxy)
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// D = A B (+ D), 64 x N, k = 16, for CTYPE (PTX type TY) in registers d[R]: ss with A and B in
// shared memory, both K-major (scale_d 0 ignores D's old value); rs_acc with A in registers
// (mma.m16n8k16 A fragments per warp) and B in shared memory with N contiguous (transposed),
// accumulating. I0.. are the operand numbers after the R accumulators.
// Keeps the compiler from moving register work on a wgmma operand across a wgmma fence or wait
// (the registers look read and written here; CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wgmma_hold(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

template <typename DType, int N> struct Wgmma;
#define JA_WGMMA(CTYPE, TY, N, R, DLIST, RLIST, I0, I1, I2, I3, I4, I5)                        \
  template <> struct Wgmma<CTYPE, N> {                                                         \
    static __device__ __forceinline__ void ss(float (&d)[R], unsigned long long a,             \
                                              unsigned long long b, int scale_d) {             \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " I2 ", 0;\n"                              \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " RLIST       \
                   ", " I0 ", " I1 ", p, 1, 1, 0, 0;\n}\n"                                      \
                   : DLIST : "l"(a), "l"(b), "r"(scale_d));                                    \
    }                                                                                          \
    static __device__ __forceinline__ void rs_acc(float (&d)[R], const unsigned (&a)[4],       \
                                                  unsigned long long b) {                      \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " I5 ", 0;\n"                              \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " RLIST       \
                   ", {" I0 ", " I1 ", " I2 ", " I3 "}, " I4 ", p, 1, 1, 1;\n}\n"                 \
                   : DLIST : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));      \
    }                                                                                          \
  };
#define JA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                 "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define JA_D32 JA_D8(0), JA_D8(8), JA_D8(16), JA_D8(24)
#define JA_D64 JA_D32, JA_D8(32), JA_D8(40), JA_D8(48), JA_D8(56)
#define JA_D96 JA_D64, JA_D8(64), JA_D8(72), JA_D8(80), JA_D8(88)
#define JA_D128 JA_D64, JA_D8(64), JA_D8(72), JA_D8(80), JA_D8(88), JA_D8(96), JA_D8(104), \
                JA_D8(112), JA_D8(120)
#define JA_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JA_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define JA_R96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define JA_R128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
JA_WGMMA(half, "f16", 64, 32, JA_D32, JA_R32, "%32", "%33", "%34", "%35", "%36", "%37")
JA_WGMMA(__nv_bfloat16, "bf16", 64, 32, JA_D32, JA_R32, "%32", "%33", "%34", "%35", "%36", "%37")
JA_WGMMA(half, "f16", 128, 64, JA_D64, JA_R64, "%64", "%65", "%66", "%67", "%68", "%69")
JA_WGMMA(__nv_bfloat16, "bf16", 128, 64, JA_D64, JA_R64, "%64", "%65", "%66", "%67", "%68", "%69")
JA_WGMMA(half, "f16", 192, 96, JA_D96, JA_R96, "%96", "%97", "%98", "%99", "%100", "%101")
JA_WGMMA(__nv_bfloat16, "bf16", 192, 96, JA_D96, JA_R96, "%96", "%97", "%98", "%99", "%100", "%101")
JA_WGMMA(half, "f16", 256, 128, JA_D128, JA_R128, "%128", "%129", "%130", "%131", "%132", "%133")
JA_WGMMA(__nv_bfloat16, "bf16", 256, 128, JA_D128, JA_R128, "%128", "%129", "%130", "%131", "%132",
         "%133")
#undef JA_WGMMA
#undef JA_D8
#undef JA_D32
#undef JA_D64
#undef JA_D96
#undef JA_D128
#undef JA_R32
#undef JA_R64
#undef JA_R96
#undef JA_R128

}  // namespace ja
