"""jitattn in one page: a custom variant, compiled on first use, checked against the reference.

The variant: Gemma-2-style soft-cap plus an ALiBi-style bias read from a captured tensor, causal,
with RoPE fused into the Q/K load. Runs on the GPU when there is one, else on the CPU
backend. A second process then runs the same call and finds the kernel in the disk cache.

    python examples/quickstart.py
"""

import os
import subprocess
import sys
import time

import torch

import jitattn as ja
from jitattn import reference


def make_variant(num_qo_heads: int, device: str) -> ja.Variant:
    slopes = ja.alibi_slopes(num_qo_heads).to(device)  # captured: bound at run time

    def softcap_alibi(score, b, h, q_idx, kv_idx):
        return 30.0 * ja.tanh(score / 30.0) + slopes[h] * (kv_idx - q_idx)
    return ja.Variant("quickstart", mask="causal", score_mod=softcap_alibi,
                      pos_encoding=ja.RoPE(theta=10000.0, style="neox"))


def run_once(device: str) -> float:
    torch.manual_seed(0)
    qo_len, kv_len, hq, hkv, d = 300, 700, 16, 4, 128   # GQA 4; not multiples of the tiles
    q = torch.randn(qo_len, hq, d, dtype=torch.float16, device=device)
    k = torch.randn(kv_len, hkv, d, dtype=torch.float16, device=device)
    v = torch.randn(kv_len, hkv, d, dtype=torch.float16, device=device)
    variant = make_variant(hq, device)
    start = time.perf_counter()
    out, lse = ja.attention(q, k, v, variant, return_lse=True)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    ref_out, ref_lse = reference.attention(q, k, v, variant, return_lse=True)
    err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    ok = err < 2e-3 and lse_err < 5e-3
    print(f"{variant.describe()}\n  device {device}: first call {first * 1e3:.0f} ms, "
          f"relative error {err:.1e}, max lse error {lse_err:.1e} against the float64 reference: "
          f"{'OK' if ok else 'FAILED'} (tolerances 2e-3, 5e-3)")
    assert ok, "jitattn disagrees with the reference"
    return first


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "--child" in sys.argv:
        run_once(device)
        return
    run_once(device)
    child = subprocess.run([sys.executable, __file__, "--child"], capture_output=True,
                           text=True, env=os.environ)
    print("second process:\n" + child.stdout.rstrip())
    if child.returncode != 0:
        sys.exit(child.stderr)
    compiled_again = "compiled" in child.stderr
    print("  cache hit: the second process compiled nothing" if not compiled_again
          else "  the second process compiled again (cache not shared?)")


if __name__ == "__main__":
    main()
