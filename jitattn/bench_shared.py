"""``jitattn bench shared-prefix | cascade``: the shared-prefix survey's grid (P in {96, 8196},
S in {4, 256}, M in {2, 32}, heads 16/8, head_dim 128, fp16) with every strategy and auto,
torch SDPA on the per-request batch as a peer; and cascade decode against plain paged decode.
Timing as in bench.py (CUDA events, median)."""

from __future__ import annotations

import functools
import json
import time

import torch
import torch.nn.functional as F

import jitattn as ja

from .bench import bar_chart, timed, timed_graph, timed_rounds
from .shared_prefix import STRATEGIES, SharedPrefixPrefill

GRID = [(p, s, m) for p in (96, 8196) for s in (4, 256) for m in (2, 32)]
CAPACITIES = dict(max_num_pages=1 << 22, max_mask_bytes=1 << 26, max_work_items=1 << 20,
                  max_partial_rows=1 << 18)
STEADY_MS = 300  # untimed calls of a fn before its timings (grid)


def grid(quick: bool, device: str) -> list[dict]:
    """One row per (cell, implementation): ms and speedup over naive."""
    hq, hkv, d, dtype = 16, 8, 128, torch.float16
    cells = [(16, 2, 2), (40, 3, 4)] if quick else GRID
    variant = ja.Variant("causal", mask="causal")
    rows = []
    for p, s, m in cells:
        n = p + s * m
        gen = torch.Generator(device=device).manual_seed(p + s + m)
        q, k, v = (torch.randn(n, h, d, generator=gen, device=device, dtype=dtype)
                   for h in (hq, hkv, hkv))
        fns = {}
        for strategy in STRATEGIES + ("auto",):
            sp = SharedPrefixPrefill(variant, strategy, device=device, **CAPACITIES)
            chosen = sp.plan(p, [s] * m, hq, hkv, d)
            label = f"auto ({chosen})" if strategy == "auto" else strategy
            fns[label] = functools.partial(sp.run, q, k, v)
        if device == "cuda":  # the peer, timed in the same rounds: every request [P, S_i] on
            # its own, one SDPA call
            idx = torch.cat([torch.cat([torch.arange(p), torch.arange(p + i * s, p + (i + 1) * s)])
                             for i in range(m)]).to(device)
            qb, kb, vb = (t[idx].view(m, p + s, -1, d).transpose(1, 2).contiguous()
                          for t in (q, k, v))
            fns["SDPA (per-request batch)"] = functools.partial(
                F.scaled_dot_product_attention, qb, kb, vb, is_causal=True, enable_gqa=True)
        # alternating rounds (bench.timed_rounds: each fn relative to its round). Cells where
        # naive takes under a millisecond (one timing, unsettled) are host-bound: two runs of
        # the same code (auto and the strategy it picks) were measured 3.7% apart with three
        # rounds at P96 S256 M2 (session 7), and
        # 10-40% apart in the first cells of a process (session 13, where every fn ran
        # slower until the process had run for a while), more than the 5% target for auto
        # allows; they get every fn untimed for STEADY_MS once, then 15 rounds. Longer
        # launches run at the H200's power limit, where a launch's clocks depend on the power
        # drawn before it: the same launch measured 5-9% faster as auto than as its strategy,
        # each after other launches (sessions 12 and 13); each of their timings starts after
        # STEADY_MS of untimed calls of the fn itself, so every fn is measured at its own
        # sustained clocks.
        cheap = not quick and timed(fns["naive"], reps=3, device=device) < 1
        if cheap:  # (its one timing of each fn is thrown away)
            timed_rounds(fns, rounds=1, reps=1, device=device, steady_ms=STEADY_MS)
        times = timed_rounds(fns, rounds=1 if quick else (15 if cheap else 3),
                             reps=5 if quick else 9, device=device,
                             steady_ms=0 if quick or cheap else STEADY_MS)
        for label, ms in times.items():
            rows.append({"case": f"P{p} S{s} M{m}", "impl": label, "ms": ms,
                         "speedup": times["naive"] / ms})
    return rows


def cascade_decode(quick: bool, device: str) -> list[dict]:
    """Cascade decode vs plain paged decode: batch 64 / prefix 32768 / suffix 128 and
    batch 16 / prefix 1024 / suffix 128, GQA 32/8, head_dim 128, page 16, fp16."""
    hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.float16
    cases = [(4, 256, 32)] if quick else [(64, 32768, 128), (16, 1024, 128)]
    variant = ja.Variant("causal", mask="causal")
    i32 = dict(dtype=torch.int32)
    rows = []
    for batch, prefix, suffix in cases:
        pp, sp = prefix // page, suffix // page
        cache = tuple(torch.randn(pp + sp * batch, page, hkv, d, device=device, dtype=dtype)
                      for _ in range(2))
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        shared = torch.arange(pp, **i32)
        own = torch.arange(pp, pp + sp * batch, **i32)
        runs = {}
        for strategy in ("cascade", "auto"):
            cd = ja.CascadeDecode(variant, page_size=page, strategy=strategy, device=device,
                                  **CAPACITIES)
            chosen = cd.plan(shared, page, torch.arange(0, sp * batch + 1, sp, **i32), own,
                             torch.full((batch,), page, **i32), hq, hkv, d)
            runs["cascade" if strategy == "cascade" else f"auto ({chosen})"] = cd
        plain = ja.BatchDecode(variant, page_size=page, device=device, **CAPACITIES)
        plain.plan(torch.arange(0, (pp + sp) * batch + 1, pp + sp, **i32),
                   torch.cat([torch.cat([shared, own[i * sp:(i + 1) * sp]])
                              for i in range(batch)]),
                   torch.full((batch,), page, **i32), hq, hkv, d)
        reps = 5 if quick else 50
        case = f"b{batch} prefix{prefix} suffix{suffix}"
        fns = {"plain decode": functools.partial(plain.run, q, cache)}
        fns.update((label, functools.partial(cd.run, q, cache)) for label, cd in runs.items())
        # eager calls in alternating rounds (host launch work included: a host's drift hits
        # every strategy alike) and, on the GPU, the same calls replayed from a CUDA graph
        # (GPU time only)
        # (15 rounds: the host's speed drifts between rounds by more than the gap measured at
        # b16 / 1024, where auto runs plain's launch)
        modes = [("", lambda fns: timed_rounds(fns, rounds=1 if quick else 15,
                                               reps=max(1, reps // 3), device=device))]
        if device != "cpu":
            modes.append((" [CUDA graph]", lambda fns: {
                label: timed_graph(fn, reps=reps // 2 or 1) for label, fn in fns.items()}))
        for suffix_label, measure in modes:
            times = measure(fns)
            t_plain = times["plain decode"]
            for label, ms in times.items():
                rows.append({"case": case, "impl": label + suffix_label, "ms": ms,
                             "speedup": t_plain / ms})
    return rows


def report_grid(rows: list[dict], json_path: str | None, png_path: str | None = None) -> str:
    """A markdown table (and optionally JSON and a PNG of speedup per strategy)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__,
            "jitattn": ja.__version__}
    lines = [f"{meta['date']}  {gpu}  torch {meta['torch']}  jitattn {meta['jitattn']}",
             "| case | implementation | ms | speedup over the first row |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['speedup']:.2f}x |"
              for r in rows]
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if png_path:  # one "auto" series; its pick in each case's label
        picks = {r["case"]: r["impl"][len("auto ("):-1] for r in rows
                 if r["impl"].startswith("auto (")}
        chart = [dict(r, case=f"{r['case']}\nauto: {picks[r['case']]}" if r["case"] in picks
                      else r["case"], impl="auto" if r["impl"].startswith("auto (") else r["impl"])
                 for r in rows]
        bar_chart(chart, "speedup", "speedup over naive" if any(
            r["impl"] == "naive" for r in rows) else "speedup over plain decode", png_path,
            log=True)
    return "\n".join(lines)
