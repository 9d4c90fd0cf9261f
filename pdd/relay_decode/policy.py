"""The RelayDecode (RLD) role: land P's KV over UCX, decode from it at once.

Owns the *landings*: per kv_request_id, the staging slots its blocks land in and the state of
the inbound transfer. Lifecycle of one landing::

    PrepareKv (or the first chunk)   slots for the prompt's whole blocks (RESOURCE_EXHAUSTED /
                                     a refused chunk when the staging arena is full); leased
                                     (PrepareKv.lease_s, else worker.kv_landing_lease_s). With
                                     fleet credentials: a fresh landing key the router hands only
                                     to the P it chose, and no landing without a PrepareKv
    chunks land                      allocate(header) -> the view of block block_start's slot;
                                     a chunk without the landing's key is refused
    Generate(kv_in)                  waits up to kv_in.wait_s for the transfer to be DONE, then
                                     loads the landed prefix (LoadParams); otherwise computes
                                     the prompt (still correct). Later chunks are refused.
    release                          consumed by a Generate and that Generate is done with the
                                     slots (final output or fence), or CancelKv, or the lease
                                     expired -- and in every case only once no transfer is open
                                     (the transport never writes into a slot after reporting)

``SlotPool.release(kv_id)`` is the one release of the slots; ``Recent`` remembers the outcome
(late AwaitKv answers, late chunks refused). Transport threads call ``_allocate`` and
``_received`` under ``_lock``; everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from pdd.config import PddConfig, WorkerConfig
from pdd.errors import TransferError
from pdd.transfer import ChunkHeader, InboundResult, ReceiverHooks
from pdd.transfer.ucx_auth import kv_token
from pdd.worker.capacity import ArenaSize, setting_of
from pdd.worker.inbound import (
    InboundState,
    Recent,
    Waiters,
    await_response,
    key_matches,
    new_landing_key,
    split_wire_id,
)
from pdd.worker.kv_plane import PlaneSpec
from pdd.worker.kv_run import (
    plain,
    stream_loading,
)
from pdd.worker.kv_wire import KvWireCheck
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
class _Landing:
    kv_id: str
    deadline: float
    slots: dict[int, int] = field(default_factory=dict)  # prompt block -> arena slot
    inbound: InboundState = field(default_factory=InboundState)
    users: int = 0  # Generates whose engine request may still read the slots
    consumed: bool = False  # a Generate took it (or gave up waiting): no more chunks
    key: str = ""  # its chunks' landing key ("": any sender, a fleet without credentials)

    def loadable(self, whole_blocks: int) -> list[int]:
        """Slots of the landed prefix [0, k), k <= whole_blocks."""
        out = []
        while len(out) < whole_blocks and len(out) in self.slots:
            out.append(self.slots[len(out)])
        return out


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
        self._worker = ctx.worker
        self._block_size = ctx.block_size
        self._slot_bytes = ctx.plane.arena.slot_bytes
        engine = ctx.engine
        self.wire_check = KvWireCheck(self._slot_bytes, lambda: engine.kv_geometry)
        self._pool = SlotPool(ctx.plane.arena.num_slots)
        self._landings: dict[str, _Landing] = {}
        self._recent = Recent()
        self._waiters = Waiters()
        self._lock = threading.Lock()
        self.refused_chunks = 0  # chunks without a prepared landing's key (keyed fleets)
        self._ticker = Ticker(self.tick, TICK_S, "rld-leases")

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiters.bind(loop)
        self._plane.start(ReceiverHooks(self._allocate, on_received=self._received))
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()
        with self._lock:
            landings, self._landings = list(self._landings.values()), {}
        for landing in landings:
            self._pool.release(landing.kv_id)

    # --- the receiver (transport threads) -------------------------------------------------

    def _allocate(self, header: ChunkHeader) -> memoryview:
        """The slot view for one chunk; raises (the chunk and its transfer are refused)."""
        self.wire_check(header)  # this worker's geometry, one whole slot
        (kv_id, key), block = split_wire_id(header.request_id), header.block_start
        with self._lock:
            landing = self._landings.get(kv_id)
            if landing is None:
                if kv_id in self._recent:
                    raise TransferError(f"KV of {kv_id!r} is no longer wanted here")
                if kv_token() is not None:  # keyed fleet: only a PrepareKv makes a landing
                    self.refused_chunks += 1
                    raise TransferError(f"no landing prepared for the KV of {kv_id!r}")
                lease = time.monotonic() + self._worker.kv_landing_lease_s
                landing = self._landings[kv_id] = _Landing(kv_id, lease)
            if not key_matches(landing.key, key):
                self.refused_chunks += 1
                raise TransferError(f"KV of {kv_id!r}: not from the P its landing is for")
            if landing.consumed or landing.inbound.cancelled is not None:
                raise TransferError(f"KV of {kv_id!r} is no longer wanted here")
            slot = landing.slots.get(block)
            if slot is None:
                slot = landing.slots[block] = self._pool.allocate(kv_id, 1)[0]
            landing.inbound.seen(header.transfer_id)
        view = self._plane.arena.view(slot)
        return view[header.offset : header.offset + header.nbytes]

    def _received(self, result: InboundResult) -> None:
        with self._lock:
            kv_id = split_wire_id(result.request_id)[0]
            landing = self._landings.get(kv_id)
            if landing is not None:
                landing.inbound.finish(result)
        if landing is not None:
            self._waiters.notify_threadsafe(kv_id, lambda: self._maybe_free(landing))

    # --- Generate -------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        landing = await self._take(call) if call.kv_in is not None else None
        slots = landing.loadable(len(call.prompt) // self._block_size) if landing else []
        if not slots:
            if landing is not None:
                self._maybe_free(landing)
            async with aclosing(plain(self._engine, call)) as stream:
                async for delta in stream:
                    yield KvDelta(delta)
            return
        landing.users += 1

        def release() -> None:
            landing.users -= 1
            self._maybe_free(landing)

        stream = stream_loading(
            self._engine, self._plane.fences, call, slots, self._block_size, release
        )
        async with aclosing(stream):
            async for kv_delta in stream:
                yield kv_delta

    async def _take(self, call: GenerateCall) -> _Landing | None:
        """Wait (kv_in.wait_s) for the request's KV if a landing expects it; the landing if it
        is DONE, else None. Either way the landing is consumed: later chunks are refused."""
        kv = call.kv_in
        assert kv is not None
        key = kv.kv_request_id
        arrived = lambda: not self._expecting(key)  # noqa: E731
        await self._waiters.wait_until(key, arrived, kv.wait_s)
        with self._lock:
            landing = self._landings.get(key)
            if landing is not None:
                landing.consumed = True
        if landing is None:
            return None
        if not landing.inbound.done:
            state, reason = landing.inbound.outcome()
            log.info("request %s: KV %s (%s), computing the prompt", key, state, reason)
            self._maybe_free(landing)
            return None
        return landing

    def _expecting(self, kv_id: str) -> bool:
        """A landing exists for ``kv_id`` and its KV is still on its way."""
        with self._lock:
            landing = self._landings.get(kv_id)
            return landing is not None and not landing.inbound.terminal

    def _terminal(self, kv_id: str) -> bool:
        with self._lock:
            landing = self._landings.get(kv_id)
            return landing.inbound.terminal if landing is not None else kv_id in self._recent

    # --- KV RPCs --------------------------------------------------------------------------

    async def prepare_kv(self, call: PrepareKvCall) -> PrepareKvResult:
        """Reserve slots for every whole block (RLD holds no cache: cached_blocks is 0)."""
        kv_id, n = call.kv_request_id, len(call.prompt) // self._block_size
        lease = call.lease_s if call.lease_s > 0 else self._worker.kv_landing_lease_s
        with self._lock:
            landing = self._landings.get(kv_id)
            if landing is None:
                landing = _Landing(kv_id, time.monotonic() + lease)
                landing.key = new_landing_key() if kv_token() is not None else ""
                missing = list(range(n))
            else:
                landing.deadline = max(landing.deadline, time.monotonic() + lease)
                missing = [b for b in range(n) if b not in landing.slots]
            slots = self._pool.allocate(kv_id, len(missing))  # OverloadedError: full
            landing.slots.update(zip(missing, slots, strict=True))
            self._landings[kv_id] = landing
            self._recent.forget(kv_id)
        return PrepareKvResult(0, n, self._plane.address(), landing.key)

    async def await_kv(self, call: AwaitKvCall) -> AwaitKvResult:
        key = call.kv_request_id
        await self._waiters.wait_until(key, lambda: self._terminal(key), call.timeout_s)
        with self._lock:
            landing = self._landings.get(key)
            if landing is not None:
                state, reason = landing.inbound.outcome()
                blocks = len(landing.loadable(len(landing.slots))) if state == "done" else 0
                return await_response(state, landing.inbound.bytes_received, blocks, reason)
        return self._recent.response(key)

    async def cancel_kv(self, call: CancelKvCall) -> CancelKvResult:
        with self._lock:
            landing = self._landings.get(call.kv_request_id)
            if landing is not None and landing.inbound.cancelled is None:
                landing.inbound.cancelled = call.reason or "cancelled"
        if landing is None:
            return CancelKvResult(False)
        self._waiters.notify(call.kv_request_id)
        self._maybe_free(landing)
        return CancelKvResult(True)

    # --- release (event loop) -------------------------------------------------------------

    def _maybe_free(self, landing: _Landing) -> None:
        """Release the landing's slots if it is finished with and nothing can touch them."""
        with self._lock:
            ended = landing.consumed or landing.inbound.cancelled is not None
            if not ended or landing.users or landing.inbound.open:
                return
            if self._landings.get(landing.kv_id) is not landing:
                return
            del self._landings[landing.kv_id]
            blocks = len(landing.loadable(len(landing.slots)))
            self._recent.put(landing.kv_id, landing.inbound, blocks)
            self._pool.release(landing.kv_id)

    def tick(self, now: float) -> None:
        with self._lock:
            expired = [x for x in self._landings.values() if x.deadline <= now and not x.users]
            for landing in expired:
                if landing.inbound.cancelled is None:
                    landing.inbound.cancelled = "lease expired"
        for landing in expired:
            log.warning("KV landing of %s: lease expired, releasing it", landing.kv_id)
            self._waiters.notify(landing.kv_id)
            self._maybe_free(landing)
        self._plane.drain()

    def kv_stats(self) -> KvStats:
        return KvStats(
            pinned_slots=self._pool.in_use,
            open_transfers=self._plane.open_transfers(),
            kv_bytes_sent=self._plane.bytes_sent,
            kv_bytes_received=self._plane.bytes_received,
            kv_refused_chunks=self.wire_check.refused + self.refused_chunks,
        )
