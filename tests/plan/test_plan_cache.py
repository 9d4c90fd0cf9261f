"""The O(1) conversation LRU makes the same choices as pdd's RadixIndex on chain workloads
(and on chains whose tail is rewritten: ``diverge``)."""

from __future__ import annotations

import random

import pytest

from pdd.plan.cache import ConversationLruCache, RadixPrefixCache


@pytest.mark.parametrize("seed", range(6))
def test_fast_cache_matches_radix_index(seed: int) -> None:
    rng = random.Random(seed)
    bs, cap = 4, 4 * 60
    exact, fast = RadixPrefixCache(cap, bs), ConversationLruCache(cap, bs)
    length = {c: 0 for c in range(8)}
    pins: list[tuple[object, object]] = []
    for _ in range(400):
        conv = rng.randrange(8)
        op = rng.random()
        if op < 0.5:  # a turn: the conversation grows, the cache stores it
            length[conv] += rng.randrange(1, 30)
            exact.store(conv, length[conv])
            fast.store(conv, length[conv])
        elif op < 0.6 and all(f[0] != conv for _, f in pins if f):
            # a turn that rewrites the tail (between turns: nothing of it pinned): the blocks
            # past its prefix go
            length[conv] = rng.randrange(0, length[conv] + 1)
            exact.diverge(conv, length[conv])
            fast.diverge(conv, length[conv])
        elif op < 0.8 and len(pins) < 3:
            pins.append((exact.pin(conv, length[conv]), fast.pin(conv, length[conv])))
        elif pins:
            e, f = pins.pop(rng.randrange(len(pins)))
            exact.unpin(e)
            fast.unpin(f)
        for c in range(8):
            assert exact.cached_tokens(c, length[c]) == fast.cached_tokens(c, length[c]), c
        assert exact.used_blocks == fast.used_blocks <= cap // bs


def test_eviction_is_lru_by_conversation_and_spares_pins() -> None:
    for cache in (RadixPrefixCache(40, 4), ConversationLruCache(40, 4)):
        cache.store(1, 16)  # 4 blocks
        cache.store(2, 16)
        pin = cache.pin(1, 16)
        cache.store(3, 24)  # needs 6 blocks, 2 free: conversation 1 is older but pinned
        assert cache.cached_tokens(1, 16) == 16
        assert cache.cached_tokens(2, 16) == 0
        assert cache.cached_tokens(3, 24) == 24
        cache.unpin(pin)
        cache.store(4, 16)  # now 1 is the oldest
        assert cache.cached_tokens(1, 16) == 0


def test_a_conversation_evicted_whole_to_store_its_own_turn_stays_a_holder() -> None:
    """The router's view (holders) must list every conversation a cache holds: one that had to
    give up all its old blocks for its longer turn (the cache full, nothing else to evict)
    and got some of them back is still listed, and can be evicted again later."""
    holders: dict = {}
    cache = ConversationLruCache(8 * 4, 4, "d0", holders)
    cache.store(1, 6 * 4)
    cache.pin(1, 6 * 4)  # ... in flight: not evicted for the next one
    cache.store(2, 2 * 4)
    cache.unpin((1, 6))
    cache.store(2, 12 * 4)  # longer than the cache: conversation 1 goes, then 2's old blocks
    assert holders == {2: {"d0": cache}} and cache.cached_tokens(2, 12 * 4) == 8 * 4
    cache.store(3, 8 * 4)  # evicts 2 whole: nothing is left of it, anywhere
    assert holders == {3: {"d0": cache}}
