"""Batch attention over paged KV caches with FlashInfer's plan/run split: BatchPrefill and
BatchDecode.

``plan()`` runs on the host once per generation step (validation, the load-balanced schedule of
plan.py) and copies the schedule into a device workspace allocated once, with capacities
declared up front. ``run()`` is then reused by every layer: it checks tensors against the plan
and launches a persistent grid (one CTA per resident slot) plus the merge kernel, with no host
sync and no allocation of its own except the outputs (pass ``out`` / ``lse`` to avoid those), so
it can be captured in a CUDA graph and replayed after a new ``plan()`` within the capacities.
A replay reuses the captured q / out / lse and scalar arguments: the new plan must keep the
number of query rows, the dtype, head_dim, head counts and sm_scale (KV lengths, page tables and
the schedule may change; BatchDecode with a fixed batch is the usual case).
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import torch

from . import dtypes, jit, launch, ops
from . import masks as masks_mod
from .args import CapacityError, bool_arg, extra_run_args, int_arg, kv_scales, missing_cache, \
    not_a_variant, planner, reject_run_kwargs, resolve_device, warn_no_grad
from .batch_inputs import check_batch
from .plan import Plan, make_plan
from .porting import unexpected_keywords
from .render import QUERY_TILES, query_kind, tiles_for
from .run_inputs import RunInputs, split_cache
from .spec import Variant
from .workspace import Workspace

LAYOUTS = ("NHD", "HND", "ragged")
# the constructor's capacities and their least values (0: plans that need none), which the
# other wrappers pass through
CAPACITY_MINIMUMS = {"max_batch_size": 1, "max_num_pages": 0, "max_work_items": 1,
                     "max_partial_rows": 0, "max_mask_bytes": 0, "max_item_tokens": 0}
CAPACITY_NAMES = tuple(CAPACITY_MINIMUMS)


def page_size_arg(page_size, call: str) -> int:
    """A wrapper's page_size as an int >= 1; a layout there (FlashInfer's wrappers take it
    second) gets a hint built on ``call``, the constructor's call up to page_size."""
    if isinstance(page_size, str) and page_size in LAYOUTS:
        raise TypeError(f"page_size={page_size!r}: expected an int >= 1; the layout is the "
                        f"argument after it ({call}page_size=16, kv_layout={page_size!r}))")
    if isinstance(page_size, torch.Tensor) and page_size.dim() > 0:  # (FlashInfer's buffer)
        raise TypeError(f"page_size=<tensor of shape {tuple(page_size.shape)}, "
                        f"{page_size.dtype}>: expected an int >= 1; FlashInfer's wrappers take "
                        f"a workspace buffer there, jitattn's size their own from the "
                        f"capacities ({call}page_size=16, max_num_pages=...))")
    return int_arg("page_size", page_size)


class BatchPrefill:
    """Prefill (any number of queries per request) over a paged KV cache, for one Variant.

    variant: the attention variant. page_size: tokens per page (1 or more). kv_layout: "NHD"
    (pages [page_size, num_kv_heads, head_dim]), "HND" ([num_kv_heads, page_size, head_dim]),
    or "ragged": no pages, k / v [total_kv, num_kv_heads, head_dim] with kv_indptr over tokens
    (plan() then takes kv_indices=None, kv_last_page_len=None; page_size is ignored). The
    layout is not read from the cache: where page_size equals num_kv_heads, an HND cache given
    to an NHD wrapper (or the reverse) has the expected shape and gives wrong outputs.
    device: where run() will be called ("cuda", "cuda:1" or "cpu"; default: the current CUDA
        device when there is one, else the CPU backend).
    Capacities of the device workspace, fixed for the wrapper's life (plan() raises
    CapacityError, a ValueError, when a batch needs more): max_batch_size requests,
    max_num_pages entries in kv_indices, max_work_items scheduled items, max_partial_rows
    split-KV partial states, max_mask_bytes of bit-packed custom mask, max_item_tokens
    multi-item token positions; ints, at least 1 for
    max_batch_size and max_work_items, 0 or more for the others (0: plans that need none,
    e.g. max_partial_rows=0 keeps every request in one piece).
    split_kv: let the scheduler cut long KV ranges into chunks merged afterwards.
    query_tile: "auto" (default) runs a batch whose requests all have one query, or at most 16
        packed query rows (qo_len x num_qo_heads / num_kv_heads), on the decode kernel's 16-row
        tiles, whose warps split the keys, and other batches on the prefill kernel's 128-row tiles
        (render.query_kind); "short" / "long" fix one. Each plan() chooses; once run() has
        been captured in a CUDA graph, later plans keep the captured kernel's tiles (the graph
        replays that kernel), whatever their query lengths.
    Algorithm: FlashInfer (Ye et al. 2025, arXiv 2501.01005), sections 3.1 and 3.3.
    """

    _kind = "prefill"

    def __init__(self, variant: Variant, page_size: int = 16, kv_layout: str = "NHD", *,
                 device=None, max_batch_size: int = 4096, max_num_pages: int = 1 << 20,
                 max_work_items: int = 1 << 16, max_partial_rows: int = 1 << 14,
                 max_mask_bytes: int = 1 << 24, max_item_tokens: int = 1 << 20,
                 split_kv: bool = True, query_tile: str = "auto", **flashinfer):
        if flashinfer:  # (FlashInfer's constructor keywords get a hint)
            raise unexpected_keywords(type(self).__name__, flashinfer, _PREFILL_KEYWORDS)
        if not isinstance(variant, Variant):
            raise not_a_variant(variant, type(self).__name__)
        page_size = page_size_arg(page_size, type(self).__name__ + "(variant, ")
        if kv_layout not in LAYOUTS:
            raise ValueError(f"kv_layout={kv_layout!r}: expected one of {LAYOUTS}")
        if query_tile not in QUERY_TILES:
            raise ValueError(f"query_tile={query_tile!r}: expected one of {QUERY_TILES}")
        self.query_tile = query_tile
        self._captured_kind: str | None = None  # the kernel a CUDA graph captured run() with
        self._captured_shared_kv: bool | None = None  # and whether its build reads shared prefixes
        self.variant, self.page_size, self.kv_layout = variant, page_size, kv_layout
        self.device = resolve_device(device)
        self._handle = ops.register_wrapper(self)  # torch.compile: the op finds us by it
        self.split_kv = bool_arg("split_kv", split_kv)
        self.capacity = {name: int_arg(name, value, CAPACITY_MINIMUMS[name])
                         for name, value in zip(CAPACITY_NAMES, (
                             max_batch_size, max_num_pages, max_work_items, max_partial_rows,
                             max_mask_bytes, max_item_tokens))}
        self._plan: Plan | None = None
        # the wrapper whose run() is this one's (CascadeDecode's plain strategy): run()'s errors
        # name it, and it refuses k_scale / v_scale as that wrapper's run() does
        self.run_owner: str | None = None
        self._ws: Workspace | None = None
        self._planned: dict = {}
        self._run_inputs: RunInputs | None = None  # what run() accepts after the last plan()
        # the last plan's launch (launch.Launcher), from its first run(); run()'s checks
        # (RunInputs) hold the shapes, dtypes, device and layout it was resolved for
        self._launcher: launch.Launcher | None = None
        self._forward_to = None  # what run() calls without a plan (unplan())

    # -- plan -------------------------------------------------------------------------------------
    @planner
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, *, q_dtype=torch.float16, kv_dtype=None,
             sm_scale: float | None = None, custom_mask=None, packed_custom_mask=None,
             mask_indptr=None, prefix_len=None, token_pos_in_items=None,
             max_item_len=None, shared_prefix_start=None, shared_prefix_len=None) -> Plan:
        """Schedule a batch; reused by every run() until the next plan().

        qo_indptr: [batch + 1] int32, request b's queries are rows qo_indptr[b]:qo_indptr[b+1]
            of q. kv_indptr: [batch + 1] int32 into kv_indices; kv_indices: page ids, int32;
            kv_last_page_len: [batch] int32 in [1, page_size] for requests with pages.
            Host (CPU) tensors avoid a device sync.
        q_dtype: torch.float16 or torch.bfloat16. kv_dtype: the cache's, q_dtype (default),
            torch.float8_e4m3fn or torch.float8_e5m2 (fp8 KV: dequantized on load, exactly,
            into q_dtype; run() takes the caches' scales k_scale / v_scale).
        sm_scale: > 0; default 1 / sqrt(head_dim).
        Mask "custom": custom_mask, flattened bool, row-major [qo_len, kv_len] per request
            (length sum(qo_len * kv_len)); or packed_custom_mask (uint8, each request's bits
            packed little-endian from byte mask_indptr[b]) with mask_indptr [batch + 1] int32.
        Mask "multi_item" (docs/sources.md, scheme 5a): prefix_len [batch] int32; token_pos_in_items
            int32, for every token after a request's prefix its 1-based position in its item
            (0 for a delimiter), concatenated over requests; max_item_len [batch] int32 (the
            longest item; lets the schedule skip keys between items).
        Shared prefixes (kv_layout "ragged"): shared_prefix_start, shared_prefix_len, [batch]
            int32: request b's keys are rows shared_prefix_start[b] ..
            shared_prefix_start[b] + shared_prefix_len[b] - 1 of k / v (a run that other
            requests may read too: a prompt prefix stored once), then its own rows
            kv_indptr[b] .. kv_indptr[b + 1] - 1; its key positions (causal, RoPE, score_mod's
            kv_idx) count from the prefix's first row. Contiguous runs keep the kernels' bulk
            K/V copies (TMA on sm_90) where one-token pages would gather rows.
        Returns the Plan (``plan.describe()`` prints it). Raises TypeError / ValueError, after
        which run() raises until the next plan() (it would otherwise run the previous plan).
        """
        qo = masks_mod.host_int32("qo_indptr", qo_indptr)
        masks = dict(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                     mask_indptr=mask_indptr, prefix_len=prefix_len,
                     token_pos_in_items=token_pos_in_items, max_item_len=max_item_len)
        return self._plan_batch(qo, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                                num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale, masks,
                                shared=(shared_prefix_start, shared_prefix_len))

    def _plan_batch(self, qo, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale, masks=None,
                    shared=(None, None)) -> Plan:
        inputs = check_batch(qo, kv_indptr, kv_indices, kv_last_page_len,
                             decode=self._kind == "decode", kv_layout=self.kv_layout,
                             page_size=self.page_size, num_qo_heads=num_qo_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype,
                             kv_dtype=kv_dtype, capacity=self.capacity,
                             shared_prefix_start=shared[0], shared_prefix_len=shared[1])
        kv, indices, kv_dtype = inputs.kv, inputs.indices, inputs.kv_dtype
        qo_lens, kv_lens, batch = inputs.qo_lens, inputs.kv_lens, inputs.batch
        sm_scale = launch.resolve_sm_scale(sm_scale, head_dim)  # (raises before any change)
        # (checked: ints, perhaps numpy's)
        num_qo_heads, num_kv_heads, head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        max_qo, max_kv = int(qo_lens.max(initial=0)), int(kv_lens.max(initial=0))
        ragged = self.kv_layout == "ragged"
        cap = self.capacity
        mask = masks_mod.mask_arrays(self.variant.mask, masks or {}, qo_lens, kv_lens,
                                     self.capacity)
        kernel_kind = self._kernel_kind(max_qo, num_qo_heads // num_kv_heads, head_dim)
        # the CUDA build that reads shared prefixes, for plans that have some (or when a CUDA
        # graph captured it: the graph replays that kernel)
        shared_kv = inputs.shared_lens is not None and bool((inputs.shared_lens > 0).any())
        if shared_kv and self._captured_shared_kv is False:
            raise ValueError("this plan has shared prefixes, but a CUDA graph captured run() "
                             "with the kernel built without them, which the graph replays; "
                             "use one wrapper per graph, or capture after a plan with shared "
                             "prefixes")
        shared_kv = shared_kv or bool(self._captured_shared_kv)
        rows, num_ctas, kv_tile = self._launch_shape(kernel_kind, q_dtype, kv_dtype, head_dim,
                                                     shared_kv)
        # ragged with shared prefixes: kv_start is where logical key 0 would be if the own run
        # held all keys (the kernels add the key index to it past the prefix)
        kv_starts = kv[:-1] if inputs.shared_lens is None else kv[:-1] - inputs.shared_lens
        plan = make_plan(qo_lens, kv_lens, kv_starts, num_qo_heads=num_qo_heads,
                         num_kv_heads=num_kv_heads, rows_per_cta=rows, num_ctas=num_ctas,
                         causal=self.variant.mask in ("causal", "multi_item"),
                         window_left=self.variant.window_left, split_kv=self.split_kv,
                         mask_offsets=mask.get("mask_offsets"), prefix_lens=mask.get("prefix"),
                         token_pos_offsets=mask.get("pos_offsets"),
                         max_item_lens=mask.get("max_item"),
                         shared_lens=inputs.shared_lens, shared_starts=inputs.shared_starts,
                         max_partial_rows=cap["max_partial_rows"],
                         max_items=cap["max_work_items"], kv_tile=kv_tile)
        if plan.num_items > cap["max_work_items"]:
            pinned = "" if self._captured_kind is None else (
                f"; the {rows}-row tiles are those of the kernel a CUDA graph captured, which "
                f"later plans keep (a wrapper per graph avoids it)")
            raise CapacityError(f"the plan has {plan.num_items} work items, more than "
                             f"max_work_items={cap['max_work_items']} given to the "
                             f"constructor{pinned}")
        if plan.num_partial_rows > cap["max_partial_rows"]:
            raise CapacityError(f"the plan needs {plan.num_partial_rows} partial rows, more than "
                             f"max_partial_rows={cap['max_partial_rows']} given to the "
                             f"constructor (or construct with split_kv=False)")
        # every check has passed: the workspace now changes (run() takes the new plan once
        # _run_inputs is set, last)
        # (allocated once, as normal tensors: later plans update them in place in or out of
        # inference mode, where inference tensors refuse in-place updates outside it)
        with torch.inference_mode(False):
            if self._ws is None:
                self._ws = Workspace(self.capacity, self.device)
            self._ws.upload(plan, np.zeros(0, np.int32) if ragged else indices[:kv[-1]])
            self._ws.upload_mask(mask)
        self._plan = plan
        self._device_plan = self._ws.device_plan(plan)
        self._planned = dict(
            total_q=int(qo[-1]), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, batch=batch, kind=kernel_kind,
            shared_kv=shared_kv, sm_scale=sm_scale,
            sizes=dict(batch_size=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                       qo_len=max_qo, kv_len=max_kv))
        self._run_inputs = RunInputs(
            total_q=int(qo[-1]), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=self.page_size,
            kv_layout=self.kv_layout, device=self.device, max_page=inputs.max_page,
            shared_prefixes=inputs.shared_lens is not None)
        return plan

    @property
    def kernel(self) -> str | None:
        """The kernel the last plan() runs on: "prefill" (128-row query tiles) or "decode"
        (16-row tiles whose warps split the keys; see query_tile); None before plan(), after
        one that raised and after unplan()."""
        return self._planned.get("kind") if self._run_inputs is not None else None

    def _drop_plan(self) -> None:
        """The last plan is gone (plan()'s first step, args.planner): after a plan() that
        raises, run() raises too, as the cascades' and SharedPrefixPrefill's do, rather than
        run the previous plan's pages for inputs of its shapes (a CUDA graph captured earlier
        still replays the device workspace of the last plan that succeeded)."""
        self._run_inputs, self._launcher = None, None

    def _kernel_kind(self, max_qo_len: int, group: int, head_dim: int) -> str:
        """The kernel this plan runs on: BatchDecode's is "decode"; BatchPrefill's follows
        query_tile, or the kernel a CUDA graph captured (see the class docstring)."""
        if self._kind == "decode":
            return "decode"
        if self._captured_kind is not None:
            return self._captured_kind
        return query_kind(max_qo_len, group, head_dim, self.query_tile)

    def _launch_shape(self, kind, q_dtype, kv_dtype, head_dim,
                      shared_kv) -> tuple[int, int, int]:
        """(packed rows per work item, persistent CTAs, keys per K/V tile): the kernel's on the
        GPU (the build the plan runs: its tiles depend on the device's arch, its CTAs per SM on
        its registers); on the CPU, the CUDA tiles' over 2 chunks per core."""
        if self.device.type == "cpu":
            tiles = tiles_for(kind, head_dim)
            return tiles.rows_per_cta(kind), 2 * (os.cpu_count() or 1), tiles.kv_tile
        kernel = jit.get_kernel(self.variant, backend="cuda", kind=kind,
                                dtype_tag=dtypes.tag(q_dtype), head_dim=head_dim,
                                device_index=self.device.index,
                                kv_tag=dtypes.kv_tag(kv_dtype), shared_kv=shared_kv)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return kernel.rows_per_cta, sms * kernel.resident_ctas_per_sm(), kernel.kv_tile

    # -- run --------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, kv_cache=None, *extra, return_lse: bool = False,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            k_scale: float = 1.0, v_scale: float = 1.0, **params):
        """Attention for the planned batch.

        q: [total_q, num_qo_heads, head_dim] (planned dtype). kv_cache: (k_cache, v_cache) with
        pages laid out as kv_layout, or one [num_pages, 2, ...] tensor, of the planned kv_dtype.
        out / lse: optional outputs [total_q, num_qo_heads, head_dim] / [total_q, num_qo_heads],
            contiguous (out 16-byte aligned); out is q itself (in place) or shares no memory
            with it, and none with lse (ValueError). Overlap with the caches is not checked
            (host time): an out inside k_cache / v_cache overwrites pages the kernels read.
        k_scale / v_scale: Python floats, the caches' dequantization scales (K = k_scale *
            k_cache, V = v_scale * v_cache; for fp8 caches quantized per tensor). k_scale is
            folded into the softmax scale, v_scale multiplies the output.
        params: the variant's runtime parameters (shape symbols from the plan: qo_len / kv_len
        are the longest request). Returns out, or (out, lse) with lse float32 natural log;
        rows that see no key give out 0 and lse -inf. Raises before any launch on bad input.
        """
        if extra:  # (FlashInfer's ragged run(q, k, v), or return_lse given positionally)
            raise extra_run_args(self.run_owner or type(self).__name__, extra)
        if kv_cache is None:  # (a default only for this message: FlashInfer's keyword's hint)
            raise missing_cache(self.run_owner or type(self).__name__, params)
        if return_lse.__class__ is not bool:
            return_lse = bool_arg("return_lse", return_lse)
        if torch.compiler.is_compiling():  # one opaque op on this wrapper: no host work traced
            for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):  # (the op's float()
                if isinstance(x, (bool, np.bool_)):  # would take True as 1.0: run() refuses it)
                    raise ValueError(f"{name}={x!r}: expected a finite Python float > 0")
            o, s = ops.wrapper_traced(self, q, _cache_tensors(kv_cache), params, num_outputs=2,
                                      extra_scalars=(k_scale, v_scale))
            return launch.into_outputs(o, s, out, lse, return_lse)
        if type(k_scale) is not float or type(v_scale) is not float or \
                k_scale != 1.0 or v_scale != 1.0:  # (the defaults need no check: host time)
            if self.run_owner:  # (a cascade's plain strategy: its run is ours)
                reject_run_kwargs(self.run_owner, dict(k_scale=k_scale, v_scale=v_scale))
            k_scale, v_scale = kv_scales(k_scale, v_scale, self._planned.get("sm_scale", 1.0))
        k_cache, v_cache = split_cache(kv_cache, self.kv_layout)
        checks = self._run_inputs
        if checks is None:
            if self._forward_to is not None:
                return self._forward_to(q, kv_cache, return_lse=return_lse, out=out, lse=lse,
                                        **params)
            raise RuntimeError(f"{type(self).__name__}.run() called before plan() (or after a "
                               f"plan() that raised)")
        held = checks.hold(q, k_cache, v_cache)
        if held is None:  # check() names what is wrong (hold() tests the same conditions)
            checks.check(q, k_cache, v_cache)
            held = (launch.kv_strides(k_cache, self.kv_layout),
                    launch.kv_strides(v_cache, self.kv_layout), False)
        k_strides, v_strides, q_dense = held
        if q.requires_grad or k_cache.requires_grad or v_cache.requires_grad:  # (attribute
            #                                                  reads first: host time)
            warn_no_grad(f"{self.run_owner or type(self).__name__}.run", q, k_cache, v_cache)
        pl, plan, ws = self._planned, self._plan, self._ws
        bound = self.variant.bind(params, device=q.device, sizes=pl["sizes"])
        shape = (pl["total_q"], pl["num_qo_heads"], pl["head_dim"])
        if out is None:  # (empty_like: 2-3 us less than torch.empty with dtype and device)
            out = torch.empty_like(q) if q_dense else torch.empty(shape, dtype=q.dtype,
                                                                  device=q.device)
        else:  # a caller's out partly inside q would be written while other rows still read q
            #    (out one row past q gave wrong rows): refused; out=q itself is in place, which
            #    the kernels allow (the caches are not checked, for host time)
            out = launch.output_buffer("out", out, shape, q.dtype, q.device, apart_from=None
                                       if launch.same_view(out, q) else {"q": q})
        if lse is not None or return_lse:  # (else the kernels store no lse: one allocation less)
            lse = launch.output_buffer("lse", lse, shape[:2], torch.float32, q.device, align=4,
                                       apart_from={"out": out, "q": q})
        launcher = self._launcher
        if launcher is not None:  # this plan's launch as its first run() resolved it
            launcher(q, k_cache, v_cache, out, lse, k_strides, v_strides,
                     pl["sm_scale"] * k_scale, self.variant, bound)
        else:
            kv = launch.KVView.ragged(k_cache, v_cache) if self.kv_layout == "ragged" else \
                launch.KVView.paged(k_cache, v_cache, ws.view("kv_indices"), self.kv_layout)
            self._launcher = launch.run_attention(
                q, kv, out, lse, self.variant, bound, num_kv_heads=pl["num_kv_heads"],
                kind=pl["kind"], plan=self._device_plan, batch=pl["batch"],
                max_qo_len=pl["sizes"]["qo_len"], single_qo_len=0, single_kv_len=0,
                sm_scale=pl["sm_scale"] * k_scale, shared_kv=pl["shared_kv"])
        capturing = checks.device_index >= 0 and torch.cuda.is_current_stream_capturing()
        if capturing:
            self._captured_kind = pl["kind"]
            self._captured_shared_kv = pl["shared_kv"]
        if capturing or len(plan.merge_rows):
            # always while a CUDA graph is captured: the row count is read on the device, so
            # the graph replays correctly after a plan with more (or fewer) merges
            launch.run_merge(ws.partial_o, ws.partial_lse, out, lse,
                             sigmoid=self.variant.reduction == "sigmoid",
                             merge_indptr=ws.view("merge_indptr"),
                             merge_rows=ws.view("merge_rows"),
                             merge_slots=ws.view("merge_slots"),
                             num_merged_dev=ws.view("merge_count"),
                             grid_ctas=plan.num_ctas)
        if v_scale != 1.0:
            out.mul_(v_scale)
        return (out, lse) if return_lse else out

    def unplan(self, forward_to=None) -> None:
        """Drop the plan until the next plan(): run() raises RuntimeError, or with
        ``forward_to`` (a callable taking run()'s arguments) returns forward_to(...)."""
        self._run_inputs, self._launcher, self._forward_to = None, None, forward_to

    def _run_eager(self, q, inputs, params, k_scale: float = 1.0, v_scale: float = 1.0):
        """run() for the wrapper_run op (ops.py): inputs are the cache tensor(s)."""
        return self.run(q, inputs[0] if len(inputs) == 1 else tuple(inputs), return_lse=True,
                        k_scale=k_scale, v_scale=v_scale, **params)


def _cache_tensors(kv_cache) -> list:
    return list(kv_cache) if isinstance(kv_cache, (tuple, list)) else [kv_cache]


# BatchDecode's keywords: BatchPrefill's but query_tile
# the constructors' keywords: BatchPrefill's, and BatchDecode's (those but query_tile)
_PREFILL_KEYWORDS = tuple(name for name, p in inspect.signature(BatchPrefill.__init__).parameters
                          .items() if name not in ("self", "variant")
                          and p.kind is not inspect.Parameter.VAR_KEYWORD)
_DECODE_KEYWORDS = tuple(name for name in _PREFILL_KEYWORDS if name != "query_tile")


class BatchDecode(BatchPrefill):
    """Decode: one query token per request over a paged (or ragged) KV cache (the decode
    kernel: warps split each work item's KV range; the scheduler splits long requests across
    CTAs). Same constructor as BatchPrefill, for variants with mask "none" or "causal" (custom
    and multi-item masks are BatchPrefill's: its plan() takes the mask data); q is
    [batch, num_qo_heads, head_dim]."""

    _kind = "decode"

    def __init__(self, variant: Variant, page_size: int = 16, kv_layout: str = "NHD",
                 **kwargs):
        if "query_tile" in kwargs:
            raise TypeError("BatchDecode takes no query_tile: one query per request always "
                            "runs on the decode kernel's tiles")
        unknown = set(kwargs) - set(_DECODE_KEYWORDS)
        if unknown:  # (else BatchPrefill's would name itself)
            raise unexpected_keywords("BatchDecode", unknown, _DECODE_KEYWORDS)
        super().__init__(variant, page_size, kv_layout, **kwargs)
        if variant.mask not in ("none", "causal"):
            raise ValueError(f"BatchDecode takes variants with mask 'none' or 'causal'; "
                             f"{variant.name!r} has mask={variant.mask!r}, whose data "
                             f"BatchPrefill.plan takes (one query per request works there)")

    @planner
    def plan(self, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, *, q_dtype=torch.float16, kv_dtype=None,
             sm_scale: float | None = None) -> Plan:
        """As BatchPrefill.plan without qo_indptr (one query per request)."""
        kv = masks_mod.host_int32("kv_indptr", kv_indptr)
        qo = np.arange(len(kv), dtype=np.int32)
        return self._plan_batch(qo, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                                num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale)

