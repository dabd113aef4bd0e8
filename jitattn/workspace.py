"""Plan -> device: the workspace a batch wrapper's plans are copied into (FlashInfer's plan/run
split, Ye et al. 2025, arXiv 2501.01005, section 3.3).

One int32 device buffer, allocated once with the capacities declared up front and never
reallocated, so that a captured CUDA graph's pointers stay valid across plans; it is carved
into 16-byte aligned views (request table, work items, CTA offsets, merge map, page table,
merge count) and has a pinned host twin for the asynchronous copies. Besides it: float32
split-KV partial states sized for the largest head_dim, and the custom-mask bits and
multi-item token positions, allocated at their first use.
"""

from __future__ import annotations

import numpy as np
import torch

from . import launch
from .plan import ITEM_FIELDS, REQUEST_FIELDS, Plan
from .render import HEAD_DIMS

MAX_CTAS = 1 << 14  # persistent-grid CTAs the offset table can hold


class Workspace:
    """capacity: max_batch_size, max_work_items, max_partial_rows, max_num_pages,
    max_mask_bytes, max_item_tokens (BatchPrefill's constructor). device: torch.device."""

    def __init__(self, capacity: dict, device: torch.device):
        self.capacity, self.device = capacity, device
        cap = capacity
        sizes = dict(merge_count=1, requests=REQUEST_FIELDS * cap["max_batch_size"],
                     items=ITEM_FIELDS * cap["max_work_items"], cta_indptr=MAX_CTAS + 1,
                     merge_indptr=cap["max_partial_rows"] + 1,
                     merge_rows=cap["max_partial_rows"], merge_slots=cap["max_partial_rows"],
                     kv_indices=cap["max_num_pages"])
        self.views, offset = {}, 0
        for name, n in sizes.items():
            self.views[name] = (offset, n)
            offset += -(-n // 4) * 4  # 16-byte aligned: the kernels read requests/items as int4
        self.ints = torch.zeros(offset, dtype=torch.int32, device=device)
        self._view_tensors = {name: self.ints[o:o + n] for name, (o, n) in self.views.items()}
        self.pinned = torch.zeros(offset, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.partial_o = torch.empty(cap["max_partial_rows"] * max(HEAD_DIMS),
                                     dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(cap["max_partial_rows"], dtype=torch.float32,
                                       device=device)
        self.mask_bits: torch.Tensor | None = None   # uint8, custom masks
        self.token_pos: torch.Tensor | None = None   # int32, multi-item masks
        self._copied: torch.cuda.Event | None = None

    def view(self, name: str) -> torch.Tensor:
        """One view of the int32 buffer (a tensor made once)."""
        return self._view_tensors[name]

    def upload(self, plan: Plan, kv_indices: np.ndarray) -> None:
        """Copy a plan into the workspace: each view's used prefix, pinned host -> device, on
        the device's current stream (ordered before the next run())."""
        if plan.num_ctas > MAX_CTAS:
            raise ValueError(f"{plan.num_ctas} CTAs exceed the workspace's {MAX_CTAS}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous plan's copy has left the pinned buffer
        host = self.pinned.numpy()
        for name, array in (("merge_count", np.array([len(plan.merge_rows)])),
                            ("requests", plan.requests), ("items", plan.items),
                            ("cta_indptr", plan.cta_indptr), ("merge_indptr", plan.merge_indptr),
                            ("merge_rows", plan.merge_rows), ("merge_slots", plan.merge_slots),
                            ("kv_indices", kv_indices)):
            offset, n = self.views[name]
            flat = np.asarray(array, dtype=np.int32).reshape(-1)
            if len(flat) > n:
                raise AssertionError(f"workspace view {name} holds {n}, plan needs {len(flat)}")
            host[offset:offset + len(flat)] = flat
            self.ints[offset:offset + len(flat)].copy_(self.pinned[offset:offset + len(flat)],
                                                       non_blocking=True)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))

    def upload_mask(self, mask: dict) -> None:
        """Copy a plan's mask data (masks.mask_arrays: "bits", "pos") to the device."""
        if "bits" in mask:
            if self.mask_bits is None:
                self.mask_bits = torch.zeros(self.capacity["max_mask_bytes"], dtype=torch.uint8,
                                             device=self.device)
            self.mask_bits[:len(mask["bits"])].copy_(torch.from_numpy(mask["bits"]))
        if "pos" in mask:
            if self.token_pos is None:
                self.token_pos = torch.zeros(self.capacity["max_item_tokens"],
                                             dtype=torch.int32, device=self.device)
            self.token_pos[:len(mask["pos"])].copy_(torch.from_numpy(mask["pos"]))

    def device_plan(self, plan: Plan) -> launch.DevicePlan:
        """What the attention kernels read of an uploaded plan."""
        return launch.DevicePlan(
            requests=self.view("requests"), items=self.view("items"),
            cta_indptr=self.view("cta_indptr"), partial_o=self.partial_o,
            partial_lse=self.partial_lse, num_items=plan.num_items, num_ctas=plan.num_ctas,
            rows_per_cta=plan.rows_per_cta, mask_bits=self.mask_bits, token_pos=self.token_pos)
