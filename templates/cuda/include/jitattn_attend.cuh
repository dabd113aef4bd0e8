// Attention on tensor cores, prefill and decode (FlashAttention-2, Dao 2023, algorithm 1).
//
// A CTA serves a tile of packed rows of one KV head (GQA head-group fusion, FlashInfer paper
// section 3.2: packed row r is query token r / g, head hk * g + r % g). Prefill splits the rows
// among the warps (FlashAttention-2 section 3.2: each warp owns ROWS_WARP rows, K and V tiles are
// shared). Decode (SPLIT_KEYS), where a tile holds a GQA group of a few rows, gives every warp the
// same ROWS_WARP = 16 rows and a quarter of each K/V tile, and merges the warps' attention states
// at the end (FlashInfer paper section 2.2): the tensor cores score the whole group at once and
// the kernel streams K/V at the memory's pace.
// Q, K and V tiles live in shared memory rows padded by 16 bytes, so that ldmatrix reads of eight
// rows fall into distinct banks. K/V tiles of BLOCK_N keys go through STAGES buffers: cp.async
// brings tiles i + 1 .. i + STAGES - 1 (through the page table, zero-filled past the range)
// while tile i is computed.
// Per tile and warp: S = Q K^T on mma.m16n8k16, the variant's score_mod / masks on each element
// of the accumulator fragments, online softmax in registers in base 2 (the running max is kept
// in log2 units), P converted in registers into the A operand of O += P V (ldmatrix.trans of V).
// A tile that every row of the CTA sees whole (not a boundary of the range, causal diagonal or
// window edge, and no data-dependent mask) skips the per-element visibility tests.
#pragma once

namespace ja {

template <bool B> struct Flag { static constexpr bool value = B; };  // a compile-time bool
template <int N> struct Keys { static constexpr int value = N; };    // a tile's computed keys
template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

// Rotate rows [0, rows) of a 16-bit tile in shared memory (RoFormer eq. 34); pos(r) is the
// position of row r, or kNoPosition to leave it (a position may be negative: the queries of a
// request with more queries than keys under mask "none"). Threads tid of nthreads share the
// work.
constexpr int kNoPosition = -2147483647 - 1;  // (INT_MIN)
// prescale: a power of two the values are multiplied by first (exact).
template <typename DType, int HEAD_DIM, int ROW, typename Pos>
__device__ __forceinline__ void rope_tile(DType* s, int rows, Pos pos, int tid, int nthreads,
                                          float prescale = 1.f) {
  if constexpr (Variant::ROPE != 0) {
    for (int i = tid; i < rows * HEAD_DIM / 2; i += nthreads) {
      const int r = i / (HEAD_DIM / 2), pair = i % (HEAD_DIM / 2);
      const int position = pos(r);
      if (position == kNoPosition) continue;
      const int2 e = rope_pair_index<HEAD_DIM>(pair);
      float x = ja_to_float(s[r * ROW + e.x]) * prescale,
            y = ja_to_float(s[r * ROW + e.y]) * prescale;
      rope_pair(x, y, position, kRopeInvFreq[pair]);
      s[r * ROW + e.x] = (DType)x;
      s[r * ROW + e.y] = (DType)y;
    }
  }
}

template <typename DType, typename KVType, int HEAD_DIM, int NUM_WARPS, int ROWS_WARP,
          int BLOCK_N, int STAGES, bool SPLIT_KEYS, bool WGMMA, bool SHARED_KV>
__device__ __forceinline__ void attend(const Args<DType, KVType>& a, const VariantParams& p) {
  constexpr int MT = ROWS_WARP / 16;       // 16-row blocks per warp: each K/V fragment feeds MT mmas
  constexpr int ROWS_CTA = SPLIT_KEYS ? ROWS_WARP : NUM_WARPS * ROWS_WARP;
  constexpr int KEYS_WARP = SPLIT_KEYS ? BLOCK_N / NUM_WARPS : BLOCK_N;  // of each K/V tile
  constexpr int ROW = HEAD_DIM + 8;        // elements per shared row (16 bytes of padding)
  constexpr int CHUNKS = HEAD_DIM / 8;     // 16-byte chunks per row
  constexpr int KD = HEAD_DIM / 16;        // k-steps of Q K^T
  constexpr int NB = KEYS_WARP / 8;        // 8-key column blocks of S
  constexpr int ND = HEAD_DIM / 8;         // 8-dim column blocks of O
  constexpr bool Q_IN_REGS = !WGMMA && MT == 1 && HEAD_DIM <= 128;  // else read from shared memory
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  constexpr float RESCALE_SLACK = 8.f;  // log2 units: see the online softmax
  // scores' factor before score_mod, and the softmax's factor from scores to log2 units
  constexpr bool FOLD_SCALE = !Variant::HAS_SCORE_MOD && !Variant::SIGMOID;
  // a score_mod OUTER * inner(INNER * score), OUTER > 0 (soft-cap): INNER joins the scores'
  // factor and OUTER the softmax's, and the scores take inner alone (Variant::SCALED_FORM)
  constexpr bool SCALED = Variant::SCALED_FORM && !Variant::SIGMOID;
  // KV_LINEAR softmax (ALiBi): the scores stay in units of the raw product, y = q.k +
  // (coef / sm_scale) * c for the key's column offset c in the tile (one FFMA a score); the
  // bias at the tile's first key (lin_base) and sm_scale join the row maximum and the
  // exponent's per-row FFMA instead (x = sm_scale * y + lin_base, sm_scale > 0). (Not at
  // head_dim 256, where ptxas spilled 8 bytes instead of 4.)
  constexpr bool LIN_Y = Variant::KV_LINEAR && !Variant::SIGMOID && HEAD_DIM <= 128;
  // WGMMA and KV_LINEAR: a range's last tile first (see last_keys below); for ALiBi the row
  // maximum then comes with the first tile and no later tile raises it (no rescaling of O)
  constexpr bool LAST_FIRST = WGMMA && Variant::KV_LINEAR;
  static_assert(!LAST_FIRST || BLOCK_N <= 192, "LAST_FIRST narrows to 64 / 128 of 128 / 192 keys");
  // fp16 q over an e5m2 cache with RoPE: K's rotation, rounded to fp16, would overflow for
  // e5m2 values near its largest (57344 * sqrt 2 > 65504; k_scale is folded into sm_scale, so
  // the tile holds the unscaled values). K is rotated at half its value (exact) and the scores
  // take twice sm_scale.
  constexpr bool K_HALVED = Variant::ROPE != 0 && SameType<DType, half>::value &&
                            SameType<KVType, ja_e5m2>::value;
  const float sm_scale = K_HALVED ? 2.f * a.sm_scale : a.sm_scale;
  const float score_scale = FOLD_SCALE ? 1.f : SCALED ? sm_scale * Variant::INNER_SCALE
                                                      : sm_scale;
  const float exp_scale = FOLD_SCALE ? sm_scale * LOG2E
                                     : SCALED ? Variant::OUTER_SCALE * LOG2E : LOG2E;
  // the exponent's factor of what s holds (LIN_Y: raw products, exp_scale's units times sm_scale)
  const float y_scale = LIN_Y ? score_scale * exp_scale : exp_scale;
  // An fp8 KV cache (e4m3 or e5m2, told apart by KVType: ja_fp8x2_to) is copied as it is into
  // the stages. Decode (FP8_REGS) converts it in registers straight into the mma's B
  // fragments: each lane reads the bytes of its fragments with 16-byte loads, in a column
  // order permuted so that they are contiguous (the same permutation applied to Q's columns
  // leaves Q K^T unchanged; applied to V's columns it permutes O's, which the store undoes).
  // Prefill, and RoPE variants (which rotate K in shared memory), dequantize a tile at a time
  // into one 16-bit K/V tile that ldmatrix reads. A 16-bit cache is copied straight into the
  // 16-bit stages (the staged tiles are the 16-bit tiles).
  constexpr bool KV_FP8 = sizeof(KVType) == 1;
  constexpr bool FP8_REGS = KV_FP8 && SPLIT_KEYS && Variant::ROPE == 0;
  constexpr bool FP8_TILE = KV_FP8 && !FP8_REGS;
  // elements per staged row: fp8 stages read by the dequantization (16 bytes per thread, whole
  // rows per 8 lanes) need no padding against bank conflicts; those read as fragments (8 rows
  // at one column per access phase) are padded by 16 bytes
  // WGMMA (sm_90a prefill, jitattn_wgmma.cuh): each warpgroup multiplies its 64 rows by the
  // whole K/V tile with wgmma, reading Q, K and V from shared memory in 128-byte swizzled
  // panels of 64 columns ([rows][64], 16-byte chunk x of row r at x ^ (r % 8)) instead of
  // padded rows; P stays in registers as wgmma's A operand.
  // The product P V of a tile runs on the tensor cores while the next tile's softmax runs on
  // the other units (FlashAttention-3, Shah et al. 2024, section 3.2, intra-warpgroup
  // overlap): tile i issues S_i = Q K_i^T and then O += P_{i-1} V_{i-1}, waits for S_i only,
  // and waits for the product just before rescaling O. K and V have STAGES slots each, tile t
  // in slot t % STAGES: at the end of tile i, S_i is done with K's slot i % STAGES, which
  // receives K of tile i + STAGES, and O += P_{i-1} V_{i-1} with V's slot (i - 1) % STAGES,
  // which receives V of tile i + STAGES - 1: with two slots each, both are copied a whole
  // tile before their first use.
  // Within a work item the two warpgroups do not meet at block barriers: warpgroup 0 copies the K
  // tiles and warpgroup 1 the V tiles (cp.async, completion signalled on an mbarrier per stage:
  // full; ragged K / V at head_dim 64 / 128: one thread's TMA copy of each whole tile inside one
  // run of rows, completing its bytes on the same barrier), every thread signals when its
  // warpgroup's products no longer
  // read a stage (empty), and the two warpgroups take turns issuing their products (two named
  // barriers; FlashAttention-3's ping-pong, section 3.1), so that one's softmax runs under the
  // other's products. Warpgroup 0 leads by about half a tile: it copies K, which both read first,
  // and warpgroup 1 copies V, which both read last, so neither waits for the other to copy. Between
  // work items the block barriers of for_each_work and of the Q copy remain (the next item's Q
  // overwrites q_s): the pipeline drains there, and only the mbarrier phases carry over (gt counts
  // the CTA's tiles across its items).
  static_assert(!WGMMA || (!SPLIT_KEYS && !KV_FP8 && Variant::ROPE == 0 && ROWS_WARP == 16 &&
                           NUM_WARPS == 8 && HEAD_DIM % 64 == 0 && BLOCK_N % 64 == 0 &&
                           STAGES >= 2),
                "wgmma: prefill over a 16-bit cache without RoPE, two warpgroups of 64 rows "
                "(the barrier counts, named barriers and the K / V copy split assume two), "
                "two stages or more");
  constexpr int TILE_ROW = WGMMA ? HEAD_DIM : ROW;  // elements per row of a 16-bit tile
  constexpr int KV_ROW = KV_FP8 ? HEAD_DIM + (FP8_REGS ? 16 : 0) : TILE_ROW;
  constexpr int KV_CHUNK = 16 / sizeof(KVType);              // elements per 16-byte copy
  constexpr int KV_CHUNKS = HEAD_DIM / KV_CHUNK;             // copies per row
  constexpr int KV_BYTES = (FP8_TILE ? 2 * BLOCK_N * ROW * (int)sizeof(DType) : 0) +
                           STAGES * 2 * BLOCK_N * KV_ROW * (int)sizeof(KVType);
  static_assert(sizeof(KVType) == 1 || sizeof(KVType) == sizeof(DType), "KV element type");
  static_assert(KEYS_WARP % 16 == 0 && HEAD_DIM % 16 == 0, "tile shapes");
  static_assert(!SPLIT_KEYS || (MT == 1 && NUM_WARPS * ROWS_WARP * (HEAD_DIM + 2) * 4 <=
                                             KV_BYTES),
                "split keys: one row block, the warps' states fit in the K/V buffers");
  extern __shared__ __align__(16) unsigned char smem[];
  // swizzled panels start 1024-byte aligned (the host adds 1024 bytes for this)
  DType* q_s = reinterpret_cast<DType*>(smem + (WGMMA ? (1024 - smem_addr(smem) % 1024) % 1024
                                                      : 0));  // [ROWS_CTA][TILE_ROW]
  // 16-bit cache: [STAGES][K, V][BLOCK_N][TILE_ROW]; FP8_TILE: the dequantized
  // [K, V][BLOCK_N][ROW]
  DType* kv_s = q_s + ROWS_CTA * TILE_ROW;
  // the staged tiles, [STAGES][K, V][BLOCK_N][KV_ROW] (16-bit cache and FP8_REGS: at kv_s)
  KVType* kv_stage = reinterpret_cast<KVType*>(FP8_TILE ? kv_s + 2 * BLOCK_N * ROW : kv_s);
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int row_w = SPLIT_KEYS ? 0 : warp * ROWS_WARP;   // the warp's first row of the tile
  const int key_w = SPLIT_KEYS ? warp * KEYS_WARP : 0;   // and first key of each K/V tile
  const int g = a.num_qo_heads / a.num_kv_heads;
  // WGMMA: mbarriers after the stages: full K, full V (count: the 128 copying threads), empty
  // K, empty V (count: all 256 threads), one of each per stage; tiles are numbered across the
  // CTA's work items (gt), tile G in stage G % STAGES, phase (G / STAGES) & 1
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(
      kv_s + (WGMMA ? STAGES * 2 * BLOCK_N * TILE_ROW : 0));
  unsigned long long *full_k = bars, *full_v = bars + STAGES, *empty_k = bars + 2 * STAGES,
                     *empty_v = bars + 3 * STAGES;
  // WGMMA: this thread's warpgroup (0 copies K, 1 copies V), broadcast from lane 0 so that the
  // compiler knows it is the same across the warp and keeps what derives from it (the
  // operands' descriptors) in uniform registers (CUTLASS's canonical_warp_group_idx)
  const int wg = WGMMA ? __shfl_sync(0xffffffffu, warp / 4, 0) : warp / 4;
  int gt = 0;
  if constexpr (WGMMA) {
    if (threadIdx.x == 0)
      for (int i = 0; i < STAGES; ++i) {
        mbar_init(&full_k[i], 128);
        mbar_init(&full_v[i], 128);
        mbar_init(&empty_k[i], 256);
        mbar_init(&empty_v[i], 256);
      }
    if (threadIdx.x == 0) fence_mbar_init();  // before the TMA unit's first complete_tx
    __syncthreads();
    if (wg == 1) named_bar_arrive(1, 256);  // warpgroup 0 issues first
  }
  // element offset of (row r, column c: a multiple of 8) in a 16-bit tile of `rows` rows
  auto tile_at = [](int rows, int r, int c) {
    if constexpr (WGMMA)
      return (c / 64) * rows * 64 + r * 64 + ((((c % 64) / 8) ^ (r % 8)) * 8);
    else
      return r * TILE_ROW + c;
  };

  for_each_work(a, ROWS_CTA, [&](const Work& w) {
    const Request req = get_request(a.requests, a.qo_indptr, a.kv_indptr, a.single_qo_len,
                                    a.single_kv_len, w.b);
    const int packed_rows = req.q_len * g;
    if (w.row0 >= packed_rows) return;
    const int row_last = min(w.row0 + ROWS_CTA, packed_rows) - 1;
    const int2 range = kv_range(req, g, w.row0, row_last, w.kv_lo, w.kv_hi);
    const int num_tiles = range.y > range.x ? (range.y - range.x + BLOCK_N - 1) / BLOCK_N : 0;
    // LAST_FIRST: the range's last tile comes first, then tiles 0 .. num_tiles - 2 (the
    // online softmax's result does not depend on the order beyond rounding). Where the range
    // ends within that tile's first 64 or 128 keys, its S = Q K^T, softmax and P V cover those
    // keys alone (last_keys), in separate instantiations of the first two tiles' steps. (For
    // all wgmma kernels: measured no faster for plain causal prefill, session 25, and at
    // 192-key tiles the shared-prefix build spilled 4 bytes; narrowing the last tile after
    // the loop instead spilled up to 108 and measured 3% slower.)
    [[maybe_unused]] const int last_keys =
        LAST_FIRST && num_tiles > 0
            ? (range.y - range.x - (num_tiles - 1) * BLOCK_N + 63) / 64 * 64 : BLOCK_N;
    // the first key of the item's i-th tile in the loop's order, and of its i-th for i > 0
    auto tile_t0_after_first = [&](int i) {
      return range.x + (LAST_FIRST ? i - 1 : i) * BLOCK_N;
    };
    auto tile_t0 = [&](int i) {
      return LAST_FIRST && i == 0 ? range.x + (num_tiles - 1) * BLOCK_N : tile_t0_after_first(i);
    };
    const int pos_first = req.kv_len - req.q_len + w.row0 / g;
    const int pos_last = req.kv_len - req.q_len + row_last / g;

    // Q tile (rows past the request zero-filled), then K/V tiles 0 .. STAGES - 2: one cp.async
    // group each (WGMMA: K of tiles 0 .. STAGES - 1 and V of tiles 0 .. STAGES - 2, tracked by
    // mbarriers, not groups)
    // A thread copies 16-byte column c of rows r0, r0 + Q_STEP, ...: a fixed step in shared
    // memory (WGMMA: the swizzle of r % 8 does not change) and in q (PackedRowWalk); the
    // division per row this replaces cost 85 instructions a row (ncu, session 8)
    {
      constexpr int Q_STEP = NUM_WARPS * WARP / CHUNKS;
      static_assert((NUM_WARPS * WARP) % CHUNKS == 0 && (!WGMMA || Q_STEP % 8 == 0),
                    "Q copy layout");
      const int r0 = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * 8;
      PackedRowWalk<Q_STEP> row(req.q_start, w.hk, g, w.row0 + r0, a.q_stride_n, a.q_stride_h);
      DType* dst = q_s + tile_at(ROWS_CTA, r0, c);
#pragma unroll
      for (int x = 0; x < (ROWS_CTA + Q_STEP - 1) / Q_STEP; ++x) {
        if (ROWS_CTA % Q_STEP == 0 || r0 + x * Q_STEP < ROWS_CTA) {
          const bool valid = w.row0 + r0 + x * Q_STEP < packed_rows;
          cp_async_16(dst + x * Q_STEP * (WGMMA ? 64 : TILE_ROW), valid ? a.q + row.offset + c : a.q,
                      valid);
        }
        row.next();
      }
    }
    cp_async_commit();
    // A thread copies 16-byte column c of rows j0, j0 + COPY_THREADS / KV_CHUNKS, ... of a K/V
    // tile: the CTA's threads copy the whole tile (prefill), or under SPLIT_KEYS each warp its
    // own KEYS_WARP rows, so that a warp waits for and reads only what it copied and the tile
    // loop needs no block barrier (decode; warps drift apart within the ring of stages).
    // The page-table lookups of all its rows are issued before any copy (one memory latency
    // per tile rather than one per row; looking a tile further ahead was measured no faster
    // on the H200 and costs registers, docs/performance.md v7).
    constexpr int COPY_THREADS = SPLIT_KEYS ? WARP : NUM_WARPS * WARP;
    constexpr int COPY_ROWS = SPLIT_KEYS ? KEYS_WARP : BLOCK_N;
    constexpr int ROWS_THREAD = COPY_ROWS * KV_CHUNKS / COPY_THREADS;
    static_assert(COPY_THREADS % KV_CHUNKS == 0 && COPY_ROWS * KV_CHUNKS % COPY_THREADS == 0,
                  "copy layout");
    const unsigned copy_tid = SPLIT_KEYS ? threadIdx.x % WARP : threadIdx.x;
    const int j0 = key_w + copy_tid / KV_CHUNKS, c = (copy_tid % KV_CHUNKS) * KV_CHUNK;
    // the barrier between a tile's copy and its use, and between its use and the next copy
    // into its stage
    auto tile_barrier = [] {
      if constexpr (SPLIT_KEYS) __syncwarp();
      else __syncthreads();
    };
    int2 loc[ROWS_THREAD];  // (page, slot) of this thread's rows of the tile being copied
    auto lookup = [&](int tile) {
      const int t0 = range.x + tile * BLOCK_N;
#pragma unroll
      for (int x = 0; x < ROWS_THREAD; ++x) {
        const int j = t0 + j0 + x * (COPY_THREADS / KV_CHUNKS);
        loc[x] = j < range.y ? a.k_layout.template locate<SHARED_KV>(req, j)
                             : make_int2(-1, 0);
      }
    };
    const KVType* k_head = a.k + (long long)w.hk * a.k_layout.stride_h + c;
    const KVType* v_head = a.v + (long long)w.hk * a.v_layout.stride_h + c;
    auto copy_tile = [&](int stage) {
      KVType* k_s = kv_stage + stage * 2 * BLOCK_N * KV_ROW;
      KVType* v_s = k_s + BLOCK_N * KV_ROW;
#pragma unroll
      for (int x = 0; x < ROWS_THREAD; ++x) {
        const int j = j0 + x * (COPY_THREADS / KV_CHUNKS);
        const bool valid = loc[x].x >= 0;  // else zero-filled; the address is not read
        const int2 at = make_int2(max(loc[x].x, 0), loc[x].y);
        const int at_s = KV_FP8 ? j * KV_ROW + c : tile_at(BLOCK_N, j, c);
        cp_async_16(k_s + at_s, k_head + a.k_layout.row_offset(at), valid);
        cp_async_16(v_s + at_s, v_head + a.v_layout.row_offset(at), valid);
      }
    };
    // WGMMA: warpgroup wg copies tensor wg (0: K, 1: V) of every tile. Thread t copies the
    // 16-byte chunk q = t % 8 of each 64-column panel of rows t / 8 + 16 x, so that a warp's
    // copy reads four whole 128-byte lines (one request each at the L2). In the swizzled panels
    // chunk q of row r lands at q ^ r % 8, the same for all of a thread's rows: the shared
    // address is a per-thread base plus constants, the global one a per-row pointer plus
    // constants. (The generic copy above costs 46 instructions per row in address arithmetic
    // here; two threads per row, 32 bytes each, quadrupled the L2 requests; ncu, session 5.)
    constexpr int WS_ROWS = BLOCK_N / 16, PANELS = HEAD_DIM / 64;  // per thread and tile
    // ragged K / V through TMA when the host passed the maps (kv_tma; render.py's tma: not at
    // head_dim 256, where the copy's coordinates made ptxas spill)
    constexpr bool TMA = WGMMA && HEAD_DIM <= 128;
    const int ws_r0 = (threadIdx.x % 128) / 8, ws_q = threadIdx.x % 8;
    const KVLayout ws_layout = wg == 0 ? a.k_layout : a.v_layout;
    const char* ws_head = reinterpret_cast<const char*>(
        (wg == 0 ? a.k : a.v) + (long long)w.hk * ws_layout.stride_h) + ws_q * 16;
    const unsigned ws_dst = ws_r0 * 128 + (ws_q ^ (ws_r0 % 8)) * 16;  // within a tile
    // ragged: bytes between a row and the next, and between a thread's rows (16 apart), the
    // latter opaque to the compiler, which otherwise forms each row's address as a 64-bit
    // product of its row number (about 9 instructions a row instead of 2; SASS, session 8);
    // not at head_dim 256 (4 rows a tile), where the register it holds made ptxas spill
    const long long ws_row_bytes = (long long)ws_layout.stride_page * sizeof(KVType);
    const long long ws_step = HEAD_DIM <= 128 ? opaque(16 * ws_row_bytes) : 0;
    // paged with a page size that divides 16: page-list entries between a thread's rows (0:
    // another page size); ws_row_bytes is then the bytes between pages
    const int ws_page_step = ws_layout.kv_indices != nullptr && 16 % ws_layout.page_size.d == 0
                                 ? 16 / ws_layout.page_size.d : 0;
    // this warpgroup's tensor of the item's tile t, once the stage is empty
    // (LAST_FIRST: t0, the tile's first key, from the caller, who knows t > 0 in the loop)
    auto load_ws = [&](int t, int t0_given) {
      const int t0 = LAST_FIRST ? t0_given : range.x + t * BLOCK_N;
      const int G = gt + t, stage = G % STAGES, use = G / STAGES;
      if (use > 0) mbar_wait(wg == 0 ? &empty_k[stage] : &empty_v[stage], (use - 1) & 1);
      const unsigned base = smem_addr(kv_s + (stage * 2 + wg) * BLOCK_N * TILE_ROW) + ws_dst;
      // ragged: the tile's keys lie in one run (the shared prefix's or the request's own), whose
      // logical key 0 is row run0; a tile across the end of the shared prefix takes the
      // per-row path at the end
      const int run0 = ragged_base<SHARED_KV>(req, t0);
      const bool one_run = !SHARED_KV || t0 >= req.shared_len ||
                           min(t0 + BLOCK_N, range.y) <= req.shared_len;
      if (TMA && a.kv_tma && t0 + BLOCK_N <= range.y && one_run) {
        // ragged, a whole tile of the range: TMA, one box of BLOCK_N rows per 64-column panel,
        // issued by one thread; the other 127 only arrive. (The last, partial tile of a range
        // is copied below, zero-filled past it, so that no row of another request, which may
        // hold anything, enters a product: LAST_FIRST's full-width P V of a range's only tile
        // relies on those zeros too.)
        unsigned long long* full = wg == 0 ? &full_k[stage] : &full_v[stage];
        if (threadIdx.x % 128 == 0) {
          mbar_arrive_expect_tx(full, PANELS * BLOCK_N * 128);
          const unsigned tile = smem_addr(kv_s + (stage * 2 + wg) * BLOCK_N * TILE_ROW);
#pragma unroll
          for (int pn = 0; pn < PANELS; ++pn)
            tma_load_3d(tile + pn * BLOCK_N * 128, &a.kv_maps->k + wg, pn * 64, w.hk,
                        run0 + t0, full);
        } else {
          mbar_arrive(full);
        }
        return;
      }
      if (ws_layout.kv_indices == nullptr && one_run) {
        // ragged: the thread's rows are 16 rows apart in k / v, a fixed step from the first
        // (the general path below spends about 12 instructions a row on its address)
        const char* src = ws_head + (long long)(run0 + t0 + ws_r0) * ws_row_bytes;
        const int rows_left = range.y - t0 - ws_r0;  // row x is a key of the range if 16 x < it
#pragma unroll
        for (int x = 0; x < WS_ROWS; ++x) {
          const bool valid = 16 * x < rows_left;  // else zero-filled from an address not read
          const char* row = HEAD_DIM <= 128 ? src + x * ws_step : src + x * 16 * ws_row_bytes;
          row = valid ? row : ws_head;  // (in the tensor)
#pragma unroll
          for (int pn = 0; pn < PANELS; ++pn)
            cp_async_16(base + pn * BLOCK_N * 128 + x * 16 * 128, row + pn * 128, valid);
        }
        cp_async_mbar_arrive_noinc(wg == 0 ? &full_k[stage] : &full_v[stage]);
        return;
      }
      if (ws_page_step > 0) {
        // page size 1, 2, 4, 8 or 16: the thread's rows, 16 apart, lie ws_page_step entries
        // apart in the request's page list, all at the same slot (one division per tile, not
        // one per row; the lookups still come before any copy)
        const int first = t0 + ws_r0, p0 = ws_layout.page_size.div(first);
        const int rows_left = range.y - first;  // row x is a key of the range if 16 x < it
        const int* pages = ws_layout.kv_indices + req.kv_start + p0;
        const char* slot_head = ws_head + (long long)(first - p0 * ws_layout.page_size.d) *
                                              ws_layout.stride_slot * (long long)sizeof(KVType);
        int page[WS_ROWS];
#pragma unroll
        for (int x = 0; x < WS_ROWS; ++x) page[x] = 16 * x < rows_left ? pages[x * ws_page_step] : -1;
#pragma unroll
        for (int x = 0; x < WS_ROWS; ++x) {
          const bool valid = page[x] >= 0;  // else zero-filled from an address not read
          const char* row = valid ? slot_head + page[x] * ws_row_bytes : ws_head;
#pragma unroll
          for (int pn = 0; pn < PANELS; ++pn)
            cp_async_16(base + pn * BLOCK_N * 128 + x * 16 * 128, row + pn * 128, valid);
        }
        cp_async_mbar_arrive_noinc(wg == 0 ? &full_k[stage] : &full_v[stage]);
        return;
      }
      // other page sizes, and ragged tiles across the end of a shared prefix: every row's
      // location (page-table lookup) before any copy: one memory latency per tile
      int2 at[WS_ROWS];
#pragma unroll
      for (int x = 0; x < WS_ROWS; ++x) {
        const int j = t0 + ws_r0 + 16 * x;
        at[x] = j < range.y ? ws_layout.template locate<SHARED_KV>(req, j)
                             : make_int2(-1, 0);
      }
#pragma unroll
      for (int x = 0; x < WS_ROWS; ++x) {
        const bool valid = at[x].x >= 0;  // else zero-filled; the address is not read
        const char* src = ws_head + ws_layout.row_offset(make_int2(max(at[x].x, 0), at[x].y)) *
                                        (long long)sizeof(KVType);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
          cp_async_16(base + pn * BLOCK_N * 128 + x * 16 * 128, src + pn * 128, valid);
      }
      cp_async_mbar_arrive_noinc(wg == 0 ? &full_k[stage] : &full_v[stage]);
    };
    // fp8: the copied rows of staged tile `stage` (K and V) into the 16-bit tile, 16 elements
    // per step (zero-filled rows stay zero)
    auto dequantize = [&](int stage) {
      const KVType* src = kv_stage + stage * 2 * BLOCK_N * KV_ROW;
      for (int i = copy_tid; i < 2 * COPY_ROWS * KV_CHUNKS; i += COPY_THREADS) {
        const int rc = i / KV_CHUNKS, col = (i % KV_CHUNKS) * KV_CHUNK;  // K rows, then V
        const int r = rc < COPY_ROWS ? key_w + rc : BLOCK_N + key_w + rc - COPY_ROWS;
        const uint4 x = *reinterpret_cast<const uint4*>(src + r * KV_ROW + col);
        const unsigned w[4] = {x.x, x.y, x.z, x.w};
        unsigned y[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          y[2 * e] = ja_fp8x2_to<DType, KVType>((unsigned short)(w[e] & 0xffffu));
          y[2 * e + 1] = ja_fp8x2_to<DType, KVType>((unsigned short)(w[e] >> 16));
        }
        uint4* dst = reinterpret_cast<uint4*>(kv_s + r * ROW + col);
        dst[0] = make_uint4(y[0], y[1], y[2], y[3]);
        dst[1] = make_uint4(y[4], y[5], y[6], y[7]);
      }
    };
    if constexpr (WGMMA) {  // K of tiles 0 .. STAGES - 1, V of tiles 0 .. STAGES - 2
#pragma unroll
      for (int t = 0; t < STAGES; ++t)
        if (t < num_tiles && (wg == 0 || t < STAGES - 1)) load_ws(t, tile_t0(t));
    } else {
#pragma unroll
      for (int t = 0; t < STAGES - 1; ++t) {  // one cp.async group per tile, empty past the end
        if (t < num_tiles) {
          lookup(t);
          copy_tile(t);
        }
        cp_async_commit();
      }
    }
    // Q has landed (WGMMA: its group; the K/V copies, never committed, have full barriers)
    cp_async_wait<WGMMA ? 0 : STAGES - 1>();
    if constexpr (WGMMA) fence_proxy_async();
    __syncthreads();
    rope_tile<DType, HEAD_DIM, ROW>(q_s, ROWS_CTA, [&](int r) {
      return w.row0 + r < packed_rows ? req.kv_len - req.q_len + (w.row0 + r) / g : kNoPosition;
    }, threadIdx.x, blockDim.x);
    if constexpr (Variant::ROPE != 0) __syncthreads();

    const DType* q_warp = q_s + row_w * ROW;
    // the A operand of row block mt, k-step kk: rows mt * 16 + lane % 16, columns
    // kk * 16 + (lane / 16) * 8
    constexpr int E = sizeof(DType);  // bytes per element: fragment addresses are in bytes
    const unsigned q_frag_row = smem_addr(q_warp + (lane % 16) * ROW + (lane / 16) * 8);
    // FP8_REGS: the A fragment of k-step kk in K's permuted column order (see the S loop):
    // the pairs (2t, 2t + 1) and (2t + 8, 2t + 9) are physical columns 4 KD t + 4 kk + (0, 1)
    // and (2, 3), t = lane % 4
    const DType* q_perm = q_warp + (lane / 4) * ROW + 4 * KD * (lane % 4);
    auto q_frag_permuted = [&](int kk, unsigned (&qa)[4]) {
      const uint2 lo = *reinterpret_cast<const uint2*>(q_perm + 4 * kk);
      const uint2 hi = *reinterpret_cast<const uint2*>(q_perm + 8 * ROW + 4 * kk);
      qa[0] = lo.x, qa[1] = hi.x, qa[2] = lo.y, qa[3] = hi.y;
    };
    unsigned q_reg[Q_IN_REGS ? KD : 1][4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        if constexpr (FP8_REGS) q_frag_permuted(kk, q_reg[kk]);
        else ldmatrix_x4(q_reg[kk], q_frag_row + kk * 16 * E);
      }
    }
    // this thread's rows: row_w + mt * 16 + lane / 4 (+ 8 for h = 1)
    RowInfo ri[MT][2];
    Variant::Row vrow[MT][2];  // the mods' per-row subexpressions
    Variant::KvLinear lin[MT][2];  // KV_LINEAR: the score_mod's per-row coefficients
    float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ri[mt][h] = row_info(req, w.hk, g, w.row0 + row_w + mt * 16 + lane / 4 + 8 * h);
        vrow[mt][h] = Variant::row(p, w.b, ri[mt][h].h, ri[mt][h].q_pos);
        lin[mt][h] = Variant::kv_linear(p, vrow[mt][h], w.b, ri[mt][h].h, ri[mt][h].q_pos);
        if constexpr (LIN_Y) lin[mt][h].coef /= score_scale;  // (per raw-product unit)
        m[mt][h] = -JA_INF;
        l[mt][h] = 0.f;
      }
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
    }

    // WGMMA: P of the previous tile, the A operand of its product with V (issued with the
    // next tile's S), and that product over the V tile at v_tile
    unsigned pa_prev[WGMMA ? KEYS_WARP / 16 : 1][4];
    auto issue_pv = [&](const DType* v_tile, auto keys) {  // over the tile's first keys.value
      if constexpr (WGMMA) {
        // V in the panels is N-major (transposed B): 16 keys a step are two 1024-byte atoms,
        // the panels of 64 columns lie BLOCK_N * 128 bytes apart
        float(&acc)[ND * 4] = *reinterpret_cast<float(*)[ND * 4]>(&o[0][0][0]);
        wgmma_hold(acc);
        wgmma_hold(pa_prev);
        const unsigned long long v_desc = wgmma_desc(v_tile, BLOCK_N * 64 * 2, 1024);
#pragma unroll
        for (int kk = 0; kk < decltype(keys)::value / 16; ++kk)
          Wgmma<DType, HEAD_DIM>::rs_acc(acc, pa_prev[kk],
                                         wgmma_desc_add(v_desc, kk * 16 * 64 * (int)sizeof(DType)));
      }
    };
    auto v_of = [&](int G) {  // the 16-bit V tile of the CTA's tile G in its stage
      return kv_s + (G % STAGES) * 2 * BLOCK_N * TILE_ROW + BLOCK_N * TILE_ROW;
    };

    // one tile of the loop. FIRST (WGMMA only): the first tile, which has no previous product
    // to issue; a separate instantiation, since a branch between the wgmmas would make ptxas
    // serialize them (warning C7520). NK (below BLOCK_N only for a FIRST tile, see last_keys):
    // S and the softmax cover the tile's first NK keys, and P is 0 past them; prev: the keys
    // of the previous tile's product P V, issued here (the product after the loop, of a
    // range's only tile, runs over the whole tile, whose V rows past the range are 0).
    // WGMMA: whether K of the next tile and V of this one have landed, probed before this
    // tile's P is packed (trace build: two waits in turn took about 200 cycles a tile)
    [[maybe_unused]] bool kv_landed = false;
    auto step = [&](const int tile, auto first, auto keys, auto prev) {
      [[maybe_unused]] constexpr bool FIRST = decltype(first)::value;
      constexpr int NK = decltype(keys)::value, NBK = NK / 8;  // keys and 8-key blocks computed
      static_assert((NK == KEYS_WARP || (LAST_FIRST && FIRST && NK % 64 == 0)) &&
                        (decltype(prev)::value == KEYS_WARP || (LAST_FIRST && !FIRST)),
                    "a narrow tile: the first of a LAST_FIRST range");
      if constexpr (!WGMMA) {  // (WGMMA: copied at the end of the previous tile, see below)
        const int ahead = tile + STAGES - 1;
        if (ahead < num_tiles) {
          lookup(ahead);
          copy_tile(ahead % STAGES);
        }
        cp_async_commit();
      }
      [[maybe_unused]] const int G = gt + tile;  // WGMMA
      if constexpr (WGMMA) {
        if (!kv_landed) {  // (the previous tile's probe did not see both land)
          mbar_wait(&full_k[G % STAGES], (G / STAGES) & 1);  // K of tile `tile` has landed
          if constexpr (!FIRST)  // and V of the one before, for the product issued with S
            mbar_wait(&full_v[(G - 1) % STAGES], ((G - 1) / STAGES) & 1);
        }
        fence_proxy_async();
      } else {
        cp_async_wait<STAGES - 1>();  // tile `tile` has landed
        tile_barrier();
      }
      DType* k_s = kv_s;
      [[maybe_unused]] const KVType* k8_s =  // FP8_REGS
          kv_stage + (tile % STAGES) * 2 * BLOCK_N * KV_ROW;
      [[maybe_unused]] const KVType* v8_s = k8_s + BLOCK_N * KV_ROW;
      if constexpr (FP8_TILE) {
        dequantize(tile % STAGES);
        tile_barrier();
      } else if constexpr (!KV_FP8) {
        k_s += ((WGMMA ? G : tile) % STAGES) * 2 * BLOCK_N * TILE_ROW;
      }
      const DType* v_s = k_s + BLOCK_N * TILE_ROW;
      const int t0 = tile_t0(tile);
      if constexpr (Variant::ROPE != 0) {  // the copied rows
        rope_tile<DType, HEAD_DIM, ROW>(k_s + key_w * ROW, COPY_ROWS,
                                        [&](int j) { return t0 + key_w + j; }, copy_tid,
                                        COPY_THREADS, K_HALVED ? 0.5f : 1.f);
        tile_barrier();
      }

      // S = Q K^T: B operand of key block pair (2 nb2, 2 nb2 + 1) from one ldmatrix.x4
      float s[MT][NB][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
      const unsigned k_frag_row =
          smem_addr(k_s + (key_w + (lane % 8) + (lane / 16) * 8) * ROW + ((lane / 8) % 2) * 8);
      if constexpr (WGMMA) {
        // the warpgroup's 64 rows of Q times the tile's keys, k = 16 columns at a time: K-major
        // operands, 32 bytes further into the panel's swizzled 128-byte rows per step
        float(&acc)[NK / 2] = *reinterpret_cast<float(*)[NK / 2]>(&s[0][0][0]);
        const unsigned long long q_desc = wgmma_desc(q_s + wg * 64 * 64, 16, 1024),
                                 k_desc = wgmma_desc(k_s, 16, 1024);
        named_bar_sync(1 + wg, 256);  // this warpgroup's turn to issue
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
          Wgmma<DType, NK>::ss(
              acc,
              wgmma_desc_add(q_desc, ((kk / 4) * ROWS_CTA * 64 + (kk % 4) * 16) * (int)sizeof(DType)),
              wgmma_desc_add(k_desc, ((kk / 4) * BLOCK_N * 64 + (kk % 4) * 16) * (int)sizeof(DType)),
              kk > 0);
        wgmma_commit();
        if constexpr (!FIRST) issue_pv(v_of(G - 1), prev);
        wgmma_commit();
        named_bar_arrive(2 - wg, 256);  // the other warpgroup's turn
        wgmma_wait<1>();  // S (the previous tile's product may still run)
        wgmma_hold(acc);
        mbar_arrive(&empty_k[G % STAGES]);
      }
      if constexpr (FP8_REGS) {
        // B fragments of keys n = lane / 4 and n + 8 of each 16-key block: this lane's 4 KD
        // bytes of each row, k-step kk in bytes 4 kk .. 4 kk + 3 (low pair, then high pair)
#pragma unroll
        for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
          unsigned kw[2][KD];
#pragma unroll
          for (int x = 0; x < 2; ++x)
            load_words<KD>(kw[x], k8_s + (key_w + nb2 * 16 + lane / 4 + 8 * x) * KV_ROW +
                                      4 * KD * (lane % 4));
#pragma unroll
          for (int kk = 0; kk < KD; ++kk) {
            unsigned qa[4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
              for (int e = 0; e < 4; ++e) qa[e] = q_reg[kk][e];
            } else {
              q_frag_permuted(kk, qa);
            }
            const unsigned kb[4] = {ja_fp8x2_to<DType, KVType>(kw[0][kk] & 0xffffu),
                                    ja_fp8x2_to<DType, KVType>(kw[0][kk] >> 16),
                                    ja_fp8x2_to<DType, KVType>(kw[1][kk] & 0xffffu),
                                    ja_fp8x2_to<DType, KVType>(kw[1][kk] >> 16)};
            mma_16816_x2<DType>(s[0][2 * nb2], s[0][2 * nb2 + 1], qa, kb);
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < (FP8_REGS || WGMMA ? 0 : KD); ++kk) {
        unsigned qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (Q_IN_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[mt][e] = q_reg[kk][e];
          } else {
            ldmatrix_x4(qa[mt], q_frag_row + (mt * 16 * ROW + kk * 16) * E);
          }
        }
#pragma unroll
        for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
          unsigned kb[4];
          ldmatrix_x4(kb, k_frag_row + (nb2 * 16 * ROW + kk * 16) * E);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            mma_16816_x2<DType>(s[mt][2 * nb2], s[mt][2 * nb2 + 1], qa[mt], kb);
        }
      }

      // scores: scale, score_mod, visibility. Without a score_mod the softmax takes the raw
      // scores and folds sm_scale into its exponent's multiply (sm_scale > 0, checked on the
      // host: the maximum of the scaled scores is then the scaled maximum)
      const bool whole = t0 + BLOCK_N <= range.y && Variant::MASK_MODE != 2 &&
                         Variant::MASK_MODE != 3 && !Variant::HAS_MASK_MOD &&
                         (!Variant::CAUSAL || t0 + BLOCK_N - 1 <= pos_first) &&
                         (Variant::WINDOW_LEFT < 0 || pos_last - t0 <= Variant::WINDOW_LEFT);
      // KV_LINEAR (a bias linear in kv_idx, e.g. ALiBi): the bias at the thread's first key
      // of the tile per row, from an exact int (one rounding, as the traced form's), then per
      // score the key's constant column offset c: LIN_Y's y = (coef / sm_scale) * KV_SIGN * c
      // + q.k (the bias and sm_scale join the softmax's per-row terms), else
      // coef * KV_SIGN * c + (score + the bias)
      [[maybe_unused]] float lin_base[MT][2];
      if constexpr (Variant::KV_LINEAR) {
        const int kv0 = t0 + key_w + (lane % 4) * 2;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            lin_base[mt][h] = fmaf(LIN_Y ? lin[mt][h].coef * score_scale : lin[mt][h].coef,
                                   (float)(Variant::KV_SIGN * kv0 + lin[mt][h].off), lin[mt][h].cst);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NBK; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const RowInfo& r = ri[mt][e / 2];
          const int kv_idx = t0 + key_w + n * 8 + (lane % 4) * 2 + (e % 2);
          float x;
          if constexpr (LIN_Y)
            x = fmaf(lin[mt][e / 2].coef, (float)(Variant::KV_SIGN * (n * 8 + e % 2)),
                     s[mt][n][e]);
          else if constexpr (Variant::KV_LINEAR)
            x = fmaf(lin[mt][e / 2].coef, (float)(Variant::KV_SIGN * (n * 8 + e % 2)),
                     fmaf(s[mt][n][e], score_scale, lin_base[mt][e / 2]));
          else if constexpr (SCALED)
            x = Variant::score_inner(s[mt][n][e] * score_scale);
          else
            x = Variant::score_mod(p, vrow[mt][e / 2], s[mt][n][e] * score_scale, w.b, r.h,
                                   r.q_pos, kv_idx);
          if (!whole) {
            bool vis = r.valid && kv_idx < range.y;  // padding rows read no mask data
            if (Variant::CAUSAL) vis = vis && kv_idx <= r.q_pos;
            if (Variant::WINDOW_LEFT >= 0) vis = vis && r.q_pos - kv_idx <= Variant::WINDOW_LEFT;
            vis = vis && data_mask(req, a.mask, r.qi, r.q_pos, kv_idx);
            vis = vis && Variant::mask_mod(p, vrow[mt][e / 2], w.b, r.h, r.q_pos, kv_idx);
            x = vis ? x : -JA_INF;
          }
          s[mt][n][e] = x;
        }
      }

      // online softmax (or sigmoid weights): s becomes P
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Variant::SIGMOID) {
#pragma unroll
          for (int n = 0; n < NBK; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float& x = s[mt][n][e];
              x = x == -JA_INF ? 0.f : 1.f / (1.f + expf(-x));
              l[mt][e / 2] += x;
            }
        } else {
          // The running maximum m (log2 units) moves only when a tile's maximum exceeds it by
          // more than RESCALE_SLACK: P = 2^(s - m) then stays below 2^8, which fp16/bf16 P and
          // the fp32 sums hold exactly as well, and O and l are rescaled far less often. Any
          // m gives the same O / l and lse = m + log2 l (FlashAttention-4's conditional
          // rescaling, docs/sources.md).
          float base[2], alpha[2], shift[2];
          bool grew = false;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float mx = -JA_INF;
#pragma unroll
            for (int n = 0; n < NBK; ++n)
              mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
            // (LIN_Y: into the scores' units with this lane's bias first: the row's four
            // lanes hold keys at different offsets from the tile's start; -inf stays)
            if constexpr (LIN_Y) mx = fmaf(mx, score_scale, lin_base[mt][h]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_max = fmaxf(m[mt][h], mx * exp_scale);
            // (-inf to finite: the difference is +inf; -inf to -inf: NaN, also not kept)
            const float m_new = m_max - m[mt][h] <= RESCALE_SLACK ? m[mt][h] : m_max;
            base[h] = m_new == -JA_INF ? 0.f : m_new;  // nothing visible yet: p = 0
            // the exponent's per-row term: LIN_Y adds the tile's bias there
            shift[h] = LIN_Y ? fmaf(lin_base[mt][h], exp_scale, -base[h]) : -base[h];
            alpha[h] = exp2_approx(m[mt][h] - base[h]);
            grew = grew || m_new != m[mt][h];
            m[mt][h] = m_new;
          }
          auto exponentiate = [&](float (&row_sum)[2]) {  // s becomes P, summed per row
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int n = 0; n < NBK; ++n)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                  s[mt][n][e] = exp2_approx(fmaf(s[mt][n][e], y_scale, shift[h]));
                  row_sum[h] += s[mt][n][e];
                }
          };
          [[maybe_unused]] float sum[2] = {0.f, 0.f};
          if constexpr (WGMMA) {
            // P first, while the previous product (O += P V) finishes, then the wait for it.
            // ptxas moves a wgmma wait up within its basic block (here to the softmax's
            // start, so that the softmax ran after the product instead of under it: SASS,
            // session 19), so the wait sits in a block of its own, the body of a loop of one
            // trip. Its trip count tests both rows' sums (never negative: always 1); ptxas
            // proves the test false, but keeps the loop, and with both sums in the test it
            // keeps their adds above the wait (with one row's, it moved half of them after
            // it). A branch around the wait would not do: every thread of the warpgroup must
            // execute the same wgmma.wait_group (PTX ISA), and a warp-level branch is not the
            // warpgroup's. (tests/test_render.py checks the order in SASS.)
            exponentiate(sum);
            const int trips = 1 + __any_sync(0xffffffffu, fminf(sum[0], sum[1]) < 0.f);
#pragma unroll 1
            for (int i = 0; i < trips; ++i) {
              wgmma_wait<0>();
              wgmma_hold(*reinterpret_cast<float(*)[ND * 4]>(&o[0][0][0]));
            }
          }
          // O and l are rescaled only when some row's max grew in this warp: otherwise every
          // factor is exactly 1, or the row has seen nothing and O, l are still 0. After the
          // first tiles the max rarely grows, so most tiles skip the ND * 4 multiplies.
          if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              l[mt][h] *= alpha[h];
#pragma unroll
              for (int n = 0; n < ND; ++n) {
                o[mt][n][2 * h] *= alpha[h];
                o[mt][n][2 * h + 1] *= alpha[h];
              }
            }
          }
          if constexpr (WGMMA) {
            l[mt][0] += sum[0];
            l[mt][1] += sum[1];
          } else {
            exponentiate(l[mt]);
          }
        }
      }

      // O += P V: P's accumulator fragments are the A operand of the next mma (16 keys a step):
      // keys 16 kk .. 16 kk + 15 of row block mt
      auto pack_p = [&](int mt, int kk, unsigned (&pa)[4]) {
        pa[0] = pack2<DType>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[1] = pack2<DType>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[2] = pack2<DType>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[3] = pack2<DType>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      };
      if constexpr (WGMMA) {  // P for the product issued with the next tile's S
        wgmma_wait<0>();  // (sigmoid: the previous product no longer reads pa_prev)
        wgmma_hold(*reinterpret_cast<float(*)[ND * 4]>(&o[0][0][0]));
        if constexpr (!FIRST) mbar_arrive(&empty_v[(G - 1) % STAGES]);
        const bool k_in = mbar_test(&full_k[(G + 1) % STAGES], ((G + 1) / STAGES) & 1);
        const bool v_in = mbar_test(&full_v[G % STAGES], (G / STAGES) & 1);
        kv_landed = (tile + 1 < num_tiles) & k_in & v_in;
#pragma unroll
        for (int kk = 0; kk < NK / 16; ++kk) {
          pack_p(0, kk, pa_prev[kk]);
        }
#pragma unroll
        for (int kk = NK / 16; kk < KEYS_WARP / 16; ++kk)  // (past the range: V's rows are 0)
#pragma unroll
          for (int e = 0; e < 4; ++e) pa_prev[kk][e] = 0u;
      }
      if constexpr (FP8_REGS) {
        // B fragments: keys (2t, 2t + 1) and (2t + 8, 2t + 9) of each 16-key step, t = lane % 4,
        // at logical column lane / 4 of every 8-column block n, physical column
        // ND * (lane / 4) + n: a lane's ND bytes of each of its four key rows are contiguous
#pragma unroll
        for (int kk = 0; kk < KEYS_WARP / 16; ++kk) {
          unsigned pa[4];
          pack_p(0, kk, pa);
          unsigned vw[4][ND / 4];  // rows 2t, 2t + 1, 2t + 8, 2t + 9
#pragma unroll
          for (int x = 0; x < 4; ++x)
            load_words<ND / 4>(vw[x], v8_s + (key_w + kk * 16 + 2 * (lane % 4) + (x % 2) +
                                              8 * (x / 2)) * KV_ROW + ND * (lane / 4));
#pragma unroll
          for (int wd = 0; wd < ND / 4; ++wd)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              // bytes j, j + 1 of two rows interleaved: (row a j, row b j, row a j+1, row b j+1)
              const unsigned sel = hh ? 0x7362u : 0x5140u;
              const unsigned lo = __byte_perm(vw[0][wd], vw[1][wd], sel);
              const unsigned hi = __byte_perm(vw[2][wd], vw[3][wd], sel);
              const int n = 4 * wd + 2 * hh;
              mma_16816<DType>(o[0][n], pa, ja_fp8x2_to<DType, KVType>(lo & 0xffffu),
                               ja_fp8x2_to<DType, KVType>(hi & 0xffffu));
              mma_16816<DType>(o[0][n + 1], pa, ja_fp8x2_to<DType, KVType>(lo >> 16),
                               ja_fp8x2_to<DType, KVType>(hi >> 16));
            }
        }
      }
      const unsigned v_frag_row =
          smem_addr(v_s + (key_w + (lane % 8) + ((lane / 8) % 2) * 8) * ROW + (lane / 16) * 8);
#pragma unroll
      for (int kk = 0; kk < (FP8_REGS || WGMMA ? 0 : KEYS_WARP / 16); ++kk) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pack_p(mt, kk, pa[mt]);
        }
#pragma unroll
        for (int nd2 = 0; nd2 < ND / 2; ++nd2) {
          unsigned vb[4];
          ldmatrix_x4_trans(vb, v_frag_row + (kk * 16 * ROW + nd2 * 16) * E);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            mma_16816_x2<DType>(o[mt][2 * nd2], o[mt][2 * nd2 + 1], pa[mt], vb);
        }
      }
      if constexpr (WGMMA) {
        // K of tile + STAGES into tile's slot, V of tile + STAGES - 1 into the slot of
        // tile - 1, once both warpgroups are done with it (load_ws waits for its empty barrier)
        const int next = tile + (wg == 0 ? STAGES : STAGES - 1);
        if (next < num_tiles) load_ws(next, tile_t0_after_first(next));  // (next >= 1)
      } else {
        tile_barrier();  // this stage is consumed before tile + STAGES is loaded into it
      }
    };
    if constexpr (WGMMA) {
      // the first tile, narrowed, and the second, whose product P V with the first's V is
      // narrowed alike
      constexpr Keys<BLOCK_N> full{};
      int tile = 1;
      if (num_tiles > 0) {
        if (!LAST_FIRST || last_keys == BLOCK_N) {
          step(0, Flag<true>{}, full, full);
        } else if constexpr (LAST_FIRST && BLOCK_N > 128) {
          if (last_keys == 128) {
            step(0, Flag<true>{}, Keys<128>{}, full);
            if (num_tiles > 1) step(tile++, Flag<false>{}, full, Keys<128>{});
          } else {
            step(0, Flag<true>{}, Keys<64>{}, full);
            if (num_tiles > 1) step(tile++, Flag<false>{}, full, Keys<64>{});
          }
        } else if constexpr (LAST_FIRST && BLOCK_N > 64) {
          step(0, Flag<true>{}, Keys<64>{}, full);
          if (num_tiles > 1) step(tile++, Flag<false>{}, full, Keys<64>{});
        }
      }
      for (; tile < num_tiles; ++tile) step(tile, Flag<false>{}, full, full);
    } else {
      for (int tile = 0; tile < num_tiles; ++tile)
        step(tile, Flag<false>{}, Keys<KEYS_WARP>{}, Keys<KEYS_WARP>{});
    }
    if constexpr (WGMMA) {  // the last tile's product
      if (num_tiles > 0) {
        const int G = gt + num_tiles - 1;
        mbar_wait(&full_v[G % STAGES], (G / STAGES) & 1);
        fence_proxy_async();
        wgmma_fence();
        issue_pv(v_of(G), Keys<KEYS_WARP>{});
        wgmma_commit();
        wgmma_wait<0>();
        mbar_arrive(&empty_v[G % STAGES]);
      }
      gt += num_tiles;
    }
    cp_async_wait<0>();

    // a finished row: into out / lse, or into the work item's partial rows
    auto store = [&](int local, const RowInfo& r, int col, float2 x) {
      const long long row = w.partial < 0
          ? (long long)(req.q_start + r.qi) * a.num_qo_heads + r.h : (long long)w.partial + local;
      if (w.partial < 0) store2(a.o + row * HEAD_DIM + col, x);
      else store2(a.partial_o + row * HEAD_DIM + col, x);
    };
    auto store_lse = [&](int local, const RowInfo& r, float x) {
      if (w.partial >= 0) a.partial_lse[(long long)w.partial + local] = x;
      else if (a.lse) a.lse[(long long)(req.q_start + r.qi) * a.num_qo_heads + r.h] = x;
    };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // the row's four lanes hold 2 columns of each 8-dim block
        l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 1);
        l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 2);
      }
    if constexpr (!SPLIT_KEYS) {
      // Rows into partial rows (float32) as they are in the fragments; into out through this
      // warp's own rows of q_s, which nothing reads any more (its products are done), so that
      // consecutive lanes store whole 16-byte chunks of a row instead of a fragment's column
      // pairs (4-byte stores, 8 rows per instruction: 8% of a window-1024 prefill, ncu)
      const bool staged = w.partial < 0;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int local = row_w + mt * 16 + lane / 4 + 8 * h;
          // recomputed here rather than kept live across the loop (registers)
          const RowInfo r = row_info(req, w.hk, g, w.row0 + local);
          const float lr = l[mt][h];
          const bool any = lr != 0.f;  // (NaN: a NaN score; the row and its lse are NaN)
          const float inv = Variant::SIGMOID ? 1.f : (any ? 1.f / lr : 0.f);
          if (staged) {  // rows past the request too (never stored)
#pragma unroll
            for (int n = 0; n < ND; ++n)
              *reinterpret_cast<typename Pair<DType>::T2*>(
                  q_s + tile_at(ROWS_CTA, local, n * 8) + (lane % 4) * 2) =
                  Pair<DType>::from_float2(
                      make_float2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv));
          } else if (r.valid) {
#pragma unroll
            for (int n = 0; n < ND; ++n)
              store(local, r, n * 8 + (lane % 4) * 2,
                    make_float2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv));
          }
          if (r.valid && lane % 4 == 0)
            store_lse(local, r, !any ? -JA_INF
                                     : (Variant::SIGMOID ? logf(lr) : m[mt][h] * LN2 + logf(lr)));
        }
      if (staged) {
        // lane: 16-byte column c of the warp's rows rw0, rw0 + O_STEP, ...
        constexpr int O_STEP = WARP / CHUNKS;
        static_assert(WARP % CHUNKS == 0, "output store layout");
        __syncwarp();
        const int rw0 = lane / CHUNKS, c = (lane % CHUNKS) * 8;
        PackedRowWalk<O_STEP> row(req.q_start, w.hk, g, w.row0 + row_w + rw0,
                                  (long long)a.num_qo_heads * HEAD_DIM, HEAD_DIM);
#pragma unroll
        for (int x = 0; x < MT * 16 / O_STEP; ++x) {
          const int local = row_w + rw0 + x * O_STEP;
          store16_if(a.o + row.offset + c,
                     *reinterpret_cast<const uint4*>(q_s + tile_at(ROWS_CTA, local, c)),
                     w.row0 + local < packed_rows);
          row.next();
        }
      }
    } else {
      // merge the warps' states of the same rows through shared memory, in the K/V stages
      // once every warp is done with them: per warp and row, o then m (log2) and l
      constexpr int RED = HEAD_DIM + 2;
      float* red = reinterpret_cast<float*>(kv_s);
      __syncthreads();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* dst = red + (warp * ROWS_WARP + lane / 4 + 8 * h) * RED;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          if constexpr (FP8_REGS) {  // logical column c of block n is physical ND c + n
            dst[ND * (lane % 4) * 2 + n] = o[0][n][2 * h];
            dst[ND * ((lane % 4) * 2 + 1) + n] = o[0][n][2 * h + 1];
          } else {
            *reinterpret_cast<float2*>(dst + n * 8 + (lane % 4) * 2) =
                make_float2(o[0][n][2 * h], o[0][n][2 * h + 1]);
          }
        }
        if (lane % 4 == 0) {
          dst[HEAD_DIM] = m[0][h];
          dst[HEAD_DIM + 1] = l[0][h];
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < ROWS_WARP * HEAD_DIM / 2; i += blockDim.x) {
        const int local = i / (HEAD_DIM / 2), col = (i % (HEAD_DIM / 2)) * 2;
        const RowInfo r = row_info(req, w.hk, g, w.row0 + local);
        if (!r.valid) continue;
        float mx = -JA_INF;
        if (!Variant::SIGMOID)
#pragma unroll
          for (int x = 0; x < NUM_WARPS; ++x) mx = fmaxf(mx, red[(x * ROWS_WARP + local) * RED + HEAD_DIM]);
        const float base = mx == -JA_INF ? 0.f : mx;
        float total = 0.f;
        float2 acc = make_float2(0.f, 0.f);
#pragma unroll
        for (int x = 0; x < NUM_WARPS; ++x) {
          const float* src = red + (x * ROWS_WARP + local) * RED;
          const float scale = Variant::SIGMOID ? 1.f : exp2_approx(src[HEAD_DIM] - base);
          total += src[HEAD_DIM + 1] * scale;
          acc.x += src[col] * scale;
          acc.y += src[col + 1] * scale;
        }
        const bool any = total != 0.f;  // (NaN: a NaN score; the row and its lse are NaN)
        const float inv = Variant::SIGMOID ? 1.f : (any ? 1.f / total : 0.f);
        store(local, r, col, make_float2(acc.x * inv, acc.y * inv));
        if (col == 0)
          store_lse(local, r, !any ? -JA_INF
                                   : (Variant::SIGMOID ? logf(total) : mx * LN2 + logf(total)));
      }
    }
  });
}

}  // namespace ja
