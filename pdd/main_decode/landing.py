"""MainDecode's inbound KV: WAN blocks land in the DRC under a PrepareKv reservation.

Owns the *reservations*: per kv_request_id, the prompt's block hash chain, the DRC lease
``reserve`` took (cached prefix pinned, landing slots for the rest) and the inbound transfer's
state. Lifecycle of one reservation::

    PrepareKv(prompt)    hashes (pdd.cache.hashing, model_salt), drc.reserve -> cached_blocks,
                         reserved_blocks, this worker's address (RESOURCE_EXHAUSTED when the
                         DRC cannot make room); leased (PrepareKv.lease_s)
                         and a fresh landing key: the router hands it to the P it chose
                         (SendKv), so only that P, for that request, can fill it
    chunk of block i     allocate: its request id must be ``kv_id#landing_key`` (anything
                         else is refused, so a forged sender cannot poison the DRC under this
                         prompt's hashes) -> drc.landing_buffer(kv_id, chain[i]); a block the
                         DRC already holds lands in a throw-away buffer. KV P sends in
                         another dtype, layout or block size (``KvWireCheck`` names it): P's
                         block i lands in a scratch buffer, and takes landing slots for the
                         DRC blocks its tokens fall in
    chunk verified       (the transport's on_verified: bytes complete, checksum passed) once
                         every byte of block i is verified, drc.land(kv_id, chain[i]) at once:
                         the DRC commits landed blocks in chain order (visible to match(),
                         exported as BlockStored), so what is committed is always a prefix.
                         Converted: once P's block is verified its tokens are copied into the
                         DRC blocks it overlaps (``kv_convert.Regroup``); a DRC block every
                         token of which came is converted into its slot and landed. One that
                         P's whole blocks do not cover (the prompt's tail with P's larger
                         blocks) never lands: MD computes those tokens
    transfer DONE        drc.land any written block not landed yet; FAILED/CANCELLED (a cut,
                         a cancel, a deadline): drc.discard the blocks not wholly verified.
                         The verified prefix stays committed (the next turn's cached blocks);
                         a verified block after a gap never commits (freed at release), and
                         no half-written block is ever visible
    lease released       consumed by a Generate and the transfer terminal, or nothing was to
                         be received; or CancelKv; or the lease expired; or a Generate
                         consumed it before any transfer arrived. Then drc.release:
                         landed blocks stay cached (LRU), unlanded slots are freed
    record dropped       lease released and no transfer open (``Recent`` keeps the outcome)

Transport threads run ``allocate`` / ``received`` under ``_lock``; the DRC has its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import BlockHash
from pdd.errors import CacheError, ConfigError, InvalidRequestError, TransferError
from pdd.kv_geometry import RECEIVER_CONVERTS, KvGeometry
from pdd.protocol import Role
from pdd.transfer import ChunkHeader, InboundResult, TransferState
from pdd.worker.inbound import (
    InboundState,
    Recent,
    Waiters,
    await_response,
    key_matches,
    new_landing_key,
    split_wire_id,
)
from pdd.worker.kv_convert import Regroup
from pdd.worker.kv_wire import KvWireCheck
from pdd.worker.roles import AwaitKvResult

log = logging.getLogger(__name__)

LEASE_SLACK_S = 5.0  # the DRC's own backstop expires a little after ours


@dataclass
class _Converting:
    """A reservation's KV that P sends in another dtype, layout or block size: P's blocks in
    scratch until verified, then regrouped into MD's blocks (``kv_convert.Regroup``)."""

    regroup: Regroup  # P's geometry -> MD's
    bufs: dict[int, bytearray] = field(default_factory=dict)  # P's block -> its bytes
    parts: dict[int, dict[int, int]] = field(default_factory=dict)  # P's block -> verified
    slots: dict[int, memoryview] = field(default_factory=dict)  # MD's block -> its DRC slot


@dataclass
class Reservation:
    kv_id: str
    chain: tuple[BlockHash, ...]
    expected: int  # blocks the DRC lacked at PrepareKv (what P sends)
    deadline: float
    inbound: InboundState = field(default_factory=InboundState)
    written: dict[int, BlockHash] = field(default_factory=dict)  # given a landing buffer
    verified: dict[int, dict[int, int]] = field(default_factory=dict)  # block -> offset: bytes
    landed: set[int] = field(default_factory=set)  # wholly verified and handed to drc.land
    converting: _Converting | None = None  # P sends KV in another geometry
    consumed: bool = False
    leased: bool = True
    landing_key: str = ""  # "": any sender (a fleet without a worker token)


class DrcLanding:
    """PrepareKv / AwaitKv / CancelKv and the TCP receiver's hooks, over one DRC."""

    def __init__(
        self,
        drc: DecodeRadixCache,
        slot_bytes: int,
        default_lease_s: float,
        geometry: Callable[[], KvGeometry | None] = lambda: None,
    ) -> None:
        self._drc = drc
        self._slot_bytes = slot_bytes
        self._geometry = geometry  # MD's own (the engine's)
        converts = RECEIVER_CONVERTS[Role.MAIN_DECODE]
        self.wire_check = KvWireCheck(slot_bytes, geometry, converts)
        self._default_lease_s = default_lease_s
        self._recs: dict[str, Reservation] = {}
        self._recent = Recent()
        self.waiters = Waiters()
        self._lock = threading.Lock()
        self.query_tokens = 0  # prompt tokens routed here (PrepareKv)
        self.hit_tokens = 0  # of which the DRC held at PrepareKv
        self.refused_chunks = 0  # chunks without their reservation's landing key

    @property
    def open_records(self) -> int:
        with self._lock:
            return len(self._recs)

    # --- RPCs (event loop) ----------------------------------------------------------------

    def prepare(
        self,
        kv_id: str,
        chain: list[BlockHash],
        n_tokens: int,
        lease_s: float,
        keyed: bool = False,
    ):
        """drc.reserve for the prompt; returns it (CacheFullError when there is no room).
        ``keyed``: the reservation gets a landing key its chunks must carry."""
        lease = lease_s if lease_s > 0 else self._default_lease_s
        with self._lock:
            if kv_id in self._recs:
                raise InvalidRequestError(f"KV of request {kv_id!r} is already prepared here")
            res = self._drc.reserve(
                kv_id, chain, num_prompt_tokens=n_tokens, ttl_s=lease + LEASE_SLACK_S
            )
            rec = Reservation(kv_id, tuple(chain), len(res.receive), time.monotonic() + lease)
            rec.landing_key = new_landing_key() if keyed else ""
            self._recs[kv_id] = rec
            self._recent.forget(kv_id)
            self.query_tokens += n_tokens
            self.hit_tokens += res.cached_tokens
        return res

    def landing_key(self, kv_id: str) -> str:
        """The secret chunks of ``kv_id``'s reservation must carry (PrepareKvResponse)."""
        with self._lock:
            rec = self._recs.get(kv_id)
            return rec.landing_key if rec is not None else ""

    def terminal(self, kv_id: str) -> bool:
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return kv_id in self._recent
            return rec.inbound.terminal or rec.expected == 0

    def expecting(self, kv_id: str) -> bool:
        """KV for ``kv_id`` is reserved here and still on its way (Generate waits for it)."""
        with self._lock:
            rec = self._recs.get(kv_id)
            return rec is not None and not (rec.inbound.terminal or rec.expected == 0)

    async def await_kv(self, kv_id: str, timeout_s: float) -> AwaitKvResult:
        await self.waiters.wait_until(kv_id, lambda: self.terminal(kv_id), timeout_s)
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is not None:
                state, reason = rec.inbound.outcome()
                if rec.expected == 0 and state == "pending":
                    state = "done"  # nothing to receive: everything was cached
                blocks = self._ready_blocks(rec)
                return await_response(state, rec.inbound.bytes_received, blocks, reason)
        return self._recent.response(kv_id)

    def cancel(self, kv_id: str, reason: str) -> bool:
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return False
            if rec.inbound.cancelled is None and not rec.inbound.done:
                rec.inbound.cancelled = reason or "cancelled"
            rec.consumed = True
        self.waiters.notify(kv_id)
        self.settle(rec)
        return True

    def consume(self, kv_id: str) -> None:
        """A Generate took the request's KV (it pinned what it loads by itself).

        If no transfer of it was ever seen (P's send failed before its first chunk, or is
        stuck behind a dead link), the Generate recomputes the prompt and nobody will use
        these slots: the reservation is given up now, and chunks arriving later are refused,
        rather than holding the landing slots until the lease expires. A transfer already
        open keeps its slots until it ends (what lands is cached for the next turn)."""
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None:
                return
            rec.consumed = True
            idle = not rec.inbound.open and not rec.inbound.terminal and rec.expected > 0
            if idle and rec.inbound.cancelled is None:
                rec.inbound.cancelled = "consumed before its KV arrived"
        if idle:
            log.warning("KV of %s: never arrived; its landing slots are released", kv_id)
            self.waiters.notify(kv_id)
        self.settle(rec)

    def settle(self, rec: Reservation) -> None:
        """Release the lease / drop the record once nothing needs them (module docstring)."""
        with self._lock:
            if self._recs.get(rec.kv_id) is not rec:
                return
            ended = rec.inbound.terminal or rec.expected == 0
            if rec.leased and (rec.inbound.cancelled is not None or (rec.consumed and ended)):
                blocks = self._ready_blocks(rec)
                self._drc.release(rec.kv_id)
                rec.leased = False
                self._recent.put(rec.kv_id, rec.inbound, blocks)
            if not rec.leased and not rec.inbound.open:
                del self._recs[rec.kv_id]

    def expire(self, now: float) -> None:
        with self._lock:
            expired = [r for r in self._recs.values() if r.deadline <= now]
            for rec in expired:
                if rec.inbound.cancelled is None and not rec.inbound.done:
                    rec.inbound.cancelled = "lease expired"
                rec.consumed = True
        for rec in expired:
            log.warning("DRC reservation of %s: lease expired, releasing it", rec.kv_id)
            self.waiters.notify(rec.kv_id)
            self.settle(rec)

    def release_all(self) -> None:
        with self._lock:
            recs, self._recs = list(self._recs.values()), {}
        for rec in recs:
            if rec.leased:
                self._drc.release(rec.kv_id)

    def _ready_blocks(self, rec: Reservation) -> int:
        if not rec.leased:
            return self._drc.match(rec.chain).cached_blocks
        try:
            return self._drc.ready(rec.kv_id).cached_blocks
        except CacheError:
            return 0

    # --- the receiver (transport threads) -------------------------------------------------

    def allocate(self, header: ChunkHeader) -> memoryview:
        """Where one chunk lands; raises to refuse it (and so its transfer)."""
        (kv_id, key), i = split_wire_id(header.request_id), header.block_start
        src = self.wire_check(header)  # refused unless it lands here; src: converted
        with self._lock:
            rec = self._recs.get(kv_id)
            if rec is None or not rec.leased or rec.inbound.cancelled is not None:
                raise TransferError(f"no DRC reservation for the KV of {kv_id!r}")
            if not key_matches(rec.landing_key, key):
                self.refused_chunks += 1
                raise TransferError(f"KV of {kv_id!r}: not from the P its reservation is for")
            if src is not None:
                conv = self._converting(rec, src)
            elif i >= len(rec.chain):
                raise TransferError(f"KV of {kv_id!r}: block {i} is past the prompt's blocks")
            rec.inbound.seen(header.transfer_id)
        if src is not None:
            return self._allocate_converted(rec, conv, header)
        buf = self._drc.landing_buffer(kv_id, rec.chain[i])  # CacheError: the lease ended
        if buf is None:  # the DRC already holds it: read the bytes and drop them
            return memoryview(bytearray(header.nbytes))
        with self._lock:
            rec.written[i] = rec.chain[i]
        return buf[header.offset : header.offset + header.nbytes]

    def verified(self, header: ChunkHeader) -> None:
        """One chunk's bytes are complete and checked; land its block once all of it is."""
        i = header.block_start
        with self._lock:
            rec = self._recs.get(split_wire_id(header.request_id)[0])
            if rec is None:
                return
            conv = rec.converting
            if conv is not None:
                ready = self._verified_converted(rec, conv, header)
            else:
                if i not in rec.written or i in rec.landed:
                    return  # a throw-away buffer (already cached), or a duplicate
                parts = rec.verified.setdefault(i, {})
                parts[header.offset] = header.nbytes
                if not rec.leased or not _covers(parts, self._slot_bytes):
                    return  # more chunks of the block to come (or the lease ended: discarded)
                rec.landed.add(i)
                block_hash = rec.written[i]
        if conv is None:
            self._land(rec.kv_id, block_hash, commit=True)
            return
        for block_hash, data, slot in ready:
            self._land(rec.kv_id, block_hash, commit=_write(data, slot))

    def received(self, result: InboundResult) -> None:
        with self._lock:
            rec = self._recs.get(split_wire_id(result.request_id)[0])
            if rec is None:
                return
            rec.inbound.finish(result)
            done = result.state is TransferState.DONE
            conv, ready = rec.converting, []
            if conv is not None:
                if done:  # every byte arrived: the blocks not distributed yet are whole
                    for i in sorted(conv.bufs):
                        ready += self._distribute(rec, conv, i)
                conv.bufs.clear()
                conv.parts.clear()
                conv.slots.clear()
            pending = [rec.written[i] for i in sorted(rec.written) if i not in rec.landed]
            rec.written.clear()
            rec.verified.clear()
        for block_hash, data, slot in ready:
            self._land(rec.kv_id, block_hash, commit=_write(data, slot))
        # DONE: the rest lands (a converted block still missing tokens never does); else:
        # none half-written
        for block_hash in pending:
            self._land(rec.kv_id, block_hash, commit=done and conv is None)
        self.waiters.notify_threadsafe(rec.kv_id, lambda: self.settle(rec))

    # --- KV in another geometry (under _lock unless said) ---------------------------------

    def _converting(self, rec: Reservation, src: KvGeometry) -> _Converting:
        """The reservation's conversion from ``src``; TransferError for a second geometry."""
        conv = rec.converting
        if conv is None:
            own = self._geometry()
            assert own is not None, "a converted chunk passed the check of a known geometry"
            try:
                conv = rec.converting = _Converting(Regroup(src, own))
            except ConfigError as exc:
                raise TransferError(f"KV of {rec.kv_id!r}: {exc.message}") from exc
        elif conv.regroup.src != src:
            raise TransferError(f"KV of {rec.kv_id!r}: chunks in two KV geometries")
        return conv

    def _allocate_converted(self, rec: Reservation, conv: _Converting, header: ChunkHeader):
        """(Not under the lock.) The scratch of P's block; DRC slots for the blocks it fills."""
        i = header.block_start
        with self._lock:
            want = [j for j in conv.regroup.targets(i) if j < len(rec.chain)]
            new = [j for j in want if j not in rec.written and j not in rec.landed]
        if not want:  # tokens past the prompt's last whole block here: read and drop
            return memoryview(bytearray(header.nbytes))
        for j in new:
            slot = self._drc.landing_buffer(rec.kv_id, rec.chain[j])  # None: already held
            if slot is not None:
                with self._lock:
                    rec.written[j] = rec.chain[j]
                    conv.slots[j] = slot
        with self._lock:
            buf = conv.bufs.setdefault(i, bytearray(conv.regroup.src.block_bytes))
        return memoryview(buf)[header.offset : header.offset + header.nbytes]

    def _verified_converted(self, rec: Reservation, conv: _Converting, header: ChunkHeader):
        i = header.block_start
        if i not in conv.bufs:
            return []  # a throw-away buffer, or a duplicate
        parts = conv.parts.setdefault(i, {})
        parts[header.offset] = header.nbytes
        if not rec.leased or not _covers(parts, conv.regroup.src.block_bytes):
            return []
        return self._distribute(rec, conv, i)

    def _distribute(self, rec: Reservation, conv: _Converting, i: int):
        """P's block ``i`` is whole: its tokens go into the DRC blocks it overlaps; the
        blocks that became whole, as (hash, bytes in MD's geometry, DRC slot)."""
        data = conv.bufs.pop(i)
        conv.parts.pop(i, None)
        wanted = [j for j in conv.regroup.targets(i) if j in rec.written and j not in rec.landed]
        done = conv.regroup.put(i, data, wanted) if wanted else {}
        rec.landed.update(done)
        return [(rec.written[j], block, conv.slots.pop(j)) for j, block in done.items()]

    def _land(self, kv_id: str, block_hash: BlockHash, *, commit: bool) -> None:
        try:
            if commit:
                self._drc.land(kv_id, block_hash)
            else:
                self._drc.discard(kv_id, block_hash)
        except CacheError as exc:
            log.debug("KV of %s: block not taken by the DRC: %s", kv_id, exc.message)


def _write(data: bytes, slot: memoryview) -> bool:
    """Write a whole block, already in MD's geometry (``Regroup``), into its DRC slot; False:
    it does not fit (the block is discarded)."""
    try:
        slot[:] = data
    except ValueError as exc:
        log.warning("KV block not converted (%s): discarded", exc)
        return False
    return True


def _covers(parts: dict[int, int], size: int) -> bool:
    """Whether the verified byte ranges ``{offset: nbytes}`` tile ``[0, size)`` exactly."""
    end = 0
    for offset in sorted(parts):
        if offset != end:
            return False
        end += parts[offset]
    return end == size
