// The prefill and decode kernel bodies. The generated .cu file fixes the constants and defines
// the extern "C" entry points, which build Args and VariantParams and call these.
//
// Two ways to find work: without a plan (items == nullptr) CTA (x, y, z) serves row tile x of
// request y and kv head z over its whole visible KV range; with a plan, the grid is persistent
// and CTA c runs work items cta_indptr[c] .. cta_indptr[c+1] (plan.py), each a row tile over a
// KV chunk, writing out/lse directly or, for a chunk of a split tile, a float32 partial state.
#pragma once

namespace ja {

template <typename DType>
struct Args {
  const DType* q;  // [total_q, num_qo_heads, HEAD_DIM], strides (q_stride_n, q_stride_h, 1)
  const DType* k;  // ragged [total_kv, Hkv, D] or paged (NHD / HND), addressed through k_layout
  const DType* v;
  DType* o;        // [total_q, num_qo_heads, HEAD_DIM], contiguous
  float* lse;      // [total_q, num_qo_heads], natural log
  const int* qo_indptr;  // [batch + 1] or nullptr (single request or planned)
  const int* kv_indptr;
  const int* requests;   // plan: [batch][4] q_start, q_len, kv_len, kv_start; or nullptr
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

// Load `rows` packed query rows starting at row0 into q_s as float, scaled by sm_scale and
// rotated; rows past the request are zero. All threads of the CTA take part.
template <typename DType, int HEAD_DIM>
__device__ __forceinline__ void load_q_rows(float* q_s, const Args<DType>& a, const Request& req,
                                            int hk, int g, int row0, int rows) {
  using P = Pair<DType>;
  using T2 = typename P::T2;
  const int packed_rows = req.q_len * g;
  for (int i = threadIdx.x; i < rows * HEAD_DIM / 2; i += blockDim.x) {
    const int r = i / (HEAD_DIM / 2), c = i % (HEAD_DIM / 2), packed = row0 + r;
    float2 val = make_float2(0.f, 0.f);
    if (packed < packed_rows) {
      const int qi = packed / g, h = hk * g + packed % g;
      const T2* src = reinterpret_cast<const T2*>(
          a.q + (long long)(req.q_start + qi) * a.q_stride_n + (long long)h * a.q_stride_h);
      val = P::to_float2(src[c]);
      val.x *= a.sm_scale;
      val.y *= a.sm_scale;
    }
    reinterpret_cast<float2*>(q_s)[i] = val;
  }
  if constexpr (Variant::ROPE != 0) {
    __syncthreads();
    for (int i = threadIdx.x; i < rows * HEAD_DIM / 2; i += blockDim.x) {
      const int r = i / (HEAD_DIM / 2), pair = i % (HEAD_DIM / 2), packed = row0 + r;
      if (packed >= packed_rows) continue;
      const int2 e = rope_pair_index<HEAD_DIM>(pair);
      rope_pair(q_s[r * HEAD_DIM + e.x], q_s[r * HEAD_DIM + e.y],
                req.kv_len - req.q_len + packed / g, kRopeInvFreq[pair]);
    }
  }
  __syncthreads();
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

// Store a finished row: into out / lse, or into the item's partial rows.
template <typename DType, int HEAD_DIM>
__device__ __forceinline__ void finish_row(const Args<DType>& a, const Request& req,
                                           const Work& w, int local_row, const RowInfo& ri,
                                           float m, float l, const float2* acc, int lane) {
  if (w.partial < 0) {
    const long long row = (long long)(req.q_start + ri.qi) * a.num_qo_heads + ri.h;
    store_row<HEAD_DIM>(a.o + row * HEAD_DIM, a.lse + row, m, l, acc, lane);
  } else {
    const long long row = w.partial + local_row;
    store_row<HEAD_DIM>(a.partial_o + row * HEAD_DIM, a.partial_lse + row, m, l, acc, lane);
  }
}

// Runs `body(work)` for every work item of this CTA (planned) or for the CTA's own tile.
template <typename DType, typename Body>
__device__ __forceinline__ void for_each_work(const Args<DType>& a, int rows_per_cta,
                                              Body body) {
  if (a.items == nullptr) {
    body(Work{(int)blockIdx.y, (int)blockIdx.z, (int)blockIdx.x * rows_per_cta, 0, 1 << 30, -1});
    return;
  }
  for (int i = a.cta_indptr[blockIdx.x]; i < a.cta_indptr[blockIdx.x + 1]; ++i) {
    __syncthreads();  // shared memory of the previous item is consumed
    body(read_item(a.items, i));
  }
}

// Prefill: the CTA's warps own disjoint rows and share each K/V tile.
template <typename DType, int HEAD_DIM, int NUM_WARPS, int ROWS_PER_WARP>
__device__ __forceinline__ void prefill(const Args<DType>& a, const VariantParams& p) {
  constexpr int ROWS_CTA = NUM_WARPS * ROWS_PER_WARP;
  constexpr int ROW = HEAD_DIM + SMEM_PAD;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int g = a.num_qo_heads / a.num_kv_heads;
  float* q_s = reinterpret_cast<float*>(smem);
  DType* k_s = reinterpret_cast<DType*>(q_s + ROWS_CTA * HEAD_DIM);
  DType* v_s = k_s + KV_TILE * ROW;

  for_each_work(a, ROWS_CTA, [&](const Work& w) {
    const Request req = get_request(a.requests, a.qo_indptr, a.kv_indptr, a.single_qo_len,
                                    a.single_kv_len, w.b);
    if (w.row0 >= req.q_len * a.num_qo_heads / a.num_kv_heads) return;
    load_q_rows<DType, HEAD_DIM>(q_s, a, req, w.hk, g, w.row0, ROWS_CTA);
    RowInfo rows[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r)
      rows[r] = row_info(req, w.hk, g, w.row0 + warp * ROWS_PER_WARP + r);
    const int2 range = kv_range(req, g, w.row0, min(w.row0 + ROWS_CTA, req.q_len * g) - 1,
                                w.kv_lo, w.kv_hi);
    RowState<ROWS_PER_WARP, HEAD_DIM> st;
    st.init();
    for (int t0 = range.x; t0 < range.y; t0 += KV_TILE) {
      __syncthreads();  // the previous tile is consumed
      load_kv_tile<DType, HEAD_DIM>(k_s, v_s, a.k, a.v, a.k_layout, a.v_layout, req.kv_start,
                                    w.hk, t0, range.y, threadIdx.x, blockDim.x);
      if constexpr (Variant::ROPE != 0) {
        __syncthreads();
        rope_k_tile<DType, HEAD_DIM>(k_s, t0, threadIdx.x, blockDim.x);
      }
      __syncthreads();
      update_rows<DType, ROWS_PER_WARP, HEAD_DIM>(st, rows,
                                                  q_s + warp * ROWS_PER_WARP * HEAD_DIM, k_s,
                                                  v_s, t0, range.y, w.b, req, a.mask, p,
                                                  lane);
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
      if (rows[r].valid)
        finish_row<DType, HEAD_DIM>(a, req, w, warp * ROWS_PER_WARP + r, rows[r], st.m[r],
                                    st.l[r], st.acc[r], lane);
    }
  });
}

// Decode (few query rows, long KV): every warp holds all ROWS rows and takes every
// NUM_WARPS-th KV tile into its own shared-memory slot; the warps' partial states are merged at
// the end (attention-state merge, FlashInfer paper section 2.2).
template <typename DType, int HEAD_DIM, int NUM_WARPS, int ROWS>
__device__ __forceinline__ void decode(const Args<DType>& a, const VariantParams& p) {
  constexpr int ROW = HEAD_DIM + SMEM_PAD;
  constexpr int NT = HEAD_DIM / 64;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int g = a.num_qo_heads / a.num_kv_heads;
  float* q_s = reinterpret_cast<float*>(smem);
  unsigned char* tiles = smem + ROWS * HEAD_DIM * sizeof(float);
  DType* k_s = reinterpret_cast<DType*>(tiles) + warp * 2 * KV_TILE * ROW;
  DType* v_s = k_s + KV_TILE * ROW;
  float* m_s = reinterpret_cast<float*>(tiles);                       // [NUM_WARPS][ROWS]
  float* l_s = m_s + NUM_WARPS * ROWS;                                 // [NUM_WARPS][ROWS]
  float2* acc_s = reinterpret_cast<float2*>(l_s + NUM_WARPS * ROWS);   // [NUM_WARPS][ROWS][D/2]

  for_each_work(a, ROWS, [&](const Work& w) {
    const Request req = get_request(a.requests, a.qo_indptr, a.kv_indptr, a.single_qo_len,
                                    a.single_kv_len, w.b);
    if (w.row0 >= req.q_len * g) return;
    load_q_rows<DType, HEAD_DIM>(q_s, a, req, w.hk, g, w.row0, ROWS);
    RowInfo rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = row_info(req, w.hk, g, w.row0 + r);
    const int2 range = kv_range(req, g, w.row0, min(w.row0 + ROWS, req.q_len * g) - 1,
                                w.kv_lo, w.kv_hi);
    RowState<ROWS, HEAD_DIM> st;
    st.init();
    for (int t0 = range.x + warp * KV_TILE; t0 < range.y; t0 += NUM_WARPS * KV_TILE) {
      __syncwarp();
      load_kv_tile<DType, HEAD_DIM>(k_s, v_s, a.k, a.v, a.k_layout, a.v_layout, req.kv_start,
                                    w.hk, t0, range.y, lane, WARP);
      __syncwarp();
      rope_k_tile<DType, HEAD_DIM>(k_s, t0, lane, WARP);
      __syncwarp();
      update_rows<DType, ROWS, HEAD_DIM>(st, rows, q_s, k_s, v_s, t0, range.y, w.b, req,
                                         a.mask, p, lane);
    }
    // Merge the warps' states through shared memory (reusing the tile area).
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (lane == 0) {
        m_s[warp * ROWS + r] = st.m[r];
        l_s[warp * ROWS + r] = st.l[r];
      }
#pragma unroll
      for (int t = 0; t < NT; ++t)
        acc_s[(warp * ROWS + r) * (HEAD_DIM / 2) + lane + 32 * t] = st.acc[r][t];
    }
    __syncthreads();
    for (int r = warp; r < ROWS; r += NUM_WARPS) {
      const RowInfo ri = row_info(req, w.hk, g, w.row0 + r);
      if (!ri.valid) continue;
      float m = -JA_INF;
      if (!Variant::SIGMOID)
        for (int x = 0; x < NUM_WARPS; ++x) m = fmaxf(m, m_s[x * ROWS + r]);
      float l = 0.f;
      float2 acc[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[t] = make_float2(0.f, 0.f);
      for (int x = 0; x < NUM_WARPS; ++x) {
        const float mx = m_s[x * ROWS + r];
        // softmax: rescale to the common max; a warp that saw nothing (m = -inf) adds nothing
        const float scale = Variant::SIGMOID ? 1.f : (mx == -JA_INF ? 0.f : expf(mx - m));
        l += l_s[x * ROWS + r] * scale;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const float2 y = acc_s[(x * ROWS + r) * (HEAD_DIM / 2) + lane + 32 * t];
          acc[t].x += y.x * scale;
          acc[t].y += y.y * scale;
        }
      }
      finish_row<DType, HEAD_DIM>(a, req, w, r, ri, m, l, acc, lane);
    }
  });
}

}  // namespace ja
