// Tensor-core and asynchronous-copy primitives (sm_80+ PTX): mma.sync m16n8k16 with float
// accumulators, ldmatrix, cp.async with zero fill. Fragment layouts are those of the PTX ISA,
// "Matrix fragments for mma.m16n8k16 with floating point type": for the accumulator C (16 x 8)
// lane l holds rows l / 4 and l / 4 + 8, columns 2 (l % 4) and 2 (l % 4) + 1.
#pragma once

namespace ja {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 matrices of 16-bit elements; lane l gives the shared-memory address (32-bit, see
// smem_addr) of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}

// d += a (16 x 16, row-major) * b (16 x 8, column-major), float accumulators.
template <typename DType>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<half>(float (&d)[4], const unsigned (&a)[4],
                                                unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; 2^-inf = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as one register of two 16-bit elements (x in the low half).
template <typename DType>
__device__ __forceinline__ unsigned pack2(float x, float y) {
  const typename Pair<DType>::T2 v = Pair<DType>::from_float2(make_float2(x, y));
  return *reinterpret_cast<const unsigned*>(&v);
}

// 16 bytes global -> shared, bypassing L1; when !valid the destination is zero-filled and
// nothing is read.
// d0 += a b[0:2], d1 += a b[2:4]: the two 8-column blocks of one ldmatrix.x4 B fragment.
template <typename DType>
__device__ __forceinline__ void mma_16816_x2(float (&d0)[4], float (&d1)[4],
                                             const unsigned (&a)[4], const unsigned (&b)[4]) {
  mma_16816<DType>(d0, a, b[0], b[1]);
  mma_16816<DType>(d1, a, b[2], b[3]);
}
// N consecutive 32-bit words from shared memory at p (4N-byte aligned), in 16-byte loads
// where N allows
template <int N>
__device__ __forceinline__ void load_words(unsigned (&w)[N], const void* p) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 x = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint2 x = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = x.x, w[2 * i + 1] = x.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = reinterpret_cast<const unsigned*>(p)[i];
  }
}
// x, through a register the compiler cannot see into (keeps it from re-deriving x from the
// expression that made it)
__device__ __forceinline__ long long opaque(long long x) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
  return x;
}
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  cp_async_16(smem_addr(dst), src, valid);
}
// mbarriers in shared memory (PTX ISA "mbarrier"): a phase completes after `count` arrivals;
// waiting names the parity of the phase to wait for
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// whether the phase of `parity` has completed, without waiting (a probe made early lets a later
// step skip its wait when the phase had completed by then)
__device__ __forceinline__ bool mbar_test(unsigned long long* bar, int parity) {
  unsigned done;
  asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
               "selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  return done != 0;
}
// one arrival on the mbarrier once this thread's earlier cp.async copies have landed (the
// barrier's count includes it)
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar))
               : "memory");
}
// named barriers 1..15 (0 is __syncthreads): sync waits for `count` threads, arrive does not
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

}  // namespace ja
