"""DecodeRadixCache: the block lifecycle as MainDecode drives it, leases, events and stats."""

from __future__ import annotations

import threading

import pytest

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import block_hashes, model_salt
from pdd.cache.messages import BlockRemoved, BlockStored, DrcEventBatch, DrcSnapshot
from pdd.config.cache import GIB, CacheConfig
from pdd.errors import CacheError, CacheFullError

BLOCK_BYTES = 16
BLOCK_SIZE = 4
SALT = model_salt("SmolLM2-135M-Instruct", "bfloat16", BLOCK_SIZE)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_drc(slots: int, clock=None, **config) -> DecodeRadixCache:
    cfg = CacheConfig(host_capacity_gib=slots * BLOCK_BYTES / GIB, **config)
    return DecodeRadixCache(cfg, BLOCK_BYTES, BLOCK_SIZE, clock=clock or FakeClock())


def prompt(*words: int, n_blocks: int) -> list[bytes]:
    """Hashes of a prompt of n_blocks whole blocks plus a partial one (never hashed)."""
    tokens = [w for w in words] + list(range(100, 100 + n_blocks * BLOCK_SIZE - len(words)))
    return block_hashes(tokens + [7, 7], BLOCK_SIZE, SALT)


def land_all(drc: DecodeRadixCache, rid: str, hashes, order=None) -> list[int]:
    """Write each block's own hash as its bytes and land it; returns ready-deltas."""
    out = []
    for h in order or hashes:
        buf = drc.landing_buffer(rid, h)
        if buf is not None:
            buf[:] = h
        out.append(drc.land(rid, h))
    return out


def assert_no_leaks(drc: DecodeRadixCache) -> None:
    stats = drc.stats()
    assert drc.pinned_blocks() == {}
    assert drc.active_requests() == []
    assert stats.landing_blocks == 0
    assert stats.free_blocks + stats.committed_blocks == stats.capacity_blocks


def test_lifecycle_out_of_order_landing_events_and_eviction():
    drc = make_drc(slots=4)
    h = prompt(1, n_blocks=3)
    assert len(h) == 3  # the trailing partial block has no hash
    res = drc.reserve("r1", h)
    assert (res.cached_blocks, res.receive) == (0, tuple(h))
    assert land_all(drc, "r1", h, order=[h[2], h[0], h[1]]) == [0, 1, 2]
    ready = drc.ready("r1")
    assert (ready.cached_blocks, ready.cached_tokens, ready.slots) == (3, 12, (0, 1, 2))
    assert bytes(drc.read(ready.slots[1])) == h[1]
    assert drc.events_since(0).events == (
        BlockStored(seq=1, parent_hash=None, block_hashes=(h[0],)),
        BlockStored(seq=2, parent_hash=h[0], block_hashes=(h[1], h[2])),
    )
    assert drc.release("r1") is True
    assert drc.release("r1") is False  # exactly one release

    other = prompt(2, n_blocks=2)
    assert drc.reserve("r2", other).receive == tuple(other)  # 1 free slot + 1 evicted
    assert drc.events_since(2).events == (BlockRemoved(seq=3, block_hashes=(h[2],)),)
    assert drc.match(h).cached_blocks == 2
    land_all(drc, "r2", other)
    drc.release("r2")
    stats = drc.stats()
    assert (stats.stored_blocks, stats.evicted_blocks, stats.event_seq) == (5, 1, 5)
    assert_no_leaks(drc)


def test_second_turn_receives_only_new_blocks():
    drc = make_drc(slots=16)
    turn1 = prompt(1, n_blocks=3)
    drc.reserve("t1", turn1, num_prompt_tokens=14)
    land_all(drc, "t1", turn1)
    drc.release("t1")
    turn2 = prompt(1, n_blocks=5)  # the same conversation, two blocks longer
    assert turn2[:3] == turn1
    res = drc.reserve("t2", turn2, num_prompt_tokens=22)
    assert (res.cached_blocks, res.cached_tokens, res.receive) == (3, 12, tuple(turn2[3:]))
    assert drc.landing_buffer("t2", turn2[0]) is None  # cached: the sender's bytes are dropped
    assert land_all(drc, "t2", turn2[3:]) == [1, 1]
    drc.release("t2")
    stats = drc.stats()
    assert (stats.requests, stats.prompt_tokens, stats.hit_tokens) == (2, 36, 12)
    assert_no_leaks(drc)


def test_concurrent_requests_store_a_shared_prefix_once():
    drc = make_drc(slots=8)
    h = prompt(1, n_blocks=2)
    assert drc.reserve("a", h).receive == tuple(h)
    assert drc.reserve("b", h).receive == tuple(h)  # neither has landed yet
    land_all(drc, "a", h)
    land_all(drc, "b", h)
    assert drc.pinned_blocks() == {h[0]: 2, h[1]: 2}
    assert drc.ready("b").slots == drc.ready("a").slots == (0, 1)
    stats = drc.stats()
    assert (stats.committed_blocks, stats.deduplicated_blocks, stats.event_seq) == (2, 2, 2)
    drc.release("a")
    drc.release("b")
    assert_no_leaks(drc)


def test_cache_full_when_the_rest_is_pinned_and_nothing_is_held_after():
    drc = make_drc(slots=2)
    h = prompt(1, n_blocks=2)
    drc.reserve("r1", h)
    land_all(drc, "r1", h)
    drc.release("r1")
    longer = prompt(1, n_blocks=3)
    # Both slots hold the cached prefix that reserve must pin: no room for the third block.
    assert drc.can_reserve(longer) is False
    with pytest.raises(CacheFullError):
        drc.reserve("r2", longer)
    assert drc.active_requests() == [] and drc.pinned_blocks() == {}
    assert drc.can_reserve(prompt(2, n_blocks=2)) is True
    assert_no_leaks(drc)


def test_failed_block_is_never_visible_and_blocks_after_it_are_freed():
    drc = make_drc(slots=4)
    h = prompt(1, n_blocks=3)
    drc.reserve("r1", h)
    assert land_all(drc, "r1", [h[0]]) == [1]
    drc.landing_buffer("r1", h[1])
    drc.discard("r1", h[1])  # e.g. its chunk failed the integrity check
    assert land_all(drc, "r1", [h[2]]) == [0]
    assert drc.match(h).cached_blocks == 1
    drc.release("r1")
    assert drc.match(h).cached_blocks == 1
    assert drc.stats().discarded_blocks == 2
    assert_no_leaks(drc)


def test_write_buffer_open_at_release_is_freed_by_its_writer_not_reused():
    drc = make_drc(slots=1)
    (h,) = prompt(1, n_blocks=1)
    drc.reserve("r1", [h])
    buf = drc.landing_buffer("r1", h)
    drc.release("r1")  # e.g. the request was cancelled mid-transfer
    assert drc.can_reserve(prompt(2, n_blocks=1)) is False
    with pytest.raises(CacheError):
        drc.landing_buffer("r1", h)
    buf[:] = h  # the late writer finishes
    assert drc.land("r1", h) == 0
    assert drc.match([h]).cached_blocks == 0
    assert_no_leaks(drc)


def test_expired_lease_is_released_by_its_deadline():
    clock = FakeClock()
    drc = make_drc(slots=4, clock=clock, lease_ttl_s=10)
    h = prompt(1, n_blocks=2)
    drc.reserve("r1", h)
    land_all(drc, "r1", h[:1])
    clock.now += 9
    assert drc.expire() == []
    drc.renew("r1")
    clock.now += 9
    assert drc.expire() == []
    clock.now += 1
    assert drc.expire() == ["r1"]
    assert drc.stats().expired_leases == 1
    assert drc.match(h).cached_blocks == 1  # what landed stays cached, unpinned
    assert_no_leaks(drc)


def test_lease_misuse_raises_cache_error():
    drc = make_drc(slots=4)
    h = prompt(1, n_blocks=1)
    drc.reserve("r1", h)
    with pytest.raises(CacheError):
        drc.reserve("r1", h)
    with pytest.raises(CacheError):
        drc.landing_buffer("nope", h[0])
    with pytest.raises(CacheError):
        drc.renew("nope")
    drc.release("r1")
    assert_no_leaks(drc)


def test_remove_exports_children_first():
    drc = make_drc(slots=4)
    h = prompt(1, n_blocks=3)
    drc.reserve("r1", h)
    land_all(drc, "r1", h)
    with pytest.raises(CacheError):
        drc.remove(h[1])  # pinned by r1
    drc.release("r1")
    assert drc.remove(h[1]) == 2
    assert drc.events_since(3).events == (BlockRemoved(seq=4, block_hashes=(h[2], h[1])),)
    assert drc.stats().removed_blocks == 2


def test_messages_round_trip_through_json():
    drc = make_drc(slots=4)
    h = prompt(1, n_blocks=2)
    drc.reserve("r1", h)
    land_all(drc, "r1", h)
    drc.release("r1")
    batch = drc.events_since(0)
    assert DrcEventBatch.model_validate_json(batch.model_dump_json()) == batch
    snap = drc.snapshot()
    assert DrcSnapshot.model_validate_json(snap.model_dump_json()) == snap
    assert set(snap.block_hashes) == set(h) and snap.seq == 2


def test_threads_landing_concurrently():
    drc = make_drc(slots=64)
    chains = {f"r{i}": prompt(i, n_blocks=16) for i in range(4)}
    for rid, h in chains.items():
        drc.reserve(rid, h)
    errors: list[BaseException] = []

    def worker(rid: str) -> None:
        try:
            land_all(drc, rid, chains[rid], order=list(reversed(chains[rid])))
        except BaseException as exc:  # surfaced in the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(rid,)) for rid in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert all(drc.ready(rid).cached_blocks == 16 for rid in chains)
    for rid in chains:
        drc.release(rid)
    assert drc.stats().committed_blocks == 64
    assert_no_leaks(drc)
