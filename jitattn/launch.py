"""Tensors (+ an optional plan on the device) -> the kernels' argument list, and the launch.

One argument list (a tuple of kinds and a list of values) serves the CUDA kernels and the CPU
backend (templates/cuda/attention.cu.j2, templates/cpu/attention.cpp.j2). Ragged K/V are passed
as a paged layout with page_size 1 and no page table; paged caches pass their page table and
strides (NHD and HND differ only in strides).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from . import dtypes, jit, load, render
from .args import positive_f32, shown_value
from .params import ScalarParam


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale: ``sm_scale``, or 1 / sqrt(head_dim) for None. Raises ValueError
    unless it is a number that float32 holds as finite and > 0 (the kernels take it as
    float32; without a score_mod the CUDA kernels fold it into the softmax's exponent, where
    the maximum of the scaled scores must be the scaled maximum)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        fine = not isinstance(sm_scale, (bool, np.bool_)) and \
            isinstance(sm_scale, numbers.Real) and positive_f32(float(sm_scale))
    except OverflowError:  # (an int beyond any float)
        fine = False
    if not fine:
        hint = " (a tensor: pass sm_scale=t.item(), a Python float)" \
            if isinstance(sm_scale, torch.Tensor) else ""
        raise ValueError(f"sm_scale={shown_value(sm_scale)}: expected a finite number > 0 (as "
                         f"float32){hint}")
    return float(sm_scale)


@dataclass
class KVView:
    """How the kernels address K and V: strides in elements and an optional page table."""

    k: torch.Tensor
    v: torch.Tensor
    kv_indices: torch.Tensor | None   # int32 on the device, or None for ragged
    page_size: int
    k_strides: tuple                  # (page, slot, head)
    v_strides: tuple

    @staticmethod
    def ragged(k: torch.Tensor, v: torch.Tensor) -> "KVView":
        """k, v: [total_kv, num_kv_heads, head_dim]."""
        return KVView(k, v, None, 1, kv_strides(k, "ragged"), kv_strides(v, "ragged"))

    @staticmethod
    def paged(k_cache, v_cache, kv_indices, layout: str) -> "KVView":
        """NHD caches are [num_pages, page_size, Hkv, D], HND [num_pages, Hkv, page_size, D]."""
        return KVView(k_cache, v_cache, kv_indices, k_cache.shape[1 if layout == "NHD" else 2],
                      kv_strides(k_cache, layout), kv_strides(v_cache, layout))


def kv_strides(t: torch.Tensor, layout: str) -> tuple:
    """The (page, slot, head) strides in elements of a K or V cache in ``layout`` ("NHD",
    "HND", or "ragged": rows [total_kv, Hkv, D] as pages of one slot)."""
    s = t.stride()
    if layout == "NHD":
        return s[0], s[1], s[2]
    return (s[0], s[2], s[1]) if layout == "HND" else (s[0], 0, s[1])


@dataclass
class DevicePlan:
    """A plan's arrays on the device (see plan.Plan) and the partial-state buffers."""

    requests: torch.Tensor
    items: torch.Tensor
    cta_indptr: torch.Tensor
    partial_o: torch.Tensor
    partial_lse: torch.Tensor
    num_items: int
    num_ctas: int
    rows_per_cta: int
    mask_bits: torch.Tensor | None = None   # uint8, custom masks
    token_pos: torch.Tensor | None = None   # int32, multi-item masks

    def __post_init__(self):
        # the kernels' plan arguments, in their order (fixed buffers: taken once)
        self.pointers = tuple(_ptr(t) for t in (
            self.requests, self.items, self.cta_indptr, self.partial_o, self.partial_lse,
            self.mask_bits, self.token_pos))


def _span(t) -> tuple[int, int]:
    """[start, end): the bytes a tensor's elements lie within (strides >= 0)."""
    start = t.data_ptr()
    if t.is_contiguous():  # (the usual case: host time)
        return start, start + t.nbytes
    if t.numel() == 0:
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements in the same layout (out=q: in place, which
    the kernels allow for q, each row being read before its output is written). False for
    anything but two tensors (output_buffer then names what it got)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() \
        and a.dtype == b.dtype and a.device == b.device


def output_buffer(name, t, shape, dtype, device, align: int = 16, apart_from=None):
    """A new output tensor, or the caller's after checking it fits: the shape, dtype and
    device, contiguous, its start a multiple of ``align`` bytes (out: 16, the kernels store
    whole 16-byte chunks of a row; lse: 4, stored a float at a time), and no byte shared with
    the tensors of ``apart_from`` (name -> tensor; lse: out, which the kernels write at the same
    time, and the inputs a caller names)."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_output(name, t, shape, dtype, device)
    if t.requires_grad and torch.is_grad_enabled():  # (its autograd history would go stale)
        raise ValueError(f"{name} requires grad; jitattn writes it without autograd (no "
                         f"backward): pass a buffer that does not, or call under "
                         f"torch.no_grad() / torch.inference_mode()")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    a0 = t.data_ptr()
    if a0 % align:
        raise ValueError(f"{name} starts at address {a0:#x}, not {align}-byte aligned; "
                         f"expected a tensor from torch.empty or a view at a {align}-byte "
                         f"offset")
    if not apart_from:
        return t
    a1 = a0 + t.nbytes  # (contiguous: _span's first case)
    for other_name, other in apart_from.items():
        b0, b1 = _span(other)
        if a0 < b1 and b0 < a1 and other.device == t.device:
            raise ValueError(f"{name} shares memory with {other_name} (bytes {a0:#x} + "
                             f"{a1 - a0} and {b0:#x} + {b1 - b0}); expected separate buffers")
    return t


def check_output(name, t, shape, dtype, device) -> None:
    """A caller's output buffer has the shape, dtype and device expected (output_buffer's
    first checks; also what a traced call can check, where addresses are unknown). Raises
    TypeError / ValueError naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; expected "
                         f"{tuple(shape)} {dtype} on {device}")


def into_outputs(o, s, out, lse, return_lse: bool):
    """A traced op's fresh outputs (out o, lse s), copied into the caller's buffers when given,
    which are checked as in eager mode (copy_ would cast a wrong dtype silently); returns what
    the eager call returns."""
    if out is not None:
        check_output("out", out, o.shape, o.dtype, o.device)
        o = out.copy_(o)
    if lse is not None:
        check_output("lse", lse, s.shape, s.dtype, s.device)
        s = lse.copy_(s)
    return (o, s) if return_lse else o


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


# the attention kernels' fixed arguments (templates/cuda/attention.cu.j2), then the variant's
_ATTENTION_KINDS = ("ptr",) * 14 + ("i32",) * 7 + ("i64", "i32", "ptr", "i32") + \
    ("i64", "i32", "i32") * 2 + ("f32",)
_KINDS: dict = {}


def _attention_kinds(variant, tma: bool = False) -> tuple:
    """The attention kernels' argument kinds for ``variant`` (its runtime parameters: a float
    per scalar, a pointer and an int per dimension per tensor; then, for the kernels that copy
    with TMA, kv_tma and the two maps); one tuple per variant and kernel family."""
    kinds = _KINDS.get((variant.key, tma))
    if kinds is None:
        extra = []
        for p in variant.params:
            extra += ["f32"] if isinstance(p, ScalarParam) else ["ptr"] + ["i32"] * len(p.shape)
        kinds = _KINDS[(variant.key, tma)] = _ATTENTION_KINDS + tuple(extra) + \
            (("i32", "tmaps") if tma else ())
    return kinds


def _fixed_args(qo_indptr, kv_indptr, plan, batch, single_qo_len, single_kv_len,
                num_qo_heads, num_kv_heads, kv_indices, page_size) -> tuple:
    """The arguments that a plan's calls share, in two runs: after the five tensors' addresses,
    and between q's strides and the K/V strides (_fill_args)."""
    return ((_ptr(qo_indptr), _ptr(kv_indptr),
             *(plan.pointers if plan is not None else (0,) * 7),
             single_qo_len, single_kv_len, batch, plan.num_items if plan else 0,
             plan.rows_per_cta if plan else 0, num_qo_heads, num_kv_heads),
            (_ptr(kv_indices), page_size))


def _fill_args(fixed, q, k, v, out, lse, ks, vs, sm_scale, variant, bound) -> list:
    """The kernels' values: the tensors' addresses and strides around ``fixed``, the softmax
    scale, the variant's parameters. Raises ValueError for q / K / V strides the kernels
    cannot address."""
    qs0, qs1, _ = q.stride()
    # both backends take q's head stride and the K/V slot and head strides as int32 (the CPU
    # kernel's ctypes wrapped them: another head's keys were read), the CUDA kernels the page
    # (ragged: token) stride and (page_size - 1) x the slot stride too
    if qs1 >= 1 << 31 or max(ks + vs) * fixed[1][1] >= 1 << 31:  # (bounds every term: host time)
        named = {"q's head stride": qs1, "K's slot stride": ks[1], "K's head stride": ks[2],
                 "V's slot stride": vs[1], "V's head stride": vs[2],
                 "(page_size - 1) x the slot stride": (fixed[1][1] - 1) * max(ks[1], vs[1])}
        if q.is_cuda:
            named.update({"K's page (ragged: token) stride": ks[0],
                          "V's page (ragged: token) stride": vs[0]})
        over = [(n, x) for n, x in named.items() if x >= 1 << 31]
        if over:
            raise ValueError(f"{over[0][0]} is {over[0][1]} elements; the kernels address it "
                             f"in int32: expected below 2**31")
    values = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), _ptr(lse), *fixed[0],
              qs0, qs1, *fixed[1], *ks, *vs, sm_scale]
    for p in variant.params:
        if isinstance(p, ScalarParam):
            values.append(bound[p.name])
        else:
            t = bound[p.name]
            values.append(t.data_ptr())
            values += t.shape
    return values


_TMA_DTYPES = {torch.float16: load.TMA_FLOAT16, torch.bfloat16: load.TMA_BFLOAT16}
_TMA_MAPS: dict = {}
_NO_MAPS = bytes(256)


def _tma_map(t: torch.Tensor, box_rows: int) -> bytes | None:
    """The TMA map of ragged k or v ([rows, num_kv_heads, head_dim], head_dim contiguous) with
    boxes of 64 columns x 1 head x box_rows rows, or None where TMA cannot address it (TMA
    needs a 16-byte aligned start and strides in multiples of 16 bytes); memoised by address,
    shape and strides."""
    key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), box_rows)
    if key in _TMA_MAPS:
        return _TMA_MAPS[key]
    es = t.element_size()
    rows, heads, head_dim = t.shape
    if t.dtype not in _TMA_DTYPES or t.stride(2) != 1 or rows == 0 or t.data_ptr() % 16 or \
            (t.stride(1) * es) % 16 or (t.stride(0) * es) % 16:
        tmap = None
    else:
        tmap = load.tensor_map(_TMA_DTYPES[t.dtype], t.data_ptr(), (head_dim, heads, rows),
                               (t.stride(1) * es, t.stride(0) * es), (64, 1, box_rows))
    if len(_TMA_MAPS) >= 256:
        _TMA_MAPS.clear()
    _TMA_MAPS[key] = tmap
    return tmap


def tma_values(k: torch.Tensor, v: torch.Tensor, paged: bool, box_rows: int) -> tuple:
    """The last arguments of the kernels that copy with TMA (render.RenderedSource.tma): kv_tma
    (1 when both maps exist) and the TMA maps of ragged k and v with boxes of box_rows rows,
    k's then v's (zeros for a paged cache, which TMA cannot gather, or where _tma_map refuses:
    the kernel then copies with cp.async)."""
    k_map = v_map = None
    if not paged:
        k_map, v_map = _tma_map(k, box_rows), _tma_map(v, box_rows)
    if k_map is None or v_map is None:
        return 0, _NO_MAPS
    return 1, k_map + v_map


# torch's current CUDA stream of a device as a raw pointer: the binding torch.compile's
# generated code uses (1.6 us -> 0.1 us per launch on the H200 host); the public call otherwise
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    """The raw cudaStream_t of torch's current stream on device ``index``."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def run_attention(q, kv: KVView, out, lse, variant, bound, *, num_kv_heads: int, kind: str,
                  qo_indptr=None, kv_indptr=None, plan: DevicePlan | None = None, batch: int,
                  max_qo_len: int, single_qo_len: int, single_kv_len: int,
                  sm_scale: float, shared_kv: bool = False) -> Launcher:
    """Launch one attention kernel: the CPU backend for CPU tensors, else the CUDA kernel of
    ``kind`` ("prefill" | "decode"), on a persistent grid of plan.num_ctas CTAs when planned;
    shared_kv: the build that reads shared prefixes (the plan has some). lse None: the
    kernel stores no lse. Returns the Launcher that repeats this launch for other tensors of
    the same shapes, dtypes, device and layout."""
    head_dim = q.shape[2]
    fixed = _fixed_args(qo_indptr, kv_indptr, plan, batch, single_qo_len, single_kv_len,
                        q.shape[1], num_kv_heads, kv.kv_indices, kv.page_size)
    tag, kv_tag = dtypes.tag(q.dtype), dtypes.kv_tag(kv.k.dtype)
    if q.device.type == "cpu":
        launcher = Launcher(jit.get_kernel(variant, backend="cpu", head_dim=head_dim,
                                           kv_tag=kv_tag),
                            _attention_kinds(variant), fixed, entry=render.cpu_entry(tag, kv_tag))
    else:
        index = device_index(q)
        kernel = jit.get_kernel(variant, backend="cuda", kind=kind, dtype_tag=tag,
                                head_dim=head_dim, device_index=index, kv_tag=kv_tag,
                                shared_kv=shared_kv)
        if plan is not None:
            grid = (plan.num_ctas, 1, 1)
        else:
            g = q.shape[1] // num_kv_heads
            grid = (-(-max_qo_len * g // kernel.rows_per_cta), batch, num_kv_heads)
        launcher = Launcher(kernel, _attention_kinds(variant, tma=kernel.tma), fixed, grid,
                            index, tma_box=kernel.kv_tile if kernel.tma else 0,
                            paged=kv.kv_indices is not None)
    launcher(q, kv.k, kv.v, out, lse, kv.k_strides, kv.v_strides, sm_scale, variant, bound)
    return launcher


@dataclass
class Launcher:
    """One attention launch as run_attention resolved it (the kernel, its argument kinds and
    grid, the arguments a plan fixes), repeated for other tensors of the same shapes, dtypes,
    device and layout: a planned wrapper's later run() calls skip the lookups. Calling it
    takes the tensors, the K / V strides (kv_strides), the softmax scale and the variant's
    bound parameters, as run_attention does."""

    kernel: object               # load.CudaKernel, or load.CpuKernel
    kinds: tuple
    fixed: tuple                 # _fixed_args
    grid: tuple = ()
    device_index: int = -1       # -1: the CPU backend
    entry: str = ""              # the CPU backend's symbol
    tma_box: int = 0             # > 0: the kernel takes TMA maps of k and v with these rows
    paged: bool = False          # (then the maps are zeros: TMA cannot gather pages)

    def __call__(self, q, k, v, out, lse, k_strides, v_strides, sm_scale, variant, bound):
        values = _fill_args(self.fixed, q, k, v, out, lse, k_strides, v_strides, sm_scale,
                            variant, bound)
        if self.tma_box:  # (the maps follow k and v's addresses)
            values += tma_values(k, v, self.paged, self.tma_box)
        if self.device_index < 0:
            self.kernel.launch(self.entry, self.kinds, values)
        else:
            self.kernel.launch(self.grid, self.kinds, values, current_stream(self.device_index))


_MERGE_KINDS = ("ptr",) * 6 + ("i32", "i32", "i64") + ("ptr",) * 4 + ("i32", "i32")


def run_merge(o_parts, lse_parts, out, lse_out, *, sigmoid: bool, merge_indptr=None,
              merge_rows=None, merge_slots=None, num_merged_dev=None, num_merged: int = 0,
              num_states: int = 0, state_stride: int = 0, o_second=None, lse_second=None,
              grid_ctas: int | None = None) -> None:
    """Launch the attention-state merge: planned mode with merge_slots; pair mode with
    o_second / lse_second (row m merges row m of o_parts / lse_parts with row m of o_second /
    lse_second; out / lse_out may be o_parts / lse_parts); else dense mode (row m merges rows
    m + i * state_stride of o_parts / lse_parts for i < num_states). lse_out None: no lse is
    stored."""
    in_tag, out_tag = dtypes.tag(o_parts.dtype), dtypes.tag(out.dtype)
    head_dim = out.shape[-1]
    values = [o_parts.data_ptr(), lse_parts.data_ptr(), _ptr(merge_indptr), _ptr(merge_rows),
              _ptr(merge_slots), _ptr(num_merged_dev), num_merged, num_states, state_stride,
              _ptr(o_second), _ptr(lse_second), out.data_ptr(), _ptr(lse_out), head_dim,
              int(sigmoid)]
    if not out.is_cuda:
        jit.get_merge_kernel(backend="cpu", in_tag=in_tag, out_tag=out_tag).launch(
            f"jitattn_merge_{in_tag}_{out_tag}", _MERGE_KINDS, values)
        return
    index = device_index(out)
    kernel = jit.get_merge_kernel(backend="cuda", in_tag=in_tag, out_tag=out_tag,
                                  device_index=index)
    ctas = grid_ctas or max(1, min(-(-num_merged // kernel.rows_per_cta), 65535))
    kernel.launch((ctas, 1, 1), _MERGE_KINDS, values, current_stream(index))
