"""Host-memory tier of the Decode-side RadixCache: a fixed arena of KV block slots.

The tier owns one numpy uint8 arena of ``num_slots x block_bytes`` (capacity from
``cache.host_capacity_gib``), the free-slot pool, the RadixIndex of committed blocks, and
every pin and landing slot by *owner* (a lease name, e.g. a request id). It only executes:
the DecodeRadixCache facade (pdd.cache.drc) decides what to reserve, commit and release.

Lifecycle of one slot::

              allocate(owner)    write(slot) .. finish_write(slot)    commit(slot)
    FREE ───────────────────> LANDING ──────────────────────────> COMMITTED, pinned by owner
     ^  (evicts LRU blocks     │ discard(slot), release_owner      │ (visible to lookups)
     │   if the pool is dry)   │ (transfer failed: never used)     │ unpin / release_owner
     ├─────────────────────────┘                                   v
     └────────── evict (LRU unprotected leaf) / remove ──── COMMITTED, unpinned (evictable)

* Only committed blocks are visible (``lookup``, ``read``); a landing slot is invisible and
  is freed, never committed, when its transfer fails.
* A commit whose hash is already cached (another request landed it first) frees its own slot
  and pins the stored block instead: a prefix is stored once.
* ``commit`` needs the block's parent committed, so the index stays prefix-closed.
* Orphans: ``release_owner`` frees the owner's landing slots, except those whose buffer was
  handed out by ``write`` and not yet finished, committed or discarded: a writer may still
  be copying into them. They stay LANDING without owner until the writer's ``commit`` or ``discard``,
  which then frees them. A slot is therefore never reused while someone may write into it.
* Readers must hold a pin on the blocks they ``read`` (a lease) for as long as they copy.

Not thread-safe: the DecodeRadixCache facade serializes calls. No torch, no vLLM.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdd.cache.hashing import BlockHash
from pdd.cache.radix import IndexMatch, RadixIndex
from pdd.errors import CacheError, CacheFullError


def kv_block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """Bytes of one KV block over all layers, K and V.

    vLLM's CPU layout per layer is [num_blocks, num_kv_heads, block_size, 2 * head_dim]
    (K and V packed), so one block of one layer is num_kv_heads * block_size * 2 * head_dim
    elements. SmolLM2-135M, bf16, 32 tokens: 30 * 3 * 32 * 128 * 2 = 737,280 bytes.
    """
    return num_layers * num_kv_heads * block_size * 2 * head_dim * dtype_bytes


class CommitOutcome(enum.StrEnum):
    STORED = "stored"  # the block is new: its slot now holds a cached block
    DUPLICATE = "duplicate"  # already cached: the slot was freed, the stored block is pinned
    ORPHANED = "orphaned"  # the owner was released meanwhile: the slot was freed


@dataclass(frozen=True, slots=True)
class Allocation:
    """Landing slots in the order of the requested hashes; ``evicted``: blocks evicted to
    make room, in eviction order."""

    slots: tuple[int, ...]
    evicted: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Commit:
    block_hash: BlockHash
    outcome: CommitOutcome
    slot: int | None  # where the block's bytes live now (None when orphaned)


@dataclass(frozen=True, slots=True)
class Released:
    unpinned: int  # pins dropped
    discarded: int  # landing slots freed
    orphaned: tuple[int, ...]  # landing slots left to their writer (freed on commit/discard)


@dataclass(slots=True)
class TierCounters:
    evicted: int = 0
    stored: int = 0
    deduplicated: int = 0
    discarded: int = 0
    removed: int = 0


@dataclass(slots=True)
class _Landing:
    owner: str | None  # None: orphaned (owner released while a writer holds the buffer)
    block_hash: BlockHash
    parent: BlockHash | None
    writing: bool = False


@dataclass(slots=True)
class _Owner:
    pins: dict[BlockHash, int] = field(default_factory=dict)
    landing: dict[int, None] = field(default_factory=dict)  # ordered set of slots


class HostTier:
    """Fixed-capacity arena of KV blocks with an LRU radix index (see module docstring)."""

    def __init__(self, num_slots: int, block_bytes: int, buffer: memoryview | None = None):
        """``buffer``: optional external memory of at least num_slots * block_bytes bytes
        (e.g. shared memory another process maps); by default a private zeroed arena, whose
        pages the OS maps only when first written."""
        if num_slots < 0 or block_bytes <= 0:
            raise CacheError(f"bad arena shape: {num_slots} slots of {block_bytes} bytes")
        if buffer is None:
            self._arena = np.zeros((num_slots, block_bytes), dtype=np.uint8)
        else:
            flat = np.frombuffer(buffer, dtype=np.uint8, count=num_slots * block_bytes)
            self._arena = flat.reshape(num_slots, block_bytes)
        self._block_bytes = block_bytes
        self._free: list[int] = list(range(num_slots))  # min-heap: lowest slot first
        self._landing: dict[int, _Landing] = {}
        self._committed: dict[int, BlockHash] = {}
        self._owners: dict[str, _Owner] = {}
        self._index = RadixIndex()
        self.counters = TierCounters()

    # --- capacity ----------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self._arena.shape[0]

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_landing(self) -> int:
        return len(self._landing)

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    @property
    def num_evictable(self) -> int:
        return self._index.num_evictable

    def can_allocate(self, n: int, keep: Sequence[BlockHash] = ()) -> bool:
        """Whether ``allocate`` of ``n`` slots would succeed now (free + evictable), also after
        pinning ``keep`` first (cached blocks of a chain from block 0 the caller will pin)."""
        evictable = self._index.num_evictable - self._index.count_unprotected(keep)
        return n <= len(self._free) + evictable

    # --- the landing path --------------------------------------------------------------------

    def allocate(
        self, owner: str, hashes: Sequence[BlockHash], parent: BlockHash | None = None
    ) -> Allocation:
        """Landing slots for a chain of blocks (``hashes[0]`` a child of ``parent``), owned by
        ``owner``; evicts LRU unprotected blocks when the free pool is short.

        Raises CacheFullError (nothing changed) when ``can_allocate`` is false.
        """
        if not self.can_allocate(len(hashes)):
            raise CacheFullError(
                f"host tier: {len(hashes)} blocks wanted, {len(self._free)} free and "
                f"{self._index.num_evictable} evictable of {self.num_slots}"
            )
        evicted = self._evict(len(hashes) - len(self._free))
        state = self._owners.setdefault(owner, _Owner())
        slots = []
        prev = parent
        for h in hashes:
            slot = heapq.heappop(self._free)
            self._landing[slot] = _Landing(owner, h, prev)
            state.landing[slot] = None
            slots.append(slot)
            prev = h
        return Allocation(tuple(slots), tuple(evicted))

    def write(self, slot: int) -> memoryview:
        """The landing buffer of ``slot`` (block_bytes, writable). The caller must end with
        ``finish_write``, ``commit`` or ``discard``; until then the slot is never reused."""
        landing = self._landing_of(slot)
        if landing.owner is None:
            raise CacheError(f"slot {slot}: its owner was released")
        landing.writing = True
        return memoryview(self._arena[slot])

    def finish_write(self, slot: int) -> None:
        """The writer is done with the slot's buffer (the bytes are complete), but the block
        cannot commit yet (its parent is still landing). Safe to free at release from now."""
        self._landing_of(slot).writing = False

    def can_commit(self, slot: int) -> bool:
        """Whether the landing block's parent is committed (or it is a first block)."""
        parent = self._landing_of(slot).parent
        return parent is None or parent in self._index

    def commit(self, slot: int) -> Commit:
        """Make a landed block visible, pinned by its owner (see CommitOutcome).

        Raises CacheError if the slot is not landing or its parent is not committed.
        """
        landing = self._landing_of(slot)
        h = landing.block_hash
        if landing.owner is None:
            self._free_landing(slot)
            return Commit(h, CommitOutcome.ORPHANED, None)
        if not self.can_commit(slot):
            raise CacheError(f"commit of block {h.hex()} before its parent")
        owner = self._owners[landing.owner]
        if h in self._index:
            self._free_landing(slot)
            self.counters.deduplicated += 1
            outcome, where = CommitOutcome.DUPLICATE, self._index.handle(h)
        else:
            self._index.insert([h], [slot], landing.parent)
            self._forget_landing(slot)
            self._committed[slot] = h
            self.counters.stored += 1
            outcome, where = CommitOutcome.STORED, slot
        self._index.pin(h)
        owner.pins[h] = owner.pins.get(h, 0) + 1
        return Commit(h, outcome, where)

    def discard(self, slot: int) -> None:
        """Free a landing slot whose bytes must never be used (transfer failed/cancelled)."""
        self._landing_of(slot)
        self._free_landing(slot)
        self.counters.discarded += 1

    # --- the lookup path ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> IndexMatch:
        """Committed prefix of a chain and its slots. Pure."""
        return self._index.match(hashes)

    def is_committed(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def read(self, slot: int) -> memoryview:
        """Read-only bytes of a committed block. Hold a pin while copying from it."""
        if slot not in self._committed:
            raise CacheError(f"slot {slot} holds no committed block")
        return memoryview(self._arena[slot]).toreadonly()

    def touch(self, hashes: Sequence[BlockHash]) -> int:
        """LRU: the committed prefix of ``hashes`` was just used. Returns its length."""
        return self._index.touch(hashes)

    def committed_hashes(self) -> Iterator[BlockHash]:
        return self._index.hashes()

    def parent_of(self, block_hash: BlockHash) -> BlockHash | None:
        return self._index.parent_of(block_hash)

    # --- ownership ---------------------------------------------------------------------------

    def pin(self, owner: str, hashes: Sequence[BlockHash]) -> None:
        """One pin per committed block for ``owner``; all or nothing (CacheError if one of
        them is not committed)."""
        missing = [h for h in hashes if h not in self._index]
        if missing:
            raise CacheError(f"pin of {len(missing)} blocks that are not cached")
        state = self._owners.setdefault(owner, _Owner())
        for h in hashes:
            self._index.pin(h)
            state.pins[h] = state.pins.get(h, 0) + 1

    def unpin(self, owner: str, block_hash: BlockHash) -> None:
        """Drop one of ``owner``'s pins. Raises CacheError if it holds none on the block."""
        state = self._owners.get(owner)
        if state is None or block_hash not in state.pins:
            raise CacheError(f"{owner!r} holds no pin on block {block_hash.hex()}")
        self._index.unpin(block_hash)
        state.pins[block_hash] -= 1
        if not state.pins[block_hash]:
            del state.pins[block_hash]

    def release_owner(self, owner: str) -> Released:
        """Drop every pin and landing slot of ``owner`` (the one release path of a lease).
        Idempotent: an unknown or already released owner releases nothing."""
        state = self._owners.pop(owner, None)
        if state is None:
            return Released(0, 0, ())
        unpinned = discarded = 0
        orphaned: list[int] = []
        for h, count in state.pins.items():
            for _ in range(count):
                self._index.unpin(h)
            unpinned += count
        for slot in list(state.landing):
            landing = self._landing[slot]
            if landing.writing:
                landing.owner = None
                orphaned.append(slot)
            else:
                self._free_landing(slot, owner_state=state)
                self.counters.discarded += 1
                discarded += 1
        return Released(unpinned, discarded, tuple(orphaned))

    def remove(self, block_hash: BlockHash) -> list[BlockHash]:
        """Drop a cached block and its subtree (CacheError if pinned); returns them, children
        first."""
        removed = self._index.remove(block_hash)
        for _, slot in removed:
            del self._committed[slot]
            heapq.heappush(self._free, slot)
        self.counters.removed += len(removed)
        return [h for h, _ in removed]

    def pinned_blocks(self) -> dict[BlockHash, int]:
        """Pinned blocks and their pin counts: empty once every owner released (leak check)."""
        return self._index.pinned()

    def owners(self) -> list[str]:
        return list(self._owners)

    def orphaned_slots(self) -> list[int]:
        return [s for s, landing in self._landing.items() if landing.owner is None]

    # --- internals ---------------------------------------------------------------------------

    def _landing_of(self, slot: int) -> _Landing:
        landing = self._landing.get(slot)
        if landing is None:
            raise CacheError(f"slot {slot} is not a landing slot")
        return landing

    def _forget_landing(self, slot: int, owner_state: _Owner | None = None) -> None:
        landing = self._landing.pop(slot)
        if owner_state is None and landing.owner is not None:
            owner_state = self._owners[landing.owner]
        if owner_state is not None:
            owner_state.landing.pop(slot, None)

    def _free_landing(self, slot: int, owner_state: _Owner | None = None) -> None:
        self._forget_landing(slot, owner_state)
        heapq.heappush(self._free, slot)

    def _evict(self, n: int) -> list[BlockHash]:
        evicted = self._index.evict(n)
        for _, slot in evicted:
            del self._committed[slot]
            heapq.heappush(self._free, slot)
        self.counters.evicted += len(evicted)
        return [h for h, _ in evicted]
