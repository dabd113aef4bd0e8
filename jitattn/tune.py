"""``jitattn tune``: measure every shared-prefix strategy on this device over a grid of
(prefix P, suffix S, requests M) and store the table beside the kernel cache; the strategy
"auto" of SharedPrefixPrefill then takes, per batch, the fastest exact strategy that fits the
wrapper's capacities (the simplest of those within TIE of the fastest) at the nearest measured
cell (nearest in log2 of P + 1, S and M, and no further than MAX_LOG2_DISTANCE along any),
for the head configuration the table was measured with. Without such a cell, "auto" applies
the rule in SharedPrefixPrefill.choose.

The table is JSON: {"device", "num_qo_heads", "num_kv_heads", "head_dim", "dtype", "cells":
[{"prefix", "suffix", "requests", "ms": {strategy: milliseconds}}]}, written atomically.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from . import env
from .cache import TUNE_DIR, Cache

log = logging.getLogger("jitattn")
PREFIXES, SUFFIXES, REQUESTS = (96, 512, 2048, 8196), (1, 4, 32, 256), (2, 8, 32)
QUICK_CELLS = ((16, 2, 2), (40, 3, 4))


def device_key(device) -> str:
    """The name a table is stored under: the GPU's name and compute capability, or "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"


def table_path(key: str, root: Path | None = None) -> Path:
    """Where device ``key``'s table lives under the cache root (default: the configured one)."""
    root = env.cache_dir() if root is None else root
    return root / TUNE_DIR / (re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".json")


@lru_cache(maxsize=None)
def load(key: str) -> dict | None:
    """The stored table for device ``key``, or None (read once per process; save() resets).
    A file that is not such a table (unreadable, not JSON, or not of the shape the module
    docstring gives) is ignored with a warning: "auto" then applies its rule. A cache root the
    kernel cache refuses (writable by other users, not this user's) is not read either."""
    cache = Cache()
    root = cache.root if cache.fallback_reason is None else cache.read_only
    if root is None:
        return None
    path = table_path(key, root)
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: JSON nested deep)
        log.warning("jitattn: ignoring the tune table %s (%s)", path,
                    "nested too deeply" if isinstance(e, RecursionError) else e)
        return None
    if not _well_formed(table):
        log.warning("jitattn: ignoring the tune table %s (not a table of the shape jitattn "
                    "tune writes; run jitattn tune again)", path)
        return None
    return table


def _well_formed(table) -> bool:
    """Whether ``table`` has the fields and types lookup() and the strategy choice read."""
    def count(x, minimum):  # (JSON ints are unbounded: the plans' counts are int32)
        return isinstance(x, int) and not isinstance(x, bool) and minimum <= x < 2**31

    def time_ok(v):  # a finite float > 0 (an int such as 10**400 has no float)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return False
        try:
            return math.isfinite(float(v)) and v > 0
        except OverflowError:
            return False

    def cell_ok(c):
        return isinstance(c, dict) and count(c.get("prefix"), 0) and \
            count(c.get("suffix"), 1) and count(c.get("requests"), 1) and \
            isinstance(c.get("ms"), dict) and all(
                isinstance(k, str) and time_ok(v) for k, v in c["ms"].items())
    return isinstance(table, dict) and all(
        count(table.get(k), 1) for k in ("num_qo_heads", "num_kv_heads", "head_dim")) and \
        isinstance(table.get("cells"), list) and all(map(cell_ok, table["cells"]))


def save(table: dict) -> Path:
    """Write the table for its device atomically; returns the path. Raises OSError when the
    cache root cannot be written (Cache's fallback_reason: a table in a private temporary
    folder would be gone at exit)."""
    cache = Cache()
    if cache.fallback_reason is not None:
        raise OSError(cache.fallback_reason)
    path = table_path(table["device"], cache.root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)
    load.cache_clear()
    return path


# a measured cell speaks for batches up to this far from it, in log2 units along each of P + 1,
# S and M: half the widest gap of the full grid (S from 4 to 32), so that every batch between
# measured cells has one, while a batch far outside the table (or a --quick table's two tiny
# cells) gets the rule instead
MAX_LOG2_DISTANCE = 1.5
# strategies measured within TIE of the fastest count as equal: the first of SIMPLEST_FIRST
# among them wins (fewest launches and no mask data first). At cells of 0.1 ms, host-bound,
# the table's own noise is that large: at P96 S256 M2 a table measured custom_mask fastest
# while the benchmark minutes later had it 12% behind ragged (H200, session 7)
TIE = 0.03
SIMPLEST_FIRST = ("ragged", "split", "cascade", "multi_item", "custom_mask", "naive")


def lookup(table: dict, prefix_len: int, suffix_len: int, requests: int, allowed) -> str | None:
    """The fastest strategy among ``allowed`` at the measured cell nearest to (P, S, M), or
    None when no cell is within MAX_LOG2_DISTANCE of it along every axis."""
    def offsets(cell):
        return (math.log2(cell["prefix"] + 1) - math.log2(prefix_len + 1),
                math.log2(cell["suffix"]) - math.log2(max(1, suffix_len)),
                math.log2(cell["requests"]) - math.log2(max(1, requests)))
    cells = [c for c in table.get("cells", []) if any(s in c["ms"] for s in allowed) and
             max(map(abs, offsets(c))) <= MAX_LOG2_DISTANCE]
    if not cells:
        return None
    ms = min(cells, key=lambda c: sum(x * x for x in offsets(c)))["ms"]
    measured = [s for s in allowed if s in ms]
    fastest = min(ms[s] for s in measured)
    return min((s for s in measured if ms[s] <= fastest * (1 + TIE)),
               key=lambda s: (SIMPLEST_FIRST.index(s) if s in SIMPLEST_FIRST
                              else len(SIMPLEST_FIRST), ms[s]))


def measure(device, *, quick: bool = False, num_qo_heads: int = 16, num_kv_heads: int = 8,
            head_dim: int = 128, dtype=torch.float16, reps: int = 5) -> dict:
    """Time every strategy on every cell of the grid (QUICK_CELLS with quick) on ``device``
    with a causal variant; returns the table (not saved). Raises TypeError / ValueError for
    head counts that are not ints in 1 .. 65535 with num_qo_heads a multiple of num_kv_heads
    (before any timing)."""
    from . import bench, bench_shared
    from .args import int_arg
    from .batch_inputs import MAX_HEADS
    num_qo_heads = int_arg("num_qo_heads", num_qo_heads, maximum=MAX_HEADS)
    num_kv_heads = int_arg("num_kv_heads", num_kv_heads, maximum=MAX_HEADS)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    from .shared_prefix import STRATEGIES, SharedPrefixPrefill
    from .spec import Variant
    device = torch.device(device)
    variant = Variant("tune", mask="causal")
    cells = QUICK_CELLS if quick else [(p, s, m) for p in PREFIXES for s in SUFFIXES
                                       for m in REQUESTS]
    rows = []
    for p, s, m in cells:
        gen = torch.Generator(device=device).manual_seed(p + s + m)
        q, k, v = (torch.randn(p + s * m, h, head_dim, generator=gen, device=device,
                               dtype=dtype)
                   for h in (num_qo_heads, num_kv_heads, num_kv_heads))
        fns = {}
        for strategy in STRATEGIES:
            sp = SharedPrefixPrefill(variant, strategy, device=device, **bench_shared.CAPACITIES)
            sp.plan(p, [s] * m, num_qo_heads, num_kv_heads, head_dim, q_dtype=dtype)
            fns[strategy] = functools.partial(sp.run, q, k, v)
        times = bench.timed_rounds(fns, rounds=1 if quick else 5, reps=reps, warmup=1,
                                   device=device.type, inner=3)
        rows.append({"prefix": p, "suffix": s, "requests": m, "ms": times})
    return {"device": device_key(device), "num_qo_heads": num_qo_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": str(dtype), "cells": rows}
