"""Variant validation, keys and parameter binding."""

import copy
import dataclasses
import re
import warnings

import numpy as np
import pytest
import torch

import jitattn as ja
from jitattn.dsl import SpecError


def test_key_is_stable_and_content_addressed():
    a = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(50.0))
    b = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(50.0))
    c = ja.Variant("softcap", mask="causal", score_mod=ja.soft_cap(30.0))
    assert a.key == b.key and a == b and hash(a) == hash(b)
    assert a.key != c.key and a.key.startswith("softcap-causal-")
    assert ja.Variant("w", window_left=4).key != ja.Variant("w", window_left=5).key


def test_captured_tensor_values_do_not_change_the_key():
    t1, t2 = torch.randn(4), torch.randn(4)
    v1 = ja.Variant("cap", mask="causal", score_mod=lambda s, b, h, q, k: s + t1[h])
    v2 = ja.Variant("cap", mask="causal", score_mod=lambda s, b, h, q, k: s + t2[h])
    assert v1.key == v2.key and v1 != v2  # same code, different bound data


@pytest.mark.parametrize("kw, match", [
    (dict(mask="diagonal"), "mask"),
    (dict(reduction="relu"), "reduction"),
    (dict(window_left=-3), "window_left"),
    (dict(window_left=2.5), "window_left"),
    (dict(window_left=2**32 + 5), r"window_left=4294967301: expected None, -1 or an int in "
                                  r"0 \.\. 2\*\*31 - 1"),  # (was a window of 5 in int32)
    (dict(pos_encoding="rope"), "pos_encoding"),
    (dict(name="bad name"), "name"),
])
def test_invalid_options(kw, match):
    kw = {"name": "v", **kw}
    with pytest.raises(SpecError, match=match):
        ja.Variant(**kw)


def test_window_minus_one_means_unlimited():
    assert ja.Variant("w", window_left=-1).window_left is None


def test_rope_validation_and_llama3_frequencies():
    with pytest.raises(SpecError, match="style"):
        ja.RoPE(style="rotate")
    with pytest.raises(SpecError, match="missing"):
        ja.RoPE(scaling={"type": "llama3", "factor": 8.0})
    # non-finite values passed the checks and then broke the build (a nan literal) or the
    # frequencies
    llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    for bad, text in (({"theta": float("inf")}, "theta=inf: expected a finite number > 1"),
                      ({"theta": True}, "theta=True"),
                      ({"scaling": {"type": "linear", "factor": float("nan")}}, "finite"),
                      ({"scaling": {**llama3, "factor": float("inf")}}, "finite")):
        with pytest.raises(SpecError, match=re.escape(text)):
            ja.RoPE(**bad)
    assert ja.RoPE(theta=np.float32(1e4), scaling={**llama3, "factor": np.int64(8)}).theta == 1e4
    # not a mapping: dict()'s own errors; frequencies beyond float32: NaN from the kernels only
    for scaling in ("linear", 3, ["linear", 2.0]):
        with pytest.raises(SpecError, match=re.escape(f"RoPE scaling={scaling!r}: expected None "
                                                      f"or a dict")):
            ja.RoPE(scaling=scaling)
    with pytest.raises(SpecError, match="frequencies up to 1e[+]39 do not fit float32"):
        ja.RoPE(scaling={"type": "linear", "factor": 1e-39})
    assert ja.RoPE(scaling={}).scaling is None
    rope = ja.RoPE(scaling={"type": "linear", "factor": 2.0})
    assert ja.RoPE(scaling=rope.scaling).scaling == rope.scaling  # (its stored form)
    # HF only warns when high_freq_factor <= low_freq_factor: the smoothing's division by their
    # difference lands in entries that are not selected, and no numpy warning escapes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for hi in (1.0, 0.5):
            rope = ja.RoPE(theta=5e5, scaling={**llama3, "high_freq_factor": hi})
            assert np.isfinite(rope.inv_freq(128)).all()
    plain = ja.RoPE(theta=500000.0).inv_freq(64)
    assert plain[0] == 1.0 and plain.shape == (32,)
    scaled = ja.RoPE(theta=500000.0, scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}).inv_freq(64)
    # high frequencies (short wavelengths) untouched, the lowest divided by the factor
    assert scaled[0] == plain[0]
    np.testing.assert_allclose(scaled[-1], plain[-1] / 32.0)
    lin = ja.RoPE(scaling={"type": "linear", "factor": 4.0}).inv_freq(128)
    np.testing.assert_allclose(lin, ja.RoPE().inv_freq(128) / 4.0)


def _alibi():
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    return ja.Variant("alibi", mask="causal",
                      score_mod=lambda s, b, h, q, k: s + slopes[h] * (k - q))


SIZES = dict(batch_size=2, num_qo_heads=8, num_kv_heads=2, qo_len=5, kv_len=9)


def test_bind_checks_names_shapes_dtypes():
    v = _alibi()
    cpu = torch.device("cpu")
    assert v.runtime_param_names == ("slopes",)
    with pytest.raises(ValueError, match="missing parameter"):
        v.bind({}, device=cpu, sizes=SIZES)
    with pytest.raises(ValueError, match="unexpected parameter"):
        v.bind({"slopes": torch.ones(8), "cap": 1.0}, device=cpu, sizes=SIZES)
    with pytest.raises(ValueError, match=r"shape \(4,\), expected \(8,\)"):
        v.bind({"slopes": torch.ones(4)}, device=cpu, sizes=SIZES)
    with pytest.raises(TypeError, match="dtype torch.float16"):
        v.bind({"slopes": torch.ones(8, dtype=torch.float16)}, device=cpu, sizes=SIZES)
    with pytest.raises(ValueError, match="contiguous"):
        v.bind({"slopes": torch.ones(16)[::2]}, device=cpu, sizes=SIZES)
    assert v.bind({"slopes": torch.ones(8)}, device=cpu, sizes=SIZES)["slopes"].shape == (8,)


def test_alibi_slopes_non_power_of_two():
    s8, s12 = ja.alibi_slopes(8), ja.alibi_slopes(12)
    assert torch.allclose(s8, torch.tensor([2.0 ** (-i) for i in range(1, 9)]))
    assert torch.equal(s12[:8], s8) and len(set(s12.tolist())) == 12
    for bad in ("8", 2.5, 4.0, None, True):  # raised deep inside, or (4.0) passed
        with pytest.raises(TypeError, match=re.escape(f"num_heads={bad!r}: expected an int")):
            ja.alibi_slopes(bad)
    with pytest.raises(ValueError, match="num_heads=0: expected an int >= 1"):
        ja.alibi_slopes(0)
    assert torch.equal(ja.alibi_slopes(np.int64(8)), s8)


def test_scalars_float32_cannot_hold_and_empty_tensors_are_rejected():
    """A runtime scalar must be a finite float32 (1e39 or inf became inf in the kernels and the
    output NaN); numpy numbers are numbers, a tensor is not."""
    cap = ja.scalar("cap")
    v = ja.Variant("cap", mask="causal", score_mod=lambda s, b, h, q, k: cap * ja.tanh(s / cap))
    cpu = torch.device("cpu")
    for bad in (float("nan"), float("inf"), -1e39, 10**400, np.float64(1e39)):
        with pytest.raises(ValueError, match=r"parameter 'cap' is .*; expected a finite number "
                                             r"that float32 holds"):
            v.bind({"cap": bad}, device=cpu, sizes=SIZES)
    for good in (3.0e38, np.float32(0.5), np.int64(30)):
        assert v.bind({"cap": good}, device=cpu, sizes=SIZES) == {"cap": float(good)}
    with pytest.raises(TypeError, match="parameter 'cap' must be a Python number, got bool"):
        v.bind({"cap": np.bool_(True)}, device=cpu, sizes=SIZES)
    # a tensor is refused as k_scale is, and as it is under torch.compile (on the GPU, .item()
    # here was a device sync per call)
    with pytest.raises(TypeError, match=r"parameter 'cap' must be a Python number, got Tensor "
                                        r"\(read a tensor once with .item\(\)"):
        v.bind({"cap": torch.tensor(2.0)}, device=cpu, sizes=SIZES)
    with pytest.raises(SpecError, match=r"soft_cap: cap=inf must be finite and > 0"):
        ja.soft_cap(float("inf"))
    # empty where a size it is declared over is 0 (a batch without keys): bound to a one-element
    # stand-in (the kernels may read a table where they hoist a query row's part); captured
    # tensors, whose sizes are fixed, may not be empty
    table = ja.tensor("table", ("kv_len",), "float32")
    w = ja.Variant("t", mask="causal", score_mod=lambda s, b, h, q, k: s + table[k])
    bound = w.bind({"table": torch.ones(0)}, device=torch.device("cpu"),
                   sizes={**SIZES, "kv_len": 0})
    assert bound["table"].shape == (1,)
    empty = torch.ones(0)
    c = ja.Variant("c", mask="causal", score_mod=lambda s, b, h, q, k: s + empty[k])
    with pytest.raises(ValueError, match=r"captured tensor 'empty \(score_captured0\)' has an "
                                         r"empty dimension"):
        c.bind({}, device=torch.device("cpu"), sizes={**SIZES, "kv_len": 0})


def test_huge_ints_are_shown_by_their_ends_and_digit_count():
    """A scalar parameter or window_left given a huge int printed every digit of it (401 for
    10**400); beyond 4300 digits str() refused it, and the error said so instead of naming the
    argument."""
    cap = ja.scalar("cap")
    v = ja.Variant("cap", mask="causal", score_mod=lambda s, b, h, q, k: cap * ja.tanh(s / cap))
    for big, digits in ((10**400, 401), (-(10**5000) - 7, 5001)):
        shown = rf"{'-' * (big < 0)}100000\.\.\.00000{7 if big < 0 else 0} \({digits} digits\)"
        with pytest.raises(ValueError, match=rf"^parameter 'cap' is {shown}; expected a finite "
                                             rf"number that float32 holds \(\|x\| <= 3.4e38\)$"):
            v.bind({"cap": big}, device=torch.device("cpu"), sizes=SIZES)
        with pytest.raises(SpecError, match=rf"^Variant window_left={shown}: expected None, -1 "
                                            rf"or an int in 0 .. 2\*\*31 - 1$"):
            ja.Variant("w", window_left=big)


def test_param_names_reserved_for_attention_keywords():
    """attention()'s and the wrappers' run() keywords cannot be parameter names (k_scale was
    taken as the fp8 scale, kv_cache / self clashed with run()'s arguments); a name or a
    variant name with a final newline is refused (a regex "$" matches before it)."""
    for name in ("sm_scale", "k_scale", "v_scale", "kv_cache", "self", "cap\n"):
        with pytest.raises(SpecError, match=re.escape(f"name {name!r} must be an identifier")):
            ja.scalar(name)
    with pytest.raises(SpecError, match="name 'k_scale' must be"):
        ja.tensor("k_scale", ("num_qo_heads",), "float32")
    with pytest.raises(SpecError, match=r"Variant name='causal\\n': expected"):
        ja.Variant("causal\n")


def test_a_mask_mod_without_a_mask_warns_that_it_is_anded_with_causal():
    """A FlexAttention port's mask_mod (a bidirectional document mask, say) was silently ANDed
    with the default causal mask: outputs differed by up to 4 with nothing said. The default
    stays causal; a mask_mod given without mask now warns, and mask= given silences it."""
    import warnings
    doc = ja.tensor("doc", ("kv_len",), "int32")

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    with pytest.warns(UserWarning, match="mask_mod is ANDed with the default mask='causal'"):
        v = ja.Variant("enc_doc", mask_mod=same_doc)
    assert v.mask == "causal"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ja.Variant("enc_doc", mask="none", mask_mod=same_doc).mask == "none"
        assert ja.Variant("dec_doc", mask="causal", mask_mod=same_doc).mask == "causal"
        assert ja.Variant("plain").mask == "causal"


def test_a_score_mod_without_a_mask_warns_that_it_is_causal():
    """A FlexAttention score_mod alone sees every key; ported without mask= it became causal
    in silence (3.5 off FlexAttention's output in a new user's trial)."""
    import warnings

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * ja.tanh(score / 20.0)
    with pytest.warns(UserWarning, match="score_mod without mask= is causal"):
        assert ja.Variant(score_mod=softcap).mask == "causal"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ja.Variant(score_mod=softcap, mask="none").mask == "none"
        assert ja.Variant(score_mod=softcap, mask="causal").mask == "causal"


def test_a_variant_needs_no_name():
    """FlexAttention has no name to give: Variant() without one was a TypeError. The default is
    the mods' function names, else "variant"; variants of one name never share a kernel."""
    def document(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    assert ja.Variant().name == "variant"
    assert ja.Variant(mask="causal", score_mod=lambda s, b, h, q, k: s * 2.0).name == "variant"
    assert ja.Variant(mask="none", score_mod=ja.soft_cap(30.0), mask_mod=document).name == \
        "softcap_document"
    assert ja.Variant(mask="causal", score_mod=ja.soft_cap(30.0)).key != ja.Variant(
        mask="causal", score_mod=ja.soft_cap(20.0)).key


def test_a_variant_made_by_replace_derives_its_name_again():
    """dataclasses.replace passes the name on: a Variant replaced from one whose name was
    derived kept the old mods' name ("softcap" for an ALiBi score_mod). A derived name follows
    the new mods, a given one stays, and the keys of different variants differ."""
    def alibi(s, b, h, q_idx, kv_idx):
        return s + 0.5 * (kv_idx - q_idx)

    def document(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    v = ja.Variant(mask="none", score_mod=ja.soft_cap(30.0))
    replaced = dataclasses.replace(v, score_mod=alibi)
    assert (v.name, replaced.name) == ("softcap", "alibi")
    assert replaced.key.startswith("alibi-none-") and replaced.key != v.key
    assert dataclasses.replace(v, mask_mod=document).name == "softcap_document"
    assert dataclasses.replace(v, score_mod=None).name == "variant"
    assert dataclasses.replace(copy.copy(v), score_mod=alibi).name == "alibi"
    same = dataclasses.replace(v, mask="causal")  # (the mask is in the key, not the name)
    assert same.name == "softcap" and same.key != v.key
    assert dataclasses.replace(v, name="mine", score_mod=alibi).name == "mine"
    given = ja.Variant("mine", mask="none", score_mod=ja.soft_cap(30.0))
    assert dataclasses.replace(given, score_mod=alibi).name == "mine"
    keys = {x.key for x in (v, replaced, given, dataclasses.replace(given, score_mod=alibi))}
    assert len(keys) == 4
