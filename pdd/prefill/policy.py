"""The Prefill (P) role: stage a prompt's KV blocks in the arena, send them where told.

Owns the *stages*: per kv_request_id, the arena slots holding the prompt's whole blocks after
a Generate(kv_stage) and the sends reading them. Lifecycle of one stage::

    Generate(kv_stage)  allocate len(prompt) // block_size slots (RESOURCE_EXHAUSTED if the
                        staging arena is full now; INVALID_ARGUMENT, a 400, if it could never
                        hold them: the worker's start check makes that unreachable for prompts
                        within max_model_len, pdd.worker.capacity); the engine exports block i
                        into slots[i]
    final response      kv_staged_blocks = blocks exported; the stage is leased
                        (worker.kv_stage_lease_s)
    SendKv              one transfer per destination, in parallel (UCX to a relay_decode, TCP
                        to a main_decode: PeerAddress.transport), each from its first_block;
                        the lease is extended to the send deadline
    CancelKv(background) the request no longer waits: its open sends are deferred (they go
                        when no other transfer has a chunk waiting) and end as ever; a
                        Generate that finds the arena full cancels deferred stages first
    release             every send terminal (done, failed, cancelled), or CancelKv, or the
                        lease expired (open sends are cancelled first; the slots come back
                        once the transport let go of them), or the Generate did not finish

The slots are the only thing a stage holds; ``SlotPool.release(kv_id)`` is their one release.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from pdd.config import PddConfig, WorkerConfig
from pdd.engine.connector_params import ExportParams, FenceRef, wrap
from pdd.errors import CacheError, ContextLengthError, InvalidRequestError, OverloadedError
from pdd.transfer import KVSegment, SendRequest, TransferHandle, TransferStatus
from pdd.worker.capacity import ArenaSize, setting_of
from pdd.worker.kv_plane import PlaneSpec
from pdd.worker.kv_run import exported_blocks, plain, run_with_kv
from pdd.worker.kv_wire import describe
from pdd.worker.roles import (
    KV_STAGE,
    CancelKvCall,
    CancelKvResult,
    GenerateCall,
    KvDelta,
    KvStats,
    RoleContext,
    SendKvCall,
    SendKvResult,
)
from pdd.worker.slots import SlotPool
from pdd.worker.ticker import Ticker

log = logging.getLogger(__name__)

TICK_S = 0.25
SEND_GRACE_S = 5.0  # lease slack past a send's own deadline
FREE_WAIT_S = 1.0  # how long a new stage waits for the slots of deferred sends it cancelled


@dataclass
class _Stage:
    kv_id: str
    slots: list[int]  # slots[i] holds prompt block i, for i < staged
    staged: int
    deadline: float
    sends: dict[int, TransferHandle] = field(default_factory=dict)  # open, by transfer id
    closed: str | None = None  # why no more sends may start (cancelled, lease expired)
    deferred: bool = False  # CancelKv(background): nobody waits; first to go when full


class PrefillRole:
    name = "prefill"
    supports = frozenset({KV_STAGE, "SendKv", "CancelKv"})

    @staticmethod
    def plane_spec(worker: WorkerConfig, block_bytes: int, config: PddConfig) -> PlaneSpec:
        """P stages in its own arena and sends over UCX (to RLD) and TCP (to MD)."""
        slots = worker.staging_slots(block_bytes)
        setting = setting_of(config, worker, "kv_staging_gib")
        arena = ArenaSize("KV staging arena", setting, worker.kv_staging_gib, slots)
        return PlaneSpec("kv_producer", slots, None, ("ucx", "tcp"), (arena,))

    def __init__(self, ctx: RoleContext) -> None:
        assert ctx.plane is not None, "prefill needs a KV plane"
        self._engine = ctx.engine
        self._plane = ctx.plane
        self._worker = ctx.worker
        self._block_size = ctx.block_size
        # What every sent slot holds, named in each chunk header (a lossy WAN codec needs it).
        self._pool = SlotPool(ctx.plane.arena.num_slots)
        self._stages: dict[str, _Stage] = {}
        self._generating: dict[str, str | None] = {}  # kv id -> why it was cancelled
        self._by_transfer: dict[int, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker = Ticker(self.tick, TICK_S, "prefill-leases")

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._plane.start(on_sent=self._sent_threadsafe)
        self._ticker.start()

    async def stop(self) -> None:
        """Drop every stage (the engine is stopped; the plane closes the transports next)."""
        await self._ticker.stop()
        for stage in list(self._stages.values()):
            for handle in stage.sends.values():
                handle.cancel()
            self._release(stage)
        for kv_id in self._pool.owners():
            self._pool.release(kv_id)

    # --- Generate -------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        blocks = len(call.prompt) // self._block_size
        if not call.kv_stage or blocks == 0:
            async with aclosing(plain(self._engine, call)) as stream:
                async for delta in stream:
                    yield KvDelta(delta)
            return
        kv_id = call.request_id
        if kv_id in self._stages or kv_id in self._generating:
            raise InvalidRequestError(
                f"request {kv_id!r} already has staged KV", param="request_id"
            )
        if blocks > self._pool.num_slots:  # would never fit, not even idle: a 400, not a 429
            raise ContextLengthError(
                f"prompt of {len(call.prompt)} tokens needs {blocks} KV blocks; this prefill "
                f"worker's staging arena holds {self._pool.num_slots} "
                f"(workers[].kv_staging_gib={self._worker.kv_staging_gib:g})",
                param="prompt",
            )
        slots = await self._allocate(kv_id, blocks)  # OverloadedError: the arena is full now
        self._generating[kv_id] = None
        staged = False

        def release() -> None:
            self._generating.pop(kv_id, None)
            if not staged:
                self._pool.release(kv_id)

        def params(fence: FenceRef) -> dict:
            return wrap(export=ExportParams(slots=slots, fence=fence))

        stream = run_with_kv(self._engine, self._plane.fences, call, params, release)
        async with aclosing(stream):
            async for delta in stream:
                if not delta.finished:
                    yield KvDelta(delta)
                    continue
                n = exported_blocks(delta.kv_transfer_params)
                staged = self._stage(kv_id, slots, n, delta.finish_reason)
                yield KvDelta(delta, staged_blocks=n if staged else 0)

    async def _allocate(self, kv_id: str, blocks: int) -> list[int]:
        """Slots for a new stage. A full arena first gives up deferred stages, oldest first
        (nobody waits for them; this request's client does), and waits a moment for their
        transports to let go of the slots."""
        try:
            return self._pool.allocate(kv_id, blocks)
        except OverloadedError:
            if self._pool.num_slots - self._pool.in_use + self._deferred_slots() < blocks:
                raise
            room = self._pool.num_slots - self._pool.in_use
            for stage in [st for st in self._stages.values() if st.deferred]:
                if room >= blocks:
                    break
                room += len(stage.slots)
                self._close(stage, "arena full: a deferred send gives way to a new request")
        deadline = time.monotonic() + FREE_WAIT_S
        while True:
            try:
                return self._pool.allocate(kv_id, blocks)
            except OverloadedError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.005)

    def _deferred_slots(self) -> int:
        """Slots of deferred stages: a new request can have them (``_allocate``)."""
        return sum(len(st.slots) for st in self._stages.values() if st.deferred)

    def _stage(self, kv_id: str, slots: list[int], n: int, finish: str | None) -> bool:
        """Lease the exported blocks for SendKv; False when there is nothing to hold."""
        cancelled = self._generating.get(kv_id)
        if n == 0 or finish not in ("stop", "length") or cancelled is not None:
            return False
        deadline = time.monotonic() + self._worker.kv_stage_lease_s
        self._stages[kv_id] = _Stage(kv_id, slots, n, deadline)
        return True

    # --- KV RPCs --------------------------------------------------------------------------

    async def send_kv(self, call: SendKvCall) -> SendKvResult:
        """Start one transfer per destination; returns the bytes queued for each."""
        stage = self._stages.get(call.kv_request_id)
        if stage is None or stage.closed is not None:
            why = stage.closed if stage is not None else "never staged, or already released"
            raise CacheError(f"no staged KV for request {call.kv_request_id!r} ({why})")
        plan = []
        for dest in call.destinations:  # check everything before the first send starts
            if dest.first_block < 0:
                raise InvalidRequestError("first_block must be >= 0", param="destinations")
            transport = self._plane.sender(dest.peer.transport)
            plan.append((transport, dest))
        deadline_s = call.deadline_s if call.deadline_s > 0 else None
        sent: list[int] = []
        wire: list[int] = []  # expected on the wire: raw x the codec's learned ratio
        for transport, dest in plan:
            segments = self._segments(stage, dest.first_block)
            if not segments:
                sent.append(0)
                wire.append(0)
                continue
            request = SendRequest(
                _wire_id(stage.kv_id, dest.landing_key), segments, deadline_s=deadline_s
            )
            peer = dest.peer.peer()
            handle = transport.send(peer, request)
            self._plane.started(handle.transfer_id)
            stage.sends[handle.transfer_id] = handle
            self._by_transfer[handle.transfer_id] = stage.kv_id
            sent.append(len(segments) * self._plane.arena.slot_bytes)
            ratio = self._plane.wire_ratio(dest.peer.transport, peer)
            wire.append(round(sent[-1] * ratio))
        lease = (deadline_s or self._plane.transfer_deadline_s) + SEND_GRACE_S
        stage.deadline = max(stage.deadline, time.monotonic() + lease)
        if not stage.sends:
            self._release(stage)  # nothing to send: the router is done with it
        return SendKvResult(stage.staged, tuple(sent), tuple(wire))

    def _segments(self, stage: _Stage, first: int) -> list[KVSegment]:
        arena = self._plane.arena
        what = describe(self._engine.kv_geometry)  # each chunk says what it carries
        return [
            KVSegment(arena.view(stage.slots[i]), block_start=i, block_end=i + 1, **what)
            for i in range(first, stage.staged)
        ]

    async def cancel_kv(self, call: CancelKvCall) -> CancelKvResult:
        kv_id = call.kv_request_id
        stage = self._stages.get(kv_id)
        if call.background and stage is not None and stage.closed is None and stage.sends:
            stage.deferred = True
            for handle in stage.sends.values():  # released as ever, when they end
                handle.defer()
            return CancelKvResult(True)
        found = False
        if kv_id in self._generating:
            self._generating[kv_id] = call.reason or "cancelled"
            found = True
        if stage is not None:
            self._close(stage, f"cancelled: {call.reason or 'CancelKv'}")
            found = True
        return CancelKvResult(found)

    # --- ends of sends and leases (event loop) --------------------------------------------

    def _sent_threadsafe(self, status: TransferStatus) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._sent, status)
            except RuntimeError:  # the loop is closing: stop() releases everything
                pass

    def _sent(self, status: TransferStatus) -> None:
        kv_id = self._by_transfer.pop(status.transfer_id, None)
        stage = self._stages.get(kv_id) if kv_id is not None else None
        if stage is None:
            return
        stage.sends.pop(status.transfer_id, None)
        if status.state.value != "done":
            log.info("KV send of %s ended %s: %s", kv_id, status.state.value, status.reason)
        if not stage.sends:
            self._release(stage)

    def _close(self, stage: _Stage, why: str) -> None:
        """No more sends; cancel the open ones; release once none is open."""
        stage.closed = why
        if not stage.sends:
            self._release(stage)
            return
        for handle in list(stage.sends.values()):
            handle.cancel()  # terminal later, reported through _sent

    def _release(self, stage: _Stage) -> None:
        if self._stages.get(stage.kv_id) is stage:
            del self._stages[stage.kv_id]
            self._pool.release(stage.kv_id)
        for tid in stage.sends:
            self._by_transfer.pop(tid, None)

    def tick(self, now: float) -> None:
        for stage in list(self._stages.values()):
            if stage.deadline <= now and stage.closed is None:
                log.warning("KV stage of %s: lease expired, releasing it", stage.kv_id)
                self._close(stage, "lease expired")
        self._plane.drain()

    def kv_stats(self) -> KvStats:
        est = self._plane.wan_estimate()
        return KvStats(
            pinned_slots=self._pool.in_use,
            arena_blocks=self._pool.num_slots,
            free_blocks=self._pool.num_slots - self._pool.in_use + self._deferred_slots(),
            open_transfers=self._plane.open_transfers(),
            wan_bandwidth_bps=est.bandwidth_bps if est else 0.0,
            wan_rtt_s=est.rtt_s if est else 0.0,
            kv_bytes_sent=self._plane.bytes_sent,
            kv_wire_bytes_sent=self._plane.wire_bytes_sent,
            wan_wire_ratio=self._plane.wan_wire_ratio(),
            kv_bytes_received=self._plane.bytes_received,
        )


def _wire_id(kv_id: str, landing_key: str) -> str:
    """The request id P's chunks carry: ``kv_id#landing_key`` when the destination's
    reservation has a key (MD's DRC landing: pdd.main_decode.landing), else ``kv_id``."""
    return f"{kv_id}#{landing_key}" if landing_key else kv_id
