"""The shared-prefix and cascade benchmark code runs (tiny sizes, CPU clock; not timings)."""

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
