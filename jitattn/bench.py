"""``jitattn bench decode | prefill`` (and ``shared-prefix | cascade``, in bench_shared.py):
jitattn beside torch SDPA (flash, cuDNN) and FlexAttention
in one process on the GPU, with the device's copy bandwidth and GEMM rate measured in the same
run. Median of many CUDA-event-timed runs on fresh random inputs (never zeros)."""

from __future__ import annotations

import functools
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

import jitattn as ja


def timed(fn, *, reps: int = 50, warmup: int = 5, device: str = "cuda",
          inner: int = 10, steady_ms: float = 0.0) -> float:
    """Median milliseconds of one fn() call. On the GPU each of the reps measurements times
    ``inner`` back-to-back calls between two CUDA events, after one untimed call queued before
    the first event: the GPU is busy while the host prepares the timed calls, so the host's
    launch work overlaps the GPU's, as in a serving loop (without it the first call's host
    time, idle GPU time, counted in the measurement). Every implementation is timed the same
    way. steady_ms: before the warm-up, ``inner`` calls at a time (waiting for each batch)
    for at least this many milliseconds of wall time, so that a GPU at its power limit
    reaches this fn's own clocks (0: none). On the CPU, wall-clock time per call: only for
    smoke tests of the benchmark code."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < steady_ms:
        for _ in range(inner):
            fn()
        if device != "cpu":
            torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    if device == "cpu":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def timed_rounds(fns: dict, *, rounds: int = 3, reps: int = 7, warmup: int = 2,
                 device: str = "cuda", inner: int = 10, steady_ms: float = 0.0) -> dict:
    """{name: milliseconds per call} for several implementations of one workload, measured in
    ``rounds`` alternating rounds (timed() each, every fn once per round). A fn's result is its
    median over the rounds of its time relative to the round's level (the geometric mean of
    the round's times), times the fastest round's level: a host that slows down for seconds
    (the H200 machine's ran every launch of the host-bound grid cells 1.6x slower for 2-4 s
    at a time, docs/performance.md session 14) or slow drift of the clocks hits every fn of a
    round alike, a slow phase that starts or ends inside a round moves that round only, and a
    transient stall of one fn's timing (which only ever adds time) is one outlier of the
    median. (Each fn keeping its fastest round, as before, let one fn's only fast timings fall
    before such a change and another's all after it: the same launch measured 0.052 and 0.082
    ms in one run.) With one fn, or one round, the fastest round. Rounds 2j and 2j + 1 take
    the given order rotated to start at its j-th fn from the end (round 0: as given), the odd
    one reversed, so that with three fns or more and three rounds or more every fn runs after
    at least two different ones (reversed, each runs after the fn it preceded): the H200 runs
    long kernels at its power limit, and the clocks a fn gets depend on what ran before it
    (one launch measured 1.367 and 1.496 ms in one run of a fixed order, right after
    different fns, docs/performance.md session 12; rotated alone, as here before, an order
    keeps every fn's predecessor: session 13). steady_ms: as for timed()."""
    names = list(fns)
    rounds_ms = []  # {name: ms} per round
    for r in range(rounds if names else 0):
        j = -(r // 2) % len(names)
        order = names[j:] + names[:j]
        rounds_ms.append({name: timed(fns[name], reps=reps, warmup=warmup, device=device,
                                      inner=inner, steady_ms=steady_ms)
                          for name in (order[::-1] if r % 2 else order)})
    if not rounds_ms:
        return {}
    # a round's level: the geometric mean of its fns' times
    levels = [math.exp(statistics.fmean(math.log(max(t, 1e-9)) for t in row.values()))
              for row in rounds_ms]
    return {name: statistics.median(row[name] / level for row, level in zip(rounds_ms, levels))
            * min(levels) for name in names}


def timed_graph(fn, *, reps: int = 20, inner: int = 10) -> float:
    """Median milliseconds of one fn() call replayed from a CUDA graph of ``inner`` calls: the
    GPU's time without the host's launch work, as an engine that captures its decode step sees
    it. fn must be capturable (no host syncs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (allocations, first launches) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return timed(graph.replay, reps=reps, warmup=2, inner=1) / inner


def ceilings() -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 GEMM rate, measured now."""
    src = torch.randn(1 << 30, dtype=torch.float16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps=20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm = timed(lambda: a @ b, reps=20)
    return {"copy_TBps": 2 * src.numel() * 2 / ms / 1e9, "gemm_TFLOPs": 2 * 8192**3 / gemm / 1e9}


def _sdpa(q, k, v, backend, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    try:
        run()
        return run
    except RuntimeError:
        return None


def _flex(q, k, v, causal, score_mod=None, window_left=None):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    block_mask = None
    if causal:
        qlen, kvlen = q.shape[2], k.shape[2]
        shift = kvlen - qlen

        def visible(b, h, qi, ki):
            seen = ki <= qi + shift
            return seen if window_left is None else seen & (qi + shift - ki <= window_left)
        block_mask = create_block_mask(visible, None, None, qlen, kvlen)
    torch._dynamo.reset()  # a fresh compile per case: no recompile-limit fallback to eager
    compiled = torch.compile(flex_attention, dynamic=False)

    def run():
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    try:
        run()
        return run
    except Exception:  # noqa: BLE001 -- a peer that fails to build is reported as missing
        return None


def _paged_decode_case(batch_lens, hq, hkv, head_dim, page_size, dtype, split_kv=True,
                       kv_dtype=None, qo_len=None, query_tile="auto"):
    """A planned decode over random paged caches of batch_lens tokens, as (run, cache). With
    qo_len: a BatchPrefill of qo_len queries per request at the end of its KV (speculative
    verification), on the query tiles ``query_tile``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = [-(-n // page_size) for n in batch_lens]
    num_pages = sum(pages)
    cache = tuple(torch.randn(num_pages, page_size, hkv, head_dim, generator=gen,
                              device="cuda", dtype=dtype).to(kv_dtype or dtype)
                  for _ in range(2))
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.randperm(num_pages, dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(batch_lens, pages)],
                        dtype=torch.int32)
    variant = ja.Variant("decode", mask="causal")
    q = torch.randn(len(batch_lens) * (qo_len or 1), hq, head_dim, generator=gen,
                    device="cuda", dtype=dtype)
    if qo_len is None:
        w = ja.BatchDecode(variant, page_size=page_size, split_kv=split_kv)
        w.plan(indptr, indices, last, hq, hkv, head_dim, q_dtype=dtype, kv_dtype=kv_dtype)
    else:
        w = ja.BatchPrefill(variant, page_size=page_size, split_kv=split_kv,
                            query_tile=query_tile)
        qo_indptr = torch.arange(0, len(batch_lens) * qo_len + 1, qo_len, dtype=torch.int32)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, head_dim, q_dtype=dtype,
               kv_dtype=kv_dtype)
    out = torch.empty_like(q)
    return (lambda: w.run(q, cache, out=out)), cache


def bench_decode(quick: bool = False) -> list[dict]:
    rows = []
    ceil = ceilings()
    hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.float16
    for batch, kv_len in ((64, 4096), (16, 32768)):
        kv_bytes = 2 * batch * kv_len * hkv * d * 2
        run, _ = _paged_decode_case([kv_len] * batch, hq, hkv, d, page, dtype)
        results = {"jitattn (paged)": timed(run)}
        # fp8 e4m3 KV: half the bytes; its row's TB/s counts the bytes it reads
        run, _ = _paged_decode_case([kv_len] * batch, hq, hkv, d, page, dtype,
                                    kv_dtype=torch.float8_e4m3fn)
        fp8_ms = timed(run)
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(batch, hq, 1, d, generator=gen, device="cuda", dtype=dtype)
        k = torch.randn(batch, hkv, kv_len, d, generator=gen, device="cuda", dtype=dtype)
        v = torch.randn(batch, hkv, kv_len, d, generator=gen, device="cuda", dtype=dtype)
        for name, fn in (("SDPA flash", _sdpa(q, k, v, "flash", False)),
                         ("SDPA cuDNN", _sdpa(q, k, v, "cudnn", False)),
                         ("FlexAttention", None if quick else _flex(q, k, v, False))):
            if fn is not None:
                results[name] = timed(fn)
        for name, ms in results.items():
            rows.append({"case": f"decode b{batch} kv{kv_len}", "impl": name, "ms": ms,
                         "TBps": kv_bytes / ms / 1e9,
                         "pct_copy": 100 * kv_bytes / ms / 1e9 / ceil["copy_TBps"]})
        rows.append({"case": f"decode b{batch} kv{kv_len}", "impl": "jitattn (paged, fp8 KV)",
                     "vs_fp16": results["jitattn (paged)"] / fp8_ms,
                     "ms": fp8_ms, "TBps": kv_bytes / 2 / fp8_ms / 1e9,
                     "pct_copy": 100 * kv_bytes / 2 / fp8_ms / 1e9 / ceil["copy_TBps"]})
    # speculative verification: 4 draft tokens per request, causal at the end of the KV; the
    # 16-row tiles ("auto" here: 4 queries x GQA 4) beside the prefill kernel's 128-row tiles
    batch, kv_len, drafts = 64, 4096, 4
    kv_bytes = 2 * batch * kv_len * hkv * d * 2
    results = {}
    for label, tile in (("jitattn (16-row tiles)", "auto"), ("jitattn (128-row tiles)", "long")):
        run, _ = _paged_decode_case([kv_len] * batch, hq, hkv, d, page, dtype, qo_len=drafts,
                                    query_tile=tile)
        results[label] = timed(run)
    if not quick:
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(batch, hq, drafts, d, generator=gen, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, hkv, kv_len, d, generator=gen, device="cuda", dtype=dtype)
                for _ in range(2))
        fn = _flex(q, k, v, True)
        if fn is not None:
            results["FlexAttention"] = timed(fn)
    for name, ms in results.items():
        rows.append({"case": f"verify b{batch} q{drafts} kv{kv_len}", "impl": name, "ms": ms,
                     "TBps": kv_bytes / ms / 1e9,
                     "pct_copy": 100 * kv_bytes / ms / 1e9 / ceil["copy_TBps"]})
    # skewed batch: one long request among short ones, with and without KV splitting
    lens = [32768] + [512] * 63
    kv_bytes = 2 * sum(lens) * hkv * d * 2
    for label, split in (("balanced (split-KV)", True), ("no split", False)):
        run, _ = _paged_decode_case(lens, hq, hkv, d, page, dtype, split_kv=split)
        ms = timed(run)
        rows.append({"case": "decode skewed 1x32768 + 63x512", "impl": f"jitattn {label}",
                     "ms": ms, "TBps": kv_bytes / ms / 1e9,
                     "pct_copy": 100 * kv_bytes / ms / 1e9 / ceil["copy_TBps"]})
    for r in rows:
        r.update(ceil)
    return rows


def _causal_pairs(seqlen: int, window_left: int | None) -> int:
    """(query, key) pairs one causal request of seqlen tokens computes (with a window)."""
    if window_left is None:
        return seqlen * (seqlen + 1) // 2
    w = min(window_left + 1, seqlen)
    return w * (w + 1) // 2 + (seqlen - w) * w


def bench_prefill(quick: bool = False) -> list[dict]:
    """Causal prefill, fp16, head_dim 128, 32 heads: the plain mask beside SDPA (flash, cuDNN)
    and FlexAttention; soft-cap 50, ALiBi and sliding window 1024 beside FlexAttention on the
    same variant; head_dim 64 and 256 in bf16 beside SDPA flash. TFLOP/s count the visible
    (query, key) pairs only, 4 * head_dim FLOPs each."""
    rows = []
    ceil = ceilings()
    hq = 32
    slopes = ja.alibi_slopes(hq).cuda()

    def alibi(score, b, h, q_idx, kv_idx):
        return score + ALIBI[h] * (kv_idx - q_idx)
    ALIBI = ja.tensor("alibi_slopes", ("num_qo_heads",), "float32")
    causal = ja.Variant("causal", mask="causal")
    variants = [("causal", causal, {}, None, None),
                ("soft-cap 50", ja.Variant("softcap", mask="causal",
                                           score_mod=ja.soft_cap(50.0)), {},
                 lambda s, b, h, qi, ki: 50.0 * torch.tanh(s / 50.0), None),
                ("soft-cap 50 approx", ja.Variant("softcap_approx", mask="causal",
                                                  score_mod=ja.soft_cap(50.0, approx=True)), {},
                 lambda s, b, h, qi, ki: 50.0 * torch.tanh(s / 50.0), None),
                ("ALiBi", ja.Variant("alibi", mask="causal", score_mod=alibi),
                 {"alibi_slopes": slopes},
                 lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), None),
                ("sliding window 1024", ja.Variant("window", mask="causal", window_left=1024),
                 {}, None, 1024)]
    cases = [(128, torch.float16, b, n, variants if n == 4096 or not quick else variants[:1])
             for b, n in ([(4, 4096)] if quick else [(4, 4096), (1, 16384)])]
    cases += [(d, torch.bfloat16, 4, 4096, variants[:1]) for d in (64, 256)]
    for d, dtype, batch, seqlen, chosen in cases:
        gen = torch.Generator(device="cuda").manual_seed(2)
        q, k, v = (torch.randn(batch * seqlen, hq, d, generator=gen, device="cuda", dtype=dtype)
                   for _ in range(3))
        indptr = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32)
        qb, kb, vb = (t.view(batch, seqlen, hq, d).transpose(1, 2).contiguous()
                      for t in (q, k, v))
        for label, variant, params, flex_mod, window in chosen:
            flops = 4 * d * hq * batch * _causal_pairs(seqlen, window)
            results = {"jitattn": timed(functools.partial(ja.attention, q, k, v, variant,
                                                          qo_indptr=indptr, kv_indptr=indptr,
                                                          **params), reps=10)}
            if label == "causal":
                peers = [("SDPA flash", _sdpa(qb, kb, vb, "flash", True))]
                if d == 128:
                    peers.append(("SDPA cuDNN", _sdpa(qb, kb, vb, "cudnn", True)))
                for name, fn in peers:
                    if fn is not None:
                        results[name] = timed(fn, reps=10)
            if not quick and d == 128:
                fn = _flex(qb, kb, vb, True, flex_mod, window)
                if fn is not None:
                    results["FlexAttention"] = timed(fn, reps=10)
            dt = "fp16" if dtype == torch.float16 else "bf16"
            for name, ms in results.items():
                rows.append({"case": f"prefill {label} {batch}x{hq}x{seqlen} d{d} {dt}",
                             "impl": name, "ms": ms, "TFLOPs": flops / ms / 1e9})
    for r in rows:
        r.update(ceil)
    return rows


def bar_chart(rows: list[dict], key: str, ylabel: str, png_path: str, *, log: bool = False,
              ceiling: float | None = None, ceiling_label: str = "") -> None:
    """A PNG of rows[key] per case (groups) and implementation (bars); matplotlib is the
    optional "plot" extra."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        ys = [next((r[key] for r in rows if r["case"] == c and r["impl"] == impl), 0)
              for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=impl)
    if ceiling:
        ax.axhline(ceiling, color="k", linestyle="--", linewidth=1, label=ceiling_label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=20,
                  ha="right", fontsize=7)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def report(rows: list[dict], json_path: str | None, png_path: str | None = None) -> str:
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "jitattn": ja.__version__}
    lines = [f"{meta['date']}  {meta['gpu']}  torch {meta['torch']}  jitattn {meta['jitattn']}",
             f"ceilings: copy {rows[0]['copy_TBps']:.2f} TB/s, bf16 GEMM "
             f"{rows[0]['gemm_TFLOPs']:.0f} TFLOP/s",
             "| case | implementation | ms | " +
             ("TB/s | % of copy |" if "TBps" in rows[0] else "TFLOP/s |"),
             "|---|---|---|---|" + ("---|" if "TBps" in rows[0] else "")]
    for r in rows:
        rate = f"{r['TBps']:.2f} | {r['pct_copy']:.0f}%" if "TBps" in r else f"{r['TFLOPs']:.1f}"
        impl = r["impl"] + (f": {r['vs_fp16']:.2f}x the fp16 tokens/s" if "vs_fp16" in r else "")
        lines.append(f"| {r['case']} | {impl} | {r['ms']:.3f} | {rate} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if png_path and "TBps" in rows[0]:
        bar_chart(rows, "TBps", "TB/s", png_path, ceiling=rows[0]["copy_TBps"],
                  ceiling_label="device copy")
    elif png_path:
        bar_chart(rows, "TFLOPs", "TFLOP/s", png_path)
    return "\n".join(lines)


def main(kind: str, quick: bool, json_path: str | None, png_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("jitattn bench needs a CUDA GPU (without one: `jitattn tune --cpu --quick` times "
              "the shared-prefix strategies on the CPU backend, and examples/ check every "
              "variant against the reference)")
        return 2
    if kind in ("shared-prefix", "cascade"):
        from . import bench_shared
        rows = bench_shared.grid(quick, "cuda") if kind == "shared-prefix" else \
            bench_shared.cascade_decode(quick, "cuda")
        print(bench_shared.report_grid(rows, json_path, png_path))
        return 0
    rows = bench_decode(quick) if kind == "decode" else bench_prefill(quick)
    print(report(rows, json_path, png_path))
    return 0 if all(math.isfinite(r["ms"]) for r in rows) else 1
