"""PrefixIndexView: the router's replica stays equal to the DRC through events, gaps and
restarts."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import block_hashes
from pdd.cache.view import PrefixIndexView
from pdd.config.cache import GIB, CacheConfig
from pdd.errors import CacheError, CacheFullError

BLOCK_BYTES = 16


def make_drc(slots: int, event_log_size: int, block_size: int = 1) -> DecodeRadixCache:
    cfg = CacheConfig(host_capacity_gib=slots * BLOCK_BYTES / GIB, event_log_size=event_log_size)
    return DecodeRadixCache(cfg, BLOCK_BYTES, block_size)


def chain(tokens: str) -> list[bytes]:
    return block_hashes([ord(c) for c in tokens], block_size=1)


def serve(drc: DecodeRadixCache, rid: str, tokens: str) -> None:
    hashes = chain(tokens)
    drc.reserve(rid, hashes)
    for h in hashes:
        buf = drc.landing_buffer(rid, h)
        if buf is not None:
            buf[:] = h
            drc.land(rid, h)
    drc.release(rid)


def test_view_answers_cached_tokens_of_the_prefix():
    drc = make_drc(slots=8, event_log_size=64, block_size=1)
    view = PrefixIndexView()
    assert view.stale and view.cached_tokens(chain("abc")) == 0
    view.apply_snapshot(drc.snapshot())
    serve(drc, "r1", "abc")
    assert view.apply_events(drc.events_since(view.seq)) is True
    assert view.cached_tokens(chain("abd")) == 2
    assert view.cached_tokens(chain("abcde")) == 3
    assert view.cached_tokens(chain("x")) == 0


def test_gap_is_detected_and_a_snapshot_resyncs():
    drc = make_drc(slots=8, event_log_size=2)
    view = PrefixIndexView()
    view.apply_snapshot(drc.snapshot())
    serve(drc, "r1", "abc")  # three events; the log keeps the last two
    batch = drc.events_since(view.seq)
    assert [e.seq for e in batch.events] == [2, 3]
    assert view.apply_events(batch) is False and view.stale
    assert view.cached_tokens(chain("abc")) == 0  # last applied state
    view.apply_snapshot(drc.snapshot())
    assert not view.stale and view.seq == 3
    assert view.blocks() == set(chain("abc"))
    serve(drc, "r2", "abd")
    assert view.apply_events(drc.events_since(view.seq)) is True
    assert view.blocks() == set(chain("abc")) | set(chain("abd"))


def test_redelivered_events_are_skipped():
    drc = make_drc(slots=8, event_log_size=64)
    view = PrefixIndexView()
    view.apply_snapshot(drc.snapshot())
    serve(drc, "r1", "ab")
    batch = drc.events_since(0)
    assert view.apply_events(batch) is True
    assert view.apply_events(batch) is True and view.seq == 2
    assert view.blocks() == set(chain("ab"))


def test_a_restarted_cache_is_a_new_epoch():
    view = PrefixIndexView()
    old = make_drc(slots=8, event_log_size=64)
    view.apply_snapshot(old.snapshot())
    serve(old, "r1", "ab")
    assert view.apply_events(old.events_since(view.seq))
    new = make_drc(slots=8, event_log_size=64)
    assert view.apply_events(new.events_since(view.seq)) is False and view.stale
    view.apply_snapshot(new.snapshot())
    assert view.blocks() == frozenset() and view.epoch == new.epoch


RIDS = ("r0", "r1", "r2")
tokens_st = st.text(alphabet="abc", min_size=1, max_size=4)


class ViewMachine(RuleBasedStateMachine):
    """Random request lifecycles on a small DRC with a short event log; two views poll at
    their own pace and must equal the cache after every sync (resyncing on gaps)."""

    def __init__(self) -> None:
        super().__init__()
        self.drc = make_drc(slots=6, event_log_size=4)
        self.views = [PrefixIndexView(), PrefixIndexView()]
        self.receive: dict[str, list[bytes]] = {}

    @rule(rid=st.sampled_from(RIDS), tokens=tokens_st)
    def reserve(self, rid, tokens):
        if rid in self.receive:
            return
        hashes = chain(tokens)
        fits = self.drc.can_reserve(hashes)
        try:
            res = self.drc.reserve(rid, hashes)
        except CacheFullError:
            assert not fits
            assert rid not in self.drc.active_requests()
            return
        assert fits
        self.receive[rid] = list(res.receive)

    @precondition(lambda self: any(self.receive.values()))
    @rule(data=st.data(), fail=st.booleans())
    def land_or_fail(self, data, fail):
        rid = data.draw(st.sampled_from(sorted(r for r, hs in self.receive.items() if hs)))
        h = data.draw(st.sampled_from(self.receive[rid]))
        self.receive[rid].remove(h)
        if fail:
            self.drc.discard(rid, h)
            return
        buf = self.drc.landing_buffer(rid, h)
        assert buf is not None
        buf[:] = h
        self.drc.land(rid, h)

    @precondition(lambda self: self.receive)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.receive)))
        assert self.drc.release(rid)
        del self.receive[rid]

    @rule(tokens=tokens_st)
    def remove(self, tokens):
        hashes = chain(tokens)
        if self.drc.match(hashes).cached_blocks == len(hashes):
            try:
                self.drc.remove(hashes[-1])
            except CacheError:
                assert self.drc.pinned_blocks()

    @rule(which=st.integers(0, 1), probes=st.lists(tokens_st, max_size=4))
    def sync_view(self, which, probes):
        view = self.views[which]
        if not view.apply_events(self.drc.events_since(view.seq)):
            view.apply_snapshot(self.drc.snapshot())
        snap = self.drc.snapshot()
        assert not view.stale and view.seq == snap.seq
        assert view.blocks() == set(snap.block_hashes)
        for p in probes:
            assert view.cached_tokens(chain(p)) == self.drc.match(chain(p)).cached_tokens

    def teardown(self):
        for rid in list(self.receive):
            self.drc.release(rid)
        assert self.drc.pinned_blocks() == {}
        assert self.drc.stats().landing_blocks == 0


ViewMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, database=None
)
TestViewFollowsCache = ViewMachine.TestCase


@pytest.mark.parametrize("log_size", [1, 1000])
def test_view_equals_cache_after_a_burst(log_size):
    drc = make_drc(slots=6, event_log_size=log_size)
    view = PrefixIndexView()
    view.apply_snapshot(drc.snapshot())
    for i, tokens in enumerate(["abc", "abd", "cab", "bca", "abcab", "ccc"]):
        serve(drc, f"r{i}", tokens)
    synced = view.apply_events(drc.events_since(view.seq))
    assert synced is (log_size == 1000)
    if not synced:
        view.apply_snapshot(drc.snapshot())
    assert view.blocks() == set(drc.snapshot().block_hashes)
    assert len(view) == 6  # full: every later request evicted LRU leaves
