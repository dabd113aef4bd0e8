"""A/B of the prefill kernels at two revisions, in alternating processes.

Each side's ``jitattn/``, ``templates/`` and ``variants/`` (a git revision through ``git
archive``, or the working tree) go into a temporary tree; every round runs one process per side,
A, B, C ... in turn, each timing every case once (``jitattn.bench.timed``), so that the GPU's
clocks and power state (the H200 runs these launches at its power limit, docs/performance.md)
drift over every side alike. Prints each case's TFLOP/s (or ms) per round and each other side's speed
over A's from each side's best round (above 1: faster than A); ``--json`` keeps the numbers.

    python benchmarks/ab_prefill.py BASE_REV [NEW_REV ...] [--rounds 3] [--cases causal_16k,...]

NEW_REV defaults to the working tree; any side may also be a directory holding a copy (one
with a ``jitattn/`` package). ``--device cpu`` runs tiny shapes on the CPU backend (a smoke test
of the harness, not a timing).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("jitattn", "templates", "variants", "pyproject.toml")
# name: (mask, window_left, score_mod (None, "alibi", "softcap", "softcap_approx": cap 50),
# batch, tokens, head_dim, dtype); heads 32 / 32
CASES = {
    "causal_4k": ("causal", None, None, 4, 4096, 128, "float16"),
    "causal_16k": ("causal", None, None, 1, 16384, 128, "float16"),
    "full_16k": ("none", None, None, 1, 16384, 128, "float16"),
    "window_4k": ("causal", 1024, None, 4, 4096, 128, "float16"),
    "window_16k": ("causal", 1024, None, 1, 16384, 128, "float16"),
    "alibi_4k": ("causal", None, "alibi", 4, 4096, 128, "float16"),
    "alibi_16k": ("causal", None, "alibi", 1, 16384, 128, "float16"),
    "softcap_4k": ("causal", None, "softcap", 4, 4096, 128, "float16"),
    "softcap_16k": ("causal", None, "softcap", 1, 16384, 128, "float16"),
    "softcap_approx_4k": ("causal", None, "softcap_approx", 4, 4096, 128, "float16"),
    "causal_d64": ("causal", None, None, 4, 4096, 64, "bfloat16"),
    "causal_d256": ("causal", None, None, 4, 4096, 256, "bfloat16"),
}
# SharedPrefixPrefill's ragged and naive strategies at P8196 S256 M32, GQA 16/8 (ms): naive's
# paged batch reads the prefix's pages in each of its 32 requests
SHARED_PREFIX = {"ragged_p8196": "ragged", "naive_p8196": "naive"}


def extract(rev: str | None, dst: Path) -> None:
    """The library at git revision ``rev`` (None: the working tree; a directory: the copy
    there, e.g. one made by ``git archive`` where the repository's history is not at hand)
    into ``dst``."""
    dst.mkdir(parents=True)
    if rev is None or (Path(rev) / "jitattn").is_dir():
        for part in PARTS:
            src = (ROOT if rev is None else Path(rev)) / part
            if src.is_dir():
                subprocess.run(["cp", "-r", str(src), str(dst / part)], check=True)
            else:
                (dst / part).write_bytes(src.read_bytes())
        return
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *PARTS],
                         capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        try:
            archive.extractall(dst, filter="data")
        except TypeError:  # a Python without extraction filters (before 3.11.4)
            archive.extractall(dst)


def child(tree: str, cases: list[str], device: str, compile_only: bool) -> None:
    """Time ``cases`` with the jitattn of ``tree``; prints one JSON line {case: [value, unit]}."""
    import torch

    import jitattn as ja
    from jitattn import bench
    if not Path(ja.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"imported jitattn from {ja.__file__}, not from {tree}")
    tiny = compile_only or device == "cpu"
    out = {}
    for name in cases:
        if name in SHARED_PREFIX:
            from jitattn.bench_shared import CAPACITIES
            from jitattn.shared_prefix import SharedPrefixPrefill
            p, s, m = (40, 8, 3) if tiny else (8196, 256, 32)
            q, k, v = (torch.randn(p + s * m, h, 128, device=device, dtype=torch.float16)
                       for h in (16, 8, 8))
            sp = SharedPrefixPrefill(ja.Variant("causal", mask="causal"), SHARED_PREFIX[name],
                                     device=device, **CAPACITIES)
            sp.plan(p, [s] * m, 16, 8, 128, q_dtype=torch.float16)
            fn, flop = (lambda: sp.run(q, k, v)), None
        else:
            mask, window, mod, b, n, d, dt = CASES[name]
            b, n, h = (1, 300, 4) if tiny else (b, n, 32)
            slopes = ja.tensor("alibi_slopes", ("num_qo_heads",), "float32")
            alibi = mod == "alibi"
            score_mod = {"alibi": lambda sc, bb, hh, qi, ki: sc + slopes[hh] * (ki - qi),
                         "softcap": ja.soft_cap(50.0),
                         "softcap_approx": ja.soft_cap(50.0, approx=True)}.get(mod)
            variant = ja.Variant(name, mask=mask, window_left=window, score_mod=score_mod)
            q, k, v = (torch.randn(b * n, h, d, device=device, dtype=getattr(torch, dt))
                       for _ in range(3))
            indptr = torch.arange(0, b * n + 1, n, dtype=torch.int32)
            extra = {"alibi_slopes": ja.alibi_slopes(h).to(device)} if alibi else {}
            fn = lambda: ja.attention(q, k, v, variant, qo_indptr=indptr,  # noqa: E731
                                      kv_indptr=indptr, **extra)
            visible = [min(i, window) + 1 if window else (i + 1 if mask == "causal" else n)
                       for i in range(n)]
            flop = 4 * b * h * d * sum(visible)
        fn()
        if compile_only:
            continue
        ms = bench.timed(fn, reps=5 if device == "cpu" else 9, device=device)
        out[name] = [ms, "ms"] if flop is None else [flop / ms / 1e9, "TFLOP/s"]
    print(json.dumps(out), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="git revision (or directory) of side A")
    ap.add_argument("new", nargs="*",
                    help="git revisions or directories of sides B, C, ... (default: the "
                         "working tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join([*CASES, *SHARED_PREFIX]),
                    help=f"comma-separated, from {', '.join([*CASES, *SHARED_PREFIX])}")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", help="write every round's numbers here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES and c not in SHARED_PREFIX]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; expected some of {[*CASES, *SHARED_PREFIX]}")
    if args.child:
        child(args.child, cases, args.device, args.compile_only)
        return 0
    with tempfile.TemporaryDirectory(prefix="jitattn-ab-") as tmp:
        sides = {chr(ord("A") + i): rev for i, rev in enumerate([args.base, *(args.new or
                                                                         [None])])}
        trees = {}
        for side, rev in sides.items():
            trees[side] = Path(tmp) / side
            extract(rev, trees[side])

        def run(side, *extra):
            env = dict(os.environ, PYTHONPATH=str(trees[side]))
            cmd = [sys.executable, __file__, args.base, "--child", str(trees[side]), "--cases",
                   args.cases, "--device", args.device, *extra]
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)

        for proc in [run(side, "--compile-only") for side in sides]:  # both build at once
            if proc.wait() != 0:
                raise SystemExit("a side failed to build its kernels")
        rounds = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                proc = run(side)
                text, _ = proc.communicate()
                if proc.returncode != 0:
                    raise SystemExit(f"side {side} failed")
                rounds[side].append(json.loads(text.strip().splitlines()[-1]))
    names = {s: rev or "working tree" for s, rev in sides.items()}
    others = [s for s in sides if s != "A"]
    print(", ".join(f"{s} = {n}" for s, n in names.items()) + f", {args.rounds} rounds, "
          f"{args.device}")
    print("| case | unit | " + " | ".join(f"{s}, rounds" for s in sides) + " | " +
          " | ".join(f"{s} / A (best rounds)" for s in others) + " |\n" +
          "|---" * (2 + len(sides) + len(others)) + "|")
    for case in cases:
        unit = rounds["A"][0][case][1]
        vals = {s: [r[case][0] for r in rounds[s]] for s in sides}
        best = {s: (min if unit == "ms" else max)(v) for s, v in vals.items()}
        ratio = {s: best[s] / best["A"] if unit != "ms" else best["A"] / best[s]
                 for s in others}
        fmt = lambda v: " / ".join(f"{x:.3f}" if unit == "ms" else f"{x:.1f}" for x in v)  # noqa
        print(f"| {case} | {unit} | " + " | ".join(fmt(vals[s]) for s in sides) + " | " +
              " | ".join(f"{ratio[s]:.3f}" for s in others) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"sides": names, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
