"""Planner invariants on random batches: coverage, chunk cap, balance bound, determinism."""

import numpy as np
import pytest

from jitattn import plan as plan_module
from jitattn.plan import kv_window, make_plan


def random_batch(rng, batch):
    qo = rng.integers(0, 300, batch)
    qo[rng.random(batch) < 0.3] = 1  # decode-like rows
    kv = qo + rng.integers(0, 2000, batch)
    kv[rng.random(batch) < 0.1] = 0  # empty KV
    return qo, kv


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 100)])
@pytest.mark.parametrize("fill", [False, True], ids=["chosen", "linear-partition"])
def test_every_query_key_pair_is_covered_exactly_once(seed, causal, window, fill, monkeypatch):
    if fill:  # take the linear partition whenever it is feasible
        monkeypatch.setattr(plan_module, "FILL_MARGIN", -1.0)
    rng = np.random.default_rng(seed)
    qo, kv = random_batch(rng, int(rng.integers(1, 12)))
    hq, hkv = [(8, 8), (8, 2), (7, 1)][seed % 3]
    g = hq // hkv
    plan = make_plan(qo, kv, np.zeros_like(kv), num_qo_heads=hq, num_kv_heads=hkv,
                     rows_per_cta=16, num_ctas=int(rng.integers(1, 40)), causal=causal,
                     window_left=window)
    covered = {}  # (request, kv head, packed row) -> list of key ranges
    partial_rows = set()
    for b, hk, row0, lo, hi, partial, _, _ in plan.items.tolist():
        rows = range(row0, min(row0 + 16, qo[b] * g))
        assert len(rows) > 0
        for r in rows:
            covered.setdefault((b, hk, r), []).append((lo, hi))
        if partial >= 0:
            new = set(range(partial, partial + 16))
            assert not new & partial_rows, "partial rows shared by two items"
            partial_rows |= new
    for b in range(len(qo)):
        for hk in range(hkv):
            for r in range(qo[b] * g):
                spans = sorted(covered[(b, hk, r)])
                tile0 = r // 16 * 16
                lo, hi = kv_window(int(qo[b]), int(kv[b]), g, tile0,
                                   min(tile0 + 16, qo[b] * g) - 1, causal, window)
                # the chunks of a tile partition its visible range [lo, hi) exactly
                assert spans[0][0] == lo and spans[-1][1] == hi
                assert all(a[1] == c[0] for a, c in zip(spans, spans[1:]))
    assert sum(len(covered[k]) > 1 for k in covered) == len(plan.merge_rows)
    assert plan.cta_indptr[-1] == plan.num_items


@pytest.mark.parametrize("seed", range(4))
def test_chunk_cap_balance_bound_and_determinism(seed):
    rng = np.random.default_rng(100 + seed)
    qo, kv = random_batch(rng, 32)
    kw = dict(num_qo_heads=32, num_kv_heads=8, rows_per_cta=8, num_ctas=64, causal=True,
              window_left=None)
    plan = make_plan(qo, kv, np.zeros_like(kv), **kw)
    lengths = plan.items[:, 4] - plan.items[:, 3]
    assert lengths.max() <= plan.chunk_cap
    # greedy longest-first list scheduling is within 4/3 of optimal (Graham 1969); against
    # the lower bound max(sum / C, max item) it is within 2x
    assert plan.cta_load.max() <= 2 * plan.lower_bound + 1e-9
    again = make_plan(qo, kv, np.zeros_like(kv), **kw)
    for a, b in ((plan.items, again.items), (plan.merge_slots, again.merge_slots),
                 (plan.cta_indptr, again.cta_indptr)):
        assert np.array_equal(a, b)
    assert "lower bound" in plan.describe()
    assert repr(plan) == (f"Plan({len(qo)} requests, {plan.num_items} work items, 64 CTAs, "
                          f"8 rows per item)")  # short in a REPL: no arrays


def test_long_request_is_split_across_ctas():
    plan = make_plan([1] * 4, [32768, 16, 16, 16], [0] * 4, num_qo_heads=32, num_kv_heads=8,
                     rows_per_cta=8, num_ctas=132, causal=True, window_left=None)
    long_items = plan.items[plan.items[:, 0] == 0]
    assert len(long_items) > 8 and (long_items[:, 5] >= 0).all()
    assert len(plan.merge_rows) == 32  # the long request's 32 query heads are merged


def test_few_long_requests_take_the_linear_partition_and_balance():
    """16 requests x 8 kv heads of 32768 keys on 264 CTAs: equal chunks leave waves (128 spans
    do not divide evenly), the linear partition gives every CTA the average within one tile
    and one item's fixed cost."""
    plan = make_plan([1] * 16, [32768] * 16, [0] * 16, num_qo_heads=32, num_kv_heads=8,
                     rows_per_cta=16, num_ctas=264, causal=True, window_left=None)
    fixed, total = 16.0 * 16, 128 * (16.0 * 16 + 32768)
    assert plan.cta_load.max() <= total / 264 + fixed + 64
    assert plan.cta_load.min() >= total / 264 - 64
    assert np.diff(plan.cta_indptr).max() <= 2


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plan = make_plan([1] * 8, [5000, 100, 3000, 1, 64, 900, 12, 4096], [0] * 8, num_qo_heads=32,
                     num_kv_heads=8, rows_per_cta=4, num_ctas=16, causal=True, window_left=None)
    plan.plot(str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_item_spans_fall_back_to_whole_tiles_when_the_workspace_is_small():
    """Tile skipping across items cuts a row tile into spans merged like splits; with too few
    partial rows for that, each row tile takes its whole causal range instead of failing."""
    qo, kv = np.array([300]), np.array([300])
    kw = dict(num_qo_heads=4, num_kv_heads=2, rows_per_cta=16, num_ctas=8, causal=True,
              window_left=None, prefix_lens=np.array([100]), max_item_lens=np.array([20]))
    skipping = make_plan(qo, kv, np.zeros(1, np.int64), **kw)
    assert skipping.num_partial_rows > 0
    whole = make_plan(qo, kv, np.zeros(1, np.int64), max_partial_rows=0, **kw)
    assert whole.num_partial_rows == 0 and len(whole.merge_rows) == 0
    for b, hk, row0, lo, hi, partial, _, _ in whole.items.tolist():
        assert (lo, hi) == kv_window(300, 300, 2, row0, min(row0 + 16, 600) - 1, True, None)
        assert partial == -1


@pytest.mark.parametrize("seed", range(8))
def test_round_placement_equals_one_by_one_lpt(seed):
    """_assign places chunks of one length a round at a time; the result must be
    exactly the sequential rule: most tiles first (ties: lower kv head, then lower chunk id;
    without tiles: costliest first) onto the least-loaded CTA (ties: lower CTA id). Costs
    differ within a length (a partial last tile) and include zeros."""
    import heapq

    from jitattn.plan import _assign
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400)) if seed else 0
    tiles = rng.choice([0, 1, 3, 7], size=n)
    costs = np.where(tiles > 0, 16.0 + tiles * 64.0 - rng.choice([0.0, 5.0, 63.0], size=n), 0.0)
    if seed % 2:
        costs = np.where(tiles > 0, costs, 16.0)
    if seed % 4 == 2:  # groups that mix zero and non-zero costs
        costs[rng.random(n) < 0.2] = 0.0
    heads = rng.integers(0, 3, size=n)
    num_ctas = 1 if seed == 3 else int(rng.integers(1, 60))
    for args, key in (((tiles, heads), lambda i: (-tiles[i], heads[i], i)),
                      ((), lambda i: (-costs[i], i))):
        cta, rank, makespan = _assign(costs, num_ctas, *args)
        heap, want = [(0.0, c) for c in range(num_ctas)], np.empty(n, dtype=np.int64)
        for i in sorted(range(n), key=key):
            load, c = heapq.heappop(heap)
            want[i] = c
            heapq.heappush(heap, (load + costs[i], c))
        assert np.array_equal(cta, want)
        assert makespan == max(load for load, _ in heap)
        assert sorted(rank) == list(range(n))


def test_assign_terminates_where_a_round_cannot_move_a_load():
    """A cost too small to move a float64 load (1 against 1e17) makes a round's set of CTAs
    empty; such groups are placed one by one instead of looping for ever."""
    from jitattn.plan import _assign
    cta, _, makespan = _assign(np.array([1e17, 1e17, 1.0, 1.0, 1.0]), 2,
                               np.array([2, 2, 1, 1, 1]), np.zeros(5, dtype=np.int64))
    # one by one: the loads stay tied at 1e17 (1e17 + 1 rounds back), so CTA 0 takes the rest
    assert cta.tolist() == [0, 1, 0, 0, 0] and makespan == 1e17


def test_equal_chunks_run_one_kv_head_at_a_time():
    """Chunks of equal length are placed head by head, so the CTAs running at the same time
    read one kv head's K/V (shared in L2): 32 requests x 8 kv heads of one 128-row tile each on
    64 CTAs take heads 0 and 1 first, then 2 and 3, ..."""
    plan = make_plan([64] * 32, [4096] * 32, [0] * 32, num_qo_heads=16, num_kv_heads=8,
                     rows_per_cta=128, num_ctas=64, causal=False, window_left=None,
                     split_kv=False)
    heads = plan.items[:, 1].reshape(64, 4)  # 4 items per CTA, in the order each runs them
    for step in range(4):
        assert sorted(set(heads[:, step].tolist())) == [2 * step, 2 * step + 1]


def test_workspace_item_capacity_and_tile_granularity():
    """max_items rules out plans with more work items than the workspace holds (the linear
    partition adds up to one item per CTA); chunks are cut on multiples of the kernel's kv_tile;
    degenerate cost models (beta 0, all costs 0) still give a plan."""
    kw = dict(num_qo_heads=32, num_kv_heads=8, rows_per_cta=16, num_ctas=264, causal=True,
              window_left=None)
    lens = [32768] * 16
    filled = make_plan([1] * 16, lens, [0] * 16, **kw)
    assert filled.num_items == 384  # the linear partition
    capped = make_plan([1] * 16, lens, [0] * 16, max_items=300, **kw)
    assert capped.num_items <= 300
    for kv_tile in (128, 192):  # the wgmma kernels' (192: not a power of two)
        wide = make_plan([1] * 16, lens, [0] * 16, kv_tile=kv_tile, **kw)
        assert (wide.items[:, 3] % kv_tile == 0).all()
        assert ((wide.items[:, 4] % kv_tile == 0) | (wide.items[:, 4] == 32768)).all()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_plan([1] * 4, [100] * 4, [0] * 4, beta=0.0, **dict(kw, num_ctas=3))
    free = make_plan([1, 1, 1], [0, 0, 0], [0] * 3, alpha=0.0, **dict(kw, num_ctas=3))
    assert free.num_items == 3 * 8


def test_short_requests_are_not_split_for_a_small_gain():
    """Splitting 80-key decode requests would shorten the predicted makespan by 16 keys' work
    but add a merge launch: the plan keeps them whole (MERGE_ITEMS). Requests ten times longer
    are still split, and the linear partition still cuts one long request."""
    kw = dict(num_qo_heads=32, num_kv_heads=8, rows_per_cta=16, num_ctas=396, causal=True,
              window_left=None)
    short = make_plan([1] * 16, [80] * 16, [0] * 16, **kw)
    assert len(short.merge_rows) == 0 and short.num_items == 16 * 8
    longer = make_plan([1] * 16, [1152] * 16, [0] * 16, **kw)
    assert len(longer.merge_rows) == 16 * 32
    one = make_plan([1], [32768], [0], **kw)
    assert len(one.merge_rows) == 32
