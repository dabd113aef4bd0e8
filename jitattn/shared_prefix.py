"""Prefill of a batch whose requests share a prefix: the five schemes of the shared-prefix survey
(docs/sources.md, scenario 2), each built from BatchPrefill plans over one deduplicated token
layout.

The layout: the model computes Q, K, V once per distinct token, [P, S_0, S_1, ..., S_{M-1}]
(P prefix tokens, then each request's suffix); every strategy returns the attention output in
that layout, equal to what each request [P, S_i] would get on its own (the prefix rows are the
same for every request).

- naive: every request [P, S_i] on its own (prefix queries and keys repeated M times).
- split: request 0 first, then the other suffixes against the prefix in a second launch.
- ragged: one launch; request 0 is [P, S_0], the others only their suffix queries, whose keys
  are the prefix's rows (one copy, read by every request: BatchPrefill's shared prefixes) and
  then their own suffix's.
- cascade: causal prefill of P; the shared level (all suffix queries as one request against
  P, no mask); the unique level (each suffix against itself, causal); an LSE merge.
- multi_item: one logical request with the multi-item mask (scheme 5a).
- custom_mask: one logical request with an explicit mask (scheme 5b).

Strategies other than naive renumber requests, move tokens to other positions or change the
batch's shape symbols inside their launches, so each accepts only the variants it computes
exactly (variant_layout.ALLOWED): cascade, multi_item and custom_mask need hooks that read neither
positions (RoPE, window, q_idx / kv_idx) nor the request index b, nor tensors shaped by
batch_size / qo_len / kv_len; split allows positions; ragged allows positions, b, and tensors
shaped by batch_size / kv_len. Others raise ValueError naming the reason.
Every strategy but naive reads k / v directly (BatchPrefill's "ragged" kv_layout, no page
table: on the H200 a paged prefill over the same tokens ran at 0.88x, docs/performance.md v12;
ragged and split's second launch list the prefix as a shared prefix of their requests' keys);
naive lists one-token pages of the layout, as a paged engine without prefix sharing would.
Capacities: naive lists M * P page entries (max_num_pages); custom_mask builds a dense
(P + sum S)^2 mask (max_mask_bytes); pass larger capacities for big batches.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Mapping

import numpy as np
import torch

from . import launch, ops, tune
from .args import CapacityError, bool_arg, int_arg, not_a_variant, over_capacity, planner, \
    reject_run_kwargs, resolve_device, warn_no_grad
from .batch import CAPACITY_MINIMUMS, CAPACITY_NAMES, BatchPrefill
from .merge import merge_state_in_place
from .plan import check_seq_lens
from .prefix import multi_item_metadata
from .render import QUERY_TILES, tiles_for
from .run_inputs import (kv_strides_fit, kv_strides_ok, q_strides_error, q_strides_fit,
                         q_strides_ok, swapped_hint)
from .spec import Variant
from .variant_layout import ALLOWED, check_strategy, layout_features

STRATEGIES = ("naive", "split", "ragged", "cascade", "multi_item", "custom_mask")
_CAPACITY_DEFAULTS = {name: p.default for name, p in
                      inspect.signature(BatchPrefill.__init__).parameters.items()
                      if name.startswith("max_")}


def _i32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32)


def _indptr(lens) -> torch.Tensor:
    return _i32(np.concatenate([[0], np.cumsum(lens)]))


def _batch_args(prefix_len, suffix_lens, num_qo_heads, num_kv_heads, head_dim) -> tuple:
    """plan()'s and choose()'s batch arguments checked: (prefix_len, suffix_lens as a list of
    ints, num_qo_heads, num_kv_heads, head_dim). TypeError for a non-int (bool included),
    ValueError for prefix_len < 0, no suffix, a suffix without a token or heads / head_dim
    below 1."""
    try:
        if isinstance(suffix_lens, (set, frozenset, Mapping, str, bytes)) or \
                getattr(suffix_lens, "ndim", 1) != 1:  # (the layout is ordered, 1-D)
            raise TypeError
        given = list(suffix_lens)
        if any(isinstance(s, (bool, np.bool_)) or
               (isinstance(s, torch.Tensor) and s.dtype == torch.bool) for s in given):
            raise TypeError
        suffix_lens = [operator.index(s) for s in given]
    except TypeError:
        raise TypeError(f"suffix_lens={suffix_lens!r}: expected a sequence of ints, in the "
                        f"order of the suffixes in q, k and v") from None
    prefix_len = int_arg("prefix_len", prefix_len, minimum=0)
    if not suffix_lens or min(suffix_lens) < 1:
        raise ValueError(f"suffix_lens={suffix_lens}: expected at least one request, each "
                         f"with at least one token of its own")
    num_qo_heads, num_kv_heads, head_dim = (  # (before "auto" computes with them)
        int_arg(name, value) for name, value in (
            ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim)))
    return prefix_len, suffix_lens, num_qo_heads, num_kv_heads, head_dim


class SharedPrefixPrefill:
    """Prefill M requests that share a P-token prefix, with one of STRATEGIES.

    variant: a causal Variant. strategy: one of STRATEGIES or "auto" (see choose(): the table
    `jitattn tune` measured on this device, else a rule fitted to the grid measured on the
    H200). device, **capacities: as for BatchPrefill.
    """

    def __init__(self, variant: Variant, strategy: str = "auto", *, device=None,
                 **capacities):
        if not isinstance(variant, Variant):
            raise not_a_variant(variant, type(self).__name__)
        if variant.mask != "causal":
            raise ValueError(f"shared-prefix prefill needs a causal variant; {variant.name!r} "
                             f"has mask={variant.mask!r}")
        if strategy not in STRATEGIES + ("auto",):
            raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES + ('auto',)}")
        if strategy != "auto":
            check_strategy(variant, strategy)
        unknown = set(capacities) - set(CAPACITY_NAMES + ("split_kv", "query_tile"))
        if unknown:  # (page_size and kv_layout are the strategies' own)
            raise TypeError(f"SharedPrefixPrefill() takes no {sorted(unknown)}; besides strategy "
                            f"and device it takes BatchPrefill's {CAPACITY_NAMES}, split_kv and "
                            f"query_tile")
        for name in CAPACITY_NAMES:
            if name in capacities:
                capacities[name] = int_arg(name, capacities[name], CAPACITY_MINIMUMS[name])
        if "split_kv" in capacities:  # (checked here, as BatchPrefill's constructor does)
            capacities["split_kv"] = bool_arg("split_kv", capacities["split_kv"])
        if capacities.get("query_tile", "auto") not in QUERY_TILES:
            raise ValueError(f"query_tile={capacities['query_tile']!r}: expected one of "
                             f"{QUERY_TILES}")
        self.variant, self.strategy, self.device = variant, strategy, resolve_device(device)
        self._capacities = capacities
        self._handle = ops.register_wrapper(self)  # torch.compile: the op finds us by it
        self._wrappers: dict = {}
        self._steps: list = []
        self._single = None  # the one step's wrapper, where it covers the whole layout
        self._stride_memo: dict = {}  # _strides_fit's memo

    def _run_eager(self, q, inputs, params):
        """run() for the wrapper_run op (ops.py): inputs are k and v."""
        return list(self.run(q, inputs[0], inputs[1], return_lse=True, **params))

    def _wrapper(self, name: str, variant: Variant, layout: str) -> BatchPrefill:
        if name not in self._wrappers:
            self._wrappers[name] = BatchPrefill(variant, page_size=1, kv_layout=layout,
                                                device=self.device, **self._capacities)
        return self._wrappers[name]

    def choose(self, prefix_len: int, suffix_lens, num_qo_heads: int = 1,
               num_kv_heads: int = 1, head_dim: int = 128) -> str:
        """The strategy "auto" tries first for this batch (plan() returns the one it took: the
        next that fits where a schedule needs more work items or partial rows than the
        wrappers hold). With a table measured by ``jitattn tune``
        on this device for this head configuration: the fastest exact strategy that fits the
        capacities, at the nearest measured cell within tune.MAX_LOG2_DISTANCE (tune.lookup);
        the table's dtype (fp16 from the command) stands for both 16-bit dtypes, whose kernels
        are the same code.
        Otherwise a rule fitted to the grid measured with
        ``jitattn bench shared-prefix`` on the H200 (docs/performance.md, v6): "cascade" when
        a long prefix (>= 1024 tokens) is shared by 8 or more requests whose suffixes are short
        (suffix_len * GQA group <= half a prefill tile: "ragged" would run each request's few
        packed rows in a tile of their own, re-reading the prefix each time, where the cascade
        packs every suffix query into one request against the prefix, read once); otherwise
        "ragged"; "naive" for variants that ragged would change; when none of those fits the
        capacities, the first other exact strategy that does (multi_item and custom_mask plan
        the batch as one request). Raises as plan() for arguments it would refuse."""
        return self._candidates(*_batch_args(prefix_len, suffix_lens, num_qo_heads,
                                             num_kv_heads, head_dim))[0]

    def _candidates(self, prefix_len: int, suffix_lens: list, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int) -> list:
        """The strategies auto takes for checked arguments (_batch_args), best first; choose()
        is the first. Those that fit the capacities plan() can foresee, the measured pick
        first, then the rule's order; plan() tries them in turn where a schedule needs more
        work items or partial rows than the wrappers hold. When none fits, the rule's first
        alone (its plan() names the capacity)."""
        m, longest = len(suffix_lens), max(suffix_lens)
        features = layout_features(self.variant)
        group = num_qo_heads // max(1, num_kv_heads)
        tile_rows = tiles_for("prefill", head_dim).rows_per_cta("prefill")
        order = ["ragged", "naive", "cascade"]  # the rule's preference, exact ones only
        if prefix_len >= 1024 and m >= 8 and longest * group <= tile_rows // 2:
            order.insert(0, "cascade")
        exact = [s for s in dict.fromkeys(order + list(STRATEGIES)) if not features - ALLOWED[s]]
        fitting = [s for s in exact if self._fits(s, prefix_len, suffix_lens)]
        table = tune.load(tune.device_key(self.device))
        if fitting and table is not None and (table["num_qo_heads"], table["num_kv_heads"],
                                              table["head_dim"]) == (num_qo_heads, num_kv_heads,
                                                                     head_dim):
            measured = tune.lookup(table, prefix_len, longest, m, fitting)
            if measured is not None:
                fitting.remove(measured)
                fitting.insert(0, measured)
        return fitting or exact[:1]

    def _fits(self, strategy: str, prefix_len: int, suffix_lens) -> bool:
        return self._over_capacity(strategy, prefix_len, suffix_lens) is None

    def _over_capacity(self, strategy: str, prefix_len: int, suffix_lens) -> str | None:
        """Which capacity given to the constructor (or BatchPrefill's defaults) ``strategy``'s
        plans exceed, as the wrappers' plan() would say it, or None; those plan() can foresee:
        requests per launch (split's second launch counts an empty request that owns the rows
        before its suffixes), naive's one-token pages, the dense mask of custom_mask, the item
        positions of multi_item. (Work items and partial rows depend on the schedule; the
        wrappers' plan() checks them.)"""
        capacity = {**_CAPACITY_DEFAULTS, **self._capacities}
        m, p, suffixes = len(suffix_lens), prefix_len, sum(suffix_lens)
        batch, pages = {"naive": (m, m * p + suffixes), "ragged": (m, 0), "split": (m, 0),
                        "cascade": (m, 0)}.get(strategy, (1, 0))
        needs = [("max_batch_size", batch), ("max_num_pages", pages)]
        if strategy == "custom_mask":
            needs.append(("max_mask_bytes", -(-(p + suffixes) ** 2 // 8)))
        if strategy == "multi_item":
            needs.append(("max_item_tokens", suffixes))
        return next((over for name, n in needs
                     if (over := over_capacity(capacity, name, n)) is not None), None)

    def _drop_plan(self) -> None:
        """Nothing planned, nothing half-planned (plan()'s first step, args.planner): after a
        plan() that raises, run() raises until the next plan()."""
        self._steps, self._single = [], None

    @planner
    def plan(self, prefix_len: int, suffix_lens, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, *, q_dtype=torch.float16, sm_scale: float | None = None) -> str:
        """Plan a batch: prefix_len P >= 0 tokens shared by len(suffix_lens) >= 1 requests with
        suffixes of suffix_lens[i] >= 1 tokens. sm_scale: as for BatchPrefill.plan (default
        1 / sqrt(head_dim)). Returns the strategy used. Raises TypeError when prefix_len or an
        entry of suffix_lens is not an int (bool included), ValueError when prefix_len < 0 or a
        suffix has no token."""
        prefix_len, suffix_lens, num_qo_heads, num_kv_heads, head_dim = _batch_args(
            prefix_len, suffix_lens, num_qo_heads, num_kv_heads, head_dim)
        heads = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     q_dtype=q_dtype, sm_scale=sm_scale)
        if self.strategy != "auto":
            return self._plan_strategy(self.strategy, prefix_len, suffix_lens, heads)
        tried = self._candidates(prefix_len, suffix_lens, num_qo_heads, num_kv_heads, head_dim)
        errors = []
        for strategy in tried:
            try:
                return self._plan_strategy(strategy, prefix_len, suffix_lens, heads)
            except ValueError as e:  # (work items or partial rows: the next one's turn)
                if not errors and type(e) is not CapacityError or any(
                        w._captured_kind is not None for w in self._wrappers.values()):
                    raise  # (the batch's own error; or a CUDA graph replays these wrappers)
                errors.append(str(e))
        raise CapacityError("strategy 'auto': no strategy fits the capacities given to the "
                            "constructor; " + "; ".join(errors))

    def _plan_strategy(self, strategy: str, prefix_len: int, suffix_lens: list,
                       heads: dict) -> str:
        """plan() of checked arguments with ``strategy``; CapacityError (a ValueError) for a
        capacity its plans exceed, naming the strategy."""
        p, s = prefix_len, suffix_lens
        # before any per-token array is built (P = 2**30 allocated 8 GiB before the length
        # check, custom_mask a dense (P + S)**2 mask before the max_mask_bytes check)
        longest = p + sum(s) if strategy in ("multi_item", "custom_mask") else p + max(s)
        check_seq_lens(longest, longest)
        over = self._over_capacity(strategy, p, s)
        if over is not None:
            raise CapacityError(f"strategy {strategy!r}: {over}")
        try:
            return self._plan_steps(strategy, p, s, heads)
        except CapacityError as e:
            raise CapacityError(f"strategy {strategy!r}: {e}") from None

    def _plan_steps(self, strategy: str, p: int, s: list, heads: dict) -> str:
        """_plan_strategy's steps: each step's wrapper planned, the run's steps stored."""
        starts = p + np.concatenate([[0], np.cumsum(s)[:-1]])   # suffix i's first token
        prefix_ids = np.arange(p)
        own = [np.arange(a, a + n) for a, n in zip(starts, s)]
        # (wrapper name, rows: slice of the layout or index tensors, kind, keys: None for a
        # page table over the layout, or the slice of k / v a contiguous step reads)
        steps = []
        total = p + sum(s)
        first_suffix = p + s[0]

        def contiguous(name, variant, q_rows_per_req, kv_lens, shared_lens=None, **mask):
            """A step whose requests' keys are consecutive runs of the layout, one after the
            other: planned over k / v directly ("ragged" kv_layout, no page table to read),
            request b's keys preceded by the prefix's first shared_lens[b] rows."""
            w = self._wrapper(name, variant, "ragged")
            if shared_lens is not None:
                mask.update(shared_prefix_start=_i32([0] * len(shared_lens)),
                            shared_prefix_len=_i32(shared_lens))
            w.plan(_indptr([len(x) for x in q_rows_per_req]), _indptr(kv_lens), None, None,
                   **heads, **mask)
            return w

        def paged(name, variant, q_rows_per_req, kv_ids_per_req, **mask):
            w = self._wrapper(name, variant, "NHD")
            ids = np.concatenate(kv_ids_per_req) if kv_ids_per_req else np.zeros(0)
            kv_lens = [len(x) for x in kv_ids_per_req]
            w.plan(_indptr([len(x) for x in q_rows_per_req]), _indptr(kv_lens), _i32(ids),
                   _i32([1] * len(kv_lens)), **heads, **mask)
            return w

        if strategy == "naive":
            rows = [np.concatenate([prefix_ids, o]) for o in own]
            paged("naive", self.variant, rows, rows)
            gather = np.concatenate(rows)
            _, first = np.unique(gather, return_index=True)  # request 0 owns the prefix rows
            as_dev = lambda x: torch.as_tensor(x, dtype=torch.long, device=self.device)  # noqa
            steps.append(("naive", (as_dev(gather), as_dev(first), as_dev(gather[first])),
                          "naive", None))
        elif strategy in ("ragged", "split"):
            # the keys of ragged's launch and of split's second: request 0 owns rows
            # 0 .. first_suffix - 1 ([P, S_0]), request i >= 1 reads the prefix's rows as a
            # shared prefix, then its suffix
            own_kv, shared_kv = [first_suffix] + s[1:], [0] + [p] * (len(s) - 1)
            if strategy == "ragged":
                contiguous("ragged", self.variant, [np.arange(first_suffix)] + own[1:], own_kv,
                           shared_lens=shared_kv)
                steps.append(("ragged", slice(0, total), "direct", slice(0, total)))
            else:
                contiguous("split0", self.variant, [np.arange(first_suffix)], [first_suffix])
                steps.append(("split0", slice(0, first_suffix), "direct",
                              slice(0, first_suffix)))
                if len(s) > 1:  # request 0 has no queries here (it only owns the rows)
                    contiguous("split1", self.variant, [[]] + own[1:], own_kv,
                               shared_lens=shared_kv)
                    steps.append(("split1", slice(first_suffix, total), "direct",
                                  slice(0, total)))
        elif strategy == "cascade":  # every level reads consecutive keys: no page tables
            if p:
                contiguous("prefix", self.variant, [prefix_ids], [p])
                steps.append(("prefix", slice(0, p), "direct", slice(0, p)))
            if p:  # (before the unique level, whose output may be q itself: out=q)
                shared = dataclasses.replace(self.variant, mask="none")
                contiguous("shared", shared, [np.arange(p, total)], [p])
                steps.append(("shared", slice(p, total), "shared", slice(0, p)))
            contiguous("unique", self.variant, own, s)
            steps.append(("unique", slice(p, total), "unique", slice(p, total)))
        elif strategy == "multi_item":
            prefix, positions, longest = multi_item_metadata(p, s)
            rows = np.arange(p + sum(s))
            contiguous("multi", dataclasses.replace(self.variant, mask="multi_item"), [rows],
                       [total], prefix_len=_i32([prefix]), token_pos_in_items=_i32(positions),
                       max_item_len=_i32([longest]))
            steps.append(("multi", slice(0, total), "direct", slice(0, total)))
        else:  # custom_mask
            item = np.full(total, -1)
            for i, o in enumerate(own):
                item[o] = i
            qi, ki = np.arange(total)[:, None], np.arange(total)[None, :]
            visible = (ki <= qi) & ((ki < p) | (item[qi] == item[ki]))
            rows = np.arange(total)
            contiguous("custom", dataclasses.replace(self.variant, mask="custom"), [rows],
                       [total], custom_mask=torch.from_numpy(visible.reshape(-1)))
            steps.append(("custom", slice(0, total), "direct", slice(0, total)))
        self._steps = steps
        whole = slice(0, total)
        self._single = steps[0][0] if len(steps) == 1 and steps[0][1:] == (
            whole, "direct", whole) else None
        self._planned = dict(total=total, heads=heads, strategy=strategy, shapes=(
            torch.Size((total, heads["num_qo_heads"], heads["head_dim"])),
            torch.Size((total, heads["num_kv_heads"], heads["head_dim"])), heads["q_dtype"]))
        return strategy

    def _strides_fit(self, q, k, v) -> bool:
        """q_strides_fit(q) and kv_strides_fit of k and v, memoized by their strides (host
        time: run() per layer); the pointers' alignment is read every call."""
        key = (q.stride(), k.stride(), v.stride())
        fit = self._stride_memo.get(key)
        if fit is None:
            if len(self._stride_memo) > 16:  # (a model's layouts are few: a bound only)
                self._stride_memo.clear()
            fit = self._stride_memo[key] = q_strides_ok(q) and kv_strides_ok(k) and \
                kv_strides_ok(v)
        return fit and not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16)

    def _check_inputs(self, q, k, v) -> None:
        """Raises TypeError / ValueError naming the first of q, k, v that does not suit the
        plan (shape, dtype, device, strides and alignment); returns where all do."""
        total = self._planned["total"]
        q_shape, kv_shape, dtype = self._planned["shapes"]
        for name, t, shape in (("q", q, q_shape), ("k", k, kv_shape), ("v", v, kv_shape)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan expects "
                                 f"{tuple(shape)} ({total} rows: P + sum(S_i))"
                                 + swapped_hint(name, t.shape, shape))
            if t.dtype != dtype:
                raise TypeError(f"{name} has dtype {t.dtype}; the plan was made for {dtype} "
                                f"(plan(..., q_dtype=) sets it)")
        for name, t in (("q", q), ("k", k), ("v", v)):  # (else a strategy's inner call
            #                                                 names k_cache)
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}; the wrapper was built for "
                                 f"{self.device}")
        if not q_strides_fit(q):  # (naive gathers q's rows, the others read q directly)
            raise q_strides_error("q", q)
        for name, t in (("k", k), ("v", v)):  # (else a strategy's inner call names k_cache, in
            #                                     its own layout's strides)
            if not kv_strides_fit(t):
                raise ValueError(f"{name} has strides {t.stride()} (data pointer "
                                 f"{t.data_ptr():#x}); expected the last dim contiguous, other "
                                 f"strides multiples of 16 bytes, a 16-byte aligned pointer")

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
            return_lse: bool = False, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, **params):
        """q, k, v: [P + sum(S_i), heads, head_dim] in the deduplicated layout (k, v: the
        plan's num_kv_heads). Returns the attention output in that layout, each request's rows
        as if it ran on its own, and with return_lse their lse [P + sum(S_i), num_qo_heads]
        (float32, natural log). out / lse: optional output buffers of those shapes (out in q's
        dtype), contiguous. params: the variant's runtime parameters; k_scale / v_scale are
        refused (ValueError)."""
        reject_run_kwargs(self, params)
        return_lse = bool_arg("return_lse", return_lse)
        if torch.compiler.is_compiling():  # one opaque op on this wrapper: no host work traced
            o, s = ops.wrapper_traced(self, q, [k, v], params, num_outputs=2)
            return launch.into_outputs(o, s, out, lse, return_lse)
        if not self._steps:
            raise RuntimeError("SharedPrefixPrefill.run() called before plan() (or after a "
                               "plan() that raised)")
        total = self._planned["total"]
        q_shape, kv_shape, dtype = self._planned["shapes"]
        if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
                and q.shape == q_shape and k.shape == kv_shape and v.shape == kv_shape and
                q.dtype == k.dtype == v.dtype == dtype and
                q.device == k.device == v.device == self.device and self._strides_fit(q, k, v)):
            self._check_inputs(q, k, v)  # (names what is wrong; a tensor subclass passes)
        if q.requires_grad or k.requires_grad or v.requires_grad:  # (attribute reads first)
            q, k, v = warn_no_grad("SharedPrefixPrefill.run", q, k, v)
        if self._single is not None and out is None and lse is None:  # one launch over the
            #  whole layout (ragged, multi_item, custom_mask): it allocates its outputs
            return self._wrappers[self._single].run(q, (k, v), return_lse=return_lse, **params)
        caller_out = out is not None
        # (contiguous, as q may not be)
        given = out = launch.output_buffer("out", out, q.shape, q.dtype, q.device)
        # the strategies read q / k / v while they write out: an out in k or v, or partly in
        # q, is computed apart and copied (out=q itself is in place: each launch reads a row
        # before it writes it, and the cascade runs its unique level last)
        if caller_out and (any(given.untyped_storage().data_ptr() ==
                               t.untyped_storage().data_ptr() for t in (k, v)) or
                           (given.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
                            and not launch.same_view(given, q))):
            out = torch.empty_like(given)
        if lse is not None or return_lse:
            lse = launch.output_buffer("lse", lse, q.shape[:2], torch.float32, q.device, align=4,
                                       apart_from={"out": given, "q": q, "k": k, "v": v})
        shared_state = None  # the cascade's shared level, merged once the unique level ran
        whole = slice(0, total)  # rows or keys of the whole layout: the tensors themselves
        for name, rows, kind, keys in self._steps:
            w = self._wrappers[name]
            # keys None: pages of one token over the token layout (naive)
            cache = (k.unsqueeze(1), v.unsqueeze(1)) if keys is None else \
                (k, v) if keys == whole else (k[keys], v[keys])
            if kind == "naive":
                gather, first, dest = rows
                if lse is None:
                    out[dest] = w.run(q[gather], cache, **params)[first]
                else:
                    o, s = w.run(q[gather], cache, return_lse=True, **params)
                    out[dest], lse[dest] = o[first], s[first]
                continue
            q_rows, out_rows, lse_rows = (q, out, lse) if rows == whole else \
                (q[rows], out[rows], None if lse is None else lse[rows])
            if kind == "direct":
                w.run(q_rows, cache, out=out_rows, lse=lse_rows, **params)
            elif kind == "shared":  # (it reads q's suffix rows before anything writes out)
                shared_state = w.run(q_rows, cache, return_lse=True, **params)
            else:  # unique level (its lse: lse's rows when given), then the shared level
                # merged into its rows (and lse) in place
                _, unique_lse = w.run(q_rows, cache, out=out_rows, lse=lse_rows,
                                      return_lse=True, **params)
                if shared_state is not None:
                    merge_state_in_place(out_rows, unique_lse, *shared_state,
                                         reduction=self.variant.reduction)
        if out is not given:
            out = given.copy_(out)
        return (out, lse) if return_lse else out
