"""Prefix discovery (block hashes, radix trie) and multi-item metadata."""

import random

import numpy as np
import pytest

from jitattn.prefix import (PrefixGroup, PrefixTrie, block_hashes, find_shared_prefixes,
                            multi_item_metadata)


def test_block_hashes_are_chained():
    a = list(range(40))
    b = [999] + list(range(1, 40))  # differs in the first block only
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 2  # the last 8 tokens are a partial block
    assert ha[0] != hb[0] and ha[1] != hb[1]  # the change propagates down the chain
    assert block_hashes(a[:32] + [5] * 8, 16) == ha


def test_groups_find_the_longest_common_block_prefix():
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(100)]       # 6 full blocks of 16 + 4
    fewshot = [rng.randrange(32000) for _ in range(50)]
    reqs = [system + [1, 2, 3], system + fewshot + [4], system + fewshot + [5, 6],
            [7] * 40, system[:20] + [8] * 30]
    groups = find_shared_prefixes(reqs, 16)
    # requests 0-2 share the system prompt's 6 whole blocks (1-2 share more, but keeping all
    # three together saves more); request 4 shares only one block with them, so it stays alone
    assert groups == [PrefixGroup(96, (0, 1, 2)), PrefixGroup(0, (3,)), PrefixGroup(0, (4,))]


@pytest.mark.parametrize("seed", range(5))
def test_each_group_gets_its_longest_common_prefix(seed):
    rng = random.Random(seed)
    block = rng.choice([1, 3, 16])
    bases = [[rng.randrange(50) for _ in range(rng.randrange(0, 80))] for _ in range(3)]
    reqs = [rng.choice(bases) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            for _ in range(12)]
    for g in find_shared_prefixes(reqs, block):
        if len(g.members) < 2:
            continue
        members = [reqs[m] for m in g.members]
        common = 0
        while all(len(r) > common for r in members) and len({r[common] for r in members}) == 1:
            common += 1
        shortest = min(map(len, members))
        expect = min(common // block * block, (shortest - 1) // block * block)
        assert g.prefix_len == expect


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        yield [[first]] + p
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1:]


def _shared(reqs, block):
    """The longest block prefix the requests all share, each keeping its last token."""
    common = 0
    while all(len(r) > common for r in reqs) and len({r[common] for r in reqs}) == 1:
        common += 1
    return min(common // block * block, (min(map(len, reqs)) - 1) // block * block)


def test_groups_save_as_much_as_the_best_partition():
    """The grouping was chosen once per trie branch point, bottom up, and could miss the best
    partition (the first case: 6 tokens saved where 7 can be); every partition of small random
    batches is tried here."""
    reqs = [[0, 1, 0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]]
    assert find_shared_prefixes(reqs, 1) == [PrefixGroup(3, (0, 1, 4)), PrefixGroup(1, (2, 3))]
    rng = random.Random(3)
    for _ in range(150):
        n, block, least = rng.randrange(1, 7), rng.choice([1, 2]), rng.choice([2, 3])
        reqs = [[rng.randrange(2) for _ in range(rng.randrange(0, 8))] for _ in range(n)]
        groups = find_shared_prefixes(reqs, block, min_members=least)
        assert sorted(m for g in groups for m in g.members) == list(range(n))
        for g in groups:
            assert g.prefix_len == 0 and len(g.members) == 1 or \
                len(g.members) >= least and g.prefix_len == _shared([reqs[m] for m in g.members],
                                                                    block) > 0
        best = max(sum(_shared([reqs[m] for m in part], block) * (len(part) - 1)
                       for part in p if len(part) >= least)
                   for p in _partitions(list(range(n))))
        assert sum(g.prefix_len * (len(g.members) - 1) for g in groups) == best, (reqs, block)


def test_batches_beyond_the_exact_budget_choose_per_branch_point(monkeypatch):
    """Past EXACT_MAX_CELLS the dynamic programme (time and memory growing as the square
    of the batch: 20000 requests in pairs took 3 s and 0.4 GB) gives way to one choice per
    branch point: the pairs here keep their longer prefix, as the exact partition would. A
    batch of 4097 requests under 30 prompts stays exact (a limit of 4096 requests had taken
    the choice per branch point, 9% fewer tokens saved)."""
    from jitattn import prefix
    n = 7000  # in pairs: about 3.7e7 cells
    groups = find_shared_prefixes([[0, i // 2, 7] for i in range(n)], 1)
    assert groups == [PrefixGroup(2, (i, i + 1)) for i in range(0, n, 2)]
    rng = random.Random(1)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(0, 70))] for _ in range(30)]
    reqs = [rng.choice(prompts)[:rng.randint(0, 70)] +
            [rng.randrange(50) for _ in range(rng.randint(0, 30))] for _ in range(4097)]

    def saved(groups):
        return sum(g.prefix_len * (len(g.members) - 1) for g in groups)
    exact = saved(find_shared_prefixes(reqs, 1))
    monkeypatch.setattr(prefix, "EXACT_MAX_CELLS", 0)
    assert saved(find_shared_prefixes(reqs, 1)) < exact
    reqs = [[0, 1, 0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]]
    trie = PrefixTrie(1)
    for r in reqs:
        trie.insert(r[:-1])
    assert trie._groups_by_branch(2) == [PrefixGroup(2, (0, 1, 2, 4)), PrefixGroup(0, (3,))]


def test_trie_match_for_cross_batch_reuse():
    trie = PrefixTrie(4)
    trie.insert(list(range(10)))
    assert trie.match(list(range(10))) == 8
    assert trie.match(list(range(6)) + [99, 99, 99]) == 4
    assert trie.match([5, 5, 5, 5]) == 0


def test_multi_item_metadata_matches_the_seed_example():
    assert multi_item_metadata(96, [4, 4]) == (96, [1, 2, 3, 4, 1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match=r"item_lens\[1\]=0: expected an int >= 1"):
        multi_item_metadata(96, [4, 0])
    # a generator was used up by the check (items vanished); a float or bool prefix came back
    assert multi_item_metadata(np.int64(3), (n for n in [2, 3])) == (3, [1, 2, 1, 2, 3], 3)
    for bad, text in ((2.5, r"prefix_len=2.5"), (True, r"prefix_len=True")):
        with pytest.raises(TypeError, match=text):
            multi_item_metadata(bad, [1])


def test_min_members_is_an_int_of_at_least_two():
    """min_members was not checked: 1 gave a lone request a shared prefix, a string a bare
    TypeError from inside the trie."""
    requests = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9]]
    for bad, error in ((1, ValueError), (0, ValueError), (1.5, TypeError), ("2", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="min_members="):
            find_shared_prefixes(requests, 1, min_members=bad)
    assert find_shared_prefixes(requests, 1, min_members=np.int64(3)) == \
        find_shared_prefixes(requests, 1, min_members=3)


def test_long_prompts_do_not_recurse_per_block():
    shared = list(range(20000))
    groups = find_shared_prefixes([shared + [1], shared + [2], shared + [2, 3]], 1)
    assert groups == [PrefixGroup(20000, (0, 1, 2))]


def test_members_left_by_deeper_branches_still_share_the_shallow_prefix():
    deep = list(range(200))
    reqs = [deep + [i] for i in range(10)] + [deep[:100] + [1000 + i] * 5 for i in range(5)]
    groups = find_shared_prefixes(reqs, 10)
    assert PrefixGroup(200, tuple(range(10))) in groups
    assert PrefixGroup(100, tuple(range(10, 15))) in groups


def test_exact_block_multiples_and_many_branches():
    # 3 duplicate pairs of exactly 2 blocks, all sharing block 0: only block 0 is shareable
    # (each request keeps its last token), so all six go together
    b0 = [1, 2, 3, 4]
    reqs = [b0 + [10 + p] * 4 for p in range(3) for _ in range(2)]
    assert find_shared_prefixes(reqs, 4) == [PrefixGroup(4, tuple(range(6)))]
    staircase = [list(range(4 * (i + 1) + 1)) for i in range(1500)]  # each one block longer
    groups = find_shared_prefixes(staircase, 4)
    assert sorted(m for g in groups for m in g.members) == list(range(1500))


def test_token_ids_are_checked_not_truncated():
    """Float ids were truncated (1.5 and 1 matched), a 2-D request flattened, text split into
    characters; each is refused by name and its first bad id. Integer tensors, arrays and
    generators give the list's groups."""
    import numpy as np
    import torch
    same = list(range(40))
    for bad, error, text in (([1.5] * 40, TypeError, r"requests\[0\] holds 1.5 \(float64 values\)"),
                             (torch.arange(40).view(2, 20), ValueError,
                              r"requests\[0\] has shape \(2, 20\); expected a 1-D"),
                             ("some text", TypeError, r"requests\[0\] is a str"),
                             ([1] + [2**64] * 20, TypeError, r"requests\[0\] holds 18446744073709551616 "
                                                             r"\(object values\)"),
                             ([1, None], TypeError, r"holds None \(object values\)"),
                             ([1, True, 3] * 10, TypeError, "requests\\[0\\] holds the bool True"),
                             (torch.ones(40, dtype=torch.bool), TypeError,
                              r"requests\[0\] is a torch.bool tensor"),
                             (np.array([1, 2**63 + 5], dtype=np.uint64), TypeError,
                              r"holds 9223372036854775813 \(uint64 values\); expected integer "
                              r"token ids that fit int64"),
                             ([1, 2**63], TypeError, "holds 9223372036854775808 "),
                             ({1, 2, 3}, TypeError, "is a set; expected a sequence"),
                             (torch.empty(40, dtype=torch.int64, device="meta"), ValueError,
                              r"requests\[0\] is a tensor \(torch.strided on meta\) that cannot"),
                             (5, TypeError, r"requests\[0\] is 5, of type int; expected a "
                                            r"sequence of token ids \(requests is a list of "
                                            r"requests")):
        with pytest.raises(error, match=text):
            find_shared_prefixes([bad, same], 16)
    with pytest.raises(TypeError, match=r"requests=tensor\(1\): expected one sequence of "
                                        r"token ids per request"):  # (torch's own error was
        find_shared_prefixes(torch.tensor(1), 16)                   # a 0-d tensor's iteration)
    want = find_shared_prefixes([same, same + [1], same[:20]], 16)
    assert want == [PrefixGroup(16, (0, 1, 2))]  # (a tie with {0, 1} at 32: together)
    for convert in (np.array, torch.tensor, lambda x: torch.tensor(x, dtype=torch.int32),
                    lambda x: (t for t in x), lambda x: np.array(x, dtype=object),
                    lambda x: [np.uint64(t) for t in x]):
        assert find_shared_prefixes([convert(same), convert(same + [1]), convert(same[:20])],
                                    16) == want
    assert find_shared_prefixes([[], same], 16) == [PrefixGroup(0, (0,)), PrefixGroup(0, (1,))]
    for block_size in (16.0, "16", True):
        with pytest.raises(TypeError, match=f"block_size={block_size!r}: expected an int >= 1"):
            find_shared_prefixes([same, same], block_size)
    with pytest.raises(ValueError, match="block_size=0: expected an int >= 1"):
        PrefixTrie(0)
    for bad in (None, 5, "ab"):  # ("'NoneType' object is not iterable")
        with pytest.raises(TypeError, match=f"requests={bad!r}: expected one sequence"):
            find_shared_prefixes(bad, 16)
        with pytest.raises(TypeError, match=f"item_lens={bad!r}: expected a sequence"):
            multi_item_metadata(3, bad)
