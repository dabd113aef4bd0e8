"""Prefix discovery from token ids: which requests of a batch share a prefix, and how long it is.

Prefixes are found at block (page) granularity, so that the shared part can be stored once and
referenced by every request's page table. Each full block is named by a chained hash of its
tokens and the hash of the block before it (vLLM's prefix caching), so equal hashes mean equal
prefixes, and a radix trie over the hash chains (SGLang's RadixAttention) gives, for every set
of requests, the longest block prefix they all share. See docs/sources.md, scenarios 1 and 2.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .args import int_arg


def _token_array(tokens, name: str = "tokens") -> np.ndarray:
    """One request's token ids as a 1-D int64 array: a sequence (or iterator) of ints, or a 1-D
    integer numpy array or torch tensor (read at once, not element by element). Raises
    TypeError / ValueError naming ``name`` and the first bad id for anything else (floats,
    bools, strings, sets and mappings, other ranks, ids beyond int64), which would otherwise be
    truncated, reordered or flattened into a different request."""
    listed = None  # the ids as a Python list, when given as one (or as another iterable)
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or \
                tokens.dtype == torch.bool:
            raise TypeError(f"{name} is a {tokens.dtype} tensor; expected integer token ids")
        try:
            tokens = tokens.detach().cpu().numpy()
        except (NotImplementedError, RuntimeError, TypeError) as e:  # meta, sparse, ...
            raise ValueError(f"{name} is a tensor ({tokens.layout} on {tokens.device}) that "
                             f"cannot be read as token ids: {e}") from None
    elif isinstance(tokens, (str, bytes, Set, Mapping)):
        raise TypeError(f"{name} is a {type(tokens).__name__}; expected a sequence of token ids "
                        f"(a tokenizer's output), in order")
    elif not isinstance(tokens, np.ndarray):
        try:
            listed = list(tokens)  # (an iterator is read once)
        except TypeError:
            hint = " (requests is a list of requests: one request's ids are [ids])" \
                if isinstance(tokens, (int, np.integer)) else ""
            raise TypeError(f"{name} is {tokens!r}, of type {type(tokens).__name__}; expected a "
                            f"sequence of token ids{hint}") from None
        if not {bool, np.bool_}.isdisjoint(map(type, listed)):
            bad = next(t for t in listed if isinstance(t, (bool, np.bool_)))
            raise TypeError(f"{name} holds the bool {bad!r}; expected integer token ids")
        tokens = listed
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError) as e:  # ragged nesting
        raise ValueError(f"{name}: expected a 1-D sequence of token ids ({e})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} has shape {arr.shape}; expected a 1-D sequence of token ids")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "i":
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind == "u" and listed is None:
        too_big = arr > np.iinfo(np.int64).max
        if not too_big.any():
            return arr.astype(np.int64)
        bad = arr[too_big.argmax()].item()
    else:  # (a list mixing ids beyond int64 or unsigned and negative ones is float or object)
        def fits(t):
            return isinstance(t, (int, np.integer)) and not isinstance(t, bool) and \
                -2**63 <= t < 2**63
        items = listed if listed is not None else arr.tolist()
        bad = next((t for t in items if not fits(t)), fits)
        if bad is fits:  # (no bad id: ints that fit, e.g. an object array of them)
            return np.array(items, dtype=np.int64)
    raise TypeError(f"{name} holds {bad!r} ({arr.dtype} values); expected integer token ids "
                    f"that fit int64")


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained sha256 of every full block: h_i = H(h_{i-1} || tokens[i*B:(i+1)*B]).
    A trailing partial block has no hash (it cannot be shared as a whole page). tokens: see
    _token_array. Raises TypeError / ValueError for bad tokens or block_size."""
    block_size = int_arg("block_size", block_size)
    arr = _token_array(tokens)
    out, prev = [], b""
    for i in range(len(arr) // block_size):
        prev = hashlib.sha256(prev + arr[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


@dataclass
class _Node:
    children: dict = field(default_factory=dict)
    members: list = field(default_factory=list)  # request indices whose chain passes here


@dataclass(frozen=True)
class PrefixGroup:
    """Requests ``members`` share their first ``prefix_len`` tokens (a multiple of the block
    size); prefix_len 0 means the group's single request shares nothing."""

    prefix_len: int
    members: tuple


# PrefixTrie.groups' exact partition where its dynamic programme's merges take at most this
# many table cells (len(a) * len(b) per merge, bounded before it runs: _merge_cells). Its time
# and memory grow as the square of the batch at worst: 20000 requests in pairs, about 3e8
# cells, took 3 s and 0.4 GB; this budget covers 6600 requests in pairs and most batches of
# many more, beyond it one choice per branch point.
EXACT_MAX_CELLS = 1 << 25


class PrefixTrie:
    """A radix trie over block-hash chains.

    insert(tokens) records a request; match(tokens) returns how many leading tokens (whole
    blocks) are already present, the cross-batch prefix-cache lookup.
    """

    def __init__(self, block_size: int):
        self.block_size = int_arg("block_size", block_size)
        self.root = _Node()
        self._count = 0

    def insert(self, tokens: Sequence[int]) -> int:
        """Add a request; returns its index."""
        index = self._count
        self._count += 1
        node = self.root
        node.members.append(index)
        for h in block_hashes(tokens, self.block_size):
            node = node.children.setdefault(h, _Node())
            node.members.append(index)
        return index

    def match(self, tokens: Sequence[int]) -> int:
        """Number of leading tokens of ``tokens`` found in the trie (a multiple of the block
        size), up to all of them: a prefix cache that reuses that many tokens' K / V still has
        to prefill at least the last token (for its output), as find_shared_prefixes, which
        never shares a request's last token, does."""
        node, matched = self.root, 0
        for h in block_hashes(tokens, self.block_size):
            node = node.children.get(h)
            if node is None:
                break
            matched += self.block_size
        return matched

    def groups(self, min_members: int = 2) -> list[PrefixGroup]:
        """Partition the inserted requests into groups that share a block prefix, saving as
        many prefix tokens as any partition can (saving = prefix_len * (members - 1), summed
        over the groups) while its dynamic programme stays within EXACT_MAX_CELLS, and nearly
        as many beyond (below). Groups smaller than ``min_members`` get prefix_len 0.
        Deterministic: groups ordered by their first member. min_members: an int >= 2
        (TypeError / ValueError otherwise). Iterative, so deep tries are fine.

        Algorithm: a dynamic programme over the trie's branch points, bottom up (a tree
        knapsack): best[v][k] is the most saved by groups below v when k of v's requests are
        left ungrouped for a group nearer the root; a group at depth d of j requests saves
        d * (j - 1). Its time and memory grow as requests^2 at worst (many branches of two or
        more requests under one point), so past its budget of table cells it takes one choice
        per branch point instead, bottom up: keep its requests together at its depth, or let
        the branches go deeper apart and group the requests they leave alone at its depth.
        That choice can miss the best partition: at block size 1, [[0,1,0,1,1,0], [0,1,0,0],
        [0,1,1,0,0,0], [0,0,0,0], [0,1,0,1]] is best split as {0,1,4} sharing 3 tokens and
        {2,3} sharing 1, 7 saved, where it gives {0,1,2,4} at 2: 6."""
        min_members = int_arg("min_members", min_members, minimum=2)
        top = self._walk(self.root)
        # branch points, parents before children, with their depths and branch points below
        order, below, depth = [], {}, {id(top): self._depth(self.root, top)}
        stack = [top]
        while stack:
            node = stack.pop()
            order.append(node)
            below[id(node)] = [self._walk(c) for c in node.children.values()]
            for child, walked in zip(node.children.values(), below[id(node)]):
                depth[id(walked)] = depth[id(node)] + 1 + self._depth(child, walked)
            stack += below[id(node)]
        if _merge_cells(order, below) > EXACT_MAX_CELLS:
            return self._groups_by_branch(min_members)
        plans = {}
        for node in reversed(order):  # children before parents
            plans[id(node)] = _BranchPlan(node, [plans[id(c)] for c in below[id(node)]],
                                          depth[id(node)] * self.block_size, min_members)
        # top down: how many requests each branch point passes up, then who they are
        top_plan = plans[id(top)]
        need = {id(top): top_plan.lo + int(np.argmax(top_plan.best))}  # (the first of equals)
        for node in order:
            plan = plans[id(node)]
            for child, count in zip(plan.children, plan.split(need[id(node)])):
                need[id(child.node)] = count
        passed, groups = {}, []
        for node in reversed(order):
            plan = plans[id(node)]
            pool = sorted(plan.ending + [m for c in plan.children for m in passed[id(c.node)]])
            size = len(pool) - need[id(node)]
            if size:
                groups.append(PrefixGroup(plan.prefix_len, tuple(pool[:size])))
            passed[id(node)] = pool[size:]
        groups += [PrefixGroup(0, (m,)) for m in passed[id(top)]]
        return sorted(groups, key=lambda g: g.members[0])

    def _walk(self, node: _Node) -> _Node:
        """The branch point at the end of node's chain of single children that every one of
        node's requests passes through."""
        while len(node.children) == 1:
            (nxt,) = node.children.values()
            if len(nxt.members) != len(node.members):
                break
            node = nxt
        return node

    def _groups_by_branch(self, min_members: int) -> list[PrefixGroup]:
        """groups() for large batches: one choice per branch point, bottom up."""
        best = {}  # id(node) -> (saving, groups)
        stack = [(self.root, 0, False)]
        while stack:
            node, depth, expanded = stack.pop()
            below = self._walk(node)
            depth, node = depth + self._depth(node, below), below
            if not expanded and node.children:
                stack.append((node, depth, True))
                stack += [(child, depth + 1, False) for child in node.children.values()]
                continue
            best[id(node)] = self._choose(node, depth, min_members, best)
        return sorted(best[id(self._walk(self.root))][1], key=lambda g: g.members[0])

    def _choose(self, node: _Node, depth: int, min_members: int, best: dict):
        """At one branch point: its requests together at its depth, or the branches' choices
        with the requests they leave alone together here, whichever saves more."""
        size = depth * self.block_size

        def together(members):
            if len(members) >= min_members and depth > 0:
                return size * (len(members) - 1), [PrefixGroup(size, tuple(members))]
            return 0, [PrefixGroup(0, (m,)) for m in members]
        stay = together(node.members)
        if not node.children:
            return stay
        saving, groups, alone = 0, [], []
        for child in node.children.values():
            s, g = best[id(self._walk(child))]
            saving += s
            for group in g:
                (alone.extend(group.members) if group.prefix_len == 0 else groups.append(group))
        covered = {m for c in node.children.values() for m in c.members}
        alone += [m for m in node.members if m not in covered]
        s, g = together(sorted(alone))
        split = (saving + s, groups + g)
        return stay if stay[0] >= split[0] else split

    @staticmethod
    def _depth(node: _Node, below: _Node) -> int:
        steps = 0
        while node is not below:
            (node,) = node.children.values()
            steps += 1
        return steps


_NOTHING_SAVED = np.zeros(1)  # (never written: the merges make new arrays)


class _BranchPlan:
    """PrefixTrie.groups' table at one branch point (prefix_len tokens deep): best[i], the most
    prefix tokens saved by the groups in its subtree when lo + i of its requests are passed up
    ungrouped (-inf where impossible; outside best, impossible too), and how each entry was
    reached. A child's table is dropped once merged (the memory of a wide trie)."""

    def __init__(self, node: _Node, children: list, prefix_len: int, min_members: int):
        self.node, self.children, self.prefix_len = node, children, prefix_len
        covered = {m for c in node.children.values() for m in c.members}
        self.ending = [m for m in node.members if m not in covered]  # requests that end here
        self._merges = []  # per child: (took, its lo, base after it); see split()
        if not children and (len(self.ending) < min_members or prefix_len == 0):
            # (most leaves: a lone request, which can only be passed up)
            self.lo, self.best, self._grouped = len(self.ending), _NOTHING_SAVED, (
                len(self.ending),)
            return
        # pool[i]: best saving below when base + i requests reach this point
        base, pool = len(self.ending), _NOTHING_SAVED
        for child in children:
            pool, took = _max_plus(pool, child.best)
            base += child.lo
            self._merges.append((took, child.lo, base))
            child.best = None
        # best[k]: pass all p = k up, or group p - k >= min_members of them here, which saves
        # prefix_len * (p - k - 1): the largest such p of the most gain
        n = base + len(pool)  # (absolute: k and p run over 0 .. n - 1)
        best = np.full(n, -np.inf)
        best[base:] = pool
        grouped = np.arange(n)
        if prefix_len > 0 and n > min_members:
            gain = (best + prefix_len * np.arange(n))[::-1]  # reversed: p = n - 1 - r
            most = np.maximum.accumulate(gain)  # most[r]: best gain over p >= n - 1 - r
            new = gain > np.concatenate(([-np.inf], most[:-1]))
            where = np.maximum.accumulate(np.where(new, np.arange(n), 0))
            k = np.arange(n - min_members)
            r = n - 1 - (k + min_members)
            value = most[r] - prefix_len * (k + 1)
            better = value > best[k]  # (equal: pass up, to stay together higher up)
            best[k[better]] = value[better]
            grouped[k[better]] = n - 1 - where[r[better]]
        finite = np.flatnonzero(best > -np.inf)
        self.lo, hi = int(finite[0]), int(finite[-1]) + 1
        self.best, self._grouped = best[self.lo:hi], grouped[self.lo:hi].astype(np.int32)

    def split(self, k: int) -> list[int]:
        """How many requests each child passes up when this point passes up k."""
        p, counts = int(self._grouped[k - self.lo]), []
        for took, lo, base in reversed(self._merges):
            t = p - base  # (the pool's index after this child's merge)
            j = t if took is None else 0 if isinstance(took, int) else int(took[t])
            counts.append(lo + j)
            p -= counts[-1]
        return counts[::-1]


def _merge_cells(order: list, below: dict) -> int:
    """An upper bound of the table cells PrefixTrie.groups' merges take: at each branch point,
    per child, the pool (at most 1 + the requests of the children merged before) times the
    child's table (at most its requests + 1)."""
    cells = 0
    for node in order:
        pool = 1
        for child in below[id(node)]:
            cells += pool * (len(child.members) + 1)
            pool += len(child.members)
    return cells


def _max_plus(a: np.ndarray, b: np.ndarray):
    """(c, took): c[t] = max over i + j = t of a[i] + b[j], and took the j of one such
    maximum (the same one every time) for each t: None where j = t (a has one entry), 0 where
    b has one entry, else an array."""
    if len(a) == 1 or len(b) == 1:
        return a[0] + b if len(a) == 1 else a + b[0], None if len(a) == 1 else 0
    c, took = np.full(len(a) + len(b) - 1, -np.inf), np.zeros(len(a) + len(b) - 1, np.int32)
    if len(a) <= len(b):
        for i in range(len(a)):
            cand = a[i] + b
            better = cand > c[i:i + len(b)]
            c[i:i + len(b)][better] = cand[better]
            took[i:i + len(b)][better] = np.arange(len(b))[better]
    else:
        for j in range(len(b)):
            cand = a + b[j]
            better = cand > c[j:j + len(a)]
            c[j:j + len(a)][better] = cand[better]
            took[j:j + len(a)][better] = j
    return c, took


def find_shared_prefixes(requests: Sequence[Sequence[int]], block_size: int,
                         min_members: int = 2) -> list[PrefixGroup]:
    """Group a batch's requests by their longest shared block prefix.

    requests: one entry per request, its token ids as a list / tuple / iterable of ints or a
    1-D integer numpy array or torch tensor. block_size: tokens per block (the KV cache's page
    size), an int >= 1. Only whole blocks are shared, and a request never shares its last token
    (the prefix must leave every request at least one token of its own to prefill), so
    prefix_len <= min(len) - 1 rounded down to a block. Returns PrefixGroups covering every
    request once (see PrefixTrie.groups; min_members: an int >= 2). Raises TypeError /
    ValueError naming requests[i], block_size or min_members for anything else (floats, bools,
    text, 2-D requests, ids beyond int64).
    """
    trie = PrefixTrie(block_size)
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable) or \
            getattr(requests, "ndim", None) == 0:  # (a 0-d tensor is Iterable, not iterable)
        raise TypeError(f"requests={requests!r}: expected one sequence of token ids per "
                        f"request")  # (None raised "'NoneType' object is not iterable")
    if isinstance(requests, (Set, Mapping)):  # (groups name requests by position)
        raise TypeError(f"requests is a {type(requests).__name__}; expected the requests in "
                        f"order (a list or tuple): the groups name them by their index")
    for i, tokens in enumerate(requests):
        trie.insert(_token_array(tokens, f"requests[{i}]")[:-1])  # the last is never shared
    return trie.groups(min_members)


def multi_item_metadata(prefix_len: int, item_lens: Sequence[int]):
    """Metadata of the multi-item mask (docs/sources.md, scheme 5a) for one request made of a
    prefix and items: (prefix_len, token_pos_in_items, max_item_len), token positions 1-based
    inside each item. The seed's example: prefix 96, items [4, 4] ->
    (96, [1, 2, 3, 4, 1, 2, 3, 4], 4). prefix_len: an int >= 0; item_lens: ints >= 1 (any
    iterable). Raises TypeError / ValueError naming the argument."""
    prefix_len = int_arg("prefix_len", prefix_len, minimum=0)
    if isinstance(item_lens, (str, bytes)) or not isinstance(item_lens, Iterable):
        raise TypeError(f"item_lens={item_lens!r}: expected a sequence of ints >= 1")
    item_lens = [int_arg(f"item_lens[{i}]", n) for i, n in enumerate(item_lens)]
    positions = [i + 1 for n in item_lens for i in range(n)]
    return prefix_len, positions, max(item_lens, default=0)
