"""The kernels' packed-row walk (templates/cuda/include/jitattn_rows.cuh), compiled with g++:
every row's offset equals the one computed with a division (row p: token q_start + p // g,
head hk * g + p % g), for random GQA groups, steps, first rows and strides."""

import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "templates"
STEPS = (1, 2, 4, 8, 16, 32)  # the kernels' Q_STEP / O_STEP: threads or lanes per 16-byte column


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_walk_matches_a_division_per_row(tmp_path):
    rng = random.Random(0)
    cases = []
    for _ in range(400):
        g = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, rng.randint(1, 64)])
        hkv = rng.randint(1, 8)
        cases.append((rng.choice(STEPS), rng.randint(0, 10_000), rng.randrange(hkv), g,
                      rng.randint(0, 300), hkv * g * rng.choice([64, 128, 136, 256]),
                      rng.choice([64, 128, 136, 256])))
    calls = "\n".join(
        f"  walk<{s}>({q0}, {hk}, {g}, {p0}, {sn}LL, {sh}LL);" for s, q0, hk, g, p0, sn, sh in cases)
    src = tmp_path / "walk.cpp"
    src.write_text(f"""
#include <cstdio>
#include "jitattn_rows.cuh"
template <int STEP>
void walk(int q_start, int hk, int g, int p0, long long sn, long long sh) {{
  ja::PackedRowWalk<STEP> row(q_start, hk, g, p0, sn, sh);
  for (int x = 0; x < 12; ++x, row.next()) std::printf("%lld ", row.offset);
  std::printf("\\n");
}}
int main() {{
{calls}
}}
""")
    exe = tmp_path / "walk"
    subprocess.run(["g++", "-O1", "-std=c++17", "-fsanitize=signed-integer-overflow",
                    "-fno-sanitize-recover", f"-I{ROOT / 'common'}", f"-I{ROOT / 'cuda/include'}",
                    str(src), "-o", str(exe)], check=True, capture_output=True, text=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    assert len(lines) == len(cases)
    for (s, q0, hk, g, p0, sn, sh), line in zip(cases, lines):
        expected = [(q0 + p // g) * sn + (hk * g + p % g) * sh for p in range(p0, p0 + 12 * s, s)]
        assert [int(v) for v in line.split()] == expected, (s, q0, hk, g, p0, sn, sh)
