"""Naive reference models of the radix index and the host tier, for property tests.

Written for obviousness, not speed: every query recomputes from plain dicts (children by
scanning, protection by walking up from every pinned block, eviction by a full scan).
"""

from __future__ import annotations


class NaiveIndex:
    """Reference of pdd.cache.radix.RadixIndex."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes | None] = {}  # insertion-ordered
        self.handle: dict[bytes, int] = {}
        self.refs: dict[bytes, int] = {}
        self.last_used: dict[bytes, int] = {}
        self.clock = 0

    def children(self, h: bytes) -> list[bytes]:
        return [c for c, p in self.parent.items() if p == h]

    def protected(self) -> set[bytes]:
        out: set[bytes] = set()
        for h, n in self.refs.items():
            cur: bytes | None = h if n else None
            while cur is not None:
                out.add(cur)
                cur = self.parent[cur]
        return out

    def num_evictable(self) -> int:
        return len(self.parent) - len(self.protected())

    def match(self, hashes: list[bytes]) -> tuple[int, tuple[int, ...]]:
        out = []
        prev = None
        for h in hashes:
            if h not in self.parent or self.parent[h] != prev:
                break
            out.append(self.handle[h])
            prev = h
        return len(out), tuple(out)

    def _touch(self, h: bytes) -> None:
        self.clock += 1
        self.last_used[h] = self.clock

    def insert(self, hashes: list[bytes], handles: list[int], parent: bytes | None):
        stored, dups = [], []
        prev = parent
        for h, handle in zip(hashes, handles, strict=True):
            if h in self.parent:
                dups.append((h, handle))
            else:
                self.parent[h] = prev
                self.handle[h] = handle
                self.refs[h] = 0
                stored.append(h)
            self._touch(h)
            prev = h
        return tuple(stored), tuple(dups)

    def touch(self, hashes: list[bytes]) -> int:
        n = self.match(hashes)[0]
        for h in hashes[:n]:
            self._touch(h)
        return n

    def _drop(self, h: bytes) -> int:
        del self.parent[h], self.refs[h], self.last_used[h]
        return self.handle.pop(h)

    def evict(self, n: int) -> list[tuple[bytes, int]]:
        out = []
        for _ in range(n):
            prot = self.protected()
            leaves = [h for h in self.parent if not self.children(h) and h not in prot]
            if not leaves:
                break
            victim = min(leaves, key=lambda h: self.last_used[h])
            out.append((victim, self._drop(victim)))
        return out

    def remove(self, h: bytes) -> list[tuple[bytes, int]] | None:
        """None when the subtree is pinned (the real index raises)."""
        if h in self.protected():
            return None
        order: list[bytes] = []

        def visit(x: bytes) -> None:
            for c in self.children(x):
                visit(c)
            order.append(x)

        visit(h)
        return [(x, self._drop(x)) for x in order]


class NaiveTier:
    """Reference of pdd.cache.host_tier.HostTier (slots, owners, landing, commit)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.index = NaiveIndex()
        self.free: set[int] = set(range(num_slots))
        self.landing: dict[int, tuple[str | None, bytes, bytes | None, bool]] = {}
        self.pins: dict[str, dict[bytes, int]] = {}
        self.owner_slots: dict[str, list[int]] = {}

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free) + self.index.num_evictable()

    def allocate(self, owner: str, hashes: list[bytes], parent: bytes | None):
        evicted = self.index.evict(len(hashes) - len(self.free))
        self.free.update(slot for _, slot in evicted)
        slots = sorted(self.free)[: len(hashes)]
        prev = parent
        for h, slot in zip(hashes, slots, strict=True):
            self.free.remove(slot)
            self.landing[slot] = (owner, h, prev, False)
            self.owner_slots.setdefault(owner, []).append(slot)
            self.pins.setdefault(owner, {})
            prev = h
        return tuple(slots), tuple(h for h, _ in evicted)

    def write(self, slot: int) -> None:
        owner, h, parent, _ = self.landing[slot]
        self.landing[slot] = (owner, h, parent, True)

    def finish_write(self, slot: int) -> None:
        owner, h, parent, _ = self.landing[slot]
        self.landing[slot] = (owner, h, parent, False)

    def _free_landing(self, slot: int) -> None:
        owner = self.landing.pop(slot)[0]
        if owner is not None:
            self.owner_slots[owner].remove(slot)
        self.free.add(slot)

    def commit(self, slot: int) -> tuple[str, int | None]:
        owner, h, parent, _ = self.landing[slot]
        if owner is None:
            self._free_landing(slot)
            return "orphaned", None
        if h in self.index.parent:
            self._free_landing(slot)
            outcome, where = "duplicate", self.index.handle[h]
        else:
            self.index.insert([h], [slot], parent)
            self.landing.pop(slot)
            self.owner_slots[owner].remove(slot)
            outcome, where = "stored", slot
        self.index.refs[h] += 1
        self.pins[owner][h] = self.pins[owner].get(h, 0) + 1
        return outcome, where

    def pin(self, owner: str, hashes: list[bytes]) -> None:
        self.pins.setdefault(owner, {})
        self.owner_slots.setdefault(owner, [])
        for h in hashes:
            self.index.refs[h] += 1
            self.pins[owner][h] = self.pins[owner].get(h, 0) + 1

    def release_owner(self, owner: str) -> tuple[int, int, tuple[int, ...]]:
        if owner not in self.pins:
            return 0, 0, ()
        pins = self.pins.pop(owner)
        for h, n in pins.items():
            self.index.refs[h] -= n
        discarded, orphaned = 0, []
        for slot in self.owner_slots.pop(owner, []):
            _, h, parent, writing = self.landing[slot]
            if writing:
                self.landing[slot] = (None, h, parent, True)
                orphaned.append(slot)
            else:
                del self.landing[slot]
                self.free.add(slot)
                discarded += 1
        return sum(pins.values()), discarded, tuple(orphaned)

    def discard(self, slot: int) -> None:
        self._free_landing(slot)

    def remove(self, h: bytes) -> list[bytes] | None:
        removed = self.index.remove(h)
        if removed is None:
            return None
        self.free.update(slot for _, slot in removed)
        return [x for x, _ in removed]
