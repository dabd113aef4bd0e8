// Building blocks shared by the prefill and decode kernels: the request table, masks, the KV
// cache's addressing, RoPE, packed-row bookkeeping and stores.
//
// Layout of the work (FlashInfer paper, arXiv 2501.01005, section 3.2 "GQA head-group fusion"):
// a CTA serves one KV head; its query rows are "packed rows" r = qi * g + (h % g), so every K/V
// element it loads is reused by all g query heads of the group.
//
// The kernels never know which variant they run: they call Variant::score_mod / mask_mod and
// read Variant::CAUSAL / WINDOW_LEFT / SIGMOID / ROPE, all generated from the Python spec.
#pragma once

// Needs jitattn_cuda_types.cuh and the generated Variant / VariantParams before it.

namespace ja {

constexpr int WARP = 32;

// Where one request's rows live: q_start/q_len index q and out; kv_start is the request's first
// entry in kv_indices (paged) or, ragged, the row of k/v that holds its logical key 0 if its
// keys were one run (see KVLayout::locate).
// mask_offset, prefix_len and token_pos_offset serve the custom and multi-item masks.
// Ragged, a request's keys may begin with a shared prefix: logical keys 0 .. shared_len - 1 are
// rows shared_start .. of k/v (a run other requests read too), the rest its own run.
struct Request {
  int q_start, q_len, kv_start, kv_len, mask_offset, prefix_len, token_pos_offset, shared_len,
      shared_start;
};

// From a plan's request table ([batch][12]: q_start, q_len, kv_len, kv_start, mask_offset,
// prefix_len, token_pos_offset, shared_len, shared_start, -, -, -), from indptrs, or for a
// single request from the lengths.
__device__ __forceinline__ Request get_request(const int* requests, const int* qo_indptr,
                                               const int* kv_indptr, int single_qo_len,
                                               int single_kv_len, int b) {
  if (requests != nullptr) {
    const int4 x = reinterpret_cast<const int4*>(requests)[3 * b];
    const int4 y = reinterpret_cast<const int4*>(requests)[3 * b + 1];
    const int sh = requests[12 * b + 8];
    return {x.x, x.y, x.w, x.z, y.x, y.y, y.z, y.w, sh};
  }
  if (qo_indptr == nullptr) return {0, single_qo_len, 0, single_kv_len, 0, 0, 0, 0, 0};
  return {qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b], kv_indptr[b],
          kv_indptr[b + 1] - kv_indptr[b], 0, 0, 0, 0, 0};
}

// Ragged: the row of k/v that holds logical key 0 of the run key j lies in (j + it is key j's
// row): the shared prefix's for j < shared_len, else the request's own run's. SHARED_KV: the
// kernel was built for batches with shared prefixes (render.py's shared_kv); the others' keys
// are one run, and their copies spend nothing on finding it.
template <bool SHARED_KV>
__device__ __forceinline__ int ragged_base(const Request& req, int j) {
  if constexpr (SHARED_KV) return j < req.shared_len ? req.shared_start : req.kv_start;
  else return req.kv_start;
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
// caches have no table: key j is a row of the request's shared prefix or of its own run
// (ragged_base).
// n / d and n % d for a divisor d >= 1 fixed at launch and 0 <= n < 2^31, by one multiply-high
// (Granlund and Montgomery, "Division by invariant integers using multiplication", PLDI 1994,
// section 4): s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s.
struct FastDiv {
  int d;
  unsigned m;
  int s;
  __device__ __forceinline__ explicit FastDiv(int divisor) : d(divisor) {
    s = 0;
    while ((1 << s) < d) ++s;
    m = (unsigned)((((1ull << 32) * ((1ull << s) - (unsigned long long)d)) / d) + 1);
  }
  __device__ __forceinline__ int div(int n) const {
    return (int)((__umulhi((unsigned)n, m) + (unsigned)n) >> s);
  }
};

struct KVLayout {
  const int* kv_indices;  // nullptr: ragged
  FastDiv page_size;
  int stride_page;        // elements between pages (ragged: between tokens); strides and
                          // (page_size - 1) * stride_slot are < 2^31 (checked in launch.py)
  int stride_slot;        // elements between slots of a page (ragged: unused)
  int stride_h;           // elements between kv heads
  // (page, slot) of key j of request req; ragged: (row, 0). K and V share it when their tables
  // are the same.
  template <bool SHARED_KV>
  __device__ __forceinline__ int2 locate(const Request& req, int j) const {
    if (kv_indices == nullptr) return make_int2(ragged_base<SHARED_KV>(req, j) + j, 0);
    const int page = page_size.div(j);
    return make_int2(kv_indices[req.kv_start + page], j - page * page_size.d);
  }
  // elements from head hk's row 0 of page 0 to (page, slot): one 32 x 32 -> 64-bit multiply
  __device__ __forceinline__ long long row_offset(int2 loc) const {
    return (long long)loc.x * stride_page + loc.y * stride_slot;
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

// Where a packed row sits: its query token, query head and logical position.
struct RowInfo {
  bool valid;
  int qi, h, q_pos;
};

__device__ __forceinline__ void store2(half* p, float2 x) {
  *reinterpret_cast<half2*>(p) = Pair<half>::from_float2(x);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float2 x) {
  *reinterpret_cast<__nv_bfloat162*>(p) = Pair<__nv_bfloat16>::from_float2(x);
}
__device__ __forceinline__ void store2(float* p, float2 x) { *reinterpret_cast<float2*>(p) = x; }
// 16 bytes to global memory when `pred`, as one predicated store: no branch around it (a
// branch per row cost its convergence barrier in the output copy; ncu, session 8). p is not
// touched otherwise.
__device__ __forceinline__ void store16_if(void* p, uint4 x, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
               "@p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n"
               :: "l"(p), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w), "r"((int)pred) : "memory");
}

}  // namespace ja
