"""The jitattn command line: doctor, cache ls | clear, compile <variant file>, bench, tune."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

from . import __version__, build, catalog, dtypes, env, jit, render
from .cache import Cache
from .dsl import SpecError


def _doctor(args) -> int:
    print(f"jitattn {__version__} ({Path(__file__).parent})")
    nvcc = env.nvcc_path()
    try:
        import cupy
    except ImportError:
        cupy = None
    fallback = "CUDA kernels will be built with NVRTC through CuPy" if cupy else \
        "and CuPy is not installed either: no CUDA kernel can be built (install the CUDA " \
        "toolkit or set JITATTN_NVCC, or pip install 'jitattn[cuda]')"
    print(f"nvcc: {nvcc or f'not found ({fallback})'}")
    if nvcc:
        print("      " + _banner("cuda"))
    cxx = env.cxx_path()
    print(f"c++ (CPU backend): {cxx or 'not found'}")
    if cxx:
        print("      " + _banner("cpp"))
    print(f"ninja: {env.ninja_path() or 'not found'}")
    try:
        import torch
        print(f"torch: {torch.__version__}")
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                print(f"GPU {i}: {torch.cuda.get_device_name(i)} ({jit.device_arch(i)})")
        else:
            print("GPU: none visible to torch (CPU tensors run on the CPU backend)")
    except ImportError:
        print("torch: not installed")
    if cupy is not None:
        print(f"cupy: {cupy.__version__}")
    else:
        print("cupy: not installed (needed only without nvcc, for NVRTC: "
              "pip install 'jitattn[cuda]')")
    unmade = _unmade_cache()
    if unmade:
        print(f"cache: {unmade}")
        return 0
    cache = Cache()
    print(f"cache: {_where(cache)}, {_entries(len(cache.entries()))}")
    return 0


def _unmade_cache() -> str | None:
    """The cache root and that it does not exist yet, where the first build can make it (its
    nearest existing folder is a directory this user may write), else None: doctor and
    `cache ls | clear` report such a root rather than make it (Cache() makes it, or says why
    it cannot)."""
    root = env.cache_dir()
    if root.exists() or root.is_symlink():
        return None
    above = next(p for p in root.parents if p.exists() or p.is_symlink())
    if not (above.is_dir() and os.access(above, os.W_OK | os.X_OK)):
        return None
    return f"{root} (not made yet: the first build makes it), no entries"


def _banner(lang: str) -> str:
    """The compiler's version line (nvcc's "release" line, a C++ compiler's first), or why it
    cannot be run."""
    try:
        lines = build.compiler_fingerprint(lang).splitlines() or [""]
    except build.CompileError as e:
        return f"cannot be run: {e.message}"
    if lang == "cuda":
        return next((line for line in lines if "release" in line), lines[-1])
    return lines[0].split(": ", 1)[-1]  # (the fingerprint starts with the tool's path)


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


def _where(cache: Cache) -> str:
    """The cache root asked for, and where new kernels go when that differs."""
    if cache.fallback_reason is None:
        return str(cache.root)
    return f"{cache.configured} ({cache.fallback_reason}; new kernels go to {cache.root})"


def _cache(args) -> int:
    unmade = _unmade_cache()
    if unmade:
        print(f"nothing to remove: {unmade}" if args.action == "clear" else unmade)
        return 0
    cache = Cache()
    if args.action == "clear":
        try:
            print(f"removed {_entries(cache.clear())} from {_where(cache)} (the empty <key>.lock "
                  f"files stay: removing one another process holds would let two builds of its "
                  f"key run at once)")
        except OSError as e:
            print(f"jitattn cache clear: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        rows = cache.entries()
    except OSError as e:
        print(f"jitattn cache ls: {e}", file=sys.stderr)
        return 1
    for meta in rows:
        built = time.strftime("%Y-%m-%d %H:%M", time.localtime(meta["created"]))
        error = f"  (unreadable: {meta['error']})" if "error" in meta else ""
        print(f"{meta['bytes'] / 1024:9.1f} KiB  {built}  {meta['key']}{error}")
    print(f"{_entries(len(rows))} in {_where(cache)}")
    return 0


def _arch(text: str) -> str:
    """--arch's value: sm_<compute capability>, with an 'a' for arch-specific features."""
    if not re.fullmatch(r"sm_\d{2,3}[af]?", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected sm_ and a compute capability, "
                                         f"e.g. sm_90a (Hopper), sm_80, sm_89")
    return text


def _one_of(allowed: tuple, convert=str):
    """An option's type for a list option (nargs="+") with ``allowed`` values; a value that
    looks like a file name (a second variant file, a built-in variant's name) gets a hint."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value not in allowed:
            hint = " (compile takes one variant file, before the options or after --)" \
                if "/" in text or "." in text or (value is None and convert is int) else ""
            raise argparse.ArgumentTypeError(f"{text!r}: expected one of "
                                             f"{', '.join(map(str, allowed))}{hint}")
        return value
    return parse


def _file_first(argv: list) -> list:
    """compile's arguments with its variant file (the first argument ending in .py before any
    "--") moved before the options: after a list option (--head-dim 64 128) argparse would
    take it as one of the list's values."""
    if argv[:1] == ["compile"]:
        end = argv.index("--") if "--" in argv else len(argv)
        files = [i for i, a in enumerate(argv[:end]) if a.endswith(".py") and
                 not a.startswith("-")]
        if files and files[0] > 1:
            i = files[0]
            return [argv[0], argv[i], *argv[1:i], *argv[i + 1:]]
    return argv


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _compile(args) -> int:
    """Render and build every variant a file defines, for the requested specialisations."""
    try:
        module = catalog.load_file(args.variant_file)
    except FileNotFoundError as e:
        print(f"jitattn compile: {e}", file=sys.stderr)
        return 2
    except SpecError as e:  # a Variant the file builds at import (no traceback: it is named)
        print(f"jitattn compile: {args.variant_file}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the file's own error (a SyntaxError, an import, its code): one line
        print(f"jitattn compile: {args.variant_file}{_line_in(e, args.variant_file)}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        variants = catalog.variants_in(module)
    except (TypeError, ValueError, SpecError) as e:  # (from make() / example(): where in it)
        where = _line_in(e, args.variant_file)
        print(f"jitattn compile: {f'{args.variant_file}{where}: ' if where else ''}{e}",
              file=sys.stderr)
        return 2
    except Exception as e:  # raised by the file's make() or example()
        print(f"jitattn compile: {args.variant_file}{_line_in(e, args.variant_file)}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    cache = Cache()
    if cache.fallback_reason is not None:  # builds would go to a folder removed at exit
        print(f"jitattn compile: {cache.fallback_reason}; nothing would be saved",
              file=sys.stderr)
        return 1
    if not variants:
        print(f"{args.variant_file}: defines no Variant and no make(); expected Variants at "
              f"module level or a make() that returns one (as in variants/*.py)",
              file=sys.stderr)
        return 2
    ignored = [name for name, given in (("--kind", args.kind is not None),
                                        ("--dtype", args.dtype is not None),
                                        ("--arch", args.arch is not None),
                                        ("--shared-kv", args.shared_kv)) if given]
    args.kind = args.kind or list(render.KINDS)
    args.dtype = args.dtype or ["f16", "bf16"]
    args.kv_dtype = args.kv_dtype or ["same"]
    if args.cpu and ignored:
        print(f"jitattn compile --cpu: {' / '.join(ignored)} ignored (one CPU library per "
              f"head_dim holds every kind and q dtype; --kv-dtype picks the 16-bit caches' "
              f"library and the fp8 caches')", file=sys.stderr)
    arch = args.arch or (jit.device_arch(0) if not args.cpu and _cuda() else "sm_90a")
    try:
        _build_all(variants, args, arch, cache.root)
    except (build.CompileError, OSError) as e:  # (the compiler's first error, not a traceback)
        print(f"jitattn compile: {e}", file=sys.stderr)
        return 1
    return 0


def _line_in(error: BaseException, path: str) -> str:
    """", line N" of the last frame of ``error``'s traceback in the file at ``path`` (a
    SyntaxError's own line), or ""."""
    import traceback
    target = os.path.realpath(path)
    if isinstance(error, SyntaxError) and error.lineno and error.filename and \
            os.path.realpath(error.filename) == target:
        return f", line {error.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__)
             if os.path.realpath(f.filename) == target]
    return f", line {lines[-1]}" if lines else ""


def _build_all(variants, args, arch: str, root: Path) -> None:
    """Build (or find cached) every specialisation; raises OSError for a build that went to a
    private folder (its key's lock could not be used: nothing would be saved)."""
    def report(path, built):
        print(f"  {'built' if built else 'cached'} {path}")
        if root.resolve() not in path.resolve().parents:
            raise OSError(f"{path} was built in a private folder removed at exit, not in "
                          f"{root} (its build lock cannot be used: see the warning); nothing "
                          f"was saved")
    for variant in variants:
        print(variant.describe())
        for head_dim in args.head_dim:
            if args.cpu:  # (one library for 16-bit caches, one for fp8's)
                for kv_fp8 in sorted({kv != "same" for kv in args.kv_dtype}):
                    report(*jit.compile_cached(render.render_cpu(variant, head_dim=head_dim,
                                                                 kv_fp8=kv_fp8), None))
                continue
            for kind, dtype_tag, kv, shared_kv in itertools.product(
                    args.kind, args.dtype, args.kv_dtype,
                    (False, True) if args.shared_kv else (False,)):
                src = render.render_cuda(variant, kind=kind, dtype_tag=dtype_tag,
                                         head_dim=head_dim, arch=arch, shared_kv=shared_kv,
                                         kv_tag=None if kv == "same" else kv)
                report(*jit.compile_cached(src, arch))


def _bench(args) -> int:
    from . import bench  # imports the peers (SDPA, FlexAttention) only when asked
    return bench.main(args.kind, args.quick, args.json, args.png)


def _tune(args) -> int:
    import torch

    from . import tune
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("jitattn tune needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    hq, hkv = args.heads
    from .batch_inputs import MAX_HEADS  # (the planner's limit on heads)
    if not (1 <= hkv <= hq <= MAX_HEADS) or hq % hkv:
        print(f"jitattn tune: --heads {hq} {hkv}: expected NUM_QO_HEADS and NUM_KV_HEADS in "
              f"1 .. {MAX_HEADS}, the first a multiple of the second", file=sys.stderr)
        return 2
    unusable = Cache().fallback_reason
    if unusable is not None and not args.quick:  # (before minutes of measurement are lost)
        print(f"jitattn tune: {unusable}; the table could not be saved", file=sys.stderr)
        return 1
    table = tune.measure(device, quick=args.quick, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=args.head_dim)
    for cell in table["cells"]:
        best = min(cell["ms"], key=cell["ms"].get)
        print(f"P{cell['prefix']} S{cell['suffix']} M{cell['requests']}: fastest {best}; ms: "
              + ", ".join(f"{k} {v:.3f}" for k, v in cell["ms"].items()))
    if args.quick:  # a smoke test's two noisy cells must not steer "auto" afterwards
        print(f"--quick: table for {table['device']} not saved")
        return 0
    try:
        print(f"table for {table['device']} written to {tune.save(table)}")
    except OSError as e:  # (the root changed during the run: the measurements are kept here)
        print(f"jitattn tune: the table could not be saved ({e}); it follows, to be saved by "
              f"hand as {tune.table_path(table['device'])}:\n{json.dumps(table, indent=1)}",
              file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jitattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="show compilers, GPUs, CuPy and the cache").set_defaults(
        fn=_doctor)
    c = sub.add_parser("cache", help="list or clear the kernel cache")
    c.add_argument("action", choices=["ls", "clear"],
                   help="ls: every cached kernel (size, build time, key); clear: remove them")
    c.set_defaults(fn=_cache)
    b = sub.add_parser("compile", help="build the kernels of a variant file into the cache")
    b.add_argument("variant_file", help="a Python file that defines Variants at module level "
                   "or a make() returning one (variants/*.py)")
    b.add_argument("--head-dim", type=_one_of(render.HEAD_DIMS, int), nargs="+", default=[128],
                   metavar="{" + ",".join(map(str, render.HEAD_DIMS)) + "}",
                   help="head dims to build (default: 128)")
    b.add_argument("--dtype", type=_one_of(("f16", "bf16")), nargs="+", metavar="{f16,bf16}",
                   help="CUDA kernels' q dtypes (default: both; the CPU library holds every "
                   "q dtype)")
    b.add_argument("--kv-dtype", type=_one_of(("same", *dtypes.FP8_TAGS)), nargs="+",
                   metavar="{" + ",".join(("same", *dtypes.FP8_TAGS)) + "}",
                   help="KV caches' dtypes: 'same' as q (default), or fp8 (the CPU backend "
                   "builds one library for 16-bit caches and one for fp8's)")
    b.add_argument("--kind", type=_one_of(tuple(render.KINDS)), nargs="+",
                   metavar="{" + ",".join(render.KINDS) + "}",
                   help=f"kernel kinds (default: {' '.join(render.KINDS)})")
    b.add_argument("--arch", type=_arch, help="CUDA target, e.g. sm_90a, sm_80 (default: the "
                   "first visible GPU's, the one the runtime looks up; without a GPU, sm_90a)")
    b.add_argument("--cpu", action="store_true", help="build the CPU backend instead")
    b.add_argument("--shared-kv", action="store_true",
                   help="also build the CUDA kernels that read ragged shared prefixes "
                   "(BatchPrefill plans with shared_prefix_len; SharedPrefixPrefill's ragged "
                   "and split)")
    b.set_defaults(fn=_compile)
    r = sub.add_parser("bench", help="time jitattn beside SDPA and FlexAttention (GPU)")
    r.add_argument("kind", choices=["decode", "prefill", "shared-prefix", "cascade"],
                   help="decode: paged decode batches; prefill: causal and variant prefill "
                   "(TFLOP/s); shared-prefix: the P x S x M grid, every strategy and auto beside "
                   "naive and SDPA; cascade: cascade decode beside plain paged decode")
    r.add_argument("--quick", action="store_true", help="skip FlexAttention and long cases")
    r.add_argument("--json", help="write the rows and metadata to this file")
    r.add_argument("--png", help="plot the table here (rates per case; shared-prefix and "
                   "cascade: speedups)")
    r.set_defaults(fn=_bench)
    t = sub.add_parser("tune", help="measure the shared-prefix strategies on this device and "
                                    "store the table strategy='auto' uses")
    t.add_argument("--quick", action="store_true",
                   help="two small cells (a smoke test; the table is printed, not saved)")
    t.add_argument("--cpu", action="store_true", help="measure the CPU backend")
    t.add_argument("--heads", type=int, nargs=2, default=[16, 8],
                   metavar=("NUM_QO_HEADS", "NUM_KV_HEADS"))
    t.add_argument("--head-dim", type=int, default=128, choices=render.HEAD_DIMS)
    t.set_defaults(fn=_tune)
    args = parser.parse_args(_file_first(list(sys.argv[1:] if argv is None else argv)))
    if args.command == "compile" and not args.cpu and env.nvcc_path() is None:
        print("jitattn compile: nvcc not found; use --cpu or install the CUDA toolkit",
              file=sys.stderr)
        return 2
    try:
        status = args.fn(args)
        sys.stdout.flush()  # (here, so that a reader gone early is caught below)
        return status
    except BrokenPipeError:  # the reader stopped early (`jitattn cache ls | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (exit's flush)
        return 1


if __name__ == "__main__":
    sys.exit(main())
