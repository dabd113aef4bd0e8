"""Attention-state merges: exact against attention over the union, empty states, sigmoid."""

import math

import pytest
import torch

import jitattn as ja

from helpers import make_batch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_merging_key_splits_equals_attention_over_all_keys(device, dtype):
    variant = ja.Variant("plain", mask="none")
    q, k, v, _, _ = make_batch([7], [90], 8, 2, 64, dtype, device, seed=3)
    full_o, full_lse = ja.attention(q, k, v, variant, return_lse=True)
    parts = [ja.attention(q, k[a:b], v[a:b], variant, return_lse=True)
             for a, b in ((0, 20), (20, 21), (21, 90))]
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    merged_o, merged_lse = ja.merge_states(o, lse)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(merged_o, full_o, **tol)
    torch.testing.assert_close(merged_lse, full_lse, atol=1e-4, rtol=1e-5)
    a_o, a_lse = ja.merge_state(parts[0][0], parts[0][1], parts[2][0], parts[2][1])
    a_o2, a_lse2 = ja.merge_state(a_o, a_lse, parts[1][0], parts[1][1])
    torch.testing.assert_close(a_o2, full_o, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_states_are_the_identity_and_never_nan(device):
    o = torch.randn(5, 4, 64, device=device)
    lse = torch.randn(5, 4, device=device)
    empty_o = torch.zeros_like(o)
    empty_lse = torch.full_like(lse, -math.inf)
    m_o, m_lse = ja.merge_state(o, lse, empty_o, empty_lse)
    torch.testing.assert_close(m_o, o)
    torch.testing.assert_close(m_lse, lse)
    e_o, e_lse = ja.merge_state(empty_o, empty_lse, empty_o, empty_lse)
    assert (e_o == 0).all() and (e_lse == -math.inf).all()
    ja.merge_state_in_place(o, lse, empty_o, empty_lse)
    assert not o.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_states_add(device):
    o = torch.randn(3, 6, 2, 128, device=device)
    lse = torch.randn(3, 6, 2, device=device)
    m_o, m_lse = ja.merge_states(o, lse, reduction="sigmoid")
    torch.testing.assert_close(m_o, o.sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m_lse, torch.logsumexp(lse, 0), atol=1e-5, rtol=1e-5)


def test_bad_states():
    o, lse = torch.randn(2, 4, 64), torch.randn(2, 4)
    with pytest.raises(TypeError, match="lse has dtype torch.float64"):
        ja.merge_states(o, lse.double())
    with pytest.raises(ValueError, match="without the last dimension"):
        ja.merge_states(o, lse[:, :3].contiguous())
    with pytest.raises(ValueError, match="states differ"):
        ja.merge_state(o[0], lse[0], o[0, :2], lse[0, :2])
