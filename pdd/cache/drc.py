"""The Decode-side RadixCache (DRC): MainDecode's KV of earlier turns, and its export.

Owns one HostTier (arena + radix index), the *lease* of each request (its pins and landing
slots, keyed by request id, with a deadline), the event log and snapshots routers replicate,
and the stats. The MainDecode role and the KV connector (pdd.engine) decide; the DRC executes.

Lifecycle of a block, as one request sees it::

    reserve(rid, prompt_hashes)
      ├─ cached prefix ─────────────────────────────> pinned by the lease, touched
      └─ missing blocks -> landing slots (evicting LRU unpinned leaves; BlockRemoved)
    landing_buffer(rid, h) -> memoryview     the transport writes the WAN bytes into it
                                             (or the connector copies a block from the device)
    land(rid, h)       the bytes are complete. Landed blocks commit in chain order as soon as
                       their parent is cached: visible to match(), exported as BlockStored,
                       pinned by the lease. A block landed by another request first is stored
                       once (the lease pins that one).
    discard(rid, h)    the block's transfer failed: its slot is freed, its bytes never used.
    release(rid)       done | failed | cancelled, or expire() past the deadline: the only
                       release path. Pins drop (the blocks become most recently used and
                       evictable); slots that never landed are freed.
    evicted            LRU leaf-first when a later reservation needs room (BlockRemoved).

Blocks MainDecode computes itself (its output tokens, a gap it recomputed) enter the same
way: a reservation under an owner key of their own, landed by copying from the device.

``landing_buffer`` and ``read`` hand out views into the arena; their user finishes with them
(``land``/``discard`` for writes, the end of the copy for reads) before ``release``. A write
buffer still open at release is left to its writer and freed by its ``land``/``discard``, so
a slot is never reused while a late writer may still copy into it.

Export: ``snapshot()`` and ``events_since(seq)`` (pdd.cache.messages) feed the router's
PrefixIndexView (pdd.cache.view). Thread-safe: every public method holds one lock, so
transport threads and the engine may call it.

Why an event feed of its own and not vLLM's KV events (``KVEventsConfig``,
``vllm.distributed.kv_events``: BlockStored / BlockRemoved / AllBlocksCleared over ZMQ): those
describe vLLM's own block pool, whose blocks the scheduler evicts whenever it needs room; the
DRC is a different store (host-tier slots that outlive vLLM's blocks, filled by WAN landings
that vLLM never sees, pinned by leases) keyed by pdd's model-salted hash chains. So its events
are its own, in the same shape as vLLM's (a BlockStored names its parent hash and a chain in
order; a BlockRemoved names hashes), and the router replicates them over gRPC (DrcEvents)
with a sequence number and snapshots to resync, which vLLM's replay endpoint covers only for
a bounded number of steps.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from pdd.cache.hashing import BlockHash
from pdd.cache.host_tier import CommitOutcome, HostTier
from pdd.cache.messages import (
    BlockRemoved,
    BlockStored,
    DrcEvent,
    DrcEventBatch,
    DrcSnapshot,
    DrcStats,
)
from pdd.config.cache import CacheConfig
from pdd.errors import CacheError, CacheFullError


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The cached whole-block prefix of a prompt and the host slots holding it."""

    cached_blocks: int
    cached_tokens: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reservation:
    """What ``reserve`` set up: ``cached_blocks`` leading blocks pinned, landing slots for
    ``receive`` (the rest of the chain, in order)."""

    request_id: str
    cached_blocks: int
    cached_tokens: int
    receive: tuple[BlockHash, ...]


@dataclass(slots=True)
class _Lease:
    chain: tuple[BlockHash, ...]
    ready: int  # leading blocks of chain cached and pinned by this lease
    deadline: float
    slots: dict[BlockHash, int]  # landing slots of blocks not yet committed, chain order
    landed: set[BlockHash] = field(default_factory=set)


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    expired: int = 0


class DecodeRadixCache:
    """MainDecode's DRC: match, reserve, land, release, export (see module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        block_bytes: int,
        block_size: int,
        *,
        tier: HostTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``tier``: the host tier to keep blocks in (MainDecode's: over the shared arena the
        connector maps); default a private one of ``config.host_slots(block_bytes)`` slots."""
        if tier is not None and tier.block_bytes != block_bytes:
            raise ValueError(f"DRC: tier blocks of {tier.block_bytes} bytes, want {block_bytes}")
        self._config = config
        self._block_size = block_size
        self._clock = clock
        self._tier = (
            tier if tier is not None else HostTier(config.host_slots(block_bytes), block_bytes)
        )
        self._leases: dict[str, _Lease] = {}
        self._orphans: dict[tuple[str, BlockHash], int] = {}
        self._log: deque[DrcEvent] = deque(maxlen=config.event_log_size)
        self._seq = 0
        self._epoch = uuid.uuid4().hex
        self._counters = _Counters()
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def epoch(self) -> str:
        return self._epoch

    # --- queries -----------------------------------------------------------------------------

    def match(self, prompt_hashes: Sequence[BlockHash]) -> MatchResult:
        """The prompt's cached prefix now. No LRU update, no pin: it may be evicted later."""
        with self._lock:
            self._counters.lookups += 1
            found = self._tier.lookup(prompt_hashes)
            return self._result(found.num_blocks, found.handles)

    def can_reserve(self, prompt_hashes: Sequence[BlockHash]) -> bool:
        """Whether ``reserve`` would find room for the prompt's missing blocks now."""
        with self._lock:
            cached = self._tier.lookup(prompt_hashes).num_blocks
            missing = len(prompt_hashes) - cached
            return self._tier.can_allocate(missing, keep=prompt_hashes[:cached])

    def ready(self, request_id: str) -> MatchResult:
        """The leading blocks of the request's chain that are cached and pinned by its lease
        (what the connector may load into the device cache now)."""
        with self._lock:
            lease = self._lease(request_id)
            found = self._tier.lookup(lease.chain[: lease.ready])
            return self._result(found.num_blocks, found.handles)

    def read(self, slot: int) -> memoryview:
        """Bytes of a committed block; the caller holds a lease pinning it."""
        with self._lock:
            return self._tier.read(slot)

    # --- the lease of one request ----------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_hashes: Sequence[BlockHash],
        *,
        num_prompt_tokens: int | None = None,
        ttl_s: float | None = None,
    ) -> Reservation:
        """Pin the prompt's cached prefix and allocate landing slots for the rest.

        ``prompt_hashes`` is the prompt's whole chain (pdd.cache.hashing); reserve a shorter
        chain to receive fewer blocks. Raises CacheError if ``request_id`` holds a lease and
        CacheFullError (nothing held) when the missing blocks do not fit.
        """
        chain = tuple(prompt_hashes)
        with self._lock:
            if request_id in self._leases or any(r == request_id for r, _ in self._orphans):
                raise CacheError(f"request {request_id!r} already holds a DRC lease")
            cached = self._tier.lookup(chain).num_blocks
            need = chain[cached:]
            if not self._tier.can_allocate(len(need), keep=chain[:cached]):
                raise CacheFullError(
                    f"DRC: {len(need)} blocks to land, {self._tier.num_free} free and "
                    f"{self._tier.num_evictable} evictable"
                )
            self._tier.pin(request_id, chain[:cached])
            parent = chain[cached - 1] if cached else None
            alloc = self._tier.allocate(request_id, need, parent)
            self._emit_removed(alloc.evicted)
            self._tier.touch(chain[:cached])
            ttl = self._config.lease_ttl_s if ttl_s is None else ttl_s
            slots = dict(zip(need, alloc.slots, strict=True))
            self._leases[request_id] = _Lease(chain, cached, self._clock() + ttl, slots)
            self._count_request(len(chain), cached, num_prompt_tokens)
            return Reservation(request_id, cached, cached * self._block_size, need)

    def landing_buffer(self, request_id: str, block_hash: BlockHash) -> memoryview | None:
        """Where to write the block's bytes; None when the lease does not expect it (already
        cached at reserve, or landed): drop those bytes. Raises CacheError without a lease."""
        with self._lock:
            lease = self._lease(request_id)
            slot = lease.slots.get(block_hash)
            if slot is None or block_hash in lease.landed:
                return None
            return self._tier.write(slot)

    def landing_slots(self, request_id: str) -> list[int]:
        """The slots of the lease's blocks still to land, in chain order, for a writer that
        fills them in place (the engine's connector, through the shared arena). Each is
        marked as being written, so it is never reused before ``land`` or ``discard``."""
        with self._lock:
            lease = self._lease(request_id)
            slots = [slot for h, slot in lease.slots.items() if h not in lease.landed]
            for slot in slots:
                self._tier.write(slot)
            return slots

    def land(self, request_id: str, block_hash: BlockHash) -> int:
        """The block's bytes are complete. Commits every landed block of the chain whose
        parent is cached, in order; returns how many blocks became ready for this request."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return self._end_orphan(request_id, block_hash, commit=True)
            slot = lease.slots.get(block_hash)
            if slot is None:
                return 0
            self._tier.finish_write(slot)
            lease.landed.add(block_hash)
            return self._advance(lease)

    def discard(self, request_id: str, block_hash: BlockHash) -> None:
        """The block's transfer failed: free its landing slot. Blocks after it in the chain
        cannot commit any more; they are freed at release."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                self._end_orphan(request_id, block_hash, commit=False)
                return
            slot = lease.slots.pop(block_hash, None)
            if slot is not None:
                lease.landed.discard(block_hash)
                self._tier.discard(slot)

    def release(self, request_id: str) -> bool:
        """End the request's lease (done, failed, cancelled): its blocks become most recently
        used and unpinned, landing slots never landed are freed. False if it held none."""
        with self._lock:
            return self._release(request_id)

    def renew(self, request_id: str, ttl_s: float | None = None) -> None:
        """Push the lease's deadline to now + ttl (default ``cache.lease_ttl_s``)."""
        with self._lock:
            ttl = self._config.lease_ttl_s if ttl_s is None else ttl_s
            self._lease(request_id).deadline = self._clock() + ttl

    def expire(self) -> list[str]:
        """Release every lease past its deadline (the backstop for lost releases); called
        periodically by the MainDecode role. Returns the expired request ids."""
        with self._lock:
            now = self._clock()
            expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
            for rid in expired:
                self._release(rid)
            self._counters.expired += len(expired)
            return expired

    # --- whole-cache operations ------------------------------------------------------------

    def touch(self, prompt_hashes: Sequence[BlockHash]) -> int:
        """LRU: the prompt's cached prefix was just used. Returns its length in blocks."""
        with self._lock:
            return self._tier.touch(prompt_hashes)

    def remove(self, block_hash: BlockHash) -> int:
        """Drop a cached block and every block after it (CacheError if one is pinned)."""
        with self._lock:
            removed = self._tier.remove(block_hash)
            self._emit_removed(removed)
            return len(removed)

    def snapshot(self) -> DrcSnapshot:
        with self._lock:
            blocks = tuple(self._tier.committed_hashes())
            return DrcSnapshot(
                epoch=self._epoch, seq=self._seq, block_size=self._block_size, block_hashes=blocks
            )

    def events_since(self, seq: int) -> DrcEventBatch:
        """Retained events numbered after ``seq``; a view detects dropped ones by number."""
        with self._lock:
            first = self._log[0].seq if self._log else self._seq + 1
            start = max(0, seq + 1 - first)
            events = tuple(islice(self._log, start, None))
            return DrcEventBatch(
                epoch=self._epoch, block_size=self._block_size, last_seq=self._seq, events=events
            )

    def pinned_blocks(self) -> dict[BlockHash, int]:
        """Pinned blocks and pin counts: empty once every lease ended (leak check)."""
        with self._lock:
            return self._tier.pinned_blocks()

    def active_requests(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def stats(self) -> DrcStats:
        with self._lock:
            return self._stats()

    # --- internals (the lock is held) ------------------------------------------------------

    def _lease(self, request_id: str) -> _Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise CacheError(f"request {request_id!r} holds no DRC lease")
        return lease

    def _result(self, blocks: int, slots: tuple[int, ...]) -> MatchResult:
        return MatchResult(blocks, blocks * self._block_size, slots)

    def _advance(self, lease: _Lease) -> int:
        """Commit landed blocks in chain order while their parent is cached."""
        start = lease.ready
        stored: list[BlockHash] = []
        while lease.ready < len(lease.chain):
            h = lease.chain[lease.ready]
            slot = lease.slots.get(h)
            if slot is None or h not in lease.landed or not self._tier.can_commit(slot):
                break
            commit = self._tier.commit(slot)
            del lease.slots[h]
            lease.landed.discard(h)
            if commit.outcome is CommitOutcome.STORED:
                stored.append(h)
            else:  # a run of stored blocks ends at a duplicate
                self._emit_stored(stored)
                stored = []
            lease.ready += 1
        self._emit_stored(stored)
        return lease.ready - start

    def _release(self, request_id: str) -> bool:
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._tier.touch(lease.chain[: lease.ready])
        released = self._tier.release_owner(request_id)
        by_slot = {slot: h for h, slot in lease.slots.items()}
        for slot in released.orphaned:
            self._orphans[(request_id, by_slot[slot])] = slot
        return True

    def _end_orphan(self, request_id: str, block_hash: BlockHash, *, commit: bool) -> int:
        slot = self._orphans.pop((request_id, block_hash), None)
        if slot is None:
            raise CacheError(f"request {request_id!r} holds no DRC lease")
        if commit:
            self._tier.commit(slot)  # frees the slot: its owner is gone
        else:
            self._tier.discard(slot)
        return 0

    def _emit_stored(self, chain: list[BlockHash]) -> None:
        if chain:
            parent = self._tier.parent_of(chain[0])
            self._seq += 1
            self._log.append(BlockStored(seq=self._seq, parent_hash=parent, block_hashes=chain))

    def _emit_removed(self, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self._seq += 1
            self._log.append(BlockRemoved(seq=self._seq, block_hashes=tuple(hashes)))

    def _count_request(self, blocks: int, cached: int, num_prompt_tokens: int | None) -> None:
        c = self._counters
        c.requests += 1
        c.prompt_tokens += (
            blocks * self._block_size if num_prompt_tokens is None else num_prompt_tokens
        )
        c.hit_tokens += cached * self._block_size

    def _stats(self) -> DrcStats:
        tier, c = self._tier, self._tier.counters
        capacity = tier.num_slots
        return DrcStats(
            epoch=self._epoch,
            block_size=self._block_size,
            block_bytes=tier.block_bytes,
            capacity_blocks=capacity,
            committed_blocks=tier.num_committed,
            landing_blocks=tier.num_landing,
            free_blocks=tier.num_free,
            pinned_blocks=len(tier.pinned_blocks()),
            evictable_blocks=tier.num_evictable,
            fill_ratio=(tier.num_committed + tier.num_landing) / capacity if capacity else 0.0,
            lookups=self._counters.lookups,
            requests=self._counters.requests,
            prompt_tokens=self._counters.prompt_tokens,
            hit_tokens=self._counters.hit_tokens,
            stored_blocks=c.stored,
            deduplicated_blocks=c.deduplicated,
            discarded_blocks=c.discarded,
            evicted_blocks=c.evicted,
            removed_blocks=c.removed,
            active_leases=len(self._leases),
            expired_leases=self._counters.expired,
            event_seq=self._seq,
        )
