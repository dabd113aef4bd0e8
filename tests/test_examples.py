"""The README's main job (examples/quickstart.py) and the numbered examples run and pass their
own checks (on the CPU backend here)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the README's main job first, then the numbered examples
EXAMPLES = [Path(__file__).parent.parent / "examples" / "quickstart.py"] + \
    sorted(p for p in (Path(__file__).parent.parent / "examples").glob("0*.py"))
# optional packages an example needs (the "test" extra installs them)
REQUIRES = {"06_minilm_embeddings": "sentence_transformers",
            "07_llama_shared_prefix": "transformers"}
# what an example must print besides exiting 0: its checks ran
PRINTS = {"quickstart": ["against the float64 reference: OK", "the second process compiled"],
          "06_minilm_embeddings": ["min cosine"],
          "08_beam_search_cascade": ["layer 1: 8 beams, max |cascade - each beam alone|"],
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


@pytest.mark.gpu
def test_llama_example_on_gpu_with_a_cuda_graph_decode_step():
    """On the GPU, example 07 also replays its decode step (every layer, CascadeDecode
    included) from one CUDA graph across steps with new plans, and checks it against the
    eager jitattn logits."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    path = next(p for p in EXAMPLES if p.stem == "07_llama_shared_prefix")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=os.environ, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in PRINTS[path.stem] + ["[cuda]", "replayed from one CUDA graph"]:
        assert line in proc.stdout, proc.stdout


def test_readme_catalog_lines_work_after_a_plain_import():
    """The README loads ready-made variants as jitattn.catalog... after `import jitattn` only (a
    fresh process: in this one another test may have imported the submodule already)."""
    code = ("import jitattn; v = jitattn.catalog.builtin()['alibi'].make(); "
            "assert isinstance(v, jitattn.Variant), v; print(v.name)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
