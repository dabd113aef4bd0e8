"""The numbered examples run and pass their own checks (on the CPU backend here)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("0*.py"))
# optional packages an example needs (the "test" extra installs them)
REQUIRES = {"06_minilm_embeddings": "sentence_transformers",
            "07_llama_shared_prefix": "transformers"}
# what an example must print besides exiting 0: its checks ran
PRINTS = {"06_minilm_embeddings": ["min cosine"],
          "07_llama_shared_prefix": ["SharedPrefixPrefill chose '",
                                     "item logits: max |jitattn - eager|",
                                     "CascadeDecode", "step logits: max |jitattn - eager|"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path):
    needs = REQUIRES.get(path.stem)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{path.name} needs {needs}")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=os.environ, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in PRINTS.get(path.stem, []):
        assert line in proc.stdout, proc.stdout
