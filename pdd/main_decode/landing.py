"""MainDecode's inbound KV: WAN blocks land in the DRC under a PrepareKv reservation.

The reservations run the shell's landing state machine (``pdd.worker.landing.Landings``: lease,
landing key, consume, cancel, release, outcomes) over ``DrcSource``, the DRC as slot source:
per kv_request_id, the prompt's block hash chain and the DRC lease ``reserve`` took (cached
prefix pinned, landing slots for the rest). The DRC *caches*: what landed outlives the
reservation. Lifecycle of one reservation::

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

The state machine's lock guards the records; ``DrcSource``'s hooks run under it and leave the
DRC commits and block copies for after it (the DRC has its own lock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.drc import Reservation as DrcReservation
from pdd.cache.hashing import BlockHash
from pdd.errors import (
    CacheError,
    CacheFullError,
    InvalidRequestError,
    TransferError,
)
from pdd.kv_geometry import RECEIVER_CONVERTS, KvGeometry
from pdd.protocol import Role
from pdd.transfer import ChunkHeader
from pdd.worker.kv_convert import Scratch, covers, scratch_for
from pdd.worker.kv_wire import KvWireCheck
from pdd.worker.landing import Landing, Landings, Later

log = logging.getLogger(__name__)

LEASE_SLACK_S = 5.0  # the DRC's own backstop expires a little after ours


@dataclass
class _Converting:
    """A reservation's KV that P sends in another dtype, layout or block size: P's blocks in
    scratch until verified, then regrouped into MD's blocks (``kv_convert.Regroup``)."""

    scratch: Scratch  # P's blocks until verified; its regroup: P's geometry -> MD's
    slots: dict[int, memoryview] = field(default_factory=dict)  # MD's block -> its DRC slot


@dataclass
class DrcSlots:
    """One reservation's blocks in the DRC (the landing's slots)."""

    reservation: DrcReservation  # what drc.reserve set up
    chain: tuple[BlockHash, ...]
    expected: int  # blocks the DRC lacked at PrepareKv (what P sends)
    written: dict[int, BlockHash] = field(default_factory=dict)  # given a landing buffer
    verified: dict[int, dict[int, int]] = field(default_factory=dict)  # block -> offset: bytes
    landed: set[int] = field(default_factory=set)  # wholly verified and handed to drc.land
    converting: _Converting | None = None  # P sends KV in another geometry


Rec = Landing[DrcSlots]
Ready = list[tuple[BlockHash, bytes, memoryview]]  # converted blocks: hash, bytes, DRC slot


class DrcSource:
    """The DRC as the landing's slot source: landing buffers, per-chunk commit, conversion."""

    noun = "DRC reservation"
    caches = True  # landed blocks stay cached; the DRC guards a write buffer open at release
    opens_on_chunk = False  # a reservation needs the prompt's hash chain (PrepareKv)

    def __init__(
        self, drc: DecodeRadixCache, slot_bytes: int, geometry: Callable[[], KvGeometry | None]
    ) -> None:
        self._drc = drc
        self._slot_bytes = slot_bytes
        self._geometry = geometry  # MD's own (the engine's)

    def open(self, kv_id: str) -> DrcSlots:
        raise AssertionError("a DRC reservation is only made by PrepareKv")

    def reserve(
        self, kv_id: str, held: DrcSlots | None, chain: list[BlockHash], n_tokens: int, lease: float
    ) -> DrcSlots:
        """drc.reserve for the prompt (CacheFullError when there is no room)."""
        if held is not None:
            raise InvalidRequestError(f"KV of request {kv_id!r} is already prepared here")
        res = self._drc.reserve(
            kv_id, chain, num_prompt_tokens=n_tokens, ttl_s=lease + LEASE_SLACK_S
        )
        return DrcSlots(res, tuple(chain), len(res.receive))

    def ready_blocks(self, rec: Rec) -> int:
        if not rec.held:
            return self._drc.match(rec.slots.chain).cached_blocks
        try:
            return self._drc.ready(rec.kv_id).cached_blocks
        except CacheError:
            return 0

    def release(self, rec: Rec) -> None:
        self._drc.release(rec.kv_id)

    # --- chunks (transport threads, under the landing lock) -------------------------------

    def buffer(self, rec: Rec, header: ChunkHeader, src: KvGeometry | None) -> memoryview:
        """Where one chunk lands; raises to refuse it (and so its transfer)."""
        s, i = rec.slots, header.block_start
        if src is not None:
            return self._converted_buffer(rec, self._converting(rec, src), header)
        if i >= len(s.chain):
            raise TransferError(f"KV of {rec.kv_id!r}: block {i} is past the prompt's blocks")
        buf = self._drc.landing_buffer(rec.kv_id, s.chain[i])  # CacheError: the lease ended
        if buf is None:  # the DRC already holds it: read the bytes and drop them
            return memoryview(bytearray(header.nbytes))
        s.written[i] = s.chain[i]
        return buf[header.offset : header.offset + header.nbytes]

    def verified(self, rec: Rec, header: ChunkHeader) -> Later:
        """One chunk's bytes are complete and checked; land its block once all of it is."""
        s, i = rec.slots, header.block_start
        conv = s.converting
        if conv is not None:
            ready = self._verified_converted(rec, conv, header)
            return lambda: self._land_ready(rec.kv_id, ready)
        if i not in s.written or i in s.landed:
            return None  # a throw-away buffer (already cached), or a duplicate
        parts = s.verified.setdefault(i, {})
        parts[header.offset] = header.nbytes
        if not rec.held or not covers(parts, self._slot_bytes):
            return None  # more chunks of the block to come (or the lease ended: discarded)
        s.landed.add(i)
        block_hash = s.written[i]
        return lambda: self._land(rec.kv_id, block_hash, commit=True)

    def received(self, rec: Rec, done: bool) -> Later:
        """DONE: the rest lands (a converted block still missing tokens never does); else:
        none half-written."""
        s, conv, ready = rec.slots, rec.slots.converting, []
        if conv is not None:
            if done:  # every byte arrived: the blocks not distributed yet are whole
                for i in sorted(conv.scratch.bufs):
                    ready += self._distribute(rec, conv, i)
            conv.scratch.clear()
            conv.slots.clear()
        pending = [s.written[i] for i in sorted(s.written) if i not in s.landed]
        s.written.clear()
        s.verified.clear()
        commit = done and conv is None

        def later() -> None:
            self._land_ready(rec.kv_id, ready)
            for block_hash in pending:
                self._land(rec.kv_id, block_hash, commit=commit)

        return later

    # --- KV in another geometry (under the landing lock) ----------------------------------

    def _converting(self, rec: Rec, src: KvGeometry) -> _Converting:
        """The reservation's conversion from ``src``; TransferError for a second geometry."""
        conv = rec.slots.converting
        scratch = scratch_for(conv.scratch if conv else None, src, self._geometry(), rec.kv_id)
        if conv is None:
            conv = rec.slots.converting = _Converting(scratch)
        return conv

    def _converted_buffer(self, rec: Rec, conv: _Converting, header: ChunkHeader):
        """The scratch of P's block; DRC slots for the blocks it fills."""
        s, i = rec.slots, header.block_start
        want = [j for j in conv.scratch.regroup.targets(i) if j < len(s.chain)]
        if not want:  # tokens past the prompt's last whole block here: read and drop
            return memoryview(bytearray(header.nbytes))
        for j in want:
            if j in s.written or j in s.landed:
                continue
            slot = self._drc.landing_buffer(rec.kv_id, s.chain[j])  # None: already held
            if slot is not None:
                s.written[j] = s.chain[j]
                conv.slots[j] = slot
        return conv.scratch.view(i, header.offset, header.nbytes)

    def _verified_converted(self, rec: Rec, conv: _Converting, header: ChunkHeader) -> Ready:
        i = header.block_start
        if not conv.scratch.verify(i, header.offset, header.nbytes) or not rec.held:
            return []
        return self._distribute(rec, conv, i)

    def _distribute(self, rec: Rec, conv: _Converting, i: int) -> Ready:
        """P's block ``i`` is whole: its tokens go into the DRC blocks it overlaps; the
        blocks that became whole, as (hash, bytes in MD's geometry, DRC slot)."""
        s, data, regroup = rec.slots, conv.scratch.pop(i), conv.scratch.regroup
        wanted = [j for j in regroup.targets(i) if j in s.written and j not in s.landed]
        done = regroup.put(i, data, wanted) if wanted else {}
        s.landed.update(done)
        return [(s.written[j], block, conv.slots.pop(j)) for j, block in done.items()]

    # --- commits (after the landing lock) -------------------------------------------------

    def _land_ready(self, kv_id: str, ready: Ready) -> None:
        for block_hash, data, slot in ready:
            self._land(kv_id, block_hash, commit=_write(data, slot))

    def _land(self, kv_id: str, block_hash: BlockHash, *, commit: bool) -> None:
        try:
            if commit:
                self._drc.land(kv_id, block_hash)
            else:
                self._drc.discard(kv_id, block_hash)
        except CacheError as exc:
            log.debug("KV of %s: block not taken by the DRC: %s", kv_id, exc.message)


class DrcLanding(Landings[DrcSlots]):
    """MainDecode's reservations: the shell's landing state machine over ``DrcSource``, and
    the DRC reservation a PrepareKv makes (with the hit counters it feeds)."""

    def __init__(
        self,
        drc: DecodeRadixCache,
        slot_bytes: int,
        default_lease_s: float,
        geometry: Callable[[], KvGeometry | None] = lambda: None,
    ) -> None:
        converts = RECEIVER_CONVERTS[Role.MAIN_DECODE]
        check = KvWireCheck(slot_bytes, geometry, converts)
        self._drc_source = DrcSource(drc, slot_bytes, geometry)
        super().__init__(self._drc_source, check, default_lease_s)
        self.query_tokens = 0  # prompt tokens routed here (PrepareKv)
        self.hit_tokens = 0  # of which the DRC held at PrepareKv

    def prepare(
        self, kv_id: str, chain: list[BlockHash], n_tokens: int, lease_s: float, keyed: bool = False
    ) -> DrcReservation:
        """drc.reserve for the prompt; returns it (CacheFullError when there is no room, even
        once the kept landings gave theirs up; InvalidRequestError when it is prepared
        already). ``keyed``: the reservation gets a landing key its chunks must carry."""

        def take(held: DrcSlots | None, lease: float) -> DrcSlots:
            return self._drc_source.reserve(kv_id, held, chain, n_tokens, lease)

        try:
            res = self.reserve(kv_id, lease_s, keyed, take).slots.reservation
        except CacheFullError:  # landings kept for later turns give way to this request
            if not self.give_up_kept(f"the DRC's room went to request {kv_id}"):
                raise
            res = self.reserve(kv_id, lease_s, keyed, take).slots.reservation
        self.query_tokens += n_tokens
        self.hit_tokens += res.cached_tokens
        return res

    def kept_room(self) -> int:
        """DRC blocks the kept landings hold and would give up to a new request (their
        landing slots no block has landed in yet): part of MD's free room (Stats)."""
        return self.kept_blocks(lambda s: max(0, s.expected - len(s.landed)))


def _write(data: bytes, slot: memoryview) -> bool:
    """Write a whole block, already in MD's geometry (``Regroup``), into its DRC slot; False:
    it does not fit (the block is discarded)."""
    try:
        slot[:] = data
    except ValueError as exc:
        log.warning("KV block not converted (%s): discarded", exc)
        return False
    return True
