"""Prefix caches of the simulated fleet: P's prefix cache, MD's DRC, a colocated worker's.

A conversation is one token stream (pdd.plan.workload), so its block i is named by
(conversation, i). Two implementations of one small interface:

``RadixPrefixCache`` (exact): pdd's own ``pdd.cache.radix.RadixIndex``, the index MainDecode's
DRC runs: prefix-closed, pins protect ancestors, leaf-first LRU eviction. One index operation
per block.

``ConversationLruCache`` (fast, the default): O(1) per request. It is the same policy for
chain-shaped workloads (every conversation a chain of blocks, no prefix shared between
conversations): RadixIndex touches a chain root side first with one tick per block, so a
conversation's blocks carry consecutive ticks, its last block is its only leaf and the newest;
the LRU leaf is then the tail of the least recently touched conversation, and eviction eats that
conversation from its tail until it is gone or reaches a pinned block (then the next
conversation). ``tests/plan/test_plan_cache.py`` checks both give the same hits and evictions.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from pdd.cache.radix import RadixIndex
from pdd.errors import CacheError


class PrefixCache(Protocol):
    block_size: int

    def cached_tokens(self, conv: int, tokens: int) -> int:
        """Tokens of the first ``tokens`` of the stream held as whole blocks (pure)."""

    def store(self, conv: int, tokens: int) -> None:
        """Hold the first ``tokens`` (whole blocks) of the stream, most recently used; evicts
        LRU blocks for room, stores only what fits."""

    def pin(self, conv: int, tokens: int) -> object:
        """Protect the cached prefix of the first ``tokens``; returns the handle to unpin."""

    def unpin(self, handle: object) -> None: ...

    def diverge(self, conv: int, tokens: int) -> None:
        """The stream's text changed after its first ``tokens``: its blocks past them are no
        longer its, dropped at once (a real radix cache keeps the old branch until LRU
        eviction, which only matters for a full cache). The simulator calls it between turns,
        when no request of the conversation holds a pin (a pinned block would stay)."""


def _key(conv: int, block: int) -> bytes:
    return (conv << 24 | block).to_bytes(8, "little")


class RadixPrefixCache:
    """Exact: pdd's RadixIndex, block by block."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size
        self.index = RadixIndex()

    def _chain(self, conv: int, tokens: int) -> list[bytes]:
        return [_key(conv, i) for i in range(tokens // self.block_size)]

    def cached_tokens(self, conv: int, tokens: int) -> int:
        return self.index.match(self._chain(conv, tokens)).num_blocks * self.block_size

    def store(self, conv: int, tokens: int) -> None:
        chain = self._chain(conv, tokens)
        have = self.index.touch(chain)
        need = len(chain) - have - (self.capacity - len(self.index))
        if need > 0:
            self.index.evict(need)
            have = self.index.match(chain).num_blocks
        room = self.capacity - len(self.index)
        new = chain[have : have + max(room, 0)]
        if new:
            self.index.insert(new, [0] * len(new), chain[have - 1] if have else None)

    def pin(self, conv: int, tokens: int) -> object:
        n = self.cached_tokens(conv, tokens) // self.block_size
        if n == 0:
            return None
        h = _key(conv, n - 1)
        self.index.pin(h)
        return h

    def unpin(self, handle: object) -> None:
        if handle is not None:
            self.index.unpin(handle)  # type: ignore[arg-type]

    def diverge(self, conv: int, tokens: int) -> None:
        block = tokens // self.block_size
        while (h := _key(conv, block)) in self.index:
            try:
                self.index.remove(h)  # and the rest of the chain after it
                return
            except CacheError:  # pinned further on by a request in flight: kept up to there
                block += 1

    @property
    def used_blocks(self) -> int:
        return len(self.index)


Holders = dict[int, dict[str, "ConversationLruCache"]]
"""conversation -> {cache owner: the cache} of every cache (of one role) holding some of it:
the simulator's routing inputs in O(holders), not O(workers), per request."""


class ConversationLruCache:
    """Fast: a block count per conversation and an LRU of conversations (module docstring).

    ``holders`` (optional, shared by the caches of one role): this cache enters itself under
    ``owner`` for each conversation it holds an entry of, and leaves when the entry goes.
    """

    def __init__(self, capacity_tokens: int, block_size: int, owner: str = "",
                 holders: Holders | None = None) -> None:  # fmt: skip
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size
        self.used_blocks = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()  # LRU first
        self._pins: dict[int, list[int]] = {}  # conv -> pinned prefix lengths (blocks)
        self.owner, self.holders = owner, holders

    def cached_tokens(self, conv: int, tokens: int) -> int:
        return min(self._blocks.get(conv, 0), tokens // self.block_size) * self.block_size

    def store(self, conv: int, tokens: int) -> None:
        want = tokens // self.block_size
        have = self._blocks.get(conv, 0)
        if conv in self._blocks:
            self._blocks.move_to_end(conv)
        elif want:
            self._blocks[conv] = 0
            if self.holders is not None:
                self.holders.setdefault(conv, {})[self.owner] = self
        if want <= have:
            return
        short = want - have - (self.capacity - self.used_blocks)
        if short > 0:
            self._evict(short, keep=conv)
            have = self._blocks[conv]
        add = min(want - have, self.capacity - self.used_blocks)
        if add > 0:
            self._blocks[conv] = have + add
            self._blocks.move_to_end(conv)
            self.used_blocks += add

    def _evict(self, n: int, keep: int) -> None:
        """Free ``n`` blocks, LRU first; conversation ``keep`` (the one being stored, which may
        give up its own old blocks for its longer turn) keeps its entry, even at 0 blocks."""
        gone = []
        for conv, blocks in self._blocks.items():  # LRU first; stops once n are freed
            if n <= 0:
                break
            floor = max(self._pins[conv]) if conv in self._pins else 0
            take = min(blocks - floor, n)
            if take <= 0:
                continue
            self._blocks[conv] = blocks - take  # same key: iteration stays valid
            self.used_blocks -= take
            n -= take
            if blocks == take and conv != keep:
                gone.append(conv)
        for conv in gone:
            self._forget(conv)

    def _forget(self, conv: int) -> None:
        del self._blocks[conv]
        if self.holders is not None:
            held = self.holders[conv]
            del held[self.owner]
            if not held:
                del self.holders[conv]

    def pin(self, conv: int, tokens: int) -> object:
        n = self.cached_tokens(conv, tokens) // self.block_size
        if n == 0:
            return None
        self._pins.setdefault(conv, []).append(n)
        return (conv, n)

    def unpin(self, handle: object) -> None:
        if handle is None:
            return
        conv, n = handle  # type: ignore[misc]
        pins = self._pins[conv]
        pins.remove(n)
        if not pins:
            del self._pins[conv]

    def diverge(self, conv: int, tokens: int) -> None:
        blocks = self._blocks.get(conv, 0)
        keep = max(tokens // self.block_size, max(self._pins.get(conv, [0])))
        if blocks <= keep:
            return
        self.used_blocks -= blocks - keep
        if keep:
            self._blocks[conv] = keep
        else:
            self._forget(conv)


def rebase(cache: PrefixCache, conv: int, tokens: int, source: int | None = None) -> None:
    """A turn of ``conv`` whose first ``tokens`` are the first ``tokens`` of ``source``'s
    stream (None: its own), the rest new text: the cache drops ``conv``'s blocks past them and,
    for another source, holds a copy of what it holds of the source's."""
    if source is None or source == conv:
        cache.diverge(conv, tokens)
        return
    cache.diverge(conv, 0)
    have = cache.cached_tokens(source, tokens)
    if have:
        cache.store(conv, have)


def make_cache(exact: bool, capacity_tokens: int, block_size: int, owner: str = "",
               holders: Holders | None = None) -> PrefixCache:  # fmt: skip
    """The exact RadixIndex cache, or the O(1) one (entered in ``holders`` when given)."""
    if exact:
        return RadixPrefixCache(capacity_tokens, block_size)
    return ConversationLruCache(capacity_tokens, block_size, owner, holders)
