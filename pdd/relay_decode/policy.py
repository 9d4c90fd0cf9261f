"""The RelayDecode (RLD) role: land P's KV over UCX, decode from it at once.

Its inbound KV runs the shell's landing state machine (``pdd.worker.landing.Landings``) over
``PoolSlots``: per kv_request_id, staging slots of its own pool, one per prompt block::

    PrepareKv (or the first chunk)   slots for the prompt's blocks (RESOURCE_EXHAUSTED /
                                     a refused chunk when the staging arena is full); leased
                                     (PrepareKv.lease_s, else worker.kv_landing_lease_s). With
                                     fleet credentials: a fresh landing key the router hands only
                                     to the P it chose, and no landing without a PrepareKv
    chunks land                      the view of block block_start's slot (a slot taken on the
                                     first chunk of a block nobody reserved); KV in another
                                     dtype, layout or block size: P's block in scratch, then
                                     regrouped into RLD's slots (``PoolSource``)
    Generate(kv_in)                  waits up to kv_in.wait_s for the transfer to be DONE, then
                                     loads the landed prefix (LoadParams); otherwise computes
                                     the prompt (still correct). Later chunks are refused. P's
                                     tail (the block its prompt ends inside, sent when the
                                     router asks: KvDestination.tail) loads too, up to the end
                                     of PrepareKv's prompt: RLD computes only P's token.
    release                          consumed by a Generate and that Generate is done with the
                                     slots (final output or fence), or CancelKv, or the lease
                                     expired -- and in every case only once no transfer is open
                                     (the pool reuses a slot at once: it does not cache)

``SlotPool.release(kv_id)`` is the one release of the slots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from pdd.cache.arena import SlotArena
from pdd.config import PddConfig, WorkerConfig
from pdd.errors import OverloadedError
from pdd.kv_geometry import RECEIVER_CONVERTS, KvGeometry
from pdd.protocol import Role
from pdd.transfer import ChunkHeader, ReceiverHooks
from pdd.transfer.ucx_auth import kv_token
from pdd.worker.capacity import ArenaSize, setting_of
from pdd.worker.kv_convert import Scratch, scratch_for
from pdd.worker.kv_plane import PlaneSpec
from pdd.worker.kv_run import plain, stream_loading
from pdd.worker.kv_wire import KvWireCheck
from pdd.worker.landing import Landing, Landings, Later
from pdd.worker.roles import (
    KV_IN,
    AwaitKvCall,
    AwaitKvResult,
    CancelKvCall,
    CancelKvResult,
    GenerateCall,
    KvDelta,
    KvStats,
    PrepareKvCall,
    PrepareKvResult,
    RoleContext,
)
from pdd.worker.slots import SlotPool
from pdd.worker.ticker import Ticker

log = logging.getLogger(__name__)

TICK_S = 0.25


@dataclass
class PoolSlots:
    """One landing's staging slots: prompt block -> arena slot."""

    slots: dict[int, int] = field(default_factory=dict)
    expected: int | None = None  # RLD takes whatever P sends
    prompt_tokens: int = 0  # PrepareKv's prompt (P's): where its tail block's KV ends
    tail: int = -1  # that block (-1: the prompt ends on a block boundary, or no PrepareKv)
    tail_came: bool = False  # a chunk of it landed (P sends it only when the router asks)
    scratch: Scratch | None = None  # P sends KV in another geometry (``PoolSource``)
    converted: set[int] = field(default_factory=set)  # then: RLD's blocks whole in their slots

    def loadable(self, blocks: int) -> list[int]:
        """Slots of the landed prefix [0, k), k <= blocks (converted: the blocks every token
        of which came; P's whole blocks may not cover the last one; the tail: if it came)."""
        out: list[int] = []
        landed = self.converted if self.scratch is not None else self.slots
        while len(out) < blocks and len(out) in landed:
            if len(out) == self.tail and not self.tail_came:
                break
            out.append(self.slots[len(out)])
        return out

    def load(self, prompt_len: int, block_size: int) -> tuple[list[int], int | None]:
        """The slots a Generate of ``prompt_len`` tokens loads, and the tokens they hold (None:
        whole blocks): the landed whole blocks, and P's tail after them when it came (KV in
        RLD's own geometry, PrepareKv's prompt shorter than this one and ending inside it)."""
        if self.scratch is None and self.tail_came and self.prompt_tokens < prompt_len:
            slots = self.loadable(self.tail + 1)
            if len(slots) == self.tail + 1:
                return slots, self.prompt_tokens
        return self.loadable(prompt_len // block_size), None


class PoolSource:
    """RLD's slot source: its staging pool over the arena the connector loads from.

    KV that P sends in another dtype, layout or block size (``KvWireCheck`` names it) lands
    block by block in a scratch buffer; once one of P's blocks is verified, its tokens go into
    RLD's blocks (``kv_convert.Regroup``), and each RLD block every token of which came is
    written into its slot. One that P's whole blocks do not cover never is: RLD computes it.
    """

    noun = "landing"
    caches = False  # a released slot is reused at once
    opens_on_chunk = True  # a fleet without credentials may send before PrepareKv

    def __init__(
        self, pool: SlotPool, arena: SlotArena, geometry: Callable[[], KvGeometry | None]
    ) -> None:
        self._pool = pool
        self._arena = arena
        self._geometry = geometry  # RLD's own (the engine's)

    def open(self, kv_id: str) -> PoolSlots:
        return PoolSlots()

    def reserve(
        self, kv_id: str, held: PoolSlots | None, prompt_len: int, block_size: int
    ) -> PoolSlots:
        """Slots for the prompt's blocks the landing has none for (OverloadedError): its whole
        blocks and its tail, which P sends (KvDestination.tail) when RLD holds KV in its own
        geometry."""
        blocks = -(-prompt_len // block_size)
        slots = held if held is not None else PoolSlots()
        slots.prompt_tokens = prompt_len
        slots.tail = prompt_len // block_size if prompt_len % block_size else -1
        missing = [b for b in range(blocks) if b not in slots.slots]
        taken = self._pool.allocate(kv_id, len(missing))  # OverloadedError: full
        slots.slots.update(zip(missing, taken, strict=True))
        return slots

    def buffer(
        self, rec: Landing[PoolSlots], header: ChunkHeader, src: KvGeometry | None
    ) -> memoryview:
        block, slots = header.block_start, rec.slots.slots
        if src is not None:
            s = rec.slots
            s.scratch = scratch_for(s.scratch, src, self._geometry(), rec.kv_id)
            return s.scratch.view(block, header.offset, header.nbytes)
        slot = slots.get(block)
        if slot is None:
            slot = slots[block] = self._pool.allocate(rec.kv_id, 1)[0]
        if block == rec.slots.tail:
            rec.slots.tail_came = True
        view = self._arena.view(slot)
        return view[header.offset : header.offset + header.nbytes]

    def verified(self, rec: Landing[PoolSlots], header: ChunkHeader) -> Later:
        """The Generate loads after the whole transfer is DONE; a converted block of P's is
        regrouped into RLD's slots as soon as it is whole (its scratch freed)."""
        scratch, i = rec.slots.scratch, header.block_start
        if scratch is not None and rec.held and scratch.verify(i, header.offset, header.nbytes):
            self._distribute(rec, scratch, i)
        return None

    def received(self, rec: Landing[PoolSlots], done: bool) -> Later:
        scratch = rec.slots.scratch
        if scratch is not None:
            if done and rec.held:  # every byte arrived: the blocks not regrouped yet are whole
                for i in sorted(scratch.bufs):
                    self._distribute(rec, scratch, i)
            scratch.clear()
        return None

    def _distribute(self, rec: Landing[PoolSlots], scratch: Scratch, i: int) -> None:
        """P's block ``i`` is whole: its tokens go into the RLD blocks it overlaps; each that
        became whole is written into its slot (one taken now if PrepareKv reserved none; a
        full pool leaves it, and what follows, to be computed)."""
        s, data = rec.slots, scratch.pop(i)
        wanted = [j for j in scratch.regroup.targets(i) if j not in s.converted]
        for j, block in scratch.regroup.put(i, data, wanted).items():
            slot = s.slots.get(j)
            if slot is None:
                try:
                    slot = s.slots[j] = self._pool.allocate(rec.kv_id, 1)[0]
                except OverloadedError:
                    log.warning("KV of %s: no slot for block %d; RLD computes it", rec.kv_id, j)
                    continue
            self._arena.view(slot)[:] = block
            s.converted.add(j)

    def ready_blocks(self, rec: Landing[PoolSlots]) -> int:
        slots = rec.slots
        return len(slots.loadable(len(slots.slots))) if rec.inbound.done else 0

    def release(self, rec: Landing[PoolSlots]) -> None:
        self._pool.release(rec.kv_id)


class RelayDecodeRole:
    name = "relay_decode"
    supports = frozenset({KV_IN, "PrepareKv", "AwaitKv", "CancelKv"})

    @staticmethod
    def plane_spec(worker: WorkerConfig, block_bytes: int, config: PddConfig) -> PlaneSpec:
        """RLD lands into its own staging arena; UCX receiver unless configured otherwise."""
        receiver = worker.kv_transport or "ucx"
        slots = worker.staging_slots(block_bytes)
        setting = setting_of(config, worker, "kv_staging_gib")
        arena = ArenaSize("KV landing arena", setting, worker.kv_staging_gib, slots)
        return PlaneSpec("kv_consumer", slots, receiver, (), (arena,))

    def __init__(self, ctx: RoleContext) -> None:
        assert ctx.plane is not None, "relay_decode needs a KV plane"
        self._engine = ctx.engine
        self._plane = ctx.plane
        self._block_size = ctx.block_size
        engine, arena = ctx.engine, ctx.plane.arena
        self._pool = SlotPool(arena.num_slots)
        geometry = lambda: engine.kv_geometry  # noqa: E731
        converts = RECEIVER_CONVERTS[Role.RELAY_DECODE]
        wire_check = KvWireCheck(arena.slot_bytes, geometry, converts)
        self._source = PoolSource(self._pool, arena, geometry)
        self._landings = Landings(self._source, wire_check, ctx.worker.kv_landing_lease_s)
        self._ticker = Ticker(self.tick, TICK_S, "rld-leases")

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        landings = self._landings
        landings.waiters.bind(asyncio.get_running_loop())
        hooks = ReceiverHooks(
            landings.allocate, on_received=landings.received, on_verified=landings.verified
        )
        self._plane.start(hooks)
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()
        self._landings.release_all()

    # --- Generate -------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        landing = await self._take(call) if call.kv_in is not None else None
        slots, tokens = (
            landing.slots.load(len(call.prompt), self._block_size) if landing else ([], None)
        )
        if not slots:
            if landing is not None:
                self._landings.done_with(landing)
            async with aclosing(plain(self._engine, call)) as stream:
                async for delta in stream:
                    yield KvDelta(delta)
            return
        release = lambda: self._landings.done_with(landing)  # noqa: E731
        stream = stream_loading(
            self._engine, self._plane.fences, call, slots, self._block_size, release, tokens
        )
        async with aclosing(stream):
            async for kv_delta in stream:
                yield kv_delta

    async def _take(self, call: GenerateCall) -> Landing[PoolSlots] | None:
        """Wait (kv_in.wait_s) for the request's KV if a landing expects it; the landing if it
        is DONE, else None. Either way the landing is consumed: later chunks are refused."""
        kv = call.kv_in
        assert kv is not None
        key, landings = kv.kv_request_id, self._landings
        await landings.waiters.wait_until(key, lambda: not landings.expecting(key), kv.wait_s)
        return landings.take(key)

    # --- KV RPCs --------------------------------------------------------------------------

    async def prepare_kv(self, call: PrepareKvCall) -> PrepareKvResult:
        """Reserve slots for every block, the tail's too (RLD holds no cache: cached_blocks is
        0)."""
        kv_id, n = call.kv_request_id, len(call.prompt)
        source, keyed = self._source, kv_token() is not None
        take = lambda held, _lease: source.reserve(kv_id, held, n, self._block_size)  # noqa: E731
        landing = self._landings.reserve(kv_id, call.lease_s, keyed, take)
        reserved = -(-n // self._block_size)
        return PrepareKvResult(0, reserved, self._plane.address(), landing.key)

    async def await_kv(self, call: AwaitKvCall) -> AwaitKvResult:
        return await self._landings.await_kv(call.kv_request_id, call.timeout_s)

    async def cancel_kv(self, call: CancelKvCall) -> CancelKvResult:
        return CancelKvResult(self._landings.cancel(call.kv_request_id, call.reason))

    # --- leases, stats --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self._landings.expire(now)
        self._plane.drain()

    def kv_stats(self) -> KvStats:
        return KvStats(
            pinned_slots=self._pool.in_use,
            arena_blocks=self._pool.num_slots,
            free_blocks=self._pool.num_slots - self._pool.in_use,
            open_transfers=self._plane.open_transfers(),
            address=self._plane.address(),
            kv_bytes_sent=self._plane.bytes_sent,
            kv_bytes_received=self._plane.bytes_received,
            kv_refused_chunks=self._landings.wire_check.refused + self._landings.refused_chunks,
        )
