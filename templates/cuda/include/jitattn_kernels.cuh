// The kernels' arguments, how a CTA finds its work, and the decode kernel body (the prefill body
// is in jitattn_prefill.cuh). The generated .cu file fixes the constants and defines the
// extern "C" entry points, which build Args and VariantParams and call these.
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
  const int* requests;   // plan: [batch][8], see get_request; or nullptr
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

// Decode (few query rows, long KV; FlashInfer paper section 3.2, CUDA-core decode): a key is
// read by a group of HEAD_DIM / 8 threads, each holding 16 bytes of it, straight from global
// memory into registers, UNROLL keys at a time; the CTA's GROUPS groups take interleaved keys
// of the work item's range. The dot products of a step are finished by a reduce-scatter, so
// that each (row, key) pair's mask, score_mod and exp are computed by one lane, and the
// weights are then broadcast back. Every group keeps an online-softmax state for all ROWS
// rows (the GQA group); the groups' states are merged at the end (attention-state merge,
// section 2.2).
template <typename DType, int HEAD_DIM, int NUM_WARPS, int ROWS>
__device__ __forceinline__ void decode(const Args<DType>& a, const VariantParams& p) {
  using P = Pair<DType>;
  constexpr int VEC = 8;                       // 16-byte chunks of 8 elements
  constexpr int GROUP = HEAD_DIM / VEC;        // threads per key
  constexpr int GROUPS = NUM_WARPS * WARP / GROUP;
  constexpr int UNROLL = 4;                    // keys per group per step
  constexpr int NV = ROWS * UNROLL;            // (row, key) pairs per group per step
  constexpr int F = NV >= GROUP ? NV / GROUP : 1;  // pairs per lane after the reduce-scatter
  constexpr int R = NV >= GROUP ? 1 : GROUP / NV;  // lanes per pair when pairs are fewer
  // lanes spanned by one row's UNROLL pairs, as xor offsets [SPAN_LO, SPAN_HI)
  constexpr int SPAN_LO = NV >= GROUP ? 1 : R;
  constexpr int SPAN_HI = NV >= GROUP ? (F >= UNROLL ? 1 : UNROLL / F) : UNROLL * R;
  extern __shared__ __align__(16) unsigned char smem[];
  const int gi = threadIdx.x / GROUP, t = threadIdx.x % GROUP;
  const int g = a.num_qo_heads / a.num_kv_heads;
  float* q_s = reinterpret_cast<float*>(smem);                  // [ROWS][HEAD_DIM]
  float* m_s = q_s + ROWS * HEAD_DIM;                           // [GROUPS][ROWS]
  float* l_s = m_s + GROUPS * ROWS;                             // [GROUPS][ROWS]
  float* acc_s = l_s + GROUPS * ROWS;                           // [GROUPS][ROWS][HEAD_DIM]

  for_each_work(a, ROWS, [&](const Work& w) {
    const Request req = get_request(a.requests, a.qo_indptr, a.kv_indptr, a.single_qo_len,
                                    a.single_kv_len, w.b);
    if (w.row0 >= req.q_len * g) return;
    load_q_rows<DType, HEAD_DIM>(q_s, a, req, w.hk, g, w.row0, ROWS);
    float q[ROWS][VEC], m[ROWS], l[ROWS], acc[ROWS][VEC];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      m[r] = -JA_INF;
      l[r] = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        q[r][e] = q_s[r * HEAD_DIM + t * VEC + e];
        acc[r][e] = 0.f;
      }
    }
    const int2 range = kv_range(req, g, w.row0, min(w.row0 + ROWS, req.q_len * g) - 1,
                                w.kv_lo, w.kv_hi);
    // the same trip count for every group, so that shuffles never diverge
    const int steps = range.y > range.x ? (range.y - range.x + GROUPS * UNROLL - 1) /
                                              (GROUPS * UNROLL) : 0;
    for (int step = 0; step < steps; ++step) {
      const int base = range.x + (step * GROUPS + gi) * UNROLL;
      uint4 kraw[UNROLL], vraw[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        kraw[u] = vraw[u] = make_uint4(0, 0, 0, 0);
        if (base + u < range.y) {
          kraw[u] = *reinterpret_cast<const uint4*>(
              a.k + a.k_layout.offset(req.kv_start, base + u, w.hk) + t * VEC);
          vraw[u] = *reinterpret_cast<const uint4*>(
              a.v + a.v_layout.offset(req.kv_start, base + u, w.hk) + t * VEC);
        }
      }
      // dot partials for every (row, key) pair: v[r * UNROLL + u]
      float v[NV];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float kf[VEC];
        const typename P::T2* k2 = reinterpret_cast<const typename P::T2*>(&kraw[u]);
#pragma unroll
        for (int e = 0; e < VEC / 2; ++e) {
          const float2 f = P::to_float2(k2[e]);
          kf[2 * e] = f.x;
          kf[2 * e + 1] = f.y;
        }
        if constexpr (Variant::ROPE == 1) {  // neox: the partner half lives GROUP / 2 lanes away
          const bool low = t < GROUP / 2;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, kf[e], GROUP / 2);
            const int i = (low ? t : t - GROUP / 2) * VEC + e;
            float sn, cs;
            sincosf((float)(base + u) * kRopeInvFreq[i], &sn, &cs);
            kf[e] = low ? kf[e] * cs - other * sn : kf[e] * cs + other * sn;
          }
        } else if constexpr (Variant::ROPE == 2) {  // gptj: pairs inside the chunk
#pragma unroll
          for (int e = 0; e < VEC / 2; ++e)
            rope_pair(kf[2 * e], kf[2 * e + 1], base + u, kRopeInvFreq[t * VEC / 2 + e]);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot = fmaf(q[r][e], kf[e], dot);
          v[r * UNROLL + u] = dot;
        }
      }
      // Reduce-scatter over the group (recursive halving): afterwards lane t holds the full
      // sums of pairs t * F .. t * F + F - 1 (with fewer pairs than lanes: pair t / R), so
      // masking, score_mod and exp run once per pair rather than once per lane.
      int cnt = NV;
#pragma unroll
      for (int o = GROUP / 2; o > 0; o >>= 1) {
        if (cnt > 1) {
          const bool upper = t & o;
#pragma unroll
          for (int i = 0; i < NV / 2; ++i) {
            if (i < cnt / 2) {
              const float send = upper ? v[i] : v[i + cnt / 2];
              const float keep = upper ? v[i + cnt / 2] : v[i];
              v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
          }
          cnt /= 2;
        } else {
          v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
      }
      // this lane's pairs: visibility, score_mod, the row's new max, the weight p
      float pj[F], mj[F];
#pragma unroll
      for (int j = 0; j < F; ++j) {
        const int idx = NV >= GROUP ? t * F + j : t / R;
        const int r = idx / UNROLL, kv_idx = base + idx % UNROLL;
        const RowInfo ri = row_info(req, w.hk, g, w.row0 + r);
        bool vis = ri.valid && kv_idx < range.y;
        if (Variant::CAUSAL) vis = vis && kv_idx <= ri.q_pos;
        if (Variant::WINDOW_LEFT >= 0) vis = vis && ri.q_pos - kv_idx <= Variant::WINDOW_LEFT;
        vis = vis && data_mask(req, a.mask, ri.qi, ri.q_pos, kv_idx);
        vis = vis && Variant::mask_mod(p, w.b, ri.h, ri.q_pos, kv_idx);
        const float score = Variant::score_mod(p, v[j], w.b, ri.h, ri.q_pos, kv_idx);
        pj[j] = vis ? score : -JA_INF;
      }
#pragma unroll
      for (int j = 0; j < F; ++j) {
        const int idx = NV >= GROUP ? t * F + j : t / R;
        float mx = -JA_INF;
#pragma unroll
        for (int x = 0; x < F; ++x)  // this lane's pairs of the same row
          if (x / UNROLL == j / UNROLL || F < UNROLL) mx = fmaxf(mx, pj[x]);
#pragma unroll
        for (int o = SPAN_LO; o < SPAN_HI; o <<= 1)  // the row's other lanes
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float m_old = -JA_INF;
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
          if (r == idx / UNROLL) m_old = m[r];
        mj[j] = fmaxf(m_old, mx);
      }
#pragma unroll
      for (int j = 0; j < F; ++j) {  // scores -> weights, once every row max is known
        if (Variant::SIGMOID) pj[j] = pj[j] == -JA_INF ? 0.f : 1.f / (1.f + expf(-pj[j]));
        else pj[j] = pj[j] == -JA_INF ? 0.f : expf(pj[j] - mj[j]);
      }
      // every lane gets every pair's weight and every row's new max, then updates its dims
      float pw[NV];
#pragma unroll
      for (int idx = 0; idx < NV; ++idx)
        pw[idx] = __shfl_sync(0xffffffffu, pj[NV >= GROUP ? idx % F : 0],
                              NV >= GROUP ? idx / F : idx * R, GROUP);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float alpha = 1.f;
        if (!Variant::SIGMOID) {
          const int idx = r * UNROLL;
          const float m_new = __shfl_sync(0xffffffffu, mj[NV >= GROUP ? idx % F : 0],
                                          NV >= GROUP ? idx / F : idx * R, GROUP);
          alpha = m_new == -JA_INF ? 1.f : expf(m[r] - m_new);  // exp(-inf) = 0 at first
          m[r] = m_new;
        }
        float psum = 0.f;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) psum += pw[r * UNROLL + u];
        l[r] = l[r] * alpha + psum;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] *= alpha;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float vf[VEC];
        const typename P::T2* v2 = reinterpret_cast<const typename P::T2*>(&vraw[u]);
#pragma unroll
        for (int e = 0; e < VEC / 2; ++e) {
          const float2 f = P::to_float2(v2[e]);
          vf[2 * e] = f.x;
          vf[2 * e + 1] = f.y;
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][e] = fmaf(pw[r * UNROLL + u], vf[e], acc[r][e]);
      }
    }
    // merge the groups' states through shared memory
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (t == 0) {
        m_s[gi * ROWS + r] = m[r];
        l_s[gi * ROWS + r] = l[r];
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc_s[(gi * ROWS + r) * HEAD_DIM + t * VEC + e] = acc[r][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * HEAD_DIM / 2; i += blockDim.x) {
      const int r = i / (HEAD_DIM / 2), c = i % (HEAD_DIM / 2);
      const RowInfo ri = row_info(req, w.hk, g, w.row0 + r);
      if (!ri.valid) continue;
      float mx = -JA_INF;
      if (!Variant::SIGMOID)
        for (int x = 0; x < GROUPS; ++x) mx = fmaxf(mx, m_s[x * ROWS + r]);
      float total = 0.f;
      float2 o = make_float2(0.f, 0.f);
      for (int x = 0; x < GROUPS; ++x) {
        const float mxx = m_s[x * ROWS + r];
        const float scale = Variant::SIGMOID ? 1.f : (mxx == -JA_INF ? 0.f : expf(mxx - mx));
        total += l_s[x * ROWS + r] * scale;
        const float2 y = reinterpret_cast<const float2*>(acc_s + (x * ROWS + r) * HEAD_DIM)[c];
        o.x += y.x * scale;
        o.y += y.y * scale;
      }
      const bool any = total > 0.f;
      const float inv = Variant::SIGMOID ? 1.f : (any ? 1.f / total : 0.f);
      o.x *= inv;
      o.y *= inv;
      const float row_lse = any ? (Variant::SIGMOID ? logf(total) : mx + logf(total)) : -JA_INF;
      if (w.partial < 0) {
        const long long row = (long long)(req.q_start + ri.qi) * a.num_qo_heads + ri.h;
        store2(a.o + row * HEAD_DIM + 2 * c, o);
        if (c == 0) a.lse[row] = row_lse;
      } else {
        const long long row = w.partial + r;
        store2(a.partial_o + row * HEAD_DIM + 2 * c, o);
        if (c == 0) a.partial_lse[row] = row_lse;
      }
    }
  });
}

}  // namespace ja
