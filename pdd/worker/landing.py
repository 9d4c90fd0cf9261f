"""Inbound KV landing: the one state machine both receivers run (relay_decode, main_decode).

A *landing* is what a receiver holds for one request's inbound KV (keyed by the router's
``kv_request_id``): slots for its blocks, the inbound transfers' state (``InboundState``), a
lease, its landing key, and whether a Generate has consumed it. Where the bytes go is the
receiver's *slot source* (``SlotSource``): RLD's staging slot pool, MD's DRC (with its
conversion and per-chunk commit). Lifecycle of one landing::

    reserve (PrepareKv)    the source's slots for the prompt's blocks; leased (lease_s, else
                           the worker's default); with fleet credentials a fresh landing key
                           (only the P the router hands it to can fill it)
    a chunk, no landing    refused, unless the source opens landings on a chunk (RLD in a
                           fleet without credentials: "or the first chunk")
    chunk                  refused without the landing's key, or once the landing is closed;
                           else the source gives its buffer (``allocate``); the transfer is
                           seen. Verified chunks and ended transfers go to the source (commit,
                           discard)
    consume / take         a Generate took the KV: no chunk lands under it afterwards (unless
                           the source caches); one that never saw a transfer gives up now
    cancel / lease expiry  given up (a cache keeps what already fully arrived)
    keep                   CancelKv(background): no Generate will come, but a cache goes on
                           landing what arrives (as if consumed); any other source: a cancel
    release                given up, or consumed and terminal (or nothing was to come), no
                           Generate reading it (``take``) and -- unless the source caches,
                           whose open write buffers outlive a release -- no transfer open:
                           the source releases the slots; ``Recent`` keeps the outcome
    record dropped         released and no transfer open

The source either *caches* (MD's DRC: what landed outlives the request, the DRC itself guards
write buffers still open at release) or not (RLD's pool: a slot is reused as soon as it is
released). That one property decides the three places the two receivers differ: chunks after
the Generate consumed the landing, a release while a transfer is open, and whether a cancel
or lease expiry marks KV that all arrived as cancelled.

Transport threads call ``allocate`` / ``verified`` / ``received``; everything else runs on the
event loop. One lock guards the records; the source's hooks run under it, and return what is
left to do (DRC commits, block copies) once it is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pdd.errors import TransferCancelled, TransferError
from pdd.kv_geometry import KvGeometry
from pdd.transfer import ChunkHeader, InboundResult, TransferState
from pdd.transfer.ucx_auth import kv_token
from pdd.worker.inbound import (
    InboundState,
    Recent,
    Waiters,
    await_response,
    key_matches,
    new_landing_key,
    parts_of,
    split_wire_id,
)
from pdd.worker.kv_wire import KvWireCheck
from pdd.worker.roles import AwaitKvResult

log = logging.getLogger(__name__)
LEASE_EXPIRED = "lease expired"  # the one give-up that fails a transfer still arriving

Later = Callable[[], None] | None  # what a source hook leaves to do once the lock is released


class Slots(Protocol):
    """A source's slots of one landing."""

    expected: int | None  # blocks the sender will send (0: nothing); None: whatever comes


S = TypeVar("S", bound=Slots)


@dataclass
class Landing(Generic[S]):
    kv_id: str
    slots: S
    deadline: float
    key: str = ""  # its chunks' landing key ("": any sender, a fleet without credentials)
    inbound: InboundState = field(default_factory=InboundState)
    users: int = 0  # Generates whose engine request may still read the slots (``take``)
    consumed: bool = False  # a Generate took it (or it expired)
    held: bool = True  # the source still holds its slots (False: released)
    committing: bool = False  # its transfer ended and the source is still committing it
    kept: bool = False  # no Generate will read it; it lands for a later request (``keep``)

    @property
    def nothing_to_come(self) -> bool:
        return self.slots.expected == 0

    @property
    def settled_in(self) -> bool:
        """Nothing more lands: the transfer ended (and was committed), or none was due."""
        return (self.inbound.terminal and not self.committing) or self.nothing_to_come


class SlotSource(Protocol[S]):
    """Where a receiver's inbound KV lands (RLD: its slot pool; MD: its DRC). The machine
    decides when; the source only executes. Every hook runs under the landing lock; the
    ``Later`` ones return what is left to do once it is released (DRC commits, copies)."""

    noun: str  # what a landing is called in refusals
    caches: bool  # what landed outlives the landing (module docstring)
    opens_on_chunk: bool  # a chunk with no landing opens one (unkeyed fleets only)

    def open(self, kv_id: str) -> S:
        """Empty slots for a landing a chunk opens (only asked when ``opens_on_chunk``)."""
        ...

    def buffer(self, rec: Landing[S], header: ChunkHeader, src: KvGeometry | None) -> memoryview:
        """Where one chunk lands (``src``: the geometry it converts from); raises to refuse."""
        ...

    def verified(self, rec: Landing[S], header: ChunkHeader) -> Later:
        """A chunk's bytes passed the checksum: commit what is now whole (partial landing)."""
        ...

    def received(self, rec: Landing[S], done: bool) -> Later:
        """A transfer ended (``done``: DONE): commit or discard what it wrote. Not asked for
        a streamed send's part that landed with more to follow (``inbound.parts_of``): what it
        wrote stays as it is, and the next part goes on from there (P's parts end on P's block
        boundaries, not on the receiver's)."""
        ...

    def ready_blocks(self, rec: Landing[S]) -> int:
        """Blocks a Generate could load now (AwaitKv's ``blocks_ready``)."""
        ...

    def release(self, rec: Landing[S]) -> None:
        """Give the landing's slots back: the one release, called once."""
        ...


class Landings(Generic[S]):
    """The landings of one receiver over its slot source (see the module docstring)."""

    def __init__(self, source: SlotSource[S], wire_check: KvWireCheck, lease_s: float) -> None:
        self._source = source
        self.wire_check = wire_check  # this worker's geometry, per chunk
        self._default_lease_s = lease_s
        self._recs: dict[str, Landing[S]] = {}
        self._recent = Recent()
        self.waiters = Waiters()
        self._lock = threading.Lock()
        self.refused_chunks = 0  # chunks without their landing's key, or with none prepared

    @property
    def open_records(self) -> int:
        with self._lock:
            return len(self._recs)

    # --- reserve (event loop) -------------------------------------------------------------

    def reserve(
        self, kv_id: str, lease_s: float, keyed: bool, take: Callable[[S | None, float], S]
    ) -> Landing[S]:
        """``take(held, lease)``: the source's slots for the request (``held``: the landing's
        slots when it exists; raises when there is no room, or when it must not exist).
        ``keyed``: a new landing gets a key its chunks must carry."""
        lease = lease_s if lease_s > 0 else self._default_lease_s
        with self._lock:
            rec = self._recs.get(kv_id)
            slots = take(rec.slots if rec is not None else None, lease)
            deadline = time.monotonic() + lease
            if rec is None:
                key = new_landing_key() if keyed else ""
                rec = self._recs[kv_id] = Landing(kv_id, slots, deadline, key)
            else:
                rec.deadline = max(rec.deadline, deadline)
            self._recent.forget(kv_id)
        return rec

    def landing_key(self, kv_id: str) -> str:
        """The secret chunks of ``kv_id``'s landing must carry (PrepareKvResult)."""
        with self._lock:
            rec = self._recs.get(kv_id)
            return rec.key if rec is not None else ""

    # --- the receiver (transport threads) -------------------------------------------------

    def allocate(self, header: ChunkHeader) -> memoryview:
        """Where one chunk lands; raises to refuse it (and so its transfer)."""
        src = self.wire_check(header)  # refused unless it lands here; src: converted
        kv_id, key = split_wire_id(header.request_id)
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                rec = self._open(kv_id)
            if not key_matches(rec.key, key):
                self.refused_chunks += 1
                raise TransferError(f"KV of {kv_id!r}: not from the P its reservation is for")
            if not self._accepts(rec):
                raise _unwanted(kv_id, rec.inbound.cancelled)
            view = self._source.buffer(rec, header, src)
            rec.inbound.seen(header.transfer_id, header.request_id)
        return view

    def _open(self, kv_id: str) -> Landing[S]:
        """(Under the lock.) A landing for a chunk nobody prepared, or the refusal."""
        noun = self._source.noun
        if not self._source.opens_on_chunk:
            raise TransferError(f"no {noun} for the KV of {kv_id!r}")
        if (past := self._recent.get(kv_id)) is not None:
            raise _unwanted(kv_id, past.reason)
        if kv_token() is not None:  # keyed fleet: only a PrepareKv makes a landing
            self.refused_chunks += 1
            raise TransferError(f"no {noun} prepared for the KV of {kv_id!r}")
        lease = time.monotonic() + self._default_lease_s
        rec = self._recs[kv_id] = Landing(kv_id, self._source.open(kv_id), lease)
        return rec

    def _accepts(self, rec: Landing[S]) -> bool:
        """Chunks still land: held, not given up, and not consumed unless the source caches."""
        given_up = rec.inbound.cancelled is not None
        return rec.held and not given_up and (self._source.caches or not rec.consumed)

    def verified(self, header: ChunkHeader) -> None:
        """One chunk's bytes are complete and checked (the source may commit its block)."""
        with self._lock:
            rec = self._recs.get(split_wire_id(header.request_id)[0])
            later = self._source.verified(rec, header) if rec is not None else None
        if later is not None:
            later()

    def received(self, result: InboundResult) -> None:
        """A transfer ended: the source commits or discards what it wrote; waiters wake."""
        with self._lock:
            rec = self._recs.get(split_wire_id(result.request_id)[0])
            if rec is None:
                return
            rec.inbound.finish(result)
            done = result.state is TransferState.DONE
            if done and parts_of(result.request_id) is None:
                later = None  # a part landed and more follow: a block it began goes on there
            else:
                later = self._source.received(rec, done)
            rec.committing = later is not None
        if later is not None:  # a Generate waiting for the KV wakes after this, not before
            later()
            with self._lock:
                rec.committing = False
        self.waiters.notify_threadsafe(rec.kv_id, lambda: self.settle(rec))

    # --- Generate and the KV RPCs (event loop) --------------------------------------------

    def expecting(self, kv_id: str) -> bool:
        """KV for ``kv_id`` is reserved here and still on its way (Generate waits for it)."""
        with self._lock:
            rec = self._recs.get(kv_id)
            return rec is not None and not rec.settled_in

    def terminal(self, kv_id: str) -> bool:
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return kv_id in self._recent
            return rec.settled_in

    async def await_kv(self, kv_id: str, timeout_s: float) -> AwaitKvResult:
        await self.waiters.wait_until(kv_id, lambda: self.terminal(kv_id), timeout_s)
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is not None:
                state, reason = rec.inbound.outcome()
                if rec.nothing_to_come and state == "pending":
                    state = "done"  # nothing to receive: everything was cached
                blocks = self._source.ready_blocks(rec)
                return await_response(state, rec.inbound.bytes_received, blocks, reason)
        return self._recent.response(kv_id)

    def consume(self, kv_id: str) -> None:
        """A Generate took the request's KV (it reads what landed, or pins it by itself).

        If no transfer of it was ever seen (P's send failed before its first chunk, or is
        stuck behind a dead link), the Generate computes the prompt and nobody will use these
        slots: the landing is given up now, and chunks arriving later are refused, rather
        than holding the slots until the lease expires. A transfer already open keeps them
        until it ends."""
        rec, _ = self._consume(kv_id, use=False)
        if rec is not None:
            self.settle(rec)

    def take(self, kv_id: str) -> Landing[S] | None:
        """``consume``, and the landing if all its KV arrived: its slots stay held for the
        caller, who reads them and calls ``done_with`` once the engine let go of them."""
        rec, used = self._consume(kv_id, use=True)
        if rec is None or used:
            return rec
        state, reason = rec.inbound.outcome()
        log.info("request %s: KV %s (%s), computing the prompt", kv_id, state, reason)
        self.settle(rec)
        return None

    def done_with(self, rec: Landing[S]) -> None:
        """A ``take``r's engine request will not read the slots any more."""
        with self._lock:
            rec.users -= 1
        self.settle(rec)

    def _consume(self, kv_id: str, use: bool) -> tuple[Landing[S] | None, bool]:
        """Mark the landing consumed; with ``use``, a user of it if all its KV arrived."""
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return None, False
            rec.consumed = True
            idle = rec.inbound.never_seen and not rec.nothing_to_come
            if idle:
                rec.inbound.cancelled = "consumed before its KV arrived"
            used = use and rec.inbound.done
            rec.users += used
        if idle:
            log.warning("KV of %s: never arrived; its landing slots are released", kv_id)
            self.waiters.notify(kv_id)
        return rec, used

    def cancel(self, kv_id: str, reason: str) -> bool:
        """Give the request's landing up (CancelKv); False when there is none."""
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return False
            self._give_up(rec, reason or "cancelled")
        self.waiters.notify(kv_id)
        self.settle(rec)
        return True

    def keep(self, kv_id: str, reason: str) -> bool:
        """No Generate will read the request's KV, but what lands is worth keeping
        (CancelKv(background)): a caching source goes on landing it and releases when the
        transfer ends or the lease does; any other source gives it up. False: none here."""
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return False
            if self._source.caches:
                rec.consumed = rec.kept = True  # released once settled in (``_releasable``)
            else:
                self._give_up(rec, reason or "cancelled")
        self.waiters.notify(kv_id)
        self.settle(rec)
        return True

    def kept_blocks(self, held: Callable[[S], int]) -> int:
        """What the kept landings still open hold (``held`` of each one's slots): room a new
        request gets when it needs it (``give_up_kept``)."""
        with self._lock:
            return sum(held(r.slots) for r in self._recs.values() if r.kept and r.held)

    def give_up_kept(self, why: str) -> int:
        """Give up every kept landing still open (a new request needs their slots more than
        a later one needs their KV); what already landed stays. Returns how many."""
        with self._lock:
            kept = [r for r in self._recs.values() if r.kept and r.held]
            for rec in kept:
                self._give_up(rec, why)
        for rec in kept:
            self.waiters.notify(rec.kv_id)
            self.settle(rec)
        return len(kept)

    def _give_up(self, rec: Landing[S], why: str) -> None:
        """(Under the lock.) A cache keeps KV that all arrived: only the rest is cancelled."""
        kept = rec.inbound.done and self._source.caches
        if rec.inbound.cancelled is None and not kept:
            rec.inbound.cancelled = why
        rec.consumed = True

    # --- release (event loop) -------------------------------------------------------------

    def settle(self, rec: Landing[S]) -> None:
        """Release the slots / drop the record once nothing needs them (module docstring)."""
        with self._lock:
            if self._recs.get(rec.kv_id) is not rec:
                return
            if rec.held and self._releasable(rec):
                blocks = self._source.ready_blocks(rec)
                self._source.release(rec)
                rec.held = False
                self._recent.put(rec.kv_id, rec.inbound, blocks)
            if not rec.held and not rec.inbound.open:
                del self._recs[rec.kv_id]

    def _releasable(self, rec: Landing[S]) -> bool:
        ended = rec.settled_in
        over = rec.inbound.cancelled is not None or (rec.consumed and ended)
        return over and not rec.users and (self._source.caches or not rec.inbound.open)

    def expire(self, now: float) -> None:
        """Give up the landings whose lease passed (no Generate reading them)."""
        with self._lock:
            expired = [
                r for r in self._recs.values() if r.held and r.deadline <= now and not r.users
            ]
            for rec in expired:
                self._give_up(rec, LEASE_EXPIRED)
        for rec in expired:
            log.warning("KV %s of %s: lease expired, releasing it", self._source.noun, rec.kv_id)
            self.waiters.notify(rec.kv_id)
            self.settle(rec)

    def release_all(self) -> None:
        """The worker stops: every slot back (the engine and transports are gone)."""
        with self._lock:
            recs, self._recs = list(self._recs.values()), {}
            for rec in recs:
                if rec.held:
                    self._source.release(rec)
                    rec.held = False


def _unwanted(kv_id: str, why: str | None) -> TransferError:
    """The refusal of a chunk whose landing was given up: the transfer is cancelled (its
    sender's outcome too) when the request moved on (CancelKv, handed off, computed,
    released), and fails when the landing's lease ran out before the KV arrived."""
    msg = f"KV of {kv_id!r} is no longer wanted here" + (f" ({why})" if why else "")
    return TransferError(msg) if why == LEASE_EXPIRED else TransferCancelled(msg)
