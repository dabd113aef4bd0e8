"""The shared-prefix and cascade benchmark code runs (tiny sizes, CPU clock; not timings)."""

import pytest

from jitattn import bench_shared


def test_shared_prefix_grid_and_cascade_smoke(tmp_path):
    rows = bench_shared.grid(quick=True, device="cpu")
    impls = {r["impl"] for r in rows}
    assert {"naive", "ragged", "cascade", "multi_item", "custom_mask", "split"} <= impls
    assert any(i.startswith("auto (") for i in impls)
    rows += bench_shared.cascade_decode(quick=True, device="cpu")
    text = bench_shared.report_grid(rows, str(tmp_path / "g.json"), str(tmp_path / "g.png"))
    assert "| P16 S2 M2 | naive |" in text and "cascade" in text
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_ab_prefill_harness_smoke(tmp_path):
    """benchmarks/ab_prefill.py builds a tree per side (a git revision, and a directory: the
    working tree), runs them in alternating processes and prints one row per case with each
    side's speed over A's (CPU backend, tiny shapes)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ab.json"
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "ab_prefill.py"), "HEAD",
                          "HEAD", str(root), "--device", "cpu", "--rounds", "2", "--cases",
                          "causal_4k,ragged_p8196,naive_p8196", "--json", str(out)],
                         capture_output=True, text=True, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| causal_4k | TFLOP/s |" in res.stdout and "| ragged_p8196 | ms |" in res.stdout
    assert "| naive_p8196 | ms |" in res.stdout
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds["A"]) == len(rounds["B"]) == len(rounds["C"]) == 2
    assert "| B / A (best rounds) | C / A (best rounds) |" in res.stdout
    assert all(r["causal_4k"][0] > 0 and r["ragged_p8196"][0] > 0 for r in rounds["A"])


def test_timed_rounds_varies_each_ones_predecessor():
    """Rounds alternate the given order (rotated every two rounds) and its reverse, so that
    with three fns or more and three rounds or more every fn runs after at least two different
    ones (on the GPU the previous launch's power draw moves the next one's clocks), counted over
    the whole sequence of calls."""
    from jitattn import bench
    calls = []

    def fn(name):
        return lambda: calls.append(name)
    for n, rounds in ((3, 3), (7, 3), (7, 15), (5, 5), (8, 4)):
        names = "abcdefgh"[:n]
        calls.clear()
        times = bench.timed_rounds({x: fn(x) for x in names}, rounds=rounds, reps=1, warmup=0,
                                   device="cpu")  # on the CPU: one call per rep
        assert sorted(calls) == sorted(list(names) * rounds)
        assert calls[:2 * n] == list(names) + list(names)[::-1]
        before = {x: {a for a, b in zip(calls, calls[1:]) if b == x and a != x} for x in names}
        assert all(len(p) >= 2 for p in before.values()), (n, rounds, before)
        assert sorted(times) == list(names) and all(t >= 0 for t in times.values())
    assert bench.timed_rounds({}, rounds=3, device="cpu") == {}


def test_timed_rounds_sees_through_slow_phases_of_the_host(monkeypatch):
    """A host that runs everything 1.6x slower from some call on (a phase that begins inside
    a round), plus one stalled timing: the results keep the fns' true ratios, at the fast
    phase's level where a round ran whole in it (keeping each fn's fastest round gave the fns timed after the change their
    slow time)."""
    from jitattn import bench
    base = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 1.5, "e": 1.0}
    for change in (2, 3, 7, 30, 60):  # the first slow call; rounds of 5 calls
        seq = []

        def fake_timed(fn, **kw):
            name = fn()
            seq.append(name)
            slow = 1.6 if len(seq) > change else 1.0
            stall = 3.0 if len(seq) == 12 else 1.0
            return base[name] * slow * stall
        monkeypatch.setattr(bench, "timed", fake_timed)
        times = bench.timed_rounds({x: (lambda x=x: x) for x in base}, rounds=15, device="cpu")
        level = times["a"] / base["a"]
        for name, ms in times.items():
            assert ms / level == pytest.approx(base[name], rel=1e-9), (change, times)
        # at the fast phase's level when one round ran whole in it
        assert level == pytest.approx(1.0) if change >= len(base) else 1.0 < level < 1.6


def test_timed_runs_the_fn_untimed_for_steady_ms_first():
    """steady_ms: calls of the fn itself, ``inner`` at a time, for at least that long before the
    timed ones (a GPU at its power limit then runs the fn at its own clocks)."""
    import time as _time

    from jitattn import bench
    calls = []

    def fn():
        calls.append(_time.perf_counter())
    start = _time.perf_counter()
    bench.timed(fn, reps=2, warmup=1, device="cpu", inner=4, steady_ms=30)
    # whole batches of 4, then the warm-up call and 2 reps, after the 30 ms
    assert calls[-3] - start >= 0.03 and len(calls) % 4 == 3
    calls.clear()
    bench.timed(fn, reps=2, warmup=1, device="cpu", inner=4)
    assert len(calls) == 3


@pytest.mark.parametrize("naive_ms, expected", [
    (0.5, [dict(rounds=1, reps=1, steady_ms=300), dict(rounds=15, reps=9, steady_ms=0)]),
    (2.0, [dict(rounds=3, reps=9, steady_ms=300)])])
def test_shared_prefix_grid_settles_each_fn(monkeypatch, naive_ms, expected):
    """The grid's timing protocol: where naive takes a millisecond or more, every timing after
    300 ms of the fn's own calls (three rounds); in host-bound cells, 300 ms of each fn once,
    then fifteen rounds."""
    monkeypatch.setattr(bench_shared, "GRID", [(16, 2, 2)])
    monkeypatch.setattr(bench_shared, "timed", lambda fn, **kw: naive_ms)
    seen = []

    def fake_rounds(fns, **kw):
        seen.append({k: kw[k] for k in ("rounds", "reps", "steady_ms")})
        return {name: 1.0 for name in fns}
    monkeypatch.setattr(bench_shared, "timed_rounds", fake_rounds)
    rows = bench_shared.grid(quick=False, device="cpu")
    assert seen == expected
    assert {r["impl"] for r in rows} >= {"naive", "ragged"} and len(rows) == 7
