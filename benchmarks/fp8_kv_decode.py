"""Paged decode over fp16, fp8 e4m3 and fp8 e5m2 KV caches on the GPU: GQA 32/8, head_dim 128,
page 16, batch 64 x 4096 and 16 x 32768 tokens; three rounds alternating the caches, ms per
call (jitattn.bench.timed) and each fp8 cache's tokens/s over fp16's (best rounds).

    python benchmarks/fp8_kv_decode.py [out.json]
"""

import json
import sys

import torch

from jitattn import bench

CACHES = (("f16", None), ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))


def main(argv: list[str]) -> None:
    out = {}
    for batch, kv_len in ((64, 4096), (16, 32768)):
        runs = {name: bench._paged_decode_case([kv_len] * batch, 32, 8, 128, 16, torch.float16,
                                               kv_dtype=kv_dtype)[0]
                for name, kv_dtype in CACHES}
        rounds = {name: [] for name in runs}
        for _ in range(3):
            for name, run in runs.items():
                rounds[name].append(bench.timed(run))
        best = {name: min(ms) for name, ms in rounds.items()}
        out[f"b{batch}x{kv_len}"] = rounds
        times = ", ".join(f"{name} {' / '.join(f'{ms:.4f}' for ms in v)} ms"
                          for name, v in rounds.items())
        print(f"b{batch} x {kv_len}: {times}; fp16 / e4m3 {best['f16'] / best['e4m3']:.3f}, "
              f"fp16 / e5m2 {best['f16'] / best['e5m2']:.3f}", flush=True)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
