"""Runtime parameters of a variant: ``ja.scalar`` and ``ja.tensor`` declarations and the tensors
a mod captures by closure (FlexAttention style), indexed by the symbols into :class:`Expr` nodes
of dsl.py. Their values are bound at call time and never enter the cache key.

Tensor indices are clamped into range in every backend, so a kernel never reads out of bounds
(a dimension of size 0 is rejected when binding, except where a size it is declared over is 0:
then nothing is computed, and the kernels get a one-element stand-in).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import numpy as np
import torch

from . import dtypes
from .dsl import SYMBOLS, Expr, SpecError, _lift
from .emit import emit_cpp

SHAPE_SYMBOLS = ("batch_size", "num_qo_heads", "num_kv_heads", "qo_len", "kv_len")
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,47}")  # (fullmatch: "$" takes a final newline)
# names taken by the keywords of attention() and the wrappers' run(); generated C++ identifiers
# are prefixed (c_name)
_RESERVED = set(SYMBOLS) | {"q", "k", "v", "out", "lse", "sm_scale", "return_lse", "qo_indptr",
                            "kv_indptr", "variant", "mask_data", "kv_cache", "k_scale", "v_scale",
                            "self"}


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _IDENT.fullmatch(name) or name in _RESERVED:
        raise SpecError(f"{what} name {name!r} must be an identifier ([A-Za-z][A-Za-z0-9_]*, "
                        f"at most 48 characters) and not one of {sorted(_RESERVED)}")


@dataclass(frozen=True)
class ScalarParam:
    """A float32 runtime scalar, passed by name at call time."""

    name: str


@dataclass(frozen=True, eq=False)
class TensorParam:
    """A runtime tensor indexed by symbols. ``shape`` holds ints or names from SHAPE_SYMBOLS.

    ``captured`` is the torch tensor when the parameter came from a closure; it is bound
    automatically at call time and never enters the cache key.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    captured: torch.Tensor | None = None
    label: str | None = None  # a captured tensor's Python name, for messages (not the key)
    scalar_of: torch.Tensor | None = None  # the 0-d tensor ``captured`` is a 1-element view of

    @property
    def display(self) -> str:
        return f"{self.label} ({self.name})" if self.label else self.name

    @property
    def signature(self) -> str:
        """Name, dtype and shape: what makes two declarations the same parameter."""
        return f"{self.name}:{dtypes.tag(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def code_signature(self) -> str:
        """What generated code depends on: name, dtype and rank (sizes are runtime arguments)."""
        return f"{self.name}:{dtypes.tag(self.dtype)}:rank{len(self.shape)}"

    def __getitem__(self, idx) -> "Expr":
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != len(self.shape):
            hint = " (index every dimension at once: t[h, kv_idx], not t[h][kv_idx])" \
                if len(idx) < len(self.shape) else ""
            raise SpecError(f"tensor {self.display!r} has {len(self.shape)} dimensions "
                            f"{self.shape} but was indexed with {len(idx)} indices{hint}")
        nodes = []
        for i, ix in enumerate(idx):
            node = _lift(ix)
            if node.kind != "int":
                raise SpecError(f"tensor {self.display!r} dimension {i} is indexed by a "
                                f"{node.kind} expression ({emit_cpp(node)}); indices must be "
                                f"integer expressions of b, h, q_idx, kv_idx and int constants")
            if node.op == "const" and node.args[0] < 0:  # (torch wraps a literal t[-1]; the
                #                                            kernels clamp indices to 0)
                size = self.shape[i]
                if not isinstance(size, int) or node.args[0] < -size:
                    raise SpecError(f"tensor {self.display!r} dimension {i} (size {size!r}) "
                                    f"is indexed by the constant {node.args[0]}, which torch "
                                    f"would wrap (or refuse) and the kernels would clamp to 0; "
                                    f"index from the start")
                node = Expr("const", (node.args[0] + size,), "int")
            nodes.append(node)
        tag = dtypes.tag(self.dtype)
        kind = "float" if dtypes.is_float_tag(tag) else ("bool" if tag == "bool" else "int")
        return Expr("index", (self, *nodes), kind)


def scalar(name: str) -> "Expr":
    """A runtime float32 scalar, e.g. ``cap = ja.scalar("cap")``; passed as ``cap=50.0``."""
    _check_name(name, "scalar")
    return Expr("scalar", (ScalarParam(name),), "float")


def _shape_entry(name: str, s):
    """A ja.tensor shape entry: a symbol of SHAPE_SYMBOLS, or a positive int (numpy's too; not
    a bool, which was taken as a size of 1)."""
    if isinstance(s, str):
        if s in SHAPE_SYMBOLS:
            return s
    elif not isinstance(s, (bool, np.bool_)):
        try:
            if operator.index(s) > 0:
                return operator.index(s)
        except TypeError:
            pass
    raise SpecError(f"tensor {name!r}: shape entry {s!r} must be a positive int or one of "
                    f"{SHAPE_SYMBOLS}")


def tensor(name: str, shape, dtype="float32") -> TensorParam:
    """A runtime tensor parameter, e.g. ``ja.tensor("slopes", ("num_qo_heads",), "float32")``.

    shape: ints or symbolic sizes ``"batch_size" | "num_qo_heads" | "num_kv_heads" | "qo_len" |
    "kv_len"`` (qo_len / kv_len: the longest request of the batch). dtype: ``"float32" |
    "float16" | "bfloat16" | "int32" | "int64" | "bool"`` or the torch dtype. The tensor must be
    contiguous and on the device of q when bound.
    """
    _check_name(name, "tensor")
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if not shape:
        raise SpecError(f"tensor {name!r}: shape must have at least one dimension")
    shape = tuple(_shape_entry(name, s) for s in shape)
    if isinstance(dtype, str):
        if dtype not in dtypes.FROM_NAME:
            raise SpecError(f"tensor {name!r}: dtype {dtype!r} must be one of "
                            f"{list(dtypes.FROM_NAME)}")
        dtype = dtypes.FROM_NAME[dtype]
    elif dtype not in dtypes.TAG:
        raise SpecError(f"tensor {name!r}: dtype {dtype} is not supported; expected one of "
                        f"{list(dtypes.FROM_NAME)}")
    return TensorParam(name, shape, dtype)
