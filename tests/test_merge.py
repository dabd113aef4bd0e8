"""Attention-state merges: exact against attention over the union, empty states, sigmoid."""

import math

import numpy as np
import pytest
import torch

import jitattn as ja

from helpers import make_batch

# the CUDA cases run with `pytest -m gpu` (the default run deselects them)
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")])]


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
    # a merge of no states at all: the identity (it raised IndexError)
    none_o, none_lse = ja.merge_states(o[:0].unsqueeze(1).expand(0, 3, 4, 64).contiguous(),
                                       lse[:0].unsqueeze(1).expand(0, 3, 4).contiguous())
    assert none_o.shape == (3, 4, 64) and (none_o == 0).all() and (none_lse == -math.inf).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_lse_propagates_and_an_empty_states_o_is_not_read(device):
    o = torch.randn(2, 4, 64, device=device)
    lse = torch.randn(2, 4, device=device)
    lse[0, 1] = math.nan
    empty_o = torch.full_like(o, math.nan)  # garbage where lse = -inf: must not be read
    empty_lse = torch.full_like(lse, -math.inf)
    for m_o, m_lse in (ja.merge_state(o, lse, empty_o, empty_lse),
                       ja.merge_state(empty_o, empty_lse, o, lse),
                       ja.merge_states(torch.stack([empty_o, o, empty_o]),
                                       torch.stack([empty_lse, lse, empty_lse]))):
        # the max over a NaN and -inf was -inf: the NaN state vanished into an empty row
        assert m_lse[0, 1].isnan() and m_o[0, 1].isnan().all()
        keep = ~lse.isnan()
        torch.testing.assert_close(m_lse[keep], lse[keep])
        torch.testing.assert_close(m_o[keep], o[keep])


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_at_plus_inf_takes_the_row_and_two_make_it_nan_in_any_grouping(device):
    """exp(lse - max) with max = +inf was exp(inf - inf) = NaN for every state of the row; one
    state at +inf is the limit (its o), two or more have none (o NaN, whatever the grouping:
    an equal share depended on it)."""
    gen = torch.Generator().manual_seed(11)
    o = torch.randn(3, 4, 2, 64, generator=gen).to(device)
    lse = torch.randn(3, 4, 2, generator=gen).to(device)
    lse[1, 0, 0] = math.inf                            # one state at +inf: the row is its o
    lse[0, 1, 1] = lse[2, 1, 1] = math.inf             # two: no limit
    lse[0, 2, 0], lse[1, 2, 0] = math.inf, -math.inf   # +inf beside an empty state
    o[1, 2, 0] = math.nan                              # (the empty state's o is not read)
    m_o, m_lse = ja.merge_states(o, lse)
    torch.testing.assert_close(m_o[0, 0], o[1, 0, 0])
    torch.testing.assert_close(m_o[2, 0], o[0, 2, 0])
    assert m_o[1, 1].isnan().all() and (m_lse[[0, 1, 2], [0, 1, 0]] == math.inf).all()
    finite = torch.ones(4, 2, dtype=torch.bool)
    finite[0, 0] = finite[1, 1] = finite[2, 0] = False
    torch.testing.assert_close(m_lse[finite], torch.logsumexp(lse, 0)[finite])
    assert not m_o[finite].isnan().any() and not m_o[0, 0].isnan().any()
    # pairs in either grouping agree with the stacked merge
    for first, second, third in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        p_o, p_lse = ja.merge_state(o[first], lse[first], o[second], lse[second])
        p_o, p_lse = ja.merge_state(p_o, p_lse, o[third], lse[third])
        torch.testing.assert_close(p_o, m_o, equal_nan=True)
        torch.testing.assert_close(p_lse, m_lse)


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_states_add(device):
    o = torch.randn(3, 6, 2, 128, device=device)
    lse = torch.randn(3, 6, 2, device=device)
    m_o, m_lse = ja.merge_states(o, lse, reduction="sigmoid")
    torch.testing.assert_close(m_o, o.sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m_lse, torch.logsumexp(lse, 0), atol=1e-5, rtol=1e-5)


def test_bad_states():
    o, lse = torch.randn(2, 4, 64), torch.randn(2, 4)
    for bad in (None, [1.0], np.zeros(4)):  # (torch.empty_like's error named no argument)
        with pytest.raises(TypeError, match=r"merge_state \(o_a, lse_a\): o and lse must be "
                                            r"torch.Tensors"):
            ja.merge_state(bad, lse[0], o[1], lse[1])
    with pytest.raises(TypeError, match="lse has dtype torch.float64"):
        ja.merge_states(o, lse.double())
    with pytest.raises(ValueError, match="without the last dimension"):
        ja.merge_states(o, lse[:, :3].contiguous())
    with pytest.raises(ValueError, match="states differ"):
        ja.merge_state(o[0], lse[0], o[0, :2], lse[0, :2])
    # one row without a row dimension: the message named lse's shape, which was right
    with pytest.raises(ValueError, match=r"merge_state \(o_a, lse_a\): o must be \[rows\.\.\., "
                                         r"head_dim\] with at least one row dimension, got \(64,\)"):
        ja.merge_state(o[0, 0], lse[0, 0], o[1, 0], lse[1, 0])
    with pytest.raises(ValueError, match=r"o must be \[n, rows\.\.\., head_dim\] .* "
                                         r"o\[:, None\], lse\[:, None\]"):
        ja.merge_states(o[:, 0].contiguous(), lse[:, 0].contiguous())
    # one state of one row: merge_states named the pair merges' o[None], whose result then got
    # the hint above
    with pytest.raises(ValueError, match=r"^merge_states: o must be \[n, rows\.\.\., head_dim\] "
                                         r"with at least one row dimension, got \(64,\)$"):
        ja.merge_states(o[0, 0], lse[0, 0])


def check_in_place_pair_merge(device):
    """merge_state_in_place (pair mode: two tensors, no stacking) gives what merge_states of the
    stacked states gives, bit for bit, written over the first state; rows empty in one or both
    states included (o = 0, lse = -inf, no NaN). Softmax and sigmoid; head_dim 96 (the CUDA
    kernel's 8-byte loads), 7 and tensors one element into their buffers (one element at a
    time)."""
    gen = torch.Generator(device=device).manual_seed(11)
    for reduction, dtype, head_dim, offset in (
            ("softmax", torch.float16, 96, 0), ("softmax", torch.float32, 96, 0),
            ("sigmoid", torch.float16, 96, 0), ("softmax", torch.bfloat16, 7, 0),
            ("softmax", torch.float16, 96, 1), ("sigmoid", torch.float32, 7, 1)):
        o_a, o_b = (torch.randn(37 * 3 * head_dim + offset, generator=gen, device=device)
                    .to(dtype)[offset:].view(37, 3, head_dim) for _ in range(2))
        lse_a, lse_b = (torch.randn(37, 3, generator=gen, device=device) * 4
                        for _ in range(2))
        lse_a[5], lse_b[9] = -math.inf, -math.inf
        lse_a[20, 1] = lse_b[20, 1] = -math.inf
        o_a[5], o_b[9], o_a[20, 1], o_b[20, 1] = 0, 0, 0, 0
        want_o, want_lse = ja.merge_states(torch.stack([o_a, o_b]),
                                           torch.stack([lse_a, lse_b]), reduction=reduction)
        pair_o, pair_lse = ja.merge_state(o_a, lse_a, o_b, lse_b, reduction=reduction)
        ja.merge_state_in_place(o_a, lse_a, o_b, lse_b, reduction=reduction)
        for got_o, got_lse in ((pair_o, pair_lse), (o_a, lse_a)):
            assert torch.equal(got_o, want_o) and torch.equal(got_lse, want_lse)
        assert not o_a.isnan().any() and (o_a[20, 1] == 0).all()
        assert lse_a[20, 1] == -math.inf


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_pair_merge_equals_stacked_merge(device):
    check_in_place_pair_merge(device)


def test_pair_merge_errors_name_the_callers_arguments():
    o, lse = torch.randn(4, 2, 64), torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"merge_state_in_place \(o_other, lse_other\): lse has"):
        ja.merge_state_in_place(o, lse, o.clone(), lse.half())
    with pytest.raises(ValueError, match="merge_state: states differ: o_a, lse_a"):
        ja.merge_state(o, lse, o[:2], lse[:2])


def test_in_place_merge_rejects_overlapping_states():
    o, lse = torch.randn(6, 2, 64), torch.randn(6, 2)
    with pytest.raises(ValueError, match="o_other overlaps"):
        ja.merge_state_in_place(o[:3], lse[:3], o[1:4], lse[3:])
    with pytest.raises(ValueError, match="lse_other overlaps"):
        ja.merge_state_in_place(o[:3], lse[:3], o[3:], lse[2:5])
    ja.merge_state_in_place(o[:3], lse[:3], o[3:], lse[3:])  # disjoint halves of one buffer
    # across o and lse (were accepted: an lse_other inside o's rows gave o off by up to 2)
    buf = torch.randn(3 * 2 * 64 + 3 * 2)
    o_in, lse_tail = buf[:3 * 2 * 64].view(3, 2, 64), buf[3 * 2 * 64:].view(3, 2)
    for args, text in (((o_in, lse[:3], o[3:], buf[64:70].view(3, 2)), "lse_other overlaps o"),
                       ((o[:3], buf[:6].view(3, 2), o_in, lse[3:]), "o_other overlaps lse"),
                       ((o_in, buf[6:12].view(3, 2), o[3:], lse[3:]), "o overlaps lse")):
        with pytest.raises(ValueError, match=text):
            ja.merge_state_in_place(*args)
    ja.merge_state_in_place(o_in, lse_tail, o[3:], lse[3:])  # o and lse side by side


def test_pair_merges_of_head_dim_0_merge_the_lse():
    """An empty o_b has a null address, which the merge kernel's pair mode read as no second
    state: every lse came back -inf (merge_states was right)."""
    gen = torch.Generator().manual_seed(3)
    la, lb = torch.randn(4, 2, generator=gen), torch.randn(4, 2, generator=gen)
    lb[0, 0] = la[0, 0] = float("-inf")
    empty = torch.zeros(4, 2, 0).half()
    want = torch.logaddexp(la, lb)
    torch.testing.assert_close(ja.merge_state(empty, la, empty.clone(), lb)[1], want)
    lse = la.clone()
    ja.merge_state_in_place(empty, lse, empty.clone(), lb)
    torch.testing.assert_close(lse, want)
    torch.testing.assert_close(ja.merge_states(torch.stack([empty, empty]),
                                               torch.stack([la, lb]))[1], want)
