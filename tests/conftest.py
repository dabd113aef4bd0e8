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
