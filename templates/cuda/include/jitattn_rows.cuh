// Walking a work item's packed rows without a division per row (the Q copy and the output
// stores of jitattn_attend.cuh). Host-compilable: tests/test_packed_rows.py checks it with g++.
#pragma once

#include "jitattn_math.h"

namespace ja {

// Packed rows p0, p0 + STEP, p0 + 2 STEP, ... of kv head hk (row p: token q_start + p / g, head
// hk * g + p % g) as element offsets into a [tokens, heads, ...] tensor with strides
// (stride_n, stride_h), one division when made instead of one per row (the Q copy and the
// output stores walk a thread's rows this way).
template <int STEP>
struct PackedRowWalk {
  long long offset;  // of the current row
  long long step;    // STEP rows further when the head does not wrap
  long long wrap;    // added when it does: the next token's head 0 instead of head g
  int h, dh, g;
  JA_HD PackedRowWalk(int q_start, int hk, int g_, int p0, long long stride_n,
                      long long stride_h) : g(g_) {
    const int qi = p0 / g;
    h = p0 - qi * g;
    dh = STEP % g;
    offset = (q_start + qi) * stride_n + (hk * g + h) * stride_h;
    step = (long long)(STEP / g) * stride_n + dh * stride_h;
    wrap = stride_n - g * stride_h;
  }
  JA_HD void next() {
    offset += step;
    h += dh;
    if (h >= g) {
      h -= g;
      offset += wrap;
    }
  }
};

}  // namespace ja
