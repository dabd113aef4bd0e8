"""Random problems against the reference (tests/fuzz.py): a fixed set of seeds on the CPU
backend, more on the GPU (``pytest -m gpu``). Longer runs: ``python tests/fuzz.py``."""

import pytest
import torch

import fuzz


@pytest.mark.parametrize("seed", range(40))
def test_random_problem_on_cpu(seed):
    fuzz.case(seed, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(160))
def test_random_problem_on_gpu(seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fuzz.case(seed, "cuda")
