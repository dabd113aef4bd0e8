"""The host-side inputs of BatchPrefill.plan / BatchDecode.plan, checked and turned into per-
request lengths: indptrs, the page table, last-page lengths, head configuration, dtypes and
the wrapper's capacities. Every error names the argument, its value and what was expected."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import dtypes
from . import masks as masks_mod
from .args import CapacityError, int_arg, over_capacity, shown_value
from .plan import check_seq_lens
from .render import HEAD_DIMS

# num_qo_heads / num_kv_heads at most this: the planner's arrays and the kernels' int32 row
# arithmetic grow with them (2**31 heads made plan() allocate 16 GiB before it failed), and
# no model comes near
MAX_HEADS = (1 << 16) - 1


@dataclass(frozen=True)
class BatchInputs:
    """A checked batch. qo / kv: the indptrs (int32 numpy; kv counts pages, or tokens for the
    ragged layout); indices: the page table (the identity for ragged); qo_lens / kv_lens:
    tokens per request, kv_lens counting the shared prefix; shared_starts / shared_lens: each
    request's shared prefix (ragged; None without one); max_page: the largest page id, or
    ragged the largest row, used (-1 for none)."""

    qo: np.ndarray
    kv: np.ndarray
    indices: np.ndarray
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    kv_dtype: torch.dtype
    max_page: int
    shared_starts: np.ndarray | None = None
    shared_lens: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return len(self.qo) - 1


def check_indptr(name: str, x: np.ndarray) -> None:
    if x[0] != 0:
        raise ValueError(f"{name}[0] is {x[0]}; expected 0")
    bad = np.nonzero(np.diff(x) < 0)[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{name} must be non-decreasing; {name}[{i}] = {x[i]} > "
                         f"{name}[{i + 1}] = {x[i + 1]}")


def check_batch(qo, kv_indptr, kv_indices, kv_last_page_len, *, decode: bool, kv_layout: str,
                page_size: int, num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype,
                capacity: dict, shared_prefix_start=None,
                shared_prefix_len=None, prefix: str = "") -> BatchInputs:
    """Check plan()'s arguments (qo: the host qo_indptr, int32 numpy; decode: the batch size
    comes from kv_indptr) against each other and the wrapper's capacities. Raises ValueError /
    TypeError naming the argument (prefix: before the names of kv_indptr, kv_indices and
    kv_last_page_len, e.g. "unique_" for CascadeDecode.plan's)."""
    n_indptr, n_indices, n_last = (prefix + n for n in ("kv_indptr", "kv_indices",
                                                        "kv_last_page_len"))
    kv = masks_mod.host_int32(n_indptr, kv_indptr)
    check_indptr("qo_indptr", qo)
    check_indptr(n_indptr, kv)
    batch = len(qo) - 1
    ragged = kv_layout == "ragged"
    if ragged:
        if kv_indices is not None or kv_last_page_len is not None:
            raise ValueError("kv_layout='ragged' has no pages: pass kv_indices=None and "
                             "kv_last_page_len=None (kv_indptr counts tokens)")
        # tokens as pages of one: the page table is the identity
        kv_indices = torch.arange(int(kv[-1]), dtype=torch.int32)
        kv_last_page_len = torch.ones(batch, dtype=torch.int32)
    indices = masks_mod.host_int32(n_indices, kv_indices, allow_empty=True)
    last = masks_mod.host_int32(n_last, kv_last_page_len, allow_empty=True)
    if len(kv) != batch + 1 or len(last) != batch:
        if decode:  # batch is len(kv_indptr) - 1
            raise ValueError(f"{n_last} has {len(last)} entries; {n_indptr}'s "
                             f"{len(kv)} make a batch of {batch}")
        raise ValueError(f"qo_indptr has {len(qo)} entries, kv_indptr {len(kv)} and "
                         f"kv_last_page_len {len(last)}; expected batch + 1, batch + 1, "
                         f"batch")
    if kv[-1] > len(indices):
        raise ValueError(f"{n_indptr}[-1] is {kv[-1]} but {n_indices} has {len(indices)} "
                         f"entries")
    used = indices[:kv[-1]]
    if len(used) and used.min() < 0:
        raise ValueError(f"{n_indices} holds a negative page id ({int(used.min())})")
    pages = np.diff(kv)
    tokens_per_page = 1 if ragged else page_size
    bad = np.nonzero((pages > 0) & ((last < 1) | (last > tokens_per_page)))[0]
    if len(bad):
        b = int(bad[0])
        raise ValueError(f"{n_last}[{b}] is {last[b]}; expected 1 .. page_size "
                         f"({page_size}) for a request with pages")
    num_qo_heads = int_arg("num_qo_heads", num_qo_heads, maximum=MAX_HEADS)
    num_kv_heads = int_arg("num_kv_heads", num_kv_heads, maximum=MAX_HEADS)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if int_arg("head_dim", head_dim) not in HEAD_DIMS:
        raise ValueError(f"head_dim={shown_value(head_dim)}: expected one of {HEAD_DIMS}")
    if q_dtype not in dtypes.QKV_DTYPES:
        raise TypeError(f"q_dtype={q_dtype!r}: expected one of {dtypes.QKV_DTYPES}")
    kv_dtype = q_dtype if kv_dtype is None else kv_dtype
    if kv_dtype not in (q_dtype,) + dtypes.FP8_KV_DTYPES:
        raise TypeError(f"kv_dtype={kv_dtype!r}: expected q_dtype ({q_dtype}) or one of "
                        f"{dtypes.FP8_KV_DTYPES}")
    for name, needed in (("max_batch_size", batch),
                         ("max_num_pages", 0 if ragged else int(kv[-1]))):
        over = over_capacity(capacity, name, needed)
        if over is not None:
            raise CapacityError(over)
    # int64: a request listing a page 2**16 times at page_size 2**16 has 2**32 keys, which
    # wrapped in int32 (to 0: an output of zeros; or below 0: the CPU kernel aborted)
    kv_lens = np.where(pages > 0, (pages.astype(np.int64) - 1) * tokens_per_page + last, 0)
    qo_lens = np.diff(qo)
    max_page = int(used.max(initial=-1))
    starts, lens = shared_prefixes(shared_prefix_start, shared_prefix_len, batch, kv_layout)
    if lens is not None:
        kv_lens = kv_lens + lens
        max_page = max(max_page, int((starts + lens)[lens > 0].max(initial=0)) - 1)
    check_seq_lens(int(qo_lens.max(initial=0)), int(kv_lens.max(initial=0)))
    if lens is None:
        kv_lens = kv_lens.astype(np.int32)  # (fits now: the int32 lengths the plan had)
    return BatchInputs(qo, kv, indices, qo_lens, kv_lens, kv_dtype, max_page, starts, lens)


def shared_prefixes(shared_prefix_start, shared_prefix_len, batch: int, kv_layout: str):
    """Check plan()'s shared prefixes (ragged only: request b's keys begin with rows
    shared_prefix_start[b] .. + shared_prefix_len[b] of k / v); (starts, lens) as int64 numpy,
    or (None, None) when neither is given."""
    if shared_prefix_start is None and shared_prefix_len is None:
        return None, None
    if kv_layout != "ragged":
        raise ValueError(f"shared_prefix_start / shared_prefix_len need kv_layout='ragged' "
                         f"(the wrapper's is {kv_layout!r}); a paged cache shares a prefix by "
                         f"listing its pages in every request's kv_indices")
    if shared_prefix_start is None or shared_prefix_len is None:
        raise ValueError("shared_prefix_start and shared_prefix_len go together: pass both")
    starts = masks_mod.host_int32("shared_prefix_start", shared_prefix_start, allow_empty=True)
    lens = masks_mod.host_int32("shared_prefix_len", shared_prefix_len, allow_empty=True)
    for name, x in (("shared_prefix_start", starts), ("shared_prefix_len", lens)):
        if len(x) != batch:
            raise ValueError(f"{name} has {len(x)} entries; expected one per request ({batch})")
        if len(x) and x.min() < 0:
            b = int(np.argmin(x))
            raise ValueError(f"{name}[{b}] is {x[b]}; expected >= 0")
    starts, lens = starts.astype(np.int64), lens.astype(np.int64)
    if len(lens) and (starts + lens).max() >= 1 << 31:  # the kernels' row numbers are int32
        b = int(np.argmax(starts + lens))
        raise ValueError(f"shared_prefix_start[{b}] + shared_prefix_len[{b}] is "
                         f"{starts[b] + lens[b]}; expected < 2**31")
    return starts, lens
