"""CascadeDecode: decode with one shared prefix, as a two-level MultiLevelCascade (the prefix's
pages read once for every request's query) or as plain paged decode, chosen per plan() by a cost
model ("auto"; the shared-prefix survey's trade-off, docs/sources.md)."""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch

from . import masks as masks_mod
from .args import CapacityError, extra_run_args, int_arg, missing_cache, over_capacity, planner, \
    warn_no_grad
from .batch import CAPACITY_NAMES, BatchDecode, _cache_tensors
from .batch_inputs import check_batch
from .cascade import MultiLevelCascade
from .emit import MAX_SEQ_LEN
from .run_inputs import swapped_hint
from .spec import Variant


# "auto" in CascadeDecode: the cascade pays about CASCADE_OVERHEAD_S more than plain decode
# (an extra level, its split-KV merge and the level merge; H200, `jitattn bench cascade`: 0.166
# vs 0.059 ms at batch 16 / prefix 1024, where the bytes saved are negligible; replayed from a
# CUDA graph the difference is 0.019 ms) and saves re-reading the prefix for every request but
# one, at about DECODE_BYTES_PER_S (`jitattn bench decode`: 3.83 TB/s). docs/performance.md, v7.
CASCADE_OVERHEAD_S = 1.1e-4
DECODE_BYTES_PER_S = 3.8e12


class CascadeDecode(MultiLevelCascade):
    """Decode with one shared prefix: level 0 packs every request's query into one request
    against the shared pages (read once); level 1 is each request against its own pages.

    strategy: "cascade", "plain" (one paged decode over [prefix pages + own pages] per
    request; needs the prefix to end on a page boundary) or "auto" (plain when the prefix
    bytes the cascade would save take less time to read than the cascade's extra launches
    cost: CASCADE_OVERHEAD_S, DECODE_BYTES_PER_S; the shared-prefix survey (docs/sources.md)
    notes the same trade-off). The choice of the last plan() is in ``chosen``. After a plan()
    that chose plain, ``run`` is the inner BatchDecode's own run() (so "auto" costs no host
    time over plain decode; its k_scale / v_scale other than 1 are refused as here); a
    reference to ``run`` kept across plans (a partial, torch.compile of it) runs the latest
    plan either way. A CUDA graph captures the launches of one strategy: to replay it after
    new plans, fix the strategy ("cascade" or "plain"), since "auto" may switch between them."""

    _LEVEL_NAMES = ("the shared level (shared_kv_indices)", "the requests' own level "
                    "(unique_kv_indices)")

    _LEVEL_KEYWORDS = CAPACITY_NAMES + ("split_kv",)  # (decode: no query_tile)
    _CALL = "{cls}(variant, "
    PLAN_PER_LEVEL = False

    def __init__(self, variant: Variant, page_size: int = 16, kv_layout: str = "NHD", *,
                 strategy: str = "auto", device=None, **capacities):
        self._refuse_unknown(capacities)
        if strategy not in ("auto", "cascade", "plain"):
            raise ValueError(f"strategy={strategy!r}: expected 'auto', 'cascade' or 'plain'")
        if kv_layout not in ("NHD", "HND", "ragged"):
            raise ValueError(f"kv_layout={kv_layout!r}: expected 'NHD' or 'HND'")
        if kv_layout == "ragged":  # (its plan() takes page tables: no plan could succeed)
            raise ValueError("kv_layout='ragged': CascadeDecode plans over page tables ('NHD' "
                             "or 'HND'); for ragged keys use MultiLevelCascade(variant, 2, "
                             "kv_layout='ragged'), whose plan() takes None per level for "
                             "kv_indices and kv_last_page_len")
        self._build_levels(variant, 2, page_size, kv_layout, device, capacities)
        # the unique level has one query per request: the decode kernel
        self.levels[1] = BatchDecode(variant, page_size=page_size, kv_layout=kv_layout,
                                     device=device, **capacities)
        self.plain = BatchDecode(variant, page_size=page_size, kv_layout=kv_layout,
                                 device=device, **capacities)
        # the plain strategy's run() refuses k_scale / v_scale as the cascade's does
        self.plain.run_owner = type(self).__name__
        self.strategy, self.chosen, self._bound_plain = strategy, None, None

    def choose(self, batch: int, prefix_len: int, num_kv_heads: int, head_dim: int,
               itemsize: int = 2) -> str:
        """What "auto" takes for ``batch`` requests sharing ``prefix_len`` tokens (KV elements
        of ``itemsize`` bytes): "cascade" when reading the prefix once instead of per request
        saves more time at decode's copy speed than the cascade's merge and second launch
        cost. Raises TypeError / ValueError naming an argument that is not an int in range."""
        batch, prefix_len = int_arg("batch", batch, 0), int_arg("prefix_len", prefix_len, 0)
        num_kv_heads, head_dim, itemsize = (int_arg(n, x) for n, x in (
            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("itemsize", itemsize)))
        saved_bytes = max(0, batch - 1) * prefix_len * 2 * num_kv_heads * head_dim * itemsize
        return "cascade" if saved_bytes / DECODE_BYTES_PER_S > CASCADE_OVERHEAD_S else "plain"

    @planner
    def plan(self, shared_kv_indices, shared_last_page_len: int, unique_kv_indptr,
             unique_kv_indices, unique_kv_last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, *, q_dtype=torch.float16, sm_scale: float | None = None) -> str:
        """shared_kv_indices: the prefix's pages (int32); shared_last_page_len: tokens on its
        last page. unique_*: each request's own pages, as for BatchDecode.plan. Returns the
        strategy used ("cascade" or "plain")."""
        # both strategies check every argument the same way, before anything is planned, on
        # host copies made once (the plans below read those: no second copy from the device)
        shared_kv_indices, unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len = (
            torch.from_numpy(masks_mod.host_int32(name, t, allow_empty=name != "unique_kv_indptr"))
            for name, t in (("shared_kv_indices", shared_kv_indices),
                            ("unique_kv_indptr", unique_kv_indptr),
                            ("unique_kv_indices", unique_kv_indices),
                            ("unique_kv_last_page_len", unique_kv_last_page_len)))
        shared = shared_kv_indices.numpy()
        if len(shared) and shared.min() < 0:
            raise ValueError(f"shared_kv_indices holds a negative page id ({int(shared.min())})")
        shared_pages = len(shared)
        # (read only when there are shared pages: then it is 1 .. page_size)
        shared_last_page_len = int_arg("shared_last_page_len", shared_last_page_len,
                                       1 if shared_pages else 0, self.page_size)
        batch = len(unique_kv_indptr) - 1
        check_batch(np.arange(batch + 1, dtype=np.int32), unique_kv_indptr, unique_kv_indices,
                    unique_kv_last_page_len, decode=True, kv_layout=self.plain.kv_layout,
                    page_size=self.page_size, num_qo_heads=num_qo_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype,
                    kv_dtype=None, capacity=self.plain.capacity, prefix="unique_")
        i32 = dict(dtype=torch.int32)
        prefix_len = (shared_pages - 1) * self.page_size + shared_last_page_len \
            if shared_pages else 0
        aligned = shared_pages == 0 or int(shared_last_page_len) == self.page_size
        strategy = self.strategy
        if strategy == "auto":
            strategy = self.choose(batch, prefix_len, num_kv_heads, head_dim,
                                   torch.empty(0, dtype=q_dtype).element_size())
            # plain copies the prefix's pages into every request's table: they must fit, and
            # the longest table's keys stay below MAX_SEQ_LEN
            plain_pages = batch * shared_pages + int(unique_kv_indptr[-1])
            if not aligned or plain_pages > self.plain.capacity["max_num_pages"] or \
                    self._plain_longest(shared_pages, unique_kv_indptr,
                                        unique_kv_last_page_len) >= MAX_SEQ_LEN:
                strategy = "cascade"
        if strategy == "plain":
            if not aligned:
                raise ValueError(f"strategy 'plain' needs the shared prefix to end on a page "
                                 f"boundary; its last page holds {shared_last_page_len} of "
                                 f"{self.page_size} tokens")
            self._plan_plain(shared_kv_indices, unique_kv_indptr, unique_kv_indices,
                             unique_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
                             q_dtype, sm_scale)
        else:
            too_many = over_capacity(self.levels[0].capacity, "max_num_pages", shared_pages)
            if too_many:  # (the first level's plan would blame the batch)
                took = "" if self.strategy == "cascade" else ", which took the cascade"
                raise CapacityError(f"strategy {self.strategy!r}{took}: the shared prefix "
                                 f"(shared_kv_indices, {shared_pages} pages) is the first "
                                 f"level's batch, and {too_many}")
            self.levels[0].plan(torch.tensor([0, batch], **i32),
                                torch.tensor([0, shared_pages], **i32), shared_kv_indices,
                                torch.tensor([shared_last_page_len], **i32), num_qo_heads,
                                num_kv_heads, head_dim, q_dtype=q_dtype, sm_scale=sm_scale)
            self.levels[1].plan(unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len,
                                num_qo_heads, num_kv_heads, head_dim, q_dtype=q_dtype,
                                sm_scale=sm_scale)
        self._set_rows([self._level_rows(0, batch, None), self._level_rows(1, batch, None)])
        self.chosen, self._q_shape = strategy, (batch, num_qo_heads, head_dim)
        if strategy == "plain" and type(self).run is CascadeDecode.run and \
                "run" not in self.__dict__:
            # run is plain's own bound run(): "auto" adds no host work to plain decode (eager
            # decode of a small batch is host-bound; auto must never be slower than plain).
            # (Not over a subclass's run() or one set on the instance.)
            self.run = self._bound_plain = self.plain.run
        return strategy

    def _drop_plan(self) -> None:
        """Back to the class's run() (when plan() had bound plain's), with nothing planned
        (plan()'s first step, args.planner).
        A reference kept from a plain plan (cd.run, a partial of it, torch.compile of it) is
        plain's run(): with plain's plan dropped, it runs this wrapper's run(), so the latest
        plan whichever it chose (held weakly: the wrappers hold no cycle)."""
        if self._bound_plain is not None and self.__dict__.get("run") is self._bound_plain:
            del self.run
        self._rows, self.chosen, self._bound_plain = None, None, None
        self.plain.unplan(forward_to=functools.partial(_run_cascade, weakref.ref(self)))

    def _plain_longest(self, shared_pages: int, indptr, last) -> int:
        """Keys in plain decode's longest page table: the prefix's shared_pages whole pages
        (plain needs it aligned), then a request's own pages (indptr, last: the unique level's
        unique_kv_indptr and unique_kv_last_page_len, checked)."""
        own = torch.diff(indptr)
        own_keys = torch.where(own > 0, (own - 1) * self.page_size + last, 0)
        return shared_pages * self.page_size + int(own_keys.max()) if len(own) else 0

    def _plan_plain(self, shared, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim,
                    q_dtype, sm_scale) -> None:
        """Every request's page table: the prefix's pages, then its own (host int32 tensors,
        checked by plan())."""
        batch, n = len(indptr) - 1, len(shared)
        own_pages = int(indptr[-1])
        too_many = over_capacity(self.plain.capacity, "max_num_pages", batch * n + own_pages)
        if too_many:
            raise CapacityError(f"strategy 'plain': {too_many} (plain decode lists the prefix's "
                             f"{n} pages in each of the {batch} requests' tables, before their "
                             f"own {own_pages})")
        own = torch.diff(indptr)
        longest = self._plain_longest(n, indptr, last)
        if longest >= MAX_SEQ_LEN:
            raise ValueError(f"strategy 'plain': a request's table would hold {longest} keys "
                             f"(the prefix's {n * self.page_size} before its own); expected "
                             f"fewer than {MAX_SEQ_LEN} (2**30 - 1024): the cascade keeps the "
                             f"prefix apart")
        tables = [torch.cat([shared, indices[int(indptr[b]):int(indptr[b + 1])]])
                  for b in range(batch)]
        full_last = torch.where(own > 0, last, torch.full_like(last, self.page_size if n else 0))
        self.plain.plan(torch.cat([torch.zeros(1, dtype=torch.int32),
                                   torch.cumsum(own + n, 0, dtype=torch.int32)]),
                        torch.cat(tables) if tables else torch.zeros(0, dtype=torch.int32),
                        full_last, num_qo_heads, num_kv_heads, head_dim, q_dtype=q_dtype,
                        sm_scale=sm_scale)

    def run(self, q: torch.Tensor, kv_cache=None, *extra, return_lse: bool = False, **params):
        """Attention of q [batch, heads, head_dim] over the shared prefix and each request's
        own pages (see MultiLevelCascade.run). After a plan() that chose "plain", ``run`` is
        plain's BatchDecode.run itself (same arguments; k_scale / v_scale other than 1
        refused as here)."""
        if extra:
            raise extra_run_args(type(self).__name__, extra)
        if kv_cache is None and self.chosen is not None:  # (unplanned: as MultiLevelCascade)
            raise missing_cache(type(self).__name__, params)
        if self.chosen == "plain":  # a reference kept from a cascade plan
            return self.plain.run(q, kv_cache, return_lse=return_lse, **params)
        # (here: the caller's line is one frame up; the levels' run() then warns no more)
        q, *caches = warn_no_grad("CascadeDecode.run", q, *_cache_tensors(kv_cache))
        kv_cache = caches[0] if len(caches) == 1 else tuple(caches)
        # (the levels accept rows beyond the plan's)
        if self.chosen is not None and isinstance(q, torch.Tensor) and \
                (q.dim() != 3 or q.shape[0] != self._q_shape[0]):
            raise ValueError(f"q has shape {tuple(q.shape)}; the plan expects {self._q_shape}"
                             + swapped_hint("q", q.shape, self._q_shape))
        return super().run(q, kv_cache, return_lse=return_lse, **params)  # (rejects them too)


def _run_cascade(ref, *args, **kwargs):
    """CascadeDecode.run of the wrapper ``ref`` refers to (a weak reference)."""
    cd = ref()
    if cd is None:
        raise RuntimeError("this run() belongs to a CascadeDecode that no longer exists")
    return CascadeDecode.run(cd, *args, **kwargs)
