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
        size)."""
        node, matched = self.root, 0
        for h in block_hashes(tokens, self.block_size):
            node = node.children.get(h)
            if node is None:
                break
            matched += self.block_size
        return matched

    def groups(self, min_members: int = 2) -> list[PrefixGroup]:
        """Partition the inserted requests into groups that share a block prefix, choosing at
        every branch of the trie what saves more prefix tokens (saving = prefix_len *
        (members - 1)): keep the members together at this depth, or let the branches go
        deeper apart, in which case the members the branches leave alone are grouped at this
        depth. Groups smaller than ``min_members`` get prefix_len 0. Deterministic: groups
        ordered by their first member. Iterative, so deep tries of many branches are fine.
        min_members: an int >= 2 (TypeError / ValueError otherwise).
        The choice is made once per branch point, bottom up: every group's prefix is one its
        members share, but a batch can have a partition that saves more (find_shared_prefixes
        of [[0,1,0,1,1,0], [0,1,0,0], [0,1,1,0,0,0], [0,0,0,0], [0,1,0,1]] at block_size 1
        gives {0,1,2,4} at 2 tokens and {3}: 6 saved, where {0,1,4} at 3 and {2,3} at 1 save
        7)."""
        min_members = int_arg("min_members", min_members, minimum=2)
        # branch points (chains of single children are walked, not stacked), post-order
        best = {}  # id(node) -> (saving, groups)
        stack = [(self.root, 0, False)]
        while stack:
            node, depth, expanded = stack.pop()
            while len(node.children) == 1:
                (nxt,) = node.children.values()
                if len(nxt.members) != len(node.members):
                    break
                node, depth = nxt, depth + 1
            if not expanded and node.children:
                stack.append((node, depth, True))
                stack += [(child, depth + 1, False) for child in node.children.values()]
                continue
            best[id(node)] = self._choose(node, depth, min_members, best)
        return sorted(best[id(self._walk(self.root))][1], key=lambda g: g.members[0])

    def _walk(self, node: _Node) -> _Node:
        while len(node.children) == 1:
            (nxt,) = node.children.values()
            if len(nxt.members) != len(node.members):
                break
            node = nxt
        return node

    def _choose(self, node: _Node, depth: int, min_members: int, best: dict):
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
