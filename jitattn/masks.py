"""Data of the "custom" and "multi_item" masks given to BatchPrefill.plan(): validation, bit
packing (FlashInfer's segment_packbits layout: each request's row-major [qo_len, kv_len] bits
packed little-endian from its own byte offset) and the per-request offsets the kernels read.
Multi-item scoring is the shared-prefix survey's scheme 5a (docs/sources.md)."""

from __future__ import annotations

import numpy as np
import torch

from .args import CapacityError, over_capacity


def host_int32(name: str, t, *, allow_empty: bool = False) -> np.ndarray:
    """A validated host copy of a 1-D int32 tensor."""
    if not isinstance(t, torch.Tensor):
        hint = " (None is a ragged layout's: a wrapper built with kv_layout='ragged')" \
            if t is None and name in ("kv_indices", "kv_last_page_len") else ""
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}{hint}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.int32 (convert with "
                        f".int(); the batch wrappers do not convert index tensors silently)")
    if t.dim() != 1 or (t.numel() == 0 and not allow_empty):
        what = "a 1-D tensor" if allow_empty else "a non-empty 1-D tensor"
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values; expected a "
                         f"tensor on the CPU or a GPU")
    if t.layout != torch.strided:
        raise ValueError(f"{name} is a {t.layout} tensor; expected a dense one")
    return t.cpu().numpy()


def mask_arrays(mode: str, masks: dict, qo_lens, kv_lens, cap: dict) -> dict:
    """Validate the mask data of a plan; returns host arrays for the request table and
    the bytes / positions to upload."""
    given = {k for k, v in masks.items() if v is not None}
    allowed = {"custom": {"custom_mask", "packed_custom_mask", "mask_indptr"},
               "multi_item": {"prefix_len", "token_pos_in_items", "max_item_len"}}
    extra = given - allowed.get(mode, set())
    if extra:
        raise ValueError(f"{sorted(extra)} given to plan() but the variant's mask is "
                         f"{mode!r}")
    batch = len(qo_lens)
    if mode == "custom":
        sizes = qo_lens.astype(np.int64) * kv_lens
        if masks.get("custom_mask") is not None and (masks.get("packed_custom_mask") is not None
                                                     or masks.get("mask_indptr") is not None):
            raise ValueError("give custom_mask, or packed_custom_mask with mask_indptr, not both "
                             "(the packed mask was ignored)")
        if masks.get("custom_mask") is not None:
            flat = masks["custom_mask"]
            if not isinstance(flat, torch.Tensor) or flat.dtype != torch.bool or \
                    flat.dim() != 1:
                raise TypeError(f"custom_mask must be a 1-D torch.bool tensor: each request's "
                                f"[qo_len, kv_len] mask flattened row-major, concatenated over "
                                f"the requests; got {_described(flat)}")
            if flat.numel() != sizes.sum():
                raise ValueError(f"custom_mask has {flat.numel()} entries; expected "
                                 f"sum(qo_len * kv_len) = {int(sizes.sum())}")
            flat = flat.cpu().numpy()
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            segments = [np.packbits(flat[bounds[b]:bounds[b + 1]], bitorder="little")
                        for b in range(batch)]
            offsets = np.concatenate([[0], np.cumsum([len(x) for x in segments])])
            bits = np.concatenate(segments) if segments else np.zeros(0, np.uint8)
        elif masks.get("packed_custom_mask") is not None:
            if masks.get("mask_indptr") is None:
                raise ValueError("packed_custom_mask needs mask_indptr")
            packed = masks["packed_custom_mask"]
            if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or \
                    packed.dim() != 1:
                raise TypeError(f"packed_custom_mask must be a 1-D torch.uint8 tensor; got "
                                f"{_described(packed)}")
            offsets = host_int32("mask_indptr", masks["mask_indptr"]).astype(np.int64)
            if len(offsets) != batch + 1 or offsets[0] != 0:
                raise ValueError(f"mask_indptr must have {batch + 1} entries starting at 0; "
                                 f"got {len(offsets)} starting at {offsets[0]}")
            need = (sizes + 7) // 8
            bad = np.nonzero(np.diff(offsets) != need)[0]
            if len(bad):
                b = int(bad[0])
                raise ValueError(f"mask_indptr gives request {b} {int(np.diff(offsets)[b])} "
                                 f"bytes; qo_len * kv_len = {int(sizes[b])} bits need "
                                 f"{int(need[b])}")
            bits = packed.cpu().numpy()[:offsets[-1]]
            if len(bits) < offsets[-1]:
                raise ValueError(f"packed_custom_mask has {packed.numel()} bytes; "
                                 f"mask_indptr[-1] is {int(offsets[-1])}")
        else:
            raise ValueError("the variant's mask is 'custom': plan() needs custom_mask or "
                             "packed_custom_mask + mask_indptr")
        over = over_capacity(cap, "max_mask_bytes", len(bits))
        if over is not None:
            raise CapacityError(over)
        return {"mask_offsets": offsets[:-1], "bits": bits}
    if mode == "multi_item":
        missing = {"prefix_len", "token_pos_in_items", "max_item_len"} - given
        if missing:
            raise ValueError(f"the variant's mask is 'multi_item': plan() needs "
                             f"{sorted(missing)}")
        prefix = host_int32("prefix_len", masks["prefix_len"])
        pos = host_int32("token_pos_in_items", masks["token_pos_in_items"],
                          allow_empty=True)
        max_item = host_int32("max_item_len", masks["max_item_len"])
        if len(prefix) != batch or len(max_item) != batch:
            raise ValueError(f"prefix_len and max_item_len need {batch} entries; got "
                             f"{len(prefix)} and {len(max_item)}")
        bad = np.flatnonzero((prefix < 0) | (prefix > kv_lens))
        if len(bad):
            b = int(bad[0])
            raise ValueError(f"prefix_len[{b}] = {prefix[b]} must lie in [0, kv_len] "
                             f"(request {b}'s kv_len: {kv_lens[b]})")
        if (max_item < 0).any():
            b = int(np.flatnonzero(max_item < 0)[0])
            raise ValueError(f"max_item_len[{b}] = {max_item[b]}: expected >= 0 (the longest "
                             f"item's tokens)")
        counts = kv_lens - prefix
        if len(pos) != counts.sum():
            raise ValueError(f"token_pos_in_items has {len(pos)} entries; expected "
                             f"sum(kv_len - prefix_len) = {int(counts.sum())}")
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for b in range(batch):
            seg = pos[offsets[b]:offsets[b + 1]]
            if len(seg) and (seg.min() < 0 or seg.max() > max_item[b]):
                at = int(np.flatnonzero((seg < 0) | (seg > max_item[b]))[0])
                raise ValueError(f"token_pos_in_items of request {b} must lie in [0, "
                                 f"max_item_len[{b}] = {max_item[b]}]; its entry {at} (entry "
                                 f"{offsets[b] + at} of the tensor) is {seg[at]}")
        over = over_capacity(cap, "max_item_tokens", len(pos))
        if over is not None:
            raise CapacityError(over)
        return {"prefix": prefix, "pos_offsets": offsets[:-1], "max_item": max_item,
                "pos": pos}
    return {}


def _described(x) -> str:
    """A mask argument as its error shows it: a tensor by shape and dtype, else its type."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__
