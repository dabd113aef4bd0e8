"""Cascade attention over levels of shared KV (FlashInfer's multi-level cascade; the shared-prefix
survey's method for decode, scenario 3 in docs/sources.md): each level is a batch whose queries
attend to a slice of the KV (e.g. level 0: every request's query packed into one request against the
system prompt, read once; level 1: a few-shot block shared by some; last level: each request's
own history), and the levels' attention states are merged by LSE.

The query rows of every level index the same q [total_q, heads, head_dim]; each level's
qo_indptr groups them (a level need not contain every row). Levels other than the last attend
without a mask (their keys all precede their queries: for a causal variant plan() checks that a
row they hold has, in its last-level request, at least qo_len - 1 keys of its own); the last
level uses the variant's own mask. Packing renumbers requests and moves queries to other
positions, so only variants whose hooks read neither (variant_layout.layout_features is empty, as
for its "cascade") are accepted.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import torch

from . import launch, ops
from .args import CapacityError, bool_arg, extra_run_args, int_arg, missing_cache, not_a_variant, \
    planner, reject_run_kwargs, resolve_device, warn_no_grad
from .batch import CAPACITY_NAMES, BatchPrefill, _cache_tensors, page_size_arg
from .merge import merge_states_into
from .porting import unexpected_keywords
from .spec import Variant
from .variant_layout import layout_features


class MultiLevelCascade:
    """num_levels levels of shared KV over one paged cache, planned once per step and run per
    layer. page_size, kv_layout, device and capacities as for BatchPrefill."""

    _LEVEL_KEYWORDS = CAPACITY_NAMES + ("split_kv", "query_tile")  # passed on to the levels
    _CALL = "{cls}(variant, num_levels, "  # the constructor's call up to page_size (hints)
    PLAN_PER_LEVEL = True  # plan() takes a list per page-table argument (porting's hints)
    _LEVEL_NAMES: tuple = ()  # what run()'s errors call level i (else "level i")

    def _refuse_unknown(self, capacities: dict) -> None:
        """TypeError for constructor keywords that are neither parameters nor the levels'
        capacities (else Python names BatchPrefill.__init__, or a clash with a positional)."""
        unknown = set(capacities) - set(self._LEVEL_KEYWORDS)
        if unknown:
            named = [n for n, p in inspect.signature(type(self).__init__).parameters.items()
                     if p.default is not inspect.Parameter.empty]
            raise unexpected_keywords(
                type(self).__name__, unknown, named + list(self._LEVEL_KEYWORDS),
                kv_dtype=False, also={"num_levels": "MultiLevelCascade's (CascadeDecode has two "
                                      "levels; MultiLevelCascade(variant, num_levels) takes any "
                                      "number)"})

    def __init__(self, variant: Variant, num_levels: int, page_size: int = 16,
                 kv_layout: str = "NHD", *, device=None, **capacities):
        self._refuse_unknown(capacities)
        self._build_levels(variant, num_levels, page_size, kv_layout, device, capacities)

    def _build_levels(self, variant: Variant, num_levels: int, page_size: int, kv_layout: str,
                      device, capacities: dict) -> None:
        """__init__ after its keyword check (CascadeDecode's __init__ makes its own)."""
        if not isinstance(variant, Variant):
            raise not_a_variant(variant, type(self).__name__)
        num_levels = int_arg("num_levels", num_levels)
        page_size = page_size_arg(page_size, self._CALL.format(cls=type(self).__name__))
        if variant.mask not in ("none", "causal"):
            raise ValueError(f"cascade levels take variants with mask 'none' or 'causal', got "
                             f"{variant.mask!r}")
        depends = layout_features(variant)
        if depends:  # (SharedPrefixPrefill's cascade strategy has the same limits)
            raise ValueError(
                f"{type(self).__name__} merges levels that each number their own requests and "
                f"keys, so it cannot run variant {variant.name!r}, whose hooks depend on "
                f"{sorted(depends)} (positions: q_idx / kv_idx, RoPE or a window; request: b); "
                f"use BatchDecode over each request's full page table")
        shared = dataclasses.replace(variant, mask="none")
        self.variant, self.device, self.page_size = variant, resolve_device(device), page_size
        self.levels = [BatchPrefill(shared if i < num_levels - 1 else variant,
                                    page_size=page_size, kv_layout=kv_layout, device=device,
                                    **capacities) for i in range(num_levels)]
        self._rows: list | None = None
        self._handle = ops.register_wrapper(self)  # torch.compile: the op finds us by it

    def _drop_plan(self) -> None:
        """Nothing planned (plan()'s first step, args.planner): after a plan() that raises,
        run() raises until the next plan()."""
        self._rows = None

    @planner
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, *, q_rows=None, q_dtype=torch.float16,
             sm_scale: float | None = None) -> None:
        """Plan every level. qo_indptr, kv_indptr, kv_indices, kv_last_page_len: one int32
        tensor per level, as for BatchPrefill.plan. q_rows: per level, the rows of q its
        queries are (int tensor, length qo_indptr[-1]); default: rows 0 .. qo_indptr[-1] - 1.
        With kv_layout="ragged" (kv_indices and kv_last_page_len None) every level reads the
        one k / v from its row 0 (kv_indptr[i][0] must be 0): a level whose keys start at row
        a > 0 lists first a request of no queries over rows 0 .. a - 1 (qo_indptr [0, 0, ...],
        kv_indptr [0, a, ...]).
        """
        n = len(self.levels)
        for name, arg in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                          ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
            if not isinstance(arg, (list, tuple)) or len(arg) != n:
                none = " (None for a ragged layout)" if name in ("kv_indices",
                                                                 "kv_last_page_len") else ""
                raise ValueError(f"{name} must be a list of {n} tensors{none}, one per level")
        sized = isinstance(q_rows, (list, tuple)) or (
            isinstance(q_rows, (torch.Tensor, np.ndarray)) and q_rows.ndim == 2)
        if q_rows is not None and (not sized or len(q_rows) != n):
            raise ValueError(f"q_rows must be a list of {n} entries (one per level: int rows of "
                             f"q, or None) or a [{n}, rows] tensor, got {type(q_rows).__name__}"
                             + (f" of {len(q_rows)}" if sized else ""))
        rows = []
        for i, level in enumerate(self.levels):
            try:
                level.plan(qo_indptr[i], kv_indptr[i], kv_indices[i], kv_last_page_len[i],
                           num_qo_heads, num_kv_heads, head_dim, q_dtype=q_dtype,
                           sm_scale=sm_scale)
            except (TypeError, ValueError) as e:  # the level's arguments are entry i of ours
                _reraise_for_level(e, f"level {i}")
            rows.append(self._level_rows(i, int(qo_indptr[i][-1]), q_rows))
        if self.variant.mask == "causal" and n > 1:
            self._check_shared_keys_precede(rows)
        self._set_rows(rows)

    def _check_shared_keys_precede(self, rows: list) -> None:
        """A causal variant's shared levels attend without a mask, so a row of q they hold
        must come after all their keys: with end-aligned positions, the query's request in the
        last level needs at least qo_len - 1 keys of its own (query i of a request with more
        queries sits before the last shared key). Raises ValueError naming the request."""
        req = self.levels[-1]._plan.requests
        short = np.nonzero(req[:, 1] > req[:, 2] + 1)[0]
        if not len(short):
            return

        def q_rows(r, local):  # rows of q at the level's own rows ``local``
            if isinstance(r, slice):
                return np.arange(r.start, r.stop)[local]
            return r.cpu().numpy()[local]
        shared = np.zeros(_rows_end(rows), dtype=bool)
        for r in rows[:-1]:
            shared[q_rows(r, slice(None))] = True
        last = len(self.levels) - 1
        for b in short:
            q0, qo_len, kv_len = (int(x) for x in req[b, :3])
            early = q_rows(rows[-1], slice(q0, q0 + qo_len - kv_len - 1))
            held = early[shared[early]]
            if len(held):
                raise ValueError(
                    f"level {last}'s request {b} has {qo_len} queries and {kv_len} keys of its "
                    f"own, and a shared level also holds row {int(held[0])} of q, among its "
                    f"first {len(early)} queries: with mask='causal' (queries aligned to the "
                    f"end of the keys) those come before some shared keys, which a shared "
                    f"level, attending without a mask, would show them; give the request at "
                    f"least qo_len - 1 = {qo_len - 1} keys of its own, or use mask='none'")

    def _level_rows(self, i: int, total: int, q_rows):
        """Level i's rows of q: a slice when they are consecutive (given so, or the default
        0 .. total - 1), else a device tensor of distinct rows >= 0."""
        if q_rows is None or q_rows[i] is None:
            return slice(0, total)
        try:
            r = torch.as_tensor(q_rows[i])
        except (TypeError, ValueError, RuntimeError):
            r = None
        if r is not None and r.numel() == 0:
            r = r.long()  # (an empty list is a float32 tensor: it holds no float values)
        if r is None or r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool:
            raise TypeError(f"q_rows[{i}] must hold integer rows of q, got "
                            f"{r.dtype if r is not None else type(q_rows[i]).__name__} values")
        r = r.to(device="cpu", dtype=torch.long)
        if r.dim() != 1 or r.numel() != total:
            raise ValueError(f"q_rows[{i}] has shape {tuple(r.shape)}; level {i} plans {total}")
        if total and (r.min() < 0 or len(torch.unique(r)) != total):
            raise ValueError(f"q_rows[{i}] must list distinct rows >= 0")
        if total and torch.equal(r, torch.arange(int(r[0]), int(r[0]) + total)):
            return slice(int(r[0]), int(r[0]) + total)
        return r.to(self.device, copy=True)  # (the caller's tensor may change after plan())

    def _set_rows(self, rows: list) -> None:
        self._rows = rows
        self._min_rows = _rows_end(rows)

    def run(self, q: torch.Tensor, kv_cache=None, *extra, return_lse: bool = False,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, **params):
        """Attention of q [total_q, heads, head_dim] over all levels, merged. Rows that no
        level covers get out 0, lse -inf. Each level writes its state into one slab of a
        [levels, total_q, ...] buffer (consecutive rows in place, without copies), and one
        merge combines the slabs (into out / lse when given: [total_q, heads, head_dim] in q's
        dtype / [total_q, heads] float32, contiguous; out is q itself or shares no memory with
        it, as for BatchPrefill.run, and none with lse). params: the variant's runtime
        parameters; k_scale / v_scale are refused (ValueError)."""
        if extra:
            raise extra_run_args(type(self).__name__, extra)
        if kv_cache is None and self._rows is not None:  # (a default only for this message)
            raise missing_cache(type(self).__name__, params)
        reject_run_kwargs(self, params)
        return_lse = bool_arg("return_lse", return_lse)
        if torch.compiler.is_compiling():  # one opaque op on this wrapper: no host work traced
            o, s = ops.wrapper_traced(self, q, _cache_tensors(kv_cache), params, num_outputs=2)
            return launch.into_outputs(o, s, out, lse, return_lse)
        if self._rows is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan() (or after a "
                               f"plan() that raised)")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 3:
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [total_q, num_qo_heads, "
                             f"head_dim]")
        if q.shape[0] < self._min_rows:
            raise ValueError(f"q has {q.shape[0]} rows; the plan uses rows up to "
                             f"{self._min_rows - 1}")
        planned = self.levels[-1]._run_inputs  # (every level's: one plan() set them all)
        if q.shape[1:] != planned.q_shape[1:] or q.dtype != planned.q_dtype:
            # (else a level names its slice of q: a shape the caller never passed)
            heads, head_dim = planned.q_shape[1:]
            raise (ValueError if q.dtype == planned.q_dtype else TypeError)(
                f"q is {tuple(q.shape)} {q.dtype}; the plan expects [total_q, {heads}, "
                f"{head_dim}] {planned.q_dtype} (plan(..., q_dtype=) sets the dtype)")
        q, *_ = warn_no_grad(f"{type(self).__name__}.run", q, *_cache_tensors(kv_cache))
        n, total = len(self.levels), q.shape[0]
        # (the levels read q before the merge writes out, but CascadeDecode's plain strategy
        # refuses an out partly inside q: so do the cascades, whichever strategy auto takes)
        out = launch.output_buffer("out", out, q.shape, q.dtype, q.device, apart_from=None
                                   if out is None or launch.same_view(out, q) else {"q": q})
        lse = launch.output_buffer("lse", lse, q.shape[:2], torch.float32, q.device, align=4,
                                   apart_from={"out": out, "q": q})
        o_levels = torch.empty((n, *q.shape), dtype=q.dtype, device=q.device)
        lse_levels = torch.empty((n, *q.shape[:2]), dtype=torch.float32, device=q.device)
        # each level's slab: one unbind for all (each view op costs host time per layer)
        for i, (level, rows, o, s) in enumerate(zip(self.levels, self._rows, o_levels.unbind(0),
                                                    lse_levels.unbind(0))):
            try:
                if isinstance(rows, slice) and rows.start == 0 and rows.stop == total:
                    level.run(q, kv_cache, out=o, lse=s, **params)  # every row: no slicing
                    continue
                o.zero_()  # rows this level does not cover are empty states
                s.fill_(float("-inf"))
                if isinstance(rows, slice):
                    level.run(q[rows], kv_cache, out=o[rows], lse=s[rows], **params)
                else:
                    o[rows], s[rows] = level.run(q[rows].contiguous(), kv_cache,
                                                 return_lse=True, **params)
            except (TypeError, ValueError) as e:  # (a page past the cache: which level's)
                _reraise_for_level(e, self._LEVEL_NAMES[i] if self._LEVEL_NAMES else f"level {i}")
        merge_states_into(o_levels, lse_levels, out, lse, self.variant.reduction)
        return (out, lse) if return_lse else out


    def _run_eager(self, q, inputs, params):
        """run() for the wrapper_run op (ops.py): inputs are the cache tensor(s)."""
        return self.run(q, inputs[0] if len(inputs) == 1 else tuple(inputs), return_lse=True,
                        **params)


def _reraise_for_level(e: Exception, label: str):
    """Raise ``e`` again as "label: message", of its type; an exception of a subclass (whose
    constructor may take other arguments) as it is."""
    if type(e) not in (TypeError, ValueError, CapacityError):
        raise e
    raise type(e)(f"{label}: {e}") from e


def _count(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _rows_end(rows: list) -> int:
    """One past the largest row of q that the levels' rows (slices or tensors) read."""
    return max((r.stop if isinstance(r, slice) else int(r.max()) + 1 for r in rows if _count(r)),
               default=0)
