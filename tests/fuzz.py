"""Random differential testing: a seed draws one attention problem and checks jitattn's out
and lse against jitattn.reference (tests/helpers.compare: the tolerances, exact zeros and lse
-inf for rows that see no key, never NaN). Drawn: the entry point (BatchPrefill over pages or
ragged K/V, BatchDecode, ja.attention, SharedPrefixPrefill's strategies, CascadeDecode,
MultiLevelCascade), a built-in or composed variant, dtype, head_dim, GQA ratio, page size and
layout, an fp8 cache, strided q / k / v views, request lengths biased to tile edges, 0 and 1.

    python tests/fuzz.py --device cuda --seconds 300 --workers 8   # seeds 0, 1, 2, ...
    python tests/fuzz.py --device cpu --seed 1234                 # one seed again, verbose

Exit status 1 when any seed failed; each failure is printed with its seed and its problem.
tests/test_fuzz.py runs a fixed set of seeds (CPU in CI, more with ``pytest -m gpu``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jitattn as ja  # noqa: E402
from jitattn import catalog, reference  # noqa: E402
from jitattn.render import QUERY_TILES  # noqa: E402
from jitattn.shared_prefix import STRATEGIES, SharedPrefixPrefill  # noqa: E402
from jitattn.variant_layout import ALLOWED, layout_features  # noqa: E402

from helpers import compare, make_paged, quantize_fp8  # noqa: E402

KINDS = ("paged_prefill", "ragged_prefill", "decode", "shared_prefix", "cascade_decode",
         "multi_level")
# lengths at and around the kernels' tiles (16-row decode tiles, 64 / 128 rows, 64 / 128 / 192
# keys), besides 0, 1 and anything up to 700
EDGES = (0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257)


def _length(rng: random.Random, hi: int = 700, lo: int = 0) -> int:
    n = rng.choice(EDGES) if rng.random() < 0.6 else rng.randint(0, hi)
    return max(lo, n)


def _cumsum(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def composed_variant(rng: random.Random, hq: int, device, causal_only: bool = False):
    """A DSL variant of randomly chosen parts (each part's constants are runtime parameters, so
    seeds share kernels): mask, window, soft-cap, an ALiBi-like bias, a mask_mod, RoPE,
    sigmoid reduction. Returns (variant, params, description)."""
    mask = "causal" if causal_only or rng.random() < 0.7 else "none"
    window = rng.choice([None, None, None, 0, 1, 63, 200])
    cap_on, bias_on = rng.random() < 0.35, rng.random() < 0.35
    keep_on, rope_on = rng.random() < 0.25, rng.random() < 0.2
    sigmoid = rng.random() < 0.15
    cap, slopes = ja.scalar("cap"), ja.tensor("slopes", ("num_qo_heads",), "float32")
    shift = ja.scalar("shift")
    params = {}
    score_mod = mask_mod = None
    if cap_on or bias_on or sigmoid:
        def score_mod(score, b, h, q_idx, kv_idx):
            if cap_on:
                score = cap * ja.tanh(score / cap)
            if bias_on:
                score = score + slopes[h] * (kv_idx - q_idx)
            if sigmoid:
                score = score + shift
            return score
        params.update({"cap": rng.choice([5.0, 30.0])} if cap_on else {})
        params.update({"slopes": ja.alibi_slopes(hq).to(device)} if bias_on else {})
        params.update({"shift": -rng.uniform(0.0, 6.0)} if sigmoid else {})
    if keep_on:
        def mask_mod(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx) % 3 == 0) | (kv_idx < 5)
    rope = ja.RoPE(theta=1e4, style=rng.choice(["neox", "gptj"])) if rope_on else None
    parts = [mask, f"w{window}" if window is not None else "", "cap" if cap_on else "",
             "bias" if bias_on else "", "keep" if keep_on else "", "rope" if rope_on else "",
             "sigmoid" if sigmoid else ""]
    name = "fuzz_" + "_".join(p for p in parts if p)
    variant = ja.Variant(name, mask=mask, window_left=window, score_mod=score_mod,
                         mask_mod=mask_mod, pos_encoding=rope,
                         reduction="sigmoid" if sigmoid else "softmax")
    return variant, params, name


def draw_variant(rng, batch, hq, hkv, max_q, max_kv, device, causal_only=False):
    """A built-in variant with its example parameters, or a composed one."""
    builtin = catalog.builtin()
    names = sorted(n for n in builtin if not causal_only or n != "prefix_lm")
    if rng.random() < 0.4:
        name = rng.choice(names)
        if name == "sliding_window":  # (its example's window follows kv_len: one kernel each)
            return builtin[name].make(window_left=rng.choice([1, 63, 200])), {}, name
        variant, params = builtin[name].example(batch, hq, hkv, max(max_q, 1), max(max_kv, 2),
                                                device)
        if not causal_only or variant.mask == "causal":
            return variant, params, name
    return composed_variant(rng, hq, device, causal_only)


def _nan_outputs(q):
    return (torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device),
            torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device))


def _heads(rng):
    hkv = rng.choice([1, 2, 4, 8])
    group = rng.choice([1, 1, 2, 3, 4, 8])
    return hkv * group, hkv


def case(seed: int, device: str) -> str:
    """Draw problem ``seed``, run it, compare with the reference; AssertionError (or any
    exception) on a mismatch. Returns the problem's description."""
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    head_dim = rng.choice([32, 64, 128, 128, 256])
    hq, hkv = _heads(rng)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa
    sm_scale = rng.choice([None, None, 0.05, 0.3])
    if kind == "shared_prefix":
        return _shared_prefix_case(rng, seed, device, dtype, head_dim, hq, hkv, rand, sm_scale)
    if kind == "cascade_decode":
        return _cascade_decode_case(rng, seed, device, dtype, head_dim, hq, hkv, rand, sm_scale)
    if kind == "multi_level":
        return _multi_level_case(rng, seed, device, dtype, head_dim, hq, hkv, rand, sm_scale)
    batch = rng.randint(1, 6)
    if kind == "decode":
        qo_lens = [1] * batch
        kv_lens = [_length(rng, 3000) for _ in range(batch)]
    else:
        qo_lens = [_length(rng) for _ in range(batch)]
        kv_lens = [_length(rng) for _ in range(batch)]
    variant, params, vname = draw_variant(rng, batch, hq, hkv, max(qo_lens), max(kv_lens),
                                          device, causal_only=kind == "decode")
    mask_data = {}
    if kind != "decode" and rng.random() < 0.1:  # an explicit custom mask
        variant = ja.Variant("fuzz_custom", mask="custom")
        params, vname = {}, "custom"
        mask_data["custom_mask"] = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens)),
                                              generator=gen) < 0.5
    split_kv = rng.random() < 0.8
    desc = (f"seed {seed}: {kind} {vname} {dtype} d{head_dim} heads {hq}/{hkv} "
            f"qo {qo_lens} kv {kv_lens} sm_scale {sm_scale} split_kv {split_kv}")
    # q's rows may be a view into wider rows (a fused QKV projection's output), and 4x larger
    # (sharper softmax: the online softmax's rescaling)
    views, amp = rng.random() < 0.3, rng.choice([1.0, 1.0, 1.0, 4.0])
    desc += f"{' strided views' if views else ''}{' q x4' if amp != 1 else ''}"
    q = (rand(sum(qo_lens), hq + (2 * hkv if views else 0), head_dim) * amp)[:, :hq]
    qo_indptr = _cumsum(qo_lens)
    out, lse = _nan_outputs(q)
    if kind == "ragged_prefill":
        if views:  # k and v: one [tokens, 2, heads, head_dim] tensor
            kv = rand(sum(kv_lens), 2, hkv, head_dim)
            k, v = kv[:, 0], kv[:, 1]
        else:
            k, v = rand(sum(kv_lens), hkv, head_dim), rand(sum(kv_lens), hkv, head_dim)
        kv_indptr = ref_kv_indptr = _cumsum(kv_lens)
        if variant.mask != "custom" and rng.random() < 0.3:  # ja.attention, unplanned
            indptrs = {} if batch == 1 and rng.random() < 0.5 else \
                dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
            desc += f" ja.attention{'' if indptrs else ' (one request)'}"
            if rng.random() < 0.5:  # (its own outputs)
                out, lse = ja.attention(q, k, v, variant, sm_scale=sm_scale, return_lse=True,
                                        **indptrs, **params)
            else:
                ja.attention(q, k, v, variant, sm_scale=sm_scale, out=out, lse=lse, **indptrs,
                             **params)
        else:
            w = ja.BatchPrefill(variant, kv_layout="ragged", device=device, split_kv=split_kv)
            w.plan(qo_indptr, kv_indptr, None, None, hq, hkv, head_dim, q_dtype=dtype,
                   sm_scale=sm_scale, **mask_data)
            w.run(q, (k, v), out=out, lse=lse, **params)
    else:
        page_size = rng.choice([1, 2, 3, 16, 16, 32])
        layout = rng.choice(["NHD", "HND"])
        desc += f" page_size {page_size} {layout}"
        cache, kv_indptr, kv_indices, last = make_paged(kv_lens, hkv, head_dim, page_size,
                                                        layout, dtype, device, seed)
        ref_cache, scales = cache, {}
        if rng.random() < 0.2:  # an fp8 cache; the reference over its exact dequantized values
            fp8 = rng.choice([torch.float8_e4m3fn, torch.float8_e5m2])
            scale = rng.choice([0.5, 1.0, 2.0])
            (k8, k16), (v8, v16) = (quantize_fp8(c, scale, fp8) for c in cache)
            cache, ref_cache = (k8, v8), (k16, v16)
            scales = dict(k_scale=scale, v_scale=scale)
            desc += f" kv {fp8} scale {scale}"
        kv_dtype = cache[0].dtype
        if kind == "decode":
            w = ja.BatchDecode(variant, page_size=page_size, kv_layout=layout, device=device,
                               split_kv=split_kv)
            w.plan(kv_indptr, kv_indices, last, hq, hkv, head_dim, q_dtype=dtype,
                   kv_dtype=kv_dtype, sm_scale=sm_scale)
        else:
            tile = rng.choice(QUERY_TILES)
            w = ja.BatchPrefill(variant, page_size=page_size, kv_layout=layout, device=device,
                                split_kv=split_kv, query_tile=tile)
            desc += f" query_tile {tile}"
            w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hkv, head_dim, q_dtype=dtype,
                   kv_dtype=kv_dtype, sm_scale=sm_scale, **mask_data)
        w.run(q, cache, out=out, lse=lse, **scales, **params)
        k, v, ref_kv_indptr = reference.paged_to_ragged(ref_cache, kv_indptr, kv_indices, last,
                                                        layout)
    _check(desc, variant, params, out, lse, q, k, v, qo_indptr, ref_kv_indptr, sm_scale, amp,
           mask_data)
    return desc


def _sharpness(sm_scale, head_dim: int, amp: float = 1.0) -> float:
    """How many times larger the scores of random unit-normal q and k are than at the default
    scale (at least 1): sm_scale * sqrt(head_dim) times q's factor."""
    return max(1.0, amp * (head_dim ** -0.5 if sm_scale is None else sm_scale) * head_dim ** 0.5)


def _check(desc, variant, params, out, lse, q, k, v, qo_indptr, kv_indptr, sm_scale, amp=1.0,
           mask_data=None):
    """helpers.compare of out and lse with the reference over q, k, v (a ragged batch), the
    description prefixed to a mismatch. Budgets: sigmoid's grows with the reference over |v|;
    lse's with the scores' sharpness (_sharpness: their rounding errors, a flipped rounding
    of a rotated bf16 element among them, grow with them)."""
    def ref(v):
        return reference.attention(q, k, v, variant, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                   sm_scale=sm_scale, return_lse=True, mask_data=mask_data,
                                   **params)
    ref_out, ref_lse = ref(v)
    slack = None
    if variant.reduction == "sigmoid":
        # P is rounded to q's dtype before P V, an error of up to u p_j |v_j| a term (u the
        # dtype's unit roundoff, eps / 2); sigmoid's sums are not normalised and may cancel,
        # so the budget follows eps sum_j p_j |v_j|, not |out| (a cascade's levels, rounded to
        # q's dtype before their merge, stay inside it too)
        slack = ref(v.abs())[0] * torch.finfo(out.dtype).eps
    try:
        compare(variant, out, lse, ref_out, ref_lse, slack=slack,
                lse_scale=_sharpness(sm_scale, q.shape[-1], amp))
    except AssertionError as e:
        raise AssertionError(f"{desc}\n{e}") from None


def _shared_prefix_case(rng, seed, device, dtype, head_dim, hq, hkv, rand, sm_scale):
    """SharedPrefixPrefill, one strategy or auto, against the reference over each request's
    prefix + suffix (the prefix's rows: the prefix on its own)."""
    prefix = _length(rng, 600)
    suffixes = [_length(rng, 200, lo=1) for _ in range(rng.randint(1, 6))]
    variant, params, vname = draw_variant(rng, len(suffixes) + 1, hq, hkv,
                                          prefix + max(suffixes), prefix + max(suffixes),
                                          device, causal_only=True)
    if layout_features(variant) - {"positions"}:  # (the reference numbers requests its way)
        variant, params, vname = composed_variant(rng, hq, device, causal_only=True)
    # the strategies that compute this variant exactly (the others refuse it: tests elsewhere)
    strategy = rng.choice([s for s in STRATEGIES if not layout_features(variant) - ALLOWED[s]]
                          + ["auto"])
    desc = (f"seed {seed}: shared_prefix {strategy} {vname} {dtype} d{head_dim} heads "
            f"{hq}/{hkv} prefix {prefix} suffixes {suffixes} sm_scale {sm_scale}")
    n = prefix + sum(suffixes)
    q, k, v = rand(n, hq, head_dim), rand(n, hkv, head_dim), rand(n, hkv, head_dim)
    sp = SharedPrefixPrefill(variant, strategy, device=device)
    chosen = sp.plan(prefix, suffixes, hq, hkv, head_dim, q_dtype=dtype, sm_scale=sm_scale)
    desc += f" (ran {chosen})"
    out, lse = _nan_outputs(q)
    sp.run(q, k, v, out=out, lse=lse, **params)
    # the reference's requests: the prefix alone (its rows), then each suffix over prefix +
    # its own keys, gathered into one run of k / v per request
    rows_q, rows_kv, start = [torch.arange(prefix)], [torch.arange(prefix)], prefix
    for s in suffixes:
        rows_q.append(torch.arange(start, start + s))
        rows_kv.append(torch.cat([torch.arange(prefix), torch.arange(start, start + s)]))
        start += s
    gq, gkv = torch.cat(rows_q).to(device), torch.cat(rows_kv).to(device)
    _check(desc, variant, params, out[gq], lse[gq], q[gq], k[gkv], v[gkv],
           _cumsum([len(r) for r in rows_q]), _cumsum([len(r) for r in rows_kv]), sm_scale)
    return desc


def _layout_free_variant(rng, batch, hq, hkv, max_q, max_kv, device, causal_only=True):
    """A variant a cascade computes exactly (nothing read by position or request)."""
    for _ in range(20):
        variant, params, vname = draw_variant(rng, batch, hq, hkv, max_q, max_kv, device,
                                              causal_only=causal_only)
        if not layout_features(variant):
            return variant, params, vname
    return ja.Variant("causal"), {}, "causal"


def _check_levels(desc, variant, params, q, cache, layout, segments, qo_lens, sm_scale):
    """The reference over each request's keys: segments[b] lists the cache's requests (in
    make_paged's table ``cache``) whose tokens, concatenated, are request b's keys."""
    (kv, k_indptr, k_indices, k_last), out, lse = cache
    k, v, tok = reference.paged_to_ragged(kv, k_indptr, k_indices, k_last, layout)
    rows = [torch.cat([torch.arange(int(tok[s]), int(tok[s + 1])) for s in segs] +
                      [torch.zeros(0, dtype=torch.long)]) for segs in segments]
    g = torch.cat(rows).to(q.device)
    _check(desc, variant, params, out, lse, q, k[g], v[g], _cumsum(qo_lens),
           _cumsum([len(r) for r in rows]), sm_scale)


def _multi_level_case(rng, seed, device, dtype, head_dim, hq, hkv, rand, sm_scale):
    """MultiLevelCascade of 2 or 3 levels (a prefix of all requests, prefixes of contiguous
    groups, each request's own keys) with a few queries a request."""
    num_levels, batch = rng.choice([2, 3]), rng.randint(1, 6)
    page_size, layout = rng.choice([1, 3, 16]), rng.choice(["NHD", "HND"])
    qo_lens = [rng.choice([1, 1, 2, 5, 17]) for _ in range(batch)]
    # (a causal variant's shared levels see no mask: a request's own keys cover its queries)
    own = [max(_length(rng, 200), n) for n in qo_lens]
    cuts = sorted(rng.sample(range(1, batch), rng.randint(0, batch - 1))) if batch > 1 else []
    groups = [(a, b) for a, b in zip([0] + cuts, cuts + [batch])]
    seg_lens = [_length(rng, 600)]  # segment 0: every request's; then the groups'; then own
    if num_levels == 3:
        seg_lens += [_length(rng, 300) for _ in groups]
    seg_lens += own
    variant, params, vname = _layout_free_variant(rng, batch, hq, hkv, max(qo_lens),
                                                  sum(seg_lens), device)
    desc = (f"seed {seed}: multi_level {num_levels} {vname} {dtype} d{head_dim} heads "
            f"{hq}/{hkv} qo {qo_lens} segments {seg_lens} groups {groups} page_size "
            f"{page_size} {layout} sm_scale {sm_scale}")
    kv, indptr, indices, last = make_paged(seg_lens, hkv, head_dim, page_size, layout, dtype,
                                           device, seed)
    own_at = len(seg_lens) - batch
    level_segs = [[0]] + ([list(range(1, 1 + len(groups)))] if num_levels == 3 else []) + \
        [list(range(own_at, own_at + batch))]
    level_rows = [[sum(qo_lens)]] + ([[sum(qo_lens[a:b]) for a, b in groups]]
                                     if num_levels == 3 else []) + [qo_lens]
    args = {"qo_indptr": [], "kv_indptr": [], "kv_indices": [], "kv_last_page_len": []}
    for segs, rows in zip(level_segs, level_rows):
        args["qo_indptr"].append(_cumsum(rows))
        args["kv_indptr"].append(_cumsum([int(indptr[s + 1] - indptr[s]) for s in segs]))
        args["kv_indices"].append(torch.cat([indices[int(indptr[s]):int(indptr[s + 1])]
                                             for s in segs]))
        args["kv_last_page_len"].append(last[segs])
    levels = ja.MultiLevelCascade(variant, num_levels, page_size=page_size, kv_layout=layout,
                                  device=device)
    levels.plan(**args, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, q_dtype=dtype,
                sm_scale=sm_scale)
    q = rand(sum(qo_lens), hq, head_dim)
    out, lse = _nan_outputs(q)
    levels.run(q, kv, out=out, lse=lse, **params)
    group_of = [i for i, (a, b) in enumerate(groups) for _ in range(a, b)]
    segments = [[0] + ([1 + group_of[b]] if num_levels == 3 else []) + [own_at + b]
                for b in range(batch)]
    _check_levels(desc, variant, params, q, ((kv, indptr, indices, last), out, lse), layout,
                  segments, qo_lens, sm_scale)
    return desc


def _cascade_decode_case(rng, seed, device, dtype, head_dim, hq, hkv, rand, sm_scale):
    """CascadeDecode (cascade, plain or auto) over a paged shared prefix and each request's own
    pages, against the reference over prefix + own keys per request."""
    strategy = rng.choice(["auto", "cascade", "plain"])
    page_size, layout = rng.choice([1, 3, 16]), rng.choice(["NHD", "HND"])
    prefix, batch = _length(rng, 2000), rng.randint(1, 8)
    unique = [_length(rng, 300) for _ in range(batch)]
    if strategy == "plain":  # (it copies the prefix's pages into every request's table)
        prefix -= prefix % page_size
    variant, params, vname = _layout_free_variant(rng, batch, hq, hkv, 1, prefix + max(unique),
                                                  device)
    desc = (f"seed {seed}: cascade_decode {strategy} {vname} {dtype} d{head_dim} heads "
            f"{hq}/{hkv} prefix {prefix} unique {unique} page_size {page_size} {layout} "
            f"sm_scale {sm_scale}")
    # one table: request 0 the prefix, then each request's own pages
    cache, indptr, indices, last = make_paged([prefix] + unique, hkv, head_dim, page_size,
                                              layout, dtype, device, seed)
    shared = indices[:int(indptr[1])]
    cd = ja.CascadeDecode(variant, page_size=page_size, kv_layout=layout, strategy=strategy,
                          device=device)
    chosen = cd.plan(shared, int(last[0]) if len(shared) else 0, indptr[1:] - indptr[1],
                     indices[int(indptr[1]):], last[1:], hq, hkv, head_dim, q_dtype=dtype,
                     sm_scale=sm_scale)
    desc += f" (ran {chosen})"
    q = rand(batch, hq, head_dim)
    out, lse = _nan_outputs(q)
    cd.run(q, cache, out=out, lse=lse, **params)
    _check_levels(desc, variant, params, q, ((cache, indptr, indices, last), out, lse), layout,
                  [[0, 1 + b] for b in range(batch)], [1] * batch, sm_scale)
    return desc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, help="run this one seed and print its problem")
    p.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--seconds", type=float, default=60.0, help="stop drawing after this long")
    p.add_argument("--workers", type=int, default=1,
                   help="processes, each taking every workers-th seed (default 1)")
    p.add_argument("--worker", default="0/1", help=argparse.SUPPRESS)  # (i/n: this process's)
    args = p.parse_args(argv)
    if args.seed is not None:
        print(case(args.seed, args.device))
        return 0
    if args.workers > 1:
        import subprocess
        procs = [subprocess.Popen([sys.executable, __file__, "--device", args.device,
                                   "--start", str(args.start), "--seconds", str(args.seconds),
                                   "--workers", "1", "--worker", f"{i}/{args.workers}"])
                 for i in range(args.workers)]
        codes = [proc.wait() for proc in procs]  # (a worker a signal killed: below 0)
        for i, rc in enumerate(codes):
            if rc not in (0, 1):
                print(f"worker {i}/{args.workers} exited with status {rc}: its last 'seed' "
                      f"line names the seed it ran", flush=True)
        return 1 if any(codes) else 0
    worker, workers = (int(x) for x in args.worker.split("/"))
    t0, seed, ran, failed = time.perf_counter(), args.start + worker, 0, []
    while time.perf_counter() - t0 < args.seconds:
        print(f"seed {seed}", flush=True)  # (before it runs: a crash's seed is the last one)
        try:
            case(seed, args.device)
        except Exception:
            failed.append(seed)
            print(f"FAILED seed {seed}:\n{traceback.format_exc()}", flush=True)
        ran += 1
        seed += workers
    print(f"worker {worker}/{workers}: {ran} seeds, {len(failed)} failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
