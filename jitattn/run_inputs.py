"""The tensors of BatchPrefill.run / BatchDecode.run, checked against their plan: q and the
K/V cache's shapes, dtypes, device, strides and alignment, and that the cache holds every page
(or ragged row) the plan refers to. Every error names the argument, its value and what was
expected. The usual call takes RunInputs.hold, a fast test of the same conditions (host time
per layer); only when it fails does RunInputs.check find and name what is wrong."""

from __future__ import annotations

import torch

from .launch import kv_strides


def split_cache(kv_cache, kv_layout: str):
    """(k_cache, v_cache) from run()'s kv_cache: the pair, or for a paged layout one
    [num_pages, 2, ...] tensor. Raises TypeError / ValueError naming kv_cache."""
    if type(kv_cache) is tuple and len(kv_cache) == 2:  # (the usual call: host time)
        return kv_cache
    if isinstance(kv_cache, torch.Tensor) and kv_layout != "ragged":
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache as one tensor must be [num_pages, 2, ...] (5-D), got "
                             f"{tuple(kv_cache.shape)}")
        return kv_cache[:, 0], kv_cache[:, 1]
    if not (isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2):
        raise TypeError("kv_cache must be (k_cache, v_cache)" + (
            "" if kv_layout == "ragged" else " or one [num_pages, 2, ...] tensor"))
    return kv_cache


def kv_strides_fit(t: torch.Tensor) -> bool:
    """Whether the kernels can address K / V tensor ``t``: kv_strides_ok, and its start
    16-byte aligned."""
    return kv_strides_ok(t) and not t.data_ptr() % 16


def kv_strides_ok(t: torch.Tensor) -> bool:
    """kv_strides_fit's test of the strides alone: the last dim contiguous, the other strides
    multiples of 16 bytes."""
    return t.stride(-1) == 1 and not any(s * t.element_size() % 16 for s in t.stride()[:-1])


def q_strides_fit(t: torch.Tensor) -> bool:
    """Whether the kernels can read q-like tensor ``t`` [rows, heads, head_dim] with 16-byte
    vector loads: q_strides_ok, and its start 16-byte aligned."""
    return q_strides_ok(t) and not t.data_ptr() % 16


def q_strides_ok(t: torch.Tensor) -> bool:
    """q_strides_fit's test of the strides alone: the last dim contiguous, the other strides
    multiples of 8 elements."""
    s0, s1, s2 = t.stride()
    return s2 == 1 and not s0 % 8 and not s1 % 8


def q_strides_error(name: str, t: torch.Tensor) -> ValueError:
    return ValueError(f"{name} has strides {t.stride()} (data pointer {t.data_ptr():#x}); "
                      f"expected the last dimension contiguous, the other strides multiples "
                      f"of 8 elements and a 16-byte aligned pointer (call .contiguous())")


def swapped_hint(name: str, shape, expected: tuple) -> str:
    """A hint for a tensor ``name`` of ``shape`` that is the plan's ``expected`` [tokens, heads,
    head_dim] with its first two dimensions swapped ([heads, tokens, head_dim], SDPA's and
    FlexAttention's layout without the batch), else ''."""
    if tuple(shape) != (expected[1], expected[0], expected[2]):
        return ""
    return (f" ({name} looks like [heads, tokens, head_dim]; run() takes [tokens, heads, "
            f"head_dim]: {name}.transpose(0, 1))")


class RunInputs:
    """What run() accepts after one plan(): q [total_q, num_qo_heads, head_dim] of q_dtype and
    K/V caches whose pages (NHD [page_size, Hkv, D], HND [Hkv, page_size, D]) or ragged rows
    ([Hkv, D]) are of kv_dtype, on ``device``, with more than max_page pages / rows (max_page:
    the largest page id, or ragged row, the plan reads; shared_prefixes: the plan has ragged
    shared prefixes, which the error then names)."""

    def __init__(self, *, total_q: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 q_dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, kv_layout: str,
                 device: torch.device, max_page: int, shared_prefixes: bool):
        self.q_shape = (total_q, num_qo_heads, head_dim)
        self.q_dtype, self.kv_dtype, self.kv_layout = q_dtype, kv_dtype, kv_layout
        self.page = {"NHD": (page_size, num_kv_heads, head_dim),
                     "HND": (num_kv_heads, page_size, head_dim),
                     "ragged": (num_kv_heads, head_dim)}[kv_layout]
        self.device = device
        self.device_index = device.index if device.type == "cuda" else -1
        self.max_page, self.shared_prefixes = max_page, shared_prefixes
        self._q_dense = (num_qo_heads * head_dim, head_dim, 1)  # q's contiguous strides
        self._fine: dict = {}  # (K/V shape, strides) -> the kernels' strides, or () (hold)

    def hold(self, q, k_cache, v_cache):
        """check()'s conditions, tested the fast way for the usual call (host time: each torch
        attribute read costs 0.1-0.3 us). Returns (k_strides, v_strides, q_dense): the caches'
        (page, slot, head) strides in elements as launch.kv_strides gives them, and whether q
        is contiguous (and a plain torch.Tensor: empty_like keeps a subclass); or None,
        which sends the call through check(), which names what is wrong."""
        # (get_device() is -1 for CPU and meta tensors alike, and other devices have indices)
        index, cuda = self.device_index, self.device_index >= 0
        if not (isinstance(q, torch.Tensor) and q.get_device() == index and
                (q.is_cuda if cuda else q.is_cpu) and q.dtype == self.q_dtype and
                q.size() == self.q_shape and not q.data_ptr() % 16):
            return None
        qs = q.stride()
        if qs[2] != 1 or qs[0] % 8 or qs[1] % 8:  # (q_strides_fit, inline: the hot path)
            return None
        kv = []
        for c in (k_cache, v_cache):
            if not (isinstance(c, torch.Tensor) and c.get_device() == index and
                    (c.is_cuda if cuda else c.is_cpu) and c.dtype == self.kv_dtype and
                    not c.data_ptr() % 16):
                return None
            key = (c.size(), c.stride())
            strides = self._fine.get(key)
            if strides is None:
                strides = self._fine[key] = self._kernel_strides(c)
                if len(self._fine) > 64:  # (a cache's shape is one per model: a bound only)
                    self._fine.clear()
            if not strides:
                return None
            kv.append(strides)
        return kv[0], kv[1], qs == self._q_dense and type(q) is torch.Tensor

    def _kernel_strides(self, c):
        """The kernels' (page, slot, head) strides of cache ``c`` (launch.kv_strides), or ()
        when its shape or strides do not suit the plan (hold's memo: shape and strides)."""
        s = c.stride()
        if c.dim() != len(self.page) + 1 or tuple(c.shape[1:]) != self.page or \
                self.max_page >= c.shape[0] or s[-1] != 1 or \
                any(x * c.element_size() % 16 for x in s[:-1]):
            return ()
        return kv_strides(c, self.kv_layout)

    def check(self, q, k_cache, v_cache) -> None:
        """Raises ValueError / TypeError naming the first argument that does not suit the plan."""
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(q.shape) != self.q_shape:
            raise ValueError(f"q has shape {tuple(q.shape)}; the plan expects {self.q_shape}"
                             + swapped_hint("q", q.shape, self.q_shape))
        if q.dtype != self.q_dtype:
            raise TypeError(f"q has dtype {q.dtype}; the plan was made for {self.q_dtype} "
                            f"(plan(..., q_dtype=) sets it)")
        page = self.page
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(c, torch.Tensor) or c.dim() != len(page) + 1 or \
                    tuple(c.shape[1:]) != page:
                what = "total_kv" if self.kv_layout == "ragged" else "num_pages"
                raise ValueError(f"{name} has shape {tuple(getattr(c, 'shape', ()))}; expected "
                                 f"[{what}, {', '.join(map(str, page))}] ({self.kv_layout})")
            if c.dtype != self.kv_dtype:
                raise TypeError(f"{name} has dtype {c.dtype}; the plan was made for "
                                f"kv_dtype={self.kv_dtype}")
            if c.device != q.device or q.device != self.device:
                raise ValueError(f"q is on {q.device}, {name} on {c.device}; the wrapper "
                                 f"was built for {self.device}")
            if not kv_strides_fit(c):
                raise ValueError(f"{name} has strides {c.stride()} (data pointer "
                                 f"{c.data_ptr():#x}); expected the last dim contiguous, other "
                                 f"strides multiples of 16 bytes, a 16-byte aligned pointer")
            if self.max_page >= c.shape[0]:
                unit = "token" if self.kv_layout == "ragged" else "page"
                where = (" (kv_indptr[-1] - 1, or the last row of a shared prefix: "
                         "shared_prefix_start + shared_prefix_len - 1)" if self.shared_prefixes
                         else " (kv_indptr[-1] - 1)") if self.kv_layout == "ragged" else \
                    " (the largest entry of plan()'s kv_indices)"
                raise ValueError(f"the plan refers to {unit} {self.max_page}{where} but {name} "
                                 f"has {c.shape[0]} {unit}s (dim 0)")
        if not q_strides_fit(q):
            raise q_strides_error("q", q)
