"""indptrs / page tables -> a frozen Plan: load-balanced work items and the merge map. Host only.

The scheduler is FlashInfer's (Ye et al., "FlashInfer", arXiv 2501.01005, section 3.3; see
docs/sources.md): a query tile is ``rows_per_cta`` packed rows (GQA head-group fusion: packed row
r of request b is query r // g of kv head hk, head hk * g + r % g). The work is
W = sum over tiles of the KV length each tile can see (causal and window ranges applied), the KV
chunk cap is L = max(1, ceil(W / C)) with C resident CTAs (here ceil(W / kC), k in 1..8 chosen
by the predicted makespan, which evens out waves), every tile's KV range is cut into
chunks of at most L keys (rounded up to whole kv_tile-key tiles), chunks are sorted by length
in whole kv_tile-key tiles (the kernel's work), longest first, ties by kv head and then id (among
chunks of equal length the CTAs take one head's chunks before the next, and read the K/V they
share from L2), and each goes to the least-loaded CTA with cost alpha * rows + beta * len. One
more candidate, a linear partition (stream-K, Osama et al. 2023: the ranges laid end to end and
cut into C runs of equal cost), is taken when it predicts a clearly shorter makespan: it
balances batches of a few long ranges that equal chunks cannot (16 x 32768 keys on 264 CTAs). A
plan that cuts tiles is kept only when it predicts a makespan shorter than the plan without cuts
by more than MERGE_ITEMS items' fixed cost, since it also launches the merge kernel. A tile cut
into several chunks writes partial states that a merge kernel combines in chunk order; nothing
uses atomics, so the same plan gives bit-identical outputs run after run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .emit import MAX_SEQ_LEN

KV_TILE = 64          # keys per K/V tile by default (make_plan's kv_tile: the kernel's)
ITEM_FIELDS = 8       # int32 per work item on the device
FILL_MARGIN = 0.08    # the linear partition (_fill) cuts more spans than longest-first placement,
#                       and each cut costs a partial-state write and a merge the model omits;
#                       it is taken only when its predicted makespan is this much shorter. On
#                       the H200 (decode, docs/performance.md v9) it measured about 7% slower
#                       than predicted relative to longest-first: predicted 12.9% faster at
#                       16 x 32768, measured 5%; predicted equal at 64 x 4096, measured 6.6% slower
MERGE_ITEMS = 1.0     # a plan that splits tiles also launches the merge kernel (which reads the
#                       partial states back and writes the rows) and, eager, pays one more
#                       launch on the host (about 20 of the 99 us per small decode run() on the
#                       H200's host, docs/performance.md session 8): it is taken only when
#                       it shortens the predicted makespan by more than this many items' fixed
#                       cost (alpha * rows_per_cta) against the plan without splits
REQUEST_FIELDS = 12   # int32 per request on the device: q_start, q_len, kv_len, kv_start,
#                       mask_offset (bytes into the packed custom mask), prefix_len,
#                       token_pos_offset (into token_pos_in_items), shared_len, shared_start,
#                       three unused (rows of three 16-byte loads)


@dataclass(frozen=True)
class Plan:
    """A schedule for one batch. Arrays are int32 numpy, laid out as the kernels read them.

    requests: [batch, 12] (q_start, q_len, kv_len, kv_start, mask_offset, prefix_len,
        token_pos_offset, shared_len, shared_start, 0, 0, 0); kv_start is the request's first
        entry in kv_indices (paged) or, ragged, the row of k/v of its logical key 0 if its keys
        were one run (own run's first row - shared_len); ragged keys j < shared_len are rows
        shared_start + j (a shared prefix); the mask fields serve the "custom" and "multi_item"
        masks.
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

    def __repr__(self) -> str:  # the arrays are long: describe() has the readable summary
        return (f"Plan({len(self.requests)} requests, {self.num_items} work items, "
                f"{self.num_ctas} CTAs, {self.rows_per_cta} rows per item)")

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


def _ceil_div(a, b):
    return -(-a // b)


def _tiles(qo_lens, kv_lens, g, rows_per_cta, num_kv_heads, causal, window_left, prefix_lens,
           max_item_lens) -> dict:
    """Query tiles and the KV span each can see, as arrays in the order (request, row tile,
    kv head, span): b, hk, row0, lo, hi, and key, the index of the (b, hk, row0) tile a span
    belongs to (several with multi-item tile skipping)."""
    rows = np.asarray(qo_lens, dtype=np.int64) * g
    per_b = _ceil_div(rows, rows_per_cta)
    b = np.repeat(np.arange(len(rows)), per_b)
    row0 = (np.arange(len(b)) - np.repeat(np.cumsum(per_b) - per_b, per_b)) * rows_per_cta
    if prefix_lens is not None and max_item_lens is not None:  # spans per row tile
        spans = [kv_spans(int(qo_lens[i]), int(kv_lens[i]), g, int(r),
                          int(min(r + rows_per_cta, rows[i]) - 1), causal, window_left,
                          int(prefix_lens[i]), int(max_item_lens[i]))
                 for i, r in zip(b.tolist(), row0.tolist())]
        count = np.array([len(x) for x in spans], dtype=np.int64)
        flat = np.array([s for x in spans for s in x], dtype=np.int64).reshape(-1, 2)
    else:
        q, kv = np.asarray(qo_lens, np.int64)[b], np.asarray(kv_lens, np.int64)[b]
        last = kv - q + (np.minimum(row0 + rows_per_cta, rows[b]) - 1) // g
        hi = np.minimum(kv, last + 1) if causal else kv
        lo = np.maximum(0, kv - q + row0 // g - window_left) if window_left is not None \
            else np.zeros_like(kv)
        count, flat = np.ones(len(b), np.int64), np.stack([lo, np.maximum(lo, hi)], 1)
    # expand: every row tile's spans for every kv head (order: tile, head, span)
    h = num_kv_heads
    tile_of = np.repeat(np.arange(len(b)), count * h)
    span_start = np.repeat(np.cumsum(count) - count, count * h)
    within = np.arange(len(tile_of)) - np.repeat(np.cumsum(count * h) - count * h, count * h)
    hk, span = within // np.repeat(count, count * h), within % np.repeat(count, count * h)
    return dict(b=b[tile_of], hk=hk, row0=row0[tile_of], lo=flat[span_start + span, 0],
                hi=flat[span_start + span, 1], key=tile_of * h + hk)


def _chunks(tiles: dict, cap: int, kv_tile: int) -> dict:
    """Cut each span into equal chunks of at most ``cap`` keys (whole kv_tile-key tiles); arrays
    tile (index of the span), lo, hi, in span order."""
    length = tiles["hi"] - tiles["lo"]
    n = np.maximum(1, _ceil_div(length, cap))
    step = np.where(length > 0, _ceil_div(_ceil_div(length, n), kv_tile) * kv_tile, 0)
    count = np.where(step > 0, _ceil_div(length, np.maximum(step, 1)), 1)
    tile = np.repeat(np.arange(len(length)), count)
    j = np.arange(len(tile)) - np.repeat(np.cumsum(count) - count, count)
    lo = tiles["lo"][tile] + j * step[tile]
    hi = np.where(step[tile] > 0, np.minimum(lo + step[tile], tiles["hi"][tile]),
                  tiles["hi"][tile])
    return dict(tile=tile, lo=lo, hi=hi)


def _fill(tiles: dict, num_ctas: int, fixed: float, beta: float, kv_tile: int):
    """Cut the spans, laid end to end in span order, into ``num_ctas`` runs of equal cost
    (a linear partition, as stream-K does for GEMM): CTA c takes everything between the
    cost positions c * T and (c + 1) * T, T = total / C, cutting a span where a boundary falls
    inside its keys (rounded to whole kv_tile-key tiles from the span's start). A span costs
    ``fixed + beta * len`` and every piece of a cut span pays ``fixed`` again. Unlike the
    longest-first placement this needs no equal chunks, so one long span per CTA pair still
    balances. Returns (chunks, cta of each chunk, processing order of each chunk, makespan)."""
    lo, hi = tiles["lo"], tiles["hi"]
    length = hi - lo
    end = np.cumsum(fixed + beta * length.astype(np.float64))
    start = end - (fixed + beta * length)
    x = np.arange(1, num_ctas) * (end[-1] / num_ctas)        # CTA boundaries, in cost
    span = np.searchsorted(end, x, side="right")
    x, span = x[span < len(lo)], span[span < len(lo)]
    keys = np.rint((x - start[span] - fixed) / beta / kv_tile) * kv_tile
    keys = np.clip(keys, 0, length[span]).astype(np.int64)
    # boundaries as one ordered scalar: span index, then keys into the span
    scale = int(length.max(initial=0)) + 1
    bound = span * scale + keys
    inner = (keys > 0) & (keys < length[span])
    cuts = np.unique(bound[inner])                            # interior cut points, sorted
    cut_span, cut_at = cuts // scale, cuts % scale
    count = 1 + np.bincount(cut_span, minlength=len(lo))
    tile = np.repeat(np.arange(len(lo)), count)
    j = np.arange(len(tile)) - np.repeat(np.cumsum(count) - count, count)
    first = j == 0
    piece_lo = np.zeros(len(tile), np.int64)
    piece_lo[~first] = cut_at                                # cuts are in span order
    piece_hi = np.append(piece_lo[1:], 0)
    last = np.append(tile[1:] != tile[:-1], True)
    piece_hi[last] = length[tile[last]]
    chunks = dict(tile=tile, lo=lo[tile] + piece_lo, hi=lo[tile] + piece_hi)
    cta = np.searchsorted(np.sort(bound), tile * scale + piece_lo, side="right")
    costs = fixed + beta * (piece_hi - piece_lo).astype(np.float64)
    makespan = float(np.bincount(cta, weights=costs, minlength=num_ctas).max(initial=0.0))
    return chunks, cta, np.arange(len(tile)), makespan


def _split_keys(tiles: dict, chunks: dict) -> np.ndarray:
    """Per chunk: whether its (b, hk, row0) tile has more than one chunk (writes partials)."""
    key = tiles["key"][chunks["tile"]]
    return np.bincount(key, minlength=int(tiles["key"].max(initial=-1)) + 1)[key] > 1


def _assign(costs: np.ndarray, num_ctas: int, tiles: np.ndarray | None = None,
            heads: np.ndarray | None = None):
    """Longest chunk first onto the least-loaded CTA (ties: lowest CTA id). Longest: most
    ``tiles`` (whole K/V tiles, the kernel's units of work), or the highest cost without them;
    ties by lowest kv head (``heads``), then lowest chunk id. Among chunks of equal length the
    CTAs then take one head's chunks before the next: CTAs that run at the same time read the
    same head's K/V, which stays in L2 (a request's row tiles, requests sharing prefix pages),
    rather than every head's at once. Chunks of one length are placed a round at a time:
    every CTA whose load is below the minimum plus the group's smallest cost takes the next
    one, in (load, id) order, exactly as one by one (each CTA's load then exceeds every load
    still waiting in the round). Returns (cta of each chunk, processing order of each
    chunk, makespan)."""
    size = -(costs if tiles is None else tiles)
    keys = (np.arange(len(costs)), size) if heads is None else \
        (np.arange(len(costs)), heads, size)
    order = np.lexsort(keys)
    loads = np.zeros(num_ctas)
    cta = np.empty(len(costs), dtype=np.int64)
    for group in np.split(order, np.flatnonzero(np.diff(size[order])) + 1):
        if not len(group):
            continue
        c = costs[group]
        if not c.any():  # free chunks leave the loads as they are: all go to the least-loaded
            cta[group] = int(np.argmin(loads))
            continue
        pos, c_min = 0, c.min()
        while pos < len(group):
            # a round; one chunk alone where it would be empty (a load too large for c_min to
            # move it in float64) or not exact (costs of 0 or below)
            ready = np.flatnonzero(loads < loads.min() + c_min) if c_min > 0 else ()
            if len(ready) < 2:
                ready = np.array([int(np.argmin(loads))])
            ready = ready[np.lexsort((ready, loads[ready]))][:len(group) - pos]
            cta[group[pos:pos + len(ready)]] = ready
            loads[ready] += c[pos:pos + len(ready)]
            pos += len(ready)
    rank = np.empty(len(costs), dtype=np.int64)
    rank[order] = np.arange(len(costs))
    return cta, rank, float(loads.max(initial=0.0))


def check_seq_lens(max_qo_len: int, max_kv_len: int) -> None:
    """Raises ValueError when a request has MAX_SEQ_LEN (2**30 - 1024) or more query or key
    tokens: the generated variant code computes positions in 32 bits where that bound proves it
    safe (emit.int_range)."""
    for name, n in (("query", max_qo_len), ("key", max_kv_len)):
        if n >= MAX_SEQ_LEN:
            raise ValueError(f"a request has {n} {name} tokens; expected fewer than "
                             f"{MAX_SEQ_LEN} (2**30 - 1024) per request")


def make_plan(qo_lens, kv_lens, kv_starts, *, num_qo_heads: int, num_kv_heads: int,
              rows_per_cta: int, num_ctas: int, causal: bool, window_left: int | None,
              split_kv: bool = True, alpha: float = 16.0, beta: float = 1.0,
              mask_offsets=None, prefix_lens=None, token_pos_offsets=None,
              max_item_lens=None, shared_lens=None, shared_starts=None,
              max_partial_rows: int | None = None,
              max_items: int | None = None, kv_tile: int = KV_TILE) -> Plan:
    """Schedule a batch. qo_lens / kv_lens / kv_starts: per request (host ints). Cost model:
    alpha per query row of an item (its fixed work: loading rows, writing or merging states)
    plus beta per key, in units of one key's work. kv_lens count a request's shared-prefix keys
    (shared_lens, ragged: the first shared_lens[b] keys are rows shared_starts[b] + j; its own
    run then starts at row kv_starts[b] + shared_lens[b]). The mask
    arrays (per request) are copied into the request table; prefix_lens with max_item_lens
    enable tile skipping for multi-item masks. max_partial_rows: the workspace's capacity;
    splits that would need more are not chosen (with none left, the KV is not split, and if
    multi-item spans still need more, row tiles are not cut into spans); max_items likewise
    rules out splits into more work items than the workspace holds. kv_tile: the kernel's keys
    per K/V tile; chunks are cut on its multiples."""
    g = num_qo_heads // num_kv_heads
    batch = len(qo_lens)
    q_starts = np.concatenate([[0], np.cumsum(qo_lens)[:-1]]).astype(np.int64) if batch \
        else np.zeros(0, np.int64)
    requests = np.zeros((batch, REQUEST_FIELDS), dtype=np.int32)
    if batch:
        requests[:, 0], requests[:, 1] = q_starts, qo_lens
        requests[:, 2], requests[:, 3] = kv_lens, kv_starts
        for col, values in ((4, mask_offsets), (5, prefix_lens), (6, token_pos_offsets),
                            (7, shared_lens), (8, shared_starts)):
            if values is not None:
                requests[:, col] = values

    def make_tiles(skip: bool) -> dict:
        return _tiles(qo_lens, kv_lens, g, rows_per_cta, num_kv_heads, causal, window_left,
                      prefix_lens if skip else None, max_item_lens if skip else None)

    def fits(chunks: dict, split: np.ndarray) -> bool:  # the workspace's capacities
        return (max_partial_rows is None or
                int(split.sum()) * rows_per_cta <= max_partial_rows) and \
            (max_items is None or len(chunks["lo"]) <= max_items)

    def cost(chunks):  # per chunk: alpha per row of the item plus beta per key
        return alpha * rows_per_cta + beta * (chunks["hi"] - chunks["lo"]).astype(np.float64)

    def order_keys(chunks):  # per chunk: whole K/V tiles and kv head (_assign's order)
        return _ceil_div(chunks["hi"] - chunks["lo"], kv_tile), tiles["hk"][chunks["tile"]]

    tiles = make_tiles(skip=True)
    # KV chunk cap: ceil(W / (k C)), with k (chunks per CTA on average) chosen by predicting
    # the makespan of each candidate; k = 1 is the paper's rule, larger k evens out the waves
    # when tiles are about as long as W / C
    total = int((tiles["hi"] - tiles["lo"]).sum())
    best = None
    for k in ((1, 2, 3, 4, 6, 8) if split_kv else ()) + (None,):
        if k is None and best is not None:
            break  # no split: only when no split fits the workspace (or splitting is off)
        cap = 1 << 30 if k is None else max(1, math.ceil(total / max(1, num_ctas * k)))
        cap = -(-cap // kv_tile) * kv_tile
        chunks = _chunks(tiles, cap, kv_tile)
        split = _split_keys(tiles, chunks)
        if not fits(chunks, split):
            if k is not None:
                continue  # would not fit the workspace
            # multi-item tile skipping cuts a row tile into spans that are merged like splits;
            # when even those do not fit, each row tile takes one span (the mask skips keys)
            tiles = make_tiles(skip=False)
            chunks = _chunks(tiles, cap, kv_tile)
            split = _split_keys(tiles, chunks)
        costs = cost(chunks)
        if best is not None and max(costs.max(initial=0.0), costs.sum() / num_ctas) >= \
                best[0] - 1e-9:
            continue  # its lower bound already loses to the best makespan
        cta, rank, makespan = _assign(costs, num_ctas, *order_keys(chunks))
        if best is None or makespan < best[0] - 1e-9:
            best = (makespan, cap, chunks, split, costs, cta, rank)
    if split_kv and len(tiles["lo"]) and num_ctas > 1 and beta > 0:
        chunks, cta, rank, makespan = _fill(tiles, num_ctas, alpha * rows_per_cta, beta,
                                            kv_tile)
        split = _split_keys(tiles, chunks)
        if fits(chunks, split) and makespan < best[0] * (1 - FILL_MARGIN):
            cap = int((chunks["hi"] - chunks["lo"]).max())
            costs = cost(chunks)
            best = (makespan, cap, chunks, split, costs, cta, rank)
    if split_kv and best[3].any():  # against the plan without splits (MERGE_ITEMS)
        chunks = _chunks(tiles, 1 << 30, kv_tile)
        split = _split_keys(tiles, chunks)
        if not split.any() and fits(chunks, split):
            costs = cost(chunks)
            cta, rank, makespan = _assign(costs, num_ctas, *order_keys(chunks))
            if makespan <= best[0] + MERGE_ITEMS * alpha * rows_per_cta:
                best = (makespan, 1 << 30, chunks, split, costs, cta, rank)
    _, cap, chunks, split, costs, cta, rank = best

    # partial rows: consecutive blocks of rows_per_cta for the chunks of split tiles, in chunk
    # order (a tile's chunks are adjacent and in KV order)
    partial = np.where(split, (np.cumsum(split) - 1) * rows_per_cta, -1)
    t = chunks["tile"]
    order = np.lexsort((rank, cta))  # items grouped by CTA, in the order they were placed
    items = np.zeros((len(order), ITEM_FIELDS), dtype=np.int64)
    items[:, 0], items[:, 1] = tiles["b"][t][order], tiles["hk"][t][order]
    items[:, 2], items[:, 3] = tiles["row0"][t][order], chunks["lo"][order]
    items[:, 4], items[:, 5] = chunks["hi"][order], partial[order]
    cta_indptr = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=num_ctas))])

    # merge map: every row of a split tile merges its chunks' partial rows in KV order
    first = np.flatnonzero(split & np.concatenate([[True], tiles["key"][t][1:] !=
                                                   tiles["key"][t][:-1]]))
    n_chunks = np.bincount(tiles["key"][t], minlength=int(tiles["key"].max(initial=-1)) + 1)
    kb, khk, krow0 = tiles["b"][t][first], tiles["hk"][t][first], tiles["row0"][t][first]
    kn, kbase = n_chunks[tiles["key"][t][first]], partial[first]
    nrows = np.minimum(rows_per_cta, np.asarray(qo_lens, np.int64)[kb] * g - krow0)
    mk = np.repeat(np.arange(len(first)), nrows)                  # merged row -> split tile
    r = krow0[mk] + np.arange(len(mk)) - np.repeat(np.cumsum(nrows) - nrows, nrows)
    merge_rows = (q_starts[kb[mk]] + r // g) * num_qo_heads + khk[mk] * g + r % g
    slots_per = kn[mk]
    sm = np.repeat(np.arange(len(mk)), slots_per)                 # slot -> merged row
    i = np.arange(len(sm)) - np.repeat(np.cumsum(slots_per) - slots_per, slots_per)
    merge_slots = kbase[mk][sm] + i * rows_per_cta + (r - krow0[mk])[sm]
    merge_indptr = np.concatenate([[0], np.cumsum(slots_per)])

    as_i32 = lambda x, shape=(-1,): np.asarray(x, dtype=np.int32).reshape(shape)  # noqa: E731
    return Plan(requests=requests, items=as_i32(items, (-1, ITEM_FIELDS)),
                cta_indptr=as_i32(cta_indptr), merge_indptr=as_i32(merge_indptr),
                merge_rows=as_i32(merge_rows), merge_slots=as_i32(merge_slots),
                item_cost=costs[order], num_ctas=num_ctas,
                rows_per_cta=rows_per_cta, group_size=g,
                num_partial_rows=int(split.sum()) * rows_per_cta, chunk_cap=cap)
