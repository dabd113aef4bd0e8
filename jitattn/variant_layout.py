"""What in a Variant depends on how a batch is laid out (token positions, the request index,
tensors shaped by the batch's sizes), and so which shared-prefix strategies, which renumber
requests or move tokens, compute it exactly (SharedPrefixPrefill, MultiLevelCascade)."""

from __future__ import annotations

from .spec import Variant


def _reads(variant: Variant, symbols: tuple) -> bool:
    def walk(expr) -> bool:
        if expr.op == "sym" and expr.args[0] in symbols:
            return True
        return any(walk(a) for a in expr.args if hasattr(a, "op"))
    return any(walk(t.expr) for t in (variant.score, variant.mask_pred) if t is not None)


def uses_positions(variant: Variant) -> bool:
    """Whether the variant's output depends on absolute token positions beyond causal order:
    fused RoPE, a sliding window, or a score_mod / mask_mod reading q_idx or kv_idx."""
    return variant.pos_encoding is not None or variant.window_left is not None or \
        _reads(variant, ("q_idx", "kv_idx"))


def layout_features(variant: Variant) -> set:
    """What in a variant depends on how a batch is laid out: "positions", "request" (reads
    b), "qo_len" / "batch_or_kv_len" (tensor parameters shaped by those symbols)."""
    features = set()
    if uses_positions(variant):
        features.add("positions")
    if _reads(variant, ("b",)):
        features.add("request")
    for p in variant.tensor_params:
        if "qo_len" in p.shape:
            features.add("qo_len")
        if "batch_size" in p.shape or "kv_len" in p.shape:
            features.add("batch_or_kv_len")
    return features


#: The layout features each strategy computes exactly.
ALLOWED = {"naive": {"positions", "request", "qo_len", "batch_or_kv_len"},
           "ragged": {"positions", "request", "batch_or_kv_len"}, "split": {"positions"},
           "cascade": set(), "multi_item": set(), "custom_mask": set()}


def check_strategy(variant: Variant, strategy: str) -> None:
    """Raise ValueError if ``strategy`` would not compute ``variant`` exactly."""
    bad = layout_features(variant) - ALLOWED[strategy]
    if bad:
        raise ValueError(f"strategy {strategy!r} renumbers requests or moves tokens, so it "
                         f"cannot run variant {variant.name!r}, whose hooks depend on "
                         f"{sorted(bad)}; use one of "
                         f"{[k for k, v in ALLOWED.items() if not (layout_features(variant) - v)]}")
