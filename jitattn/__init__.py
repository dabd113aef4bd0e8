"""jitattn: a JIT code-generation attention compiler for LLM inference.

Describe an attention variant in Python (:class:`Variant`); the first call renders CUDA (or C++
for CPU tensors) from Jinja2 templates, builds it with ninja + nvcc (or g++), caches the binary on
disk under a file lock, loads it (the CUDA driver through ctypes; a shared library for the CPU)
and runs it on PyTorch tensors.
Nothing runs at import time.
"""

__version__ = "0.1.0"

from .dsl import IntOverflowWarning, SpecError, abs_ as abs, exp, log, maximum, minimum, sigmoid, tanh, where  # noqa: E501
from .params import scalar, tensor
from .mods import alibi_slopes, soft_cap
from .rope import RoPE
from .spec import Variant
from .build import CompileError
from .args import CapacityError
from .api import attention
from .batch import BatchDecode, BatchPrefill
from .merge import merge_state, merge_state_in_place, merge_states
from .prefix import PrefixGroup, PrefixTrie, find_shared_prefixes, multi_item_metadata
from .shared_prefix import SharedPrefixPrefill
from .cascade import MultiLevelCascade
from .cascade_decode import CascadeDecode
from . import catalog  # the ready-made variants: catalog.builtin()[name].make()

__all__ = [
    "Variant", "RoPE", "SpecError", "IntOverflowWarning", "CompileError", "CapacityError",
    "attention", "scalar",
    "tensor", "where",
    "tanh", "exp", "log", "sigmoid", "minimum", "maximum", "abs", "soft_cap", "alibi_slopes",
    "merge_state", "merge_state_in_place", "merge_states", "BatchPrefill", "BatchDecode",
    "PrefixGroup", "PrefixTrie", "find_shared_prefixes", "multi_item_metadata",
    "SharedPrefixPrefill", "CascadeDecode", "MultiLevelCascade", "catalog",
    "__version__",
]
