"""Prefill of a batch whose requests share a prefix: the schemes of SEEDS_DIGEST.md (the shared
prefix survey, section "Five ways to prefill a batch that shares a prefix"), each built from
BatchPrefill plans over one deduplicated token layout.

The layout: the model computes Q, K, V once per distinct token, [P, S_0, S_1, ..., S_{M-1}]
(P prefix tokens, then each request's suffix); every strategy returns the attention output in
that layout, equal to what each request [P, S_i] would get on its own (the prefix rows are the
same for every request).

- naive: every request [P, S_i] on its own (prefix queries and keys repeated M times).
- split: request 0 first, then the other suffixes against the prefix in a second launch.
- ragged: one launch; request 0 is [P, S_0], the others only their suffix queries, with page
  tables (page size 1 over the token layout) that list the shared prefix.
- cascade: causal prefill of P; the shared level (all suffix queries as one request against
  P, no mask); the unique level (each suffix against itself, causal); an LSE merge.
- multi_item: one logical request with the multi-item mask (scheme 5a).
- custom_mask: one logical request with an explicit mask (scheme 5b).

cascade, multi_item and custom_mask move queries and keys to other positions inside their
launches, so they are exact only for variants whose hooks do not read positions (no RoPE, no
window, no q_idx / kv_idx in score_mod or mask_mod); for the others they raise ValueError.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .batch import BatchPrefill
from .merge import merge_state
from .prefix import multi_item_metadata
from .spec import Variant

STRATEGIES = ("naive", "split", "ragged", "cascade", "multi_item", "custom_mask")
_POSITION_FREE = ("cascade", "multi_item", "custom_mask")


def uses_positions(variant: Variant) -> bool:
    """Whether the variant's output depends on absolute token positions beyond causal order:
    fused RoPE, a sliding window, or a score_mod / mask_mod reading q_idx or kv_idx."""
    def reads_positions(expr) -> bool:
        if expr.op == "sym" and expr.args[0] in ("q_idx", "kv_idx"):
            return True
        return any(reads_positions(a) for a in expr.args if hasattr(a, "op"))
    traced = [t.expr for t in (variant.score, variant.mask_pred) if t is not None]
    return variant.pos_encoding is not None or variant.window_left is not None or any(
        reads_positions(e) for e in traced)


def _i32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32)


def _indptr(lens) -> torch.Tensor:
    return _i32(np.concatenate([[0], np.cumsum(lens)]))


class SharedPrefixPrefill:
    """Prefill M requests that share a P-token prefix, with one of STRATEGIES.

    variant: a causal Variant. strategy: one of STRATEGIES or "auto" (the seed's selection
    guide: multi_item for a long prefix, many requests and short suffixes, else ragged; a
    measured cost model is future work). device, **capacities: as for BatchPrefill.
    """

    def __init__(self, variant: Variant, strategy: str = "auto", *, device="cuda",
                 **capacities):
        if not isinstance(variant, Variant):
            raise TypeError(f"variant must be a jitattn.Variant, got {type(variant).__name__}")
        if variant.mask != "causal":
            raise ValueError(f"shared-prefix prefill needs a causal variant; {variant.name!r} "
                             f"has mask={variant.mask!r}")
        if strategy not in STRATEGIES + ("auto",):
            raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES + ('auto',)}")
        if strategy in _POSITION_FREE and uses_positions(variant):
            raise ValueError(f"strategy {strategy!r} moves tokens to other positions, so it is "
                             f"exact only for variants that do not read positions; "
                             f"{variant.name!r} does (use naive, split or ragged)")
        self.variant, self.strategy, self.device = variant, strategy, torch.device(device)
        self._capacities = capacities
        self._wrappers: dict = {}
        self._steps: list = []

    def _wrapper(self, name: str, variant: Variant, layout: str) -> BatchPrefill:
        if name not in self._wrappers:
            self._wrappers[name] = BatchPrefill(variant, page_size=1, kv_layout=layout,
                                                device=self.device, **self._capacities)
        return self._wrappers[name]

    def choose(self, prefix_len: int, suffix_lens) -> str:
        """The strategy "auto" takes for this batch."""
        m, longest = len(suffix_lens), max(suffix_lens, default=0)
        if prefix_len >= 1024 and m >= 8 and longest <= 4 and not uses_positions(self.variant):
            return "multi_item"
        return "ragged"

    def plan(self, prefix_len: int, suffix_lens, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, *, q_dtype=torch.float16) -> str:
        """Plan a batch: prefix_len P >= 0 tokens shared by len(suffix_lens) >= 1 requests with
        suffixes of suffix_lens[i] >= 1 tokens. Returns the strategy used."""
        suffix_lens = [int(s) for s in suffix_lens]
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
            raise ValueError(f"prefix_len={prefix_len!r}: expected an int >= 0")
        if not suffix_lens or min(suffix_lens) < 1:
            raise ValueError(f"suffix_lens={suffix_lens}: expected at least one request, each "
                             f"with at least one token of its own")
        strategy = self.choose(prefix_len, suffix_lens) if self.strategy == "auto" \
            else self.strategy
        p, s = prefix_len, suffix_lens
        starts = p + np.concatenate([[0], np.cumsum(s)[:-1]])   # suffix i's first token
        heads = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     q_dtype=q_dtype)
        prefix_ids = np.arange(p)
        own = [np.arange(a, a + n) for a, n in zip(starts, s)]
        steps = []  # (wrapper name, q rows, output rows or None, kind)

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
            steps.append(("naive", np.concatenate(rows), "naive"))
        elif strategy in ("split", "ragged"):
            first = np.concatenate([prefix_ids, own[0]])
            rest_q = own[1:]
            rest_kv = [np.concatenate([prefix_ids, o]) for o in own[1:]]
            if strategy == "ragged":
                paged("ragged", self.variant, [first] + rest_q, [first] + rest_kv)
                steps.append(("ragged", np.concatenate([first] + rest_q), "direct"))
            else:
                paged("split0", self.variant, [first], [first])
                steps.append(("split0", first, "direct"))
                if rest_q:
                    paged("split1", self.variant, rest_q, rest_kv)
                    steps.append(("split1", np.concatenate(rest_q), "direct"))
        elif strategy == "cascade":
            if p:
                paged("prefix", self.variant, [prefix_ids], [prefix_ids])
                steps.append(("prefix", prefix_ids, "direct"))
            suffix_rows = np.concatenate(own)
            paged("unique", self.variant, own, own)
            steps.append(("unique", suffix_rows, "unique"))
            if p:
                shared = dataclasses.replace(self.variant, mask="none")
                paged("shared", shared, [suffix_rows], [prefix_ids])
                steps.append(("shared", suffix_rows, "shared"))
        elif strategy == "multi_item":
            prefix, positions, longest = multi_item_metadata(p, s)
            rows = np.arange(p + sum(s))
            paged("multi", dataclasses.replace(self.variant, mask="multi_item"), [rows], [rows],
                  prefix_len=_i32([prefix]), token_pos_in_items=_i32(positions),
                  max_item_len=_i32([longest]))
            steps.append(("multi", rows, "direct"))
        else:  # custom_mask
            total = p + sum(s)
            item = np.full(total, -1)
            for i, o in enumerate(own):
                item[o] = i
            qi, ki = np.arange(total)[:, None], np.arange(total)[None, :]
            visible = (ki <= qi) & ((ki < p) | (item[qi] == item[ki]))
            rows = np.arange(total)
            paged("custom", dataclasses.replace(self.variant, mask="custom"), [rows], [rows],
                  custom_mask=torch.from_numpy(visible.reshape(-1)))
            steps.append(("custom", rows, "direct"))
        self._steps = steps
        self._planned = dict(total=p + sum(s), heads=heads, strategy=strategy)
        return strategy

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **params) -> torch.Tensor:
        """q, k, v: [P + sum(S_i), heads, head_dim] in the deduplicated layout. Returns the
        attention output in that layout (each request's rows as if it ran on its own)."""
        if not self._steps:
            raise RuntimeError("SharedPrefixPrefill.run() called before plan()")
        total = self._planned["total"]
        if q.shape[0] != total or k.shape[0] != total or v.shape[0] != total:
            raise ValueError(f"q, k, v must have {total} rows (P + sum(S_i)); got "
                             f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        cache = (k.unsqueeze(1), v.unsqueeze(1))  # pages of one token over the token layout
        out = torch.empty_like(q)
        unique = None
        for name, rows, kind in self._steps:
            w = self._wrappers[name]
            q_rows = torch.as_tensor(rows, device=q.device, dtype=torch.long)
            if kind == "naive":  # each token's first occurrence: request 0 owns the prefix rows
                o = w.run(q[q_rows].contiguous(), cache, **params)
                _, first = np.unique(rows, return_index=True)
                first = torch.as_tensor(first, device=q.device)
                out[q_rows[first]] = o[first]
            elif kind == "direct":
                out[q_rows] = w.run(q[q_rows].contiguous(), cache, **params)
            elif kind == "unique":
                unique = w.run(q[q_rows].contiguous(), cache, return_lse=True, **params)
                out[q_rows] = unique[0]
            else:  # shared level: merge with the unique level
                o_s, lse_s = w.run(q[q_rows].contiguous(), cache, return_lse=True, **params)
                out[q_rows] = merge_state(o_s, lse_s, unique[0], unique[1],
                                          reduction=self.variant.reduction)[0]
        return out
