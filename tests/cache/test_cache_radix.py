"""RadixIndex: exact semantics (dedup, pins, leaf-first LRU order, remove) and a property test
against the naive reference model in tests/cache/naive.py."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdd.cache.hashing import block_hashes
from pdd.cache.radix import RadixIndex
from pdd.errors import CacheError
from tests.cache.naive import NaiveIndex


def chain(tokens: str) -> list[bytes]:
    """One block per character: chain("abc") names blocks a, ab, abc."""
    return block_hashes([ord(c) for c in tokens], block_size=1)


NAMES = {h: w[: i + 1] for w in ("abc", "abd", "abz", "ax", "xy") for i, h in enumerate(chain(w))}


def name_of(h: bytes) -> str:
    """Inverse of chain() over the blocks these tests use, for readable assertions."""
    return NAMES[h]


def test_exact_eviction_order_leaf_first_lru():
    """
    root ── a ── ab ── abc       inserted first (ticks 1..3)
             └── ax              inserted second (tick 5: 'a' re-touched at 4)
    root ── x ── xy              inserted third (ticks 6..7)
    touch(a, ab): ticks 8, 9 -> 'ab' is newer than 'ax' but 'abc' (tick 3) is still oldest.
    Leaves by last_used: abc(3), ax(5), xy(7). Evicting abc makes ab (9) a leaf; a has
    children until both ab and ax are gone.
    """
    idx = RadixIndex()
    idx.insert(chain("abc"), [1, 2, 3])
    idx.insert(chain("ax")[1:], [4], parent=chain("a")[0])
    idx.insert(chain("ax")[:1], [99])  # re-touch 'a' (duplicate, offered handle returned)
    idx.insert(chain("xy"), [5, 6])
    assert idx.touch(chain("abz")) == 2
    evicted = idx.evict(10)
    assert [(name_of(h), handle) for h, handle in evicted] == [
        ("abc", 3),
        ("ax", 4),
        ("xy", 6),
        ("x", 5),
        ("ab", 2),
        ("a", 1),
    ]
    assert len(idx) == 0


def test_dedup_same_prefix_stored_once():
    idx = RadixIndex()
    first = idx.insert(chain("abc"), [10, 11, 12])
    second = idx.insert(chain("abd"), [20, 21, 22])
    assert [name_of(h) for h in first.stored] == ["a", "ab", "abc"]
    assert [name_of(h) for h in second.stored] == ["abd"]
    assert [(name_of(h), slot) for h, slot in second.duplicates] == [("a", 20), ("ab", 21)]
    assert len(idx) == 4
    assert idx.match(chain("abdx")).handles == (10, 11, 22)


def test_pinned_block_and_its_ancestors_are_never_evicted():
    idx = RadixIndex()
    idx.insert(chain("abc"), [1, 2, 3])
    idx.insert(chain("xy"), [4, 5])
    idx.pin(chain("ab")[1])
    assert idx.num_evictable == 3  # abc, xy, x
    assert [name_of(h) for h, _ in idx.evict(10)] == ["abc", "xy", "x"]
    assert idx.match(chain("abc")).num_blocks == 2
    idx.unpin(chain("ab")[1])
    assert [name_of(h) for h, _ in idx.evict(10)] == ["ab", "a"]
    with pytest.raises(CacheError):
        idx.unpin(chain("ab")[1])


def test_remove_takes_subtree_children_first_and_refuses_pinned():
    idx = RadixIndex()
    idx.insert(chain("abc"), [1, 2, 3])
    idx.insert(chain("abd")[2:], [4], parent=chain("ab")[1])
    idx.pin(chain("abd")[2])
    with pytest.raises(CacheError):
        idx.remove(chain("a")[0])
    assert len(idx) == 4
    idx.unpin(chain("abd")[2])
    removed = idx.remove(chain("ab")[1])
    assert [(name_of(h), slot) for h, slot in removed] == [("abc", 3), ("abd", 4), ("ab", 2)]
    assert [name_of(h) for h in idx.hashes()] == ["a"]


def test_insert_needs_parent_and_rejects_conflicting_chains():
    idx = RadixIndex()
    with pytest.raises(CacheError):
        idx.insert(chain("ab")[1:], [1], parent=chain("a")[0])
    idx.insert(chain("ab"), [1, 2])
    with pytest.raises(CacheError):  # 'ab' exists under 'a', offered under root
        idx.insert(chain("ab")[1:], [3])
    assert len(idx) == 2 and idx.pinned() == {}


ALPHABET = "abc"
tokens_st = st.text(alphabet=ALPHABET, min_size=1, max_size=4)


class RadixMachine(RuleBasedStateMachine):
    """Random insert/match/touch/pin/unpin/evict/remove against NaiveIndex."""

    def __init__(self) -> None:
        super().__init__()
        self.real = RadixIndex()
        self.ref = NaiveIndex()
        self.next_handle = 0

    def _handles(self, n: int) -> list[int]:
        self.next_handle += n
        return list(range(self.next_handle - n, self.next_handle))

    @rule(tokens=tokens_st, start=st.integers(0, 4))
    def insert(self, tokens, start):
        hashes = chain(tokens)
        k = min(start, self.ref.match(hashes)[0])
        parent = hashes[k - 1] if k else None
        handles = self._handles(len(hashes) - k)
        got = self.real.insert(hashes[k:], handles, parent)
        want = self.ref.insert(hashes[k:], handles, parent)
        assert (got.stored, got.duplicates) == want

    @rule(tokens=tokens_st)
    def insert_without_parent_fails(self, tokens):
        hashes = chain(tokens + "z")
        if hashes[-2] in self.ref.parent:
            return
        with pytest.raises(CacheError):
            self.real.insert(hashes[-1:], self._handles(1), parent=hashes[-2])

    @rule(tokens=tokens_st)
    def match(self, tokens):
        m = self.real.match(chain(tokens))
        assert (m.num_blocks, m.handles) == self.ref.match(chain(tokens))

    @rule(tokens=tokens_st)
    def touch(self, tokens):
        assert self.real.touch(chain(tokens)) == self.ref.touch(chain(tokens))

    @precondition(lambda self: self.ref.parent)
    @rule(data=st.data())
    def pin(self, data):
        h = data.draw(st.sampled_from(sorted(self.ref.parent)))
        self.real.pin(h)
        self.ref.refs[h] += 1

    @precondition(lambda self: any(self.ref.refs.values()))
    @rule(data=st.data())
    def unpin(self, data):
        h = data.draw(st.sampled_from(sorted(h for h, n in self.ref.refs.items() if n)))
        self.real.unpin(h)
        self.ref.refs[h] -= 1

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        assert self.real.evict(n) == self.ref.evict(n)

    @precondition(lambda self: self.ref.parent)
    @rule(data=st.data())
    def remove(self, data):
        h = data.draw(st.sampled_from(sorted(self.ref.parent)))
        want = self.ref.remove(h)
        if want is None:
            with pytest.raises(CacheError):
                self.real.remove(h)
        else:
            assert self.real.remove(h) == want

    @invariant()
    def same_state(self):
        assert list(self.real.hashes()) == list(self.ref.parent)
        assert self.real.pinned() == {h: n for h, n in self.ref.refs.items() if n}
        assert self.real.num_evictable == self.ref.num_evictable()
        for h, parent in self.ref.parent.items():
            assert self.real.parent_of(h) == parent
            assert self.real.handle(h) == self.ref.handle[h]


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None
)
TestRadixAgainstReference = RadixMachine.TestCase
