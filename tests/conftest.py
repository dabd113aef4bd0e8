"""Test fixtures: every test session builds into its own kernel cache, never the user's."""

import pytest

from jitattn import jit


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("jitattn-cache")
    mp.setenv("JITATTN_CACHE_DIR", str(root))
    jit.clear_memo()
    yield root
    mp.undo()


@pytest.fixture
def keep_splits(monkeypatch):
    """Plans keep the split-KV schedule the planner picks even where the plan without splits
    predicts no longer a makespan (plan.MERGE_ITEMS = -inf): small batches then still exercise
    the merge path."""
    from jitattn import plan
    monkeypatch.setattr(plan, "MERGE_ITEMS", float("-inf"))
