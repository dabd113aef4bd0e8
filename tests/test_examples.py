"""The numbered examples run and pass their own checks (on the CPU backend here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("0*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path):
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=os.environ, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
