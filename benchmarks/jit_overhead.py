"""JIT costs on the GPU: cold compile of one kernel, warm load in a new process, host time of a
cached call. Prints one table; run on the device: ``python benchmarks/jit_overhead.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

import jitattn as ja

CHILD = r"""
import time, torch
t0 = time.perf_counter()
import jitattn as ja
t1 = time.perf_counter()
q = torch.randn(1, 32, 128, dtype=torch.float16, device="cuda")
k = torch.randn(4096, 8, 128, dtype=torch.float16, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
ja.attention(q, k, k, ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(50.0)))
torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"{(t1 - t0) * 1e3:.1f} {(t3 - t2) * 1e3:.1f}")
"""


def main() -> None:
    cache = tempfile.mkdtemp(prefix="jitattn-bench-")
    os.environ["JITATTN_CACHE_DIR"] = cache
    variant = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(50.0))
    q = torch.randn(1, 32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(4096, 8, 128, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ja.attention(q, k, k, variant)
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0

    child = [subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                            env=os.environ, check=True).stdout.split() for _ in range(3)]
    imports = sorted(float(c[0]) for c in child)[1]
    warm = sorted(float(c[1]) for c in child)[1]

    k = k[:16].contiguous()  # a tiny problem, so that the GPU keeps up with the host
    for _ in range(100):
        ja.attention(q, k, k, variant)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        ja.attention(q, k, k, variant)
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"cold first call (render + nvcc + load + run): {cold:8.2f} s")
    print(f"warm first call in a new process (median of 3): {warm:8.1f} ms "
          f"(import jitattn {imports:.1f} ms)")
    print(f"host time of a cached call (decode 32/8 heads, kv 16, mean of {n}): "
          f"{host * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
