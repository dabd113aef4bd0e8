// The kernels' arguments and how a CTA finds its work (the kernel body is jitattn_attend.cuh).
// The generated .cu file fixes the constants and defines the extern "C" entry point, which
// builds Args and VariantParams and calls ja::attend.
//
// Two ways to find work: without a plan (items == nullptr) CTA (x, y, z) serves row tile x of
// request y and kv head z over its whole visible KV range; with a plan, the grid is persistent
// and CTA c runs work items cta_indptr[c] .. cta_indptr[c+1] (plan.py), each a row tile over a
// KV chunk, writing out/lse directly or, for a chunk of a split tile, a float32 partial state.
#pragma once

namespace ja {

// A TMA tensor map (the driver's CUtensorMap: 128 opaque bytes, 64-byte aligned), encoded on
// the host (load.py, cuTensorMapEncodeTiled) and passed by value as a __grid_constant__
// kernel parameter, whose address the TMA copy takes
struct alignas(64) TmaMap {
  unsigned long long words[16];
};
struct KVMaps {  // k's, then v's: one kernel parameter
  TmaMap k, v;
};

template <typename DType, typename KVType = DType>
struct Args {
  const DType* q;  // [total_q, num_qo_heads, HEAD_DIM], strides (q_stride_n, q_stride_h, 1)
  const KVType* k; // ragged [total_kv, Hkv, D] or paged (NHD / HND), addressed through k_layout;
  const KVType* v; // DType, or fp8 e4m3 / e5m2 (dequantized to DType on load)
  DType* o;        // [total_q, num_qo_heads, HEAD_DIM], contiguous
  float* lse;      // [total_q, num_qo_heads], natural log; nullptr: not stored
  const int* qo_indptr;  // [batch + 1] or nullptr (single request or planned)
  const int* kv_indptr;
  const int* requests;   // plan: [batch][12], see get_request; or nullptr
  const int* items;      // plan: [n][8] request, kv_head, row0, kv_lo, kv_hi, partial, -, -
  const int* cta_indptr; // plan: [num_ctas + 1]
  float* partial_o;      // plan: [partial rows][HEAD_DIM]
  float* partial_lse;    // plan: [partial rows]
  MaskData mask;         // plan: custom / multi-item mask data
  int single_qo_len, single_kv_len;
  int num_qo_heads, num_kv_heads;
  long long q_stride_n;
  int q_stride_h;
  KVLayout k_layout, v_layout;
  float sm_scale;
  // wgmma kernels over ragged K / V, when kv_tma: TMA maps of k and v as
  // [rows][num_kv_heads][HEAD_DIM] (innermost first: HEAD_DIM, heads, rows) with boxes of 64
  // columns x 1 head x BLOCK_N rows and the 128-byte swizzle of the shared panels. kv_tma is 0
  // where the host could not encode them (strides or addresses TMA cannot take), for a paged
  // cache and in the other kernels: K / V are then copied by cp.async
  int kv_tma = 0;
  const KVMaps* kv_maps = nullptr;
};

// One unit of work: packed rows [row0, row0 + ROWS_CTA) of request b on kv head hk, over keys
// [kv_lo, kv_hi) (further limited by causal / window), stored at partial row `partial` or, when
// partial < 0, into out / lse.
struct Work {
  int b, hk, row0, kv_lo, kv_hi, partial;
};

__device__ __forceinline__ Work read_item(const int* items, int i) {
  const int4 w = reinterpret_cast<const int4*>(items)[2 * i];
  const int2 x = reinterpret_cast<const int2*>(items)[4 * i + 2];
  return {w.x, w.y, w.z, w.w, x.x, x.y};
}

__device__ __forceinline__ RowInfo row_info(const Request& req, int hk, int g, int packed) {
  const int qi = packed / g;
  return {packed < req.q_len * g, qi, hk * g + packed % g, req.kv_len - req.q_len + qi};
}

// KV range [lo, hi) that rows [row0, row_last] of a request can see under causal / window,
// within the work item's chunk [kv_lo, kv_hi).
__device__ __forceinline__ int2 kv_range(const Request& req, int g, int row0, int row_last,
                                         int kv_lo, int kv_hi) {
  const int pos_first = req.kv_len - req.q_len + row0 / g;
  const int pos_last = req.kv_len - req.q_len + row_last / g;
  int hi = Variant::CAUSAL ? min(req.kv_len, pos_last + 1) : req.kv_len;
  int lo = Variant::WINDOW_LEFT >= 0 ? max(0, pos_first - Variant::WINDOW_LEFT) : 0;
  return make_int2(max(lo, kv_lo), min(hi, kv_hi));
}

// Runs `body(work)` for every work item of this CTA (planned) or for the CTA's own tile.
template <typename A, typename Body>
__device__ __forceinline__ void for_each_work(const A& a, int rows_per_cta,
                                              Body body) {
  if (a.items == nullptr) {
    // last row tiles first: under a causal mask they see the most keys
    body(Work{(int)blockIdx.y, (int)blockIdx.z, (int)(gridDim.x - 1 - blockIdx.x) * rows_per_cta,
              0, 1 << 30, -1});
    return;
  }
  for (int i = a.cta_indptr[blockIdx.x]; i < a.cta_indptr[blockIdx.x + 1]; ++i) {
    __syncthreads();  // shared memory of the previous item is consumed
    body(read_item(a.items, i));
  }
}

}  // namespace ja
