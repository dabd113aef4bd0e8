"""`jitattn tune`: the measured table is stored beside the cache and drives strategy="auto"."""

import json

import pytest
import torch

import jitattn as ja
from jitattn import cli, tune
from jitattn.shared_prefix import STRATEGIES, SharedPrefixPrefill


@pytest.fixture
def fresh_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path))
    tune.load.cache_clear()
    yield tmp_path
    tune.load.cache_clear()


def test_tune_quick_prints_every_strategy_and_saves_nothing(fresh_tables, capsys):
    """--quick is a smoke test: its two tiny, noisy cells must not steer "auto" afterwards."""
    assert cli.main(["tune", "--quick", "--cpu", "--heads", "4", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "--quick: table for cpu not saved" in out and not tune.table_path("cpu").exists()
    for p, s, m in tune.QUICK_CELLS:
        line = next(x for x in out.splitlines() if x.startswith(f"P{p} S{s} M{m}: "))
        assert all(f" {strategy} " in line for strategy in STRATEGIES)


@pytest.mark.parametrize("heads", [("0", "8"), ("-1", "1"), ("3", "2"), ("70000", "70000")])
def test_tune_names_bad_heads(fresh_tables, capsys, monkeypatch, heads):
    """--heads 0 8 / -1 1 / 3 2 ended in tracebacks from deep inside the measurement."""
    assert cli.main(["tune", "--quick", "--cpu", "--heads", *heads]) == 2
    assert f"--heads {' '.join(heads)}: expected NUM_QO_HEADS and NUM_KV_HEADS in 1 .. 65535" in \
        capsys.readouterr().err
    from jitattn import bench  # measure() refuses them before it plans or times anything

    def timed(*args, **kwargs):
        raise AssertionError("timed before the head counts were checked")
    monkeypatch.setattr(bench, "timed_rounds", timed)
    monkeypatch.setattr(SharedPrefixPrefill, "plan", timed)
    with pytest.raises((TypeError, ValueError), match="num_"):
        tune.measure("cpu", quick=True, num_qo_heads=int(heads[0]), num_kv_heads=int(heads[1]))


def test_tune_stores_the_table_and_auto_follows_it(fresh_tables):
    table = tune.measure("cpu", quick=True, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    assert (table["num_qo_heads"], table["num_kv_heads"], table["head_dim"]) == (4, 2, 64)
    assert [(c["prefix"], c["suffix"], c["requests"]) for c in table["cells"]] == \
        list(tune.QUICK_CELLS)
    for cell in table["cells"]:
        assert set(cell["ms"]) == set(STRATEGIES) and min(cell["ms"].values()) > 0
    path = tune.save(table)
    assert path == tune.table_path("cpu") and json.loads(path.read_text()) == table
    assert tune.load("cpu") == table
    # auto now follows the table at the measured cells (within TIE of the fastest)
    sp = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu")
    for cell in table["cells"]:
        chosen = sp.choose(cell["prefix"], [cell["suffix"]] * cell["requests"], 4, 2, 64)
        assert cell["ms"][chosen] <= min(cell["ms"].values()) * (1 + tune.TIE)


def _write(table_ms, heads=(16, 8, 128)):
    tune.save({"device": "cpu", "num_qo_heads": heads[0], "num_kv_heads": heads[1],
               "head_dim": heads[2], "dtype": "torch.float16",
               "cells": [{"prefix": 8196, "suffix": 4, "requests": 32, "ms": table_ms},
                         {"prefix": 96, "suffix": 4, "requests": 2,
                          "ms": {s: 1.0 for s in STRATEGIES}}]})


def test_auto_takes_the_fastest_exact_strategy_of_the_nearest_cell(fresh_tables):
    _write({"split": 1.0, "ragged": 2.0, "naive": 3.0, "cascade": 4.0, "multi_item": 5.0,
            "custom_mask": 6.0})
    causal = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu")
    assert causal.choose(6000, [5] * 40, 16, 8, 128) == "split"
    # a variant reading the request index: split and the packed strategies would change it
    by_request = ja.Variant("r", mask="causal", score_mod=lambda s, b, h, q, kv: s + b)
    assert SharedPrefixPrefill(by_request, device="cpu").choose(6000, [5] * 40, 16, 8,
                                                                128) == "ragged"
    # another head configuration: the table does not apply, the fitted rule does
    assert causal.choose(8196, [4] * 32, 32, 8, 128) == "cascade"


def test_near_ties_go_to_the_simplest_strategy(fresh_tables):
    """Within TIE of the fastest, the table's noise: ragged (one launch, no mask data) wins."""
    assert set(tune.SIMPLEST_FIRST) == set(STRATEGIES)  # every strategy has a rank
    near = 1 + tune.TIE / 2
    _write({"custom_mask": 1.0, "multi_item": 1.001, "ragged": near, "split": 1.0,
            "naive": 3.0, "cascade": 4.0})
    sp = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu")
    assert sp.choose(6000, [5] * 40, 16, 8, 128) == "ragged"
    _write({"custom_mask": 1.0, "multi_item": 1.001, "ragged": 1 + 2 * tune.TIE,
            "split": 1.0 + tune.TIE / 2, "naive": 3.0, "cascade": 4.0})
    assert sp.choose(6000, [5] * 40, 16, 8, 128) == "split"


def test_no_table_means_the_fitted_rule(fresh_tables):
    assert tune.load("cpu") is None
    sp = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu")
    assert sp.choose(8196, [4] * 32, 16, 8, 128) == "cascade"


def test_a_table_speaks_only_near_its_cells_and_within_capacities(fresh_tables):
    """A --quick table's tiny cells do not decide a batch of 8196 prefix tokens (the rule
    does), and a strategy whose plans would not fit the capacities is never taken."""
    tune.save({"device": "cpu", "num_qo_heads": 16, "num_kv_heads": 8, "head_dim": 128,
               "dtype": "torch.float16",
               "cells": [{"prefix": p, "suffix": s, "requests": m,
                          "ms": {**{x: 2.0 for x in STRATEGIES}, "multi_item": 1.0}}
                         for p, s, m in tune.QUICK_CELLS]})
    sp = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu")
    assert sp.choose(8196, [4] * 32, 16, 8, 128) == "cascade"  # the rule
    assert sp.choose(40, [3] * 4, 16, 8, 128) == "multi_item"  # a measured cell
    _write({"custom_mask": 1.0, "ragged": 2.0, "naive": 3.0})
    # 8196 + 32 x 4 tokens: an 8.7 MB dense mask fits the default 16 MB, 2.2 MB does not
    assert sp.choose(8196, [4] * 32, 16, 8, 128) == "custom_mask"
    small = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu",
                                max_mask_bytes=1 << 21)
    assert small.choose(8196, [4] * 32, 16, 8, 128) == "ragged"
    small.plan(8196, [4] * 32, 16, 8, 128)  # plans, where custom_mask would have raised
    # without a table, the rule's choice must fit too: naive would list 3616 one-token pages;
    # ragged and the cascade read k / v directly, whatever max_num_pages
    tune.table_path("cpu").unlink()
    tune.load.cache_clear()
    few_pages = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu",
                                    max_num_pages=1000)
    assert not few_pages._fits("naive", 900, [4] * 4) and few_pages._fits("ragged", 900, [4] * 4)
    assert few_pages.choose(900, [4] * 4, 16, 8, 128) == "ragged"
    few_pages.plan(900, [4] * 4, 16, 8, 128)
    # when none of the rule's strategies fits, another exact one that does (it raised: two
    # requests over max_batch_size=1, which multi_item plans as one request)
    one_request = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu",
                                      max_batch_size=1)
    assert one_request.choose(20, [2, 3], 2, 1, 64) == "multi_item"
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(25, h, 64, generator=gen).half() for h in (2, 1, 1))
    one_request.plan(20, [2, 3], 2, 1, 64)
    naive = SharedPrefixPrefill(ja.Variant("c", mask="causal"), "naive", device="cpu")
    naive.plan(20, [2, 3], 2, 1, 64)
    torch.testing.assert_close(one_request.run(q, k, v), naive.run(q, k, v), atol=2e-3,
                               rtol=2e-3)
    # a variant only naive computes exactly: plan() names the capacity it exceeds
    per_query = ja.tensor("bias", ("qo_len",), "float32")
    only_naive = SharedPrefixPrefill(
        ja.Variant("q", mask="causal", score_mod=lambda s, b, h, qi, ki: s + per_query[qi]),
        device="cpu", max_num_pages=1000)
    assert only_naive.choose(900, [4] * 4, 16, 8, 128) == "naive"
    with pytest.raises(ValueError, match="max_num_pages=1000"):
        only_naive.plan(900, [4] * 4, 16, 8, 128)


def test_a_table_of_another_shape_is_ignored_with_a_warning(fresh_tables, caplog):
    """A stored file that parses as JSON but is not a tune table crashed every "auto" plan
    (KeyError, TypeError, a math domain error); like a file that does not parse, it is now
    ignored and "auto" applies its rule."""
    good = {"device": "cpu", "num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64,
            "dtype": "torch.float16",
            "cells": [{"prefix": 16, "suffix": 2, "requests": 2, "ms": {"ragged": 1.0}}]}
    cell = good["cells"][0]
    rule = SharedPrefixPrefill(ja.Variant("c", mask="causal"), device="cpu").choose(
        16, [2, 2], 4, 2, 64)
    for bad in ({}, [], {**good, "cells": [{**cell, "suffix": 0}]},
                {**good, "cells": [{k: v for k, v in cell.items() if k != "ms"}]},
                {**good, "cells": [{**cell, "ms": {"ragged": None}}]}, {**good, "head_dim": "64"},
                "not JSON",
                # JSON's unbounded ints (OverflowError), nesting past the parser's recursion
                {**good, "cells": [{**cell, "ms": {"ragged": 10**400}}]},
                {**good, "cells": [{**cell, "requests": 2**40}]}, "[" * 100000):
        tune.table_path("cpu").parent.mkdir(parents=True, exist_ok=True)
        tune.table_path("cpu").write_text(bad if isinstance(bad, str) else json.dumps(bad))
        tune.load.cache_clear()
        with caplog.at_level("WARNING", logger="jitattn"):
            sp = SharedPrefixPrefill(ja.Variant("c", mask="causal"), "auto", device="cpu")
            sp.plan(16, [2, 2], 4, 2, 64)
        assert sp.choose(16, [2, 2], 4, 2, 64) == rule and "ignoring the tune table" in caplog.text
        caplog.clear()
