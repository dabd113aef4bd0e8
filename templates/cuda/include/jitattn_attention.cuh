// CUDA-core attention building blocks shared by the prefill and decode kernels.
//
// Layout of the work (FlashInfer paper, arXiv 2501.01005, section 3.2 "GQA head-group fusion"):
// a CTA serves one KV head; its query rows are "packed rows" r = qi * g + (h % g), so the K/V tile
// in shared memory is reused by all g query heads of the group. Within a warp, lane j scores key
// j of a 32-key tile against each of the warp's rows, then every lane accumulates its own slice
// of head_dim (dims 2*lane + 64*t, +1). Online softmax (Milakov & Gimelshein 2018; FlashAttention
// section 3.1) keeps the running max m, sum l and unnormalised acc per row in registers.
//
// The kernel never knows which variant it runs: it calls Variant::score_mod / mask_mod and reads
// Variant::CAUSAL / WINDOW_LEFT / SIGMOID / ROPE, all generated from the Python spec.
#pragma once

// Needs jitattn_cuda_types.cuh and the generated Variant / VariantParams before it.

namespace ja {

constexpr int WARP = 32;
constexpr int KV_TILE = 32;   // one key per lane in the scoring step
constexpr int SMEM_PAD = 2;   // halves of padding per K/V row: odd word stride, no bank conflicts

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Where one request's rows live: q_start/q_len index q and out; kv_start is the request's first
// row of k/v (ragged) or its first entry in kv_indices (paged).
// mask_offset, prefix_len and token_pos_offset serve the custom and multi-item masks.
struct Request {
  int q_start, q_len, kv_start, kv_len, mask_offset, prefix_len, token_pos_offset;
};

// From a plan's request table ([batch][8]: q_start, q_len, kv_len, kv_start, mask_offset,
// prefix_len, token_pos_offset, -), from indptrs, or for a single request from the lengths.
__device__ __forceinline__ Request get_request(const int* requests, const int* qo_indptr,
                                               const int* kv_indptr, int single_qo_len,
                                               int single_kv_len, int b) {
  if (requests != nullptr) {
    const int4 x = reinterpret_cast<const int4*>(requests)[2 * b];
    const int4 y = reinterpret_cast<const int4*>(requests)[2 * b + 1];
    return {x.x, x.y, x.w, x.z, y.x, y.y, y.z};
  }
  if (qo_indptr == nullptr) return {0, single_qo_len, 0, single_kv_len, 0, 0, 0};
  return {qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b], kv_indptr[b],
          kv_indptr[b + 1] - kv_indptr[b], 0, 0, 0};
}

// Data of the "custom" (bit-packed, little-endian bit order, row-major [q_len][kv_len] per
// request from byte mask_offset) and "multi_item" (1-based position of each token after the
// prefix inside its item; 0 marks a delimiter) masks.
struct MaskData {
  const unsigned char* bits;
  const int* token_pos;
};

// Whether query qi (at position q_pos) of request `req` may see key kv_idx under the
// variant's data-carrying mask; true for the other masks.
__device__ __forceinline__ bool data_mask(const Request& req, const MaskData& md, int qi,
                                          int q_pos, int kv_idx) {
  if constexpr (Variant::MASK_MODE == 2) {
    const long long bit = (long long)qi * req.kv_len + kv_idx;
    return (md.bits[req.mask_offset + (bit >> 3)] >> (bit & 7)) & 1;
  } else if constexpr (Variant::MASK_MODE == 3) {
    // prefix keys: causal (applied by the caller); item keys: only from the query's own item
    if (kv_idx < req.prefix_len) return true;
    return q_pos >= req.prefix_len &&
           kv_idx > q_pos - md.token_pos[req.token_pos_offset + q_pos - req.prefix_len];
  } else {
    return true;
  }
}

// Element offset of logical key j of a request in a K or V cache. Paged: the page table maps j to
// (kv_indices[kv_start + j / page_size], j % page_size) (FlashInfer paper, section 3.1); ragged
// caches are the special case page_size 1 with no table.
struct KVLayout {
  const int* kv_indices;  // nullptr: ragged
  int page_size;
  long long stride_page;  // elements between pages (ragged: between tokens)
  int stride_slot;        // elements between slots of a page (ragged: unused)
  int stride_h;           // elements between kv heads
  __device__ __forceinline__ long long offset(int kv_start, int j, int hk) const {
    if (kv_indices == nullptr) return (long long)(kv_start + j) * stride_page + (long long)hk * stride_h;
    const int page = kv_indices[kv_start + j / page_size];
    return (long long)page * stride_page + (long long)(j % page_size) * stride_slot +
           (long long)hk * stride_h;
  }
};

// Rotate one pair (x, y) by angle pos * inv_freq (RoFormer eq. 34).
__device__ __forceinline__ void rope_pair(float& x, float& y, int pos, float inv_freq) {
  float s, c;
  sincosf((float)pos * inv_freq, &s, &c);
  const float nx = x * c - y * s, ny = y * c + x * s;
  x = nx;
  y = ny;
}
// Index of the two elements of rotated pair i (neox: halves; gptj: neighbours).
template <int HEAD_DIM>
__device__ __forceinline__ int2 rope_pair_index(int i) {
  return Variant::ROPE == 1 ? make_int2(i, i + HEAD_DIM / 2) : make_int2(2 * i, 2 * i + 1);
}

// Copy keys [tile_start, tile_end) of one KV head into shared memory (zeros past tile_end, so
// that p * v never meets garbage). Threads `tid` of `nthreads` cooperate; 16-byte global loads.
template <typename DType, int HEAD_DIM>
__device__ __forceinline__ void load_kv_tile(DType* k_s, DType* v_s, const DType* k,
                                             const DType* v, const KVLayout& kl,
                                             const KVLayout& vl, int kv_start, int hk,
                                             int tile_start, int tile_end, int tid,
                                             int nthreads) {
  constexpr int ROW = HEAD_DIM + SMEM_PAD;
  constexpr int VEC = 8;
  for (int i = tid; i < KV_TILE * HEAD_DIM / VEC; i += nthreads) {
    const int j = i / (HEAD_DIM / VEC), c = (i % (HEAD_DIM / VEC)) * VEC;
    uint4 kk = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
    if (tile_start + j < tile_end) {
      kk = *reinterpret_cast<const uint4*>(k + kl.offset(kv_start, tile_start + j, hk) + c);
      vv = *reinterpret_cast<const uint4*>(v + vl.offset(kv_start, tile_start + j, hk) + c);
    }
    unsigned* kd = reinterpret_cast<unsigned*>(k_s + j * ROW + c);
    unsigned* vd = reinterpret_cast<unsigned*>(v_s + j * ROW + c);
    kd[0] = kk.x; kd[1] = kk.y; kd[2] = kk.z; kd[3] = kk.w;
    vd[0] = vv.x; vd[1] = vv.y; vd[2] = vv.z; vd[3] = vv.w;
  }
}

template <typename DType, int HEAD_DIM>
__device__ __forceinline__ void rope_k_tile(DType* k_s, int tile_start, int tid, int nthreads) {
  if constexpr (Variant::ROPE != 0) {
    constexpr int ROW = HEAD_DIM + SMEM_PAD;
    for (int i = tid; i < KV_TILE * HEAD_DIM / 2; i += nthreads) {
      const int j = i / (HEAD_DIM / 2), pair = i % (HEAD_DIM / 2);
      const int2 e = rope_pair_index<HEAD_DIM>(pair);
      float x = ja_to_float(k_s[j * ROW + e.x]), y = ja_to_float(k_s[j * ROW + e.y]);
      rope_pair(x, y, tile_start + j, kRopeInvFreq[pair]);
      k_s[j * ROW + e.x] = (DType)x;
      k_s[j * ROW + e.y] = (DType)y;
    }
  }
}

// Running state of ROWS query rows held by one warp; lane owns dims 2*lane + 64*t, +1.
template <int ROWS, int HEAD_DIM>
struct RowState {
  static constexpr int NT = HEAD_DIM / 64;
  float m[ROWS], l[ROWS];
  float2 acc[ROWS][NT];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      m[r] = -JA_INF;
      l[r] = 0.f;
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = make_float2(0.f, 0.f);
    }
  }
};

// Where a warp's row r sits: its query token, query head and logical position.
struct RowInfo {
  bool valid;
  int qi, h, q_pos;
};

// Score one 32-key tile against the warp's ROWS rows and fold it into the running state.
// q_s: ROWS rows of HEAD_DIM floats (already scaled by sm_scale and rotated).
template <typename DType, int ROWS, int HEAD_DIM>
__device__ __forceinline__ void update_rows(RowState<ROWS, HEAD_DIM>& st, const RowInfo* rows,
                                            const float* q_s, const DType* k_s,
                                            const DType* v_s, int tile_start, int tile_end,
                                            int b, const Request& req, const MaskData& md,
                                            const VariantParams& p, int lane) {
  using P = Pair<DType>;
  using T2 = typename P::T2;
  constexpr int ROW = HEAD_DIM + SMEM_PAD;
  const T2* k2 = reinterpret_cast<const T2*>(k_s + lane * ROW);
  float s[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) s[r] = 0.f;
#pragma unroll 8
  for (int c = 0; c < HEAD_DIM / 2; ++c) {
    const float2 kf = P::to_float2(k2[c]);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float2 qf = reinterpret_cast<const float2*>(q_s + r * HEAD_DIM)[c];
      s[r] = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, s[r]));
    }
  }
  const int kv_idx = tile_start + lane;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (!rows[r].valid) continue;  // warp-uniform
    const int q_pos = rows[r].q_pos;
    bool vis = kv_idx < tile_end;
    if (Variant::CAUSAL) vis = vis && kv_idx <= q_pos;
    if (Variant::WINDOW_LEFT >= 0) vis = vis && q_pos - kv_idx <= Variant::WINDOW_LEFT;
    vis = vis && data_mask(req, md, rows[r].qi, q_pos, kv_idx);
    vis = vis && Variant::mask_mod(p, b, rows[r].h, q_pos, kv_idx);
    const float score = Variant::score_mod(p, s[r], b, rows[r].h, q_pos, kv_idx);
    float pj, alpha;
    if (Variant::SIGMOID) {
      pj = vis ? 1.f / (1.f + expf(-score)) : 0.f;
      alpha = 1.f;
    } else {
      const float m_new = fmaxf(st.m[r], warp_max(vis ? score : -JA_INF));
      if (m_new == -JA_INF) continue;  // nothing visible yet
      pj = vis ? expf(score - m_new) : 0.f;
      alpha = expf(st.m[r] - m_new);  // exp(-inf) = 0 on the first visible tile
      st.m[r] = m_new;
    }
    st.l[r] = st.l[r] * alpha + warp_sum(pj);
#pragma unroll
    for (int t = 0; t < RowState<ROWS, HEAD_DIM>::NT; ++t) {
      st.acc[r][t].x *= alpha;
      st.acc[r][t].y *= alpha;
    }
#pragma unroll 4
    for (int j = 0; j < KV_TILE; ++j) {
      const float pb = __shfl_sync(0xffffffffu, pj, j);
      const T2* v2 = reinterpret_cast<const T2*>(v_s + j * ROW);
#pragma unroll
      for (int t = 0; t < RowState<ROWS, HEAD_DIM>::NT; ++t) {
        const float2 vf = P::to_float2(v2[lane + 32 * t]);
        st.acc[r][t].x = fmaf(pb, vf.x, st.acc[r][t].x);
        st.acc[r][t].y = fmaf(pb, vf.y, st.acc[r][t].y);
      }
    }
  }
}

__device__ __forceinline__ void store2(half* p, float2 x) {
  *reinterpret_cast<half2*>(p) = Pair<half>::from_float2(x);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float2 x) {
  *reinterpret_cast<__nv_bfloat162*>(p) = Pair<__nv_bfloat16>::from_float2(x);
}
__device__ __forceinline__ void store2(float* p, float2 x) { *reinterpret_cast<float2*>(p) = x; }

// Normalise and store one row at out_row (HEAD_DIM elements) and *lse: softmax o = acc / l,
// lse = m + log l; sigmoid o = acc, lse = log l (natural log). A row that saw no key gets o = 0,
// lse = -inf. OutT is the output dtype, or float for split-KV partial states.
template <int HEAD_DIM, typename OutT>
__device__ __forceinline__ void store_row(OutT* out_row, float* lse, float m, float l,
                                          const float2* acc, int lane) {
  const bool any = l > 0.f;
  const float inv = Variant::SIGMOID ? 1.f : (any ? 1.f / l : 0.f);
#pragma unroll
  for (int t = 0; t < HEAD_DIM / 64; ++t)
    store2(out_row + 2 * (lane + 32 * t), make_float2(acc[t].x * inv, acc[t].y * inv));
  if (lane == 0) *lse = any ? (Variant::SIGMOID ? logf(l) : m + logf(l)) : -JA_INF;
}

}  // namespace ja
