"""indptrs / page tables -> a frozen Plan: load-balanced work items and the merge map. Host only.

The scheduler is FlashInfer's (Ye et al., "FlashInfer", arXiv 2501.01005, section 3.3; see
SEEDS_DIGEST.md): a query tile is ``rows_per_cta`` packed rows (GQA head-group fusion: packed row
r of request b is query r // g of kv head hk, head hk * g + r % g). The work is
W = sum over tiles of the KV length each tile can see (causal and window ranges applied), the KV
chunk cap is L = max(1, ceil(W / C)) with C resident CTAs (here ceil(W / kC), k in 1..8 chosen
by the predicted makespan, which evens out waves), every tile's KV range is cut into
chunks of at most L keys (rounded up to whole 32-key tiles), chunks are sorted by length,
longest first with stable ids for ties, and each goes to the least-loaded CTA with cost
alpha * rows + beta * len. A tile cut into several chunks writes partial states that a merge
kernel combines in chunk order; nothing uses atomics, so the same plan gives bit-identical
outputs run after run.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

KV_TILE = 32          # keys per shared-memory tile in the kernels
ITEM_FIELDS = 8       # int32 per work item on the device
REQUEST_FIELDS = 8    # int32 per request on the device: q_start, q_len, kv_len, kv_start,
#                       mask_offset (bytes into the packed custom mask), prefix_len,
#                       token_pos_offset (into token_pos_in_items), unused


@dataclass(frozen=True)
class Plan:
    """A schedule for one batch. Arrays are int32 numpy, laid out as the kernels read them.

    requests: [batch, 8] (q_start, q_len, kv_len, kv_start, mask_offset, prefix_len,
        token_pos_offset, 0); kv_start is the request's first entry in kv_indices (paged) or its
        first row of k/v (ragged); the mask fields serve the "custom" and "multi_item" masks.
    items: [num_items, 8] (request, kv_head, row0, kv_lo, kv_hi, partial_row, 0, 0), grouped by
        CTA; partial_row is -1 when the item writes out/lse directly, else the first of
        ``rows_per_cta`` partial-state rows it owns.
    cta_indptr: [num_ctas + 1] offsets of each CTA's items in ``items``.
    merge_indptr: [num_merged + 1]; merge_rows: [num_merged] output rows (token * Hq + head);
        merge_slots: partial rows to merge for each, in KV order.
    item_cost: [num_items] predicted cost (alpha * rows + beta * keys) of each item.
    """

    requests: np.ndarray
    items: np.ndarray
    cta_indptr: np.ndarray
    merge_indptr: np.ndarray
    merge_rows: np.ndarray
    merge_slots: np.ndarray
    item_cost: np.ndarray
    num_ctas: int
    rows_per_cta: int
    group_size: int
    num_partial_rows: int
    chunk_cap: int

    @property
    def num_items(self) -> int:
        return len(self.items)

    @property
    def cta_load(self) -> np.ndarray:
        """Predicted cost per CTA."""
        return np.add.reduceat(np.append(self.item_cost, 0.0), self.cta_indptr[:-1]) \
            * (np.diff(self.cta_indptr) > 0)

    @property
    def lower_bound(self) -> float:
        """max(sum of item costs / C, largest item): no schedule of these items does better."""
        if self.num_items == 0:
            return 0.0
        return float(max(self.item_cost.sum() / self.num_ctas, self.item_cost.max()))

    def describe(self) -> str:
        """A readable summary: items per CTA, predicted makespan against the lower bound."""
        load = self.cta_load
        counts = np.diff(self.cta_indptr)
        split = int((self.items[:, 5] >= 0).sum()) if self.num_items else 0
        lines = [
            f"Plan: {len(self.requests)} requests, {self.num_items} work items on "
            f"{self.num_ctas} CTAs ({self.rows_per_cta} packed rows per item, GQA group "
            f"{self.group_size}), KV chunk cap {self.chunk_cap} keys",
            f"  predicted makespan {load.max() if len(load) else 0:.0f} vs lower bound "
            f"{self.lower_bound:.0f} (cost units: alpha*rows + beta*keys)",
            f"  items per CTA: min {counts.min() if len(counts) else 0}, "
            f"max {counts.max() if len(counts) else 0}; {split} items write partial states, "
            f"{len(self.merge_rows)} output rows merged",
        ]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Save a PNG of the predicted load per CTA against the lower bound (needs matplotlib:
        ``pip install 'jitattn[plot]'``)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("Plan.plot needs matplotlib: pip install 'jitattn[plot]'") from e
        fig, ax = plt.subplots(figsize=(10, 3.5))
        ax.bar(range(self.num_ctas), self.cta_load, width=1.0, color="#4878a8")
        ax.axhline(self.lower_bound, color="#c44e52", lw=1.5,
                   label=f"lower bound max(sum/C, max item) = {self.lower_bound:.0f}")
        ax.set_xlabel("CTA")
        ax.set_ylabel("predicted cost (alpha*rows + beta*keys)")
        ax.set_title(f"{len(self.requests)} requests, {self.num_items} work items, "
                     f"chunk cap {self.chunk_cap} keys")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def kv_window(q_len: int, kv_len: int, g: int, row0: int, row_last: int, causal: bool,
              window_left: int | None) -> tuple[int, int]:
    """KV range [lo, hi) that packed rows [row0, row_last] can see (queries end-aligned)."""
    first = kv_len - q_len + row0 // g
    last = kv_len - q_len + row_last // g
    hi = min(kv_len, last + 1) if causal else kv_len
    lo = max(0, first - window_left) if window_left is not None else 0
    return lo, max(lo, hi)


def kv_spans(q_len: int, kv_len: int, g: int, row0: int, row_last: int, causal: bool,
             window_left: int | None, prefix_len: int | None = None,
             max_item_len: int | None = None) -> list[tuple[int, int]]:
    """Disjoint KV spans rows [row0, row_last] can see. With a multi-item mask (prefix_len and
    max_item_len given) rows inside the items see the prefix and at most max_item_len keys back
    into their own item, so the keys between are skipped (tile skipping across items)."""
    lo, hi = kv_window(q_len, kv_len, g, row0, row_last, causal, window_left)
    if prefix_len is None or max_item_len is None:
        return [(lo, hi)]
    first = kv_len - q_len + row0 // g
    item_lo = max(prefix_len, first - max_item_len + 1)
    if first < prefix_len or item_lo <= prefix_len:
        return [(lo, hi)]
    spans = [(lo, min(hi, prefix_len)), (max(lo, item_lo), hi)]
    return [(a, b) for a, b in spans if b > a] or [(lo, lo)]


def _chunks(tiles, cap):
    """Cut each tile's KV range into equal chunks of at most ``cap`` keys (whole 32-key tiles).
    Returns (length, id, tile index, lo, hi) per chunk."""
    chunks = []
    for t, (b, hk, row0, lo, hi) in enumerate(tiles):
        n = max(1, math.ceil((hi - lo) / cap))
        step = -(-(hi - lo) // n) if hi > lo else 0
        step = -(-step // KV_TILE) * KV_TILE if step else 0
        for s in (range(lo, hi, step) if step else [lo]):
            end = min(s + step, hi) if step else hi
            chunks.append((end - s, len(chunks), t, s, end))
    return chunks


def _partial_rows(chunks, tiles, rows_per_cta) -> int:
    """Partial-state rows a chunking needs: every chunk of a row tile cut in several."""
    per_tile = {}
    for _, _, t, _, _ in chunks:
        per_tile[tiles[t][:3]] = per_tile.get(tiles[t][:3], 0) + 1
    return sum(n for n in per_tile.values() if n > 1) * rows_per_cta


def _assign(chunks, num_ctas, item_cost, key_cost):
    """Longest chunk first onto the least-loaded CTA (ties: lowest CTA id); cost of a chunk is
    item_cost + key_cost * keys. Returns (per-CTA lists, makespan)."""
    heap = [(0.0, c) for c in range(num_ctas)]
    assigned = [[] for _ in range(num_ctas)]
    for length, cid, t, lo, hi in sorted(chunks, key=lambda c: (-c[0], c[1])):
        load, cta = heapq.heappop(heap)
        cost = item_cost + key_cost * length
        assigned[cta].append((cid, t, lo, hi, cost))
        heapq.heappush(heap, (load + cost, cta))
    return assigned, max(load for load, _ in heap)


def make_plan(qo_lens, kv_lens, kv_starts, *, num_qo_heads: int, num_kv_heads: int,
              rows_per_cta: int, num_ctas: int, causal: bool, window_left: int | None,
              split_kv: bool = True, alpha: float = 16.0, beta: float = 1.0,
              mask_offsets=None, prefix_lens=None, token_pos_offsets=None,
              max_item_lens=None, max_partial_rows: int | None = None) -> Plan:
    """Schedule a batch. qo_lens / kv_lens / kv_starts: per request (host ints). Cost model:
    alpha per query row of an item (its fixed work: loading rows, writing or merging states)
    plus beta per key, in units of one key's work. The mask
    arrays (per request) are copied into the request table; prefix_lens with max_item_lens
    enable tile skipping for multi-item masks. max_partial_rows: the workspace's capacity;
    splits that would need more are not chosen (with none left, the KV is not split, and if
    multi-item spans still need more, row tiles are not cut into spans)."""
    g = num_qo_heads // num_kv_heads
    batch = len(qo_lens)
    q_starts = np.concatenate([[0], np.cumsum(qo_lens)[:-1]]) if batch else np.zeros(0)
    requests = np.zeros((batch, REQUEST_FIELDS), dtype=np.int32)
    if batch:
        requests[:, 0], requests[:, 1] = q_starts, qo_lens
        requests[:, 2], requests[:, 3] = kv_lens, kv_starts
        for col, values in ((4, mask_offsets), (5, prefix_lens), (6, token_pos_offsets)):
            if values is not None:
                requests[:, col] = values

    # query tiles and the KV spans each can see (one tile per span)
    def make_tiles(skip: bool):
        tiles = []  # (request, kv_head, row0, lo, hi)
        for b in range(batch):
            rows = int(qo_lens[b]) * g
            multi = skip and prefix_lens is not None and max_item_lens is not None
            for row0 in range(0, rows, rows_per_cta):
                spans = kv_spans(int(qo_lens[b]), int(kv_lens[b]), g, row0,
                                 min(row0 + rows_per_cta, rows) - 1, causal, window_left,
                                 int(prefix_lens[b]) if multi else None,
                                 int(max_item_lens[b]) if multi else None)
                for hk in range(num_kv_heads):
                    for lo, hi in spans:
                        tiles.append((b, hk, row0, lo, hi))
        return tiles

    tiles = make_tiles(skip=True)
    # KV chunk cap: ceil(W / (k C)), with k (chunks per CTA on average) chosen by predicting
    # the makespan of each candidate; k = 1 is the paper's rule, larger k evens out the waves
    # when tiles are about as long as W / C
    total = sum(hi - lo for *_, lo, hi in tiles)
    best = None
    for k in ((1, 2, 3, 4, 6, 8) if split_kv else ()) + (None,):
        if k is None and best is not None:
            break  # no split: only when no split fits the workspace (or splitting is off)
        cap = 1 << 30 if k is None else max(1, math.ceil(total / max(1, num_ctas * k)))
        cap = -(-cap // KV_TILE) * KV_TILE
        chunks = _chunks(tiles, cap)
        if max_partial_rows is not None and \
                _partial_rows(chunks, tiles, rows_per_cta) > max_partial_rows:
            if k is not None:
                continue  # would not fit the workspace
            # multi-item tile skipping cuts a row tile into spans that are merged like splits;
            # when even those do not fit, each row tile takes one span (the mask skips keys)
            tiles = make_tiles(skip=False)
            chunks = _chunks(tiles, cap)
        assigned, makespan = _assign(chunks, num_ctas, alpha * rows_per_cta, beta)
        if best is None or makespan < best[0] - 1e-9:
            best = (makespan, cap, chunks, assigned)
    _, cap, chunks, assigned = best

    # partial rows for row tiles whose keys are cut into several chunks (or spans)
    per_tile = {}  # (request, kv_head, row0) -> chunk spans
    for _, _, t, lo, hi in chunks:
        per_tile.setdefault(tiles[t][:3], []).append((lo, hi))
    partial_of = {}  # (request, kv_head, row0, lo) -> first partial row
    next_row = 0
    for key, spans in per_tile.items():
        if len(spans) > 1:
            for lo, _ in spans:
                partial_of[(*key, lo)] = next_row
                next_row += rows_per_cta

    items, costs, cta_indptr = [], [], [0]
    for cta in range(num_ctas):
        for cid, t, lo, hi, cost in assigned[cta]:
            b, hk, row0, _, _ = tiles[t]
            items.append((b, hk, row0, lo, hi, partial_of.get((b, hk, row0, lo), -1), 0, 0))
            costs.append(cost)
        cta_indptr.append(len(items))

    merge_indptr, merge_rows, merge_slots = [0], [], []
    for (b, hk, row0), spans in per_tile.items():
        if len(spans) < 2:
            continue
        rows = int(qo_lens[b]) * g
        for r in range(row0, min(row0 + rows_per_cta, rows)):
            token = int(q_starts[b]) + r // g
            merge_rows.append(token * num_qo_heads + hk * g + r % g)
            merge_slots += [partial_of[(b, hk, row0, lo)] + (r - row0) for lo, _ in sorted(spans)]
            merge_indptr.append(len(merge_slots))

    as_i32 = lambda x, shape=(-1,): np.asarray(x, dtype=np.int32).reshape(shape)  # noqa: E731
    return Plan(requests=requests, items=as_i32(items, (-1, ITEM_FIELDS)),
                cta_indptr=as_i32(cta_indptr), merge_indptr=as_i32(merge_indptr),
                merge_rows=as_i32(merge_rows), merge_slots=as_i32(merge_slots),
                item_cost=np.asarray(costs, dtype=np.float64), num_ctas=num_ctas,
                rows_per_cta=rows_per_cta, group_size=g, num_partial_rows=next_row,
                chunk_cap=cap)
