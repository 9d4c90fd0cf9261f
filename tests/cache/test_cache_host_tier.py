"""HostTier: capacity, landing/commit, owners, orphans, exact slots and eviction order against
the naive reference in tests/cache/naive.py."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdd.cache.hashing import block_hashes
from pdd.cache.host_tier import CommitOutcome, HostTier, kv_block_bytes
from pdd.errors import CacheError, CacheFullError
from tests.cache.naive import NaiveTier

BLOCK_BYTES = 16  # one hash per block: the bytes of a landed block are its own hash


def chain(tokens: str) -> list[bytes]:
    return block_hashes([ord(c) for c in tokens], block_size=1)


def land(tier: HostTier, slot: int, h: bytes) -> None:
    tier.write(slot)[:] = h


def test_block_bytes_of_the_default_model():
    assert kv_block_bytes(30, 3, 64, 32, 2) == 737_280


def test_lifecycle_reserve_land_commit_pin_evict():
    tier = HostTier(num_slots=3, block_bytes=BLOCK_BYTES)
    a, ab, abc = chain("abc")
    alloc = tier.allocate("r1", [a, ab, abc])
    assert alloc.slots == (0, 1, 2) and alloc.evicted == ()
    assert tier.lookup([a]).num_blocks == 0  # landing blocks are invisible
    for slot, h in zip(alloc.slots, (a, ab, abc), strict=True):
        land(tier, slot, h)
    with pytest.raises(CacheError):
        tier.commit(2)  # parent 'ab' is not committed yet
    assert [tier.commit(s).outcome for s in (0, 1, 2)] == [CommitOutcome.STORED] * 3
    assert tier.lookup([a, ab, abc]).handles == (0, 1, 2)
    assert bytes(tier.read(1)) == ab
    assert not tier.can_allocate(1)  # everything is pinned by r1
    with pytest.raises(CacheFullError):
        tier.allocate("r2", chain("x"))
    assert tier.release_owner("r1").unpinned == 3
    assert tier.release_owner("r1").unpinned == 0  # released exactly once
    x = chain("x")[0]
    alloc = tier.allocate("r2", [x])
    assert alloc.slots == (2,) and alloc.evicted == (abc,)
    tier.release_owner("r2")
    assert tier.pinned_blocks() == {} and tier.num_landing == 0


def test_failed_transfer_is_discarded_never_visible():
    tier = HostTier(num_slots=2, block_bytes=BLOCK_BYTES)
    (a,) = chain("a")
    (slot,) = tier.allocate("r1", [a]).slots
    land(tier, slot, a)
    tier.discard(slot)
    assert tier.lookup([a]).num_blocks == 0 and tier.num_free == 2
    with pytest.raises(CacheError):
        tier.commit(slot)
    tier.release_owner("r1")


def test_dedup_second_commit_frees_its_slot_and_pins_the_stored_block():
    tier = HostTier(num_slots=4, block_bytes=BLOCK_BYTES)
    (a,) = chain("a")
    (s1,) = tier.allocate("r1", [a]).slots
    (s2,) = tier.allocate("r2", [a]).slots
    land(tier, s1, a)
    land(tier, s2, a)
    assert tier.commit(s1).outcome is CommitOutcome.STORED
    dup = tier.commit(s2)
    assert (dup.outcome, dup.slot) == (CommitOutcome.DUPLICATE, s1)
    assert tier.num_committed == 1 and tier.num_free == 3
    assert tier.pinned_blocks() == {a: 2}
    tier.release_owner("r1")
    tier.release_owner("r2")
    assert tier.pinned_blocks() == {}


def test_open_write_buffer_survives_release_as_orphan():
    tier = HostTier(num_slots=1, block_bytes=BLOCK_BYTES)
    (a,) = chain("a")
    (slot,) = tier.allocate("r1", [a]).slots
    buf = tier.write(slot)
    released = tier.release_owner("r1")
    assert released.orphaned == (slot,)
    assert not tier.can_allocate(1)  # a writer may still be copying: never reused
    buf[:] = a
    assert tier.commit(slot).outcome is CommitOutcome.ORPHANED
    assert tier.lookup([a]).num_blocks == 0 and tier.can_allocate(1)
    assert tier.orphaned_slots() == []


OWNERS = ("r0", "r1", "r2")
tokens_st = st.text(alphabet="abc", min_size=1, max_size=3)


class TierMachine(RuleBasedStateMachine):
    """allocate / write / commit / discard / pin / unpin / release / remove vs NaiveTier."""

    def __init__(self) -> None:
        super().__init__()
        self.real = HostTier(num_slots=5, block_bytes=BLOCK_BYTES)
        self.ref = NaiveTier(num_slots=5)
        self.written: set[int] = set()  # landing slots whose bytes were written

    @rule(owner=st.sampled_from(OWNERS), tokens=tokens_st, start=st.integers(0, 3))
    def allocate(self, owner, tokens, start):
        hashes = chain(tokens)
        k = min(start, self.ref.index.match(hashes)[0])
        parent = hashes[k - 1] if k else None
        if not self.ref.can_allocate(len(hashes) - k):
            with pytest.raises(CacheFullError):
                self.real.allocate(owner, hashes[k:], parent)
            return
        protected = self.ref.index.protected()
        got = self.real.allocate(owner, hashes[k:], parent)
        assert (got.slots, got.evicted) == self.ref.allocate(owner, hashes[k:], parent)
        assert not protected & set(got.evicted), "a pinned block was evicted"

    @precondition(lambda self: any(o is not None for o, *_ in self.ref.landing.values()))
    @rule(data=st.data())
    def write(self, data):
        owned = sorted(s for s, (o, *_) in self.ref.landing.items() if o is not None)
        slot = data.draw(st.sampled_from(owned))
        land(self.real, slot, self.ref.landing[slot][1])
        self.ref.write(slot)
        self.written.add(slot)

    @precondition(lambda self: any(w for *_, w in self.ref.landing.values()))
    @rule(data=st.data())
    def finish_write(self, data):
        slot = data.draw(st.sampled_from(sorted(s for s, v in self.ref.landing.items() if v[3])))
        self.real.finish_write(slot)
        self.ref.finish_write(slot)

    @precondition(lambda self: self.written & set(self.ref.landing))
    @rule(data=st.data())
    def commit(self, data):
        slot = data.draw(st.sampled_from(sorted(self.written & set(self.ref.landing))))
        owner, _, parent, _ = self.ref.landing[slot]
        if owner is not None and parent is not None and parent not in self.ref.index.parent:
            with pytest.raises(CacheError):
                self.real.commit(slot)
            return
        got = self.real.commit(slot)
        assert (got.outcome.value, got.slot) == self.ref.commit(slot)
        self.written.discard(slot)

    @precondition(lambda self: self.ref.landing)
    @rule(data=st.data())
    def discard(self, data):
        slot = data.draw(st.sampled_from(sorted(self.ref.landing)))
        self.real.discard(slot)
        self.ref.discard(slot)
        self.written.discard(slot)

    @rule(owner=st.sampled_from(OWNERS), tokens=tokens_st)
    def pin_cached_prefix(self, owner, tokens):
        hashes = chain(tokens)
        n = self.ref.index.match(hashes)[0]
        self.real.pin(owner, hashes[:n])
        self.ref.pin(owner, hashes[:n])

    @precondition(lambda self: any(self.ref.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        owner = data.draw(st.sampled_from(sorted(o for o, p in self.ref.pins.items() if p)))
        h = data.draw(st.sampled_from(sorted(self.ref.pins[owner])))
        self.real.unpin(owner, h)
        self.ref.index.refs[h] -= 1
        self.ref.pins[owner][h] -= 1
        if not self.ref.pins[owner][h]:
            del self.ref.pins[owner][h]

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner):
        got = self.real.release_owner(owner)
        assert (got.unpinned, got.discarded, got.orphaned) == self.ref.release_owner(owner)
        self.written &= set(self.ref.landing)

    @precondition(lambda self: self.ref.index.parent)
    @rule(data=st.data())
    def remove(self, data):
        h = data.draw(st.sampled_from(sorted(self.ref.index.parent)))
        want = self.ref.remove(h)
        if want is None:
            with pytest.raises(CacheError):
                self.real.remove(h)
        else:
            assert self.real.remove(h) == want

    @invariant()
    def same_state_and_capacity(self):
        real, ref = self.real, self.ref
        assert real.num_free + real.num_landing + real.num_committed == real.num_slots
        assert (real.num_free, real.num_landing) == (len(ref.free), len(ref.landing))
        assert list(real.committed_hashes()) == list(ref.index.parent)
        assert real.pinned_blocks() == {h: n for h, n in ref.index.refs.items() if n}
        assert real.num_evictable == ref.index.num_evictable()
        for h, slot in ref.index.handle.items():
            assert bytes(real.read(slot)) == h, "a committed block's bytes changed"

    def teardown(self):
        """Leak check: releasing every owner and ending every orphan leaves nothing held."""
        for owner in OWNERS:
            self.real.release_owner(owner)
        for slot in self.real.orphaned_slots():
            self.real.discard(slot)
        assert self.real.pinned_blocks() == {}
        assert self.real.num_landing == 0 and self.real.owners() == []
        assert self.real.num_free + self.real.num_committed == self.real.num_slots


TierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None
)
TestTierAgainstReference = TierMachine.TestCase
