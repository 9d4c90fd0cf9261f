"""The Prefill (P) role: stage a prompt's KV blocks in the arena, send them where told.

Owns the *stages*: per kv_request_id, the arena slots holding the prompt's blocks from its
Generate(kv_stage) on, and the sends reading them. Lifecycle of one stage::

    Generate(kv_stage)  allocate ceil(len(prompt) / block_size) slots: the whole blocks and
                        the tail, a last block cut short (exported once the prompt is done; it
                        goes only to a destination that asks, ``KvDestination.tail``: an RLD in
                        P's own geometry, which then computes just P's token). RESOURCE_EXHAUSTED
                        if the staging arena is full now; INVALID_ARGUMENT, a 400, if it could
                        never hold them (the worker's start check makes that unreachable for
                        prompts within max_model_len, pdd.worker.capacity); the engine exports
                        block i into slots[i] as the forward that computed it ends, and says how
                        far it got after every step (``Fences.exported``: ``staged``)
    SendKv              at any time, even before P's token (the router streams the KV while P
                        prefills) and before this Generate reached P (it waits a moment): one
                        send per destination (UCX to a relay_decode, TCP to a main_decode:
                        PeerAddress.transport), from its first_block; while the engine
                        prefills, what is staged goes out in *parts*, one transfer after the
                        other (pdd.worker.inbound.wire_id), the last once the prompt is done;
                        the lease is extended to the send deadline
    final response      kv_staged_blocks = whole blocks exported; the stage is leased
                        (worker.kv_stage_lease_s) for a SendKv still to come
    CancelKv(background) the request no longer waits: its sends are deferred (they go when no
                        other transfer has a chunk waiting) and end as ever; a Generate that
                        finds the arena full cancels deferred stages first
    release             the engine let go of the slots (its final output, or its fence after
                        an abort) and no send is open, and: every destination got its last part,
                        or the stage was closed (CancelKv, the lease expired, the prefill did
                        not finish; open sends are cancelled first)

The slots are the only thing a stage holds; ``SlotPool.release(kv_id)`` is their one release.
A destination whose part failed gets nothing more (its receiver stops at the failed part).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from pdd.config import PddConfig, WorkerConfig
from pdd.engine.connector_params import ExportParams, FenceRef, wrap
from pdd.errors import CacheError, ContextLengthError, InvalidRequestError, OverloadedError
from pdd.transfer import (
    KVSegment,
    PeerAddress,
    SendRequest,
    TransferHandle,
    TransferStatus,
    Transport,
)
from pdd.worker.capacity import ArenaSize, setting_of
from pdd.worker.inbound import wire_id
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
    WarmKvCall,
    WarmKvResult,
)
from pdd.worker.slots import SlotPool
from pdd.worker.ticker import Ticker

log = logging.getLogger(__name__)

TICK_S = 0.25
POLL_S = 0.005  # how often a stage still prefilling is checked for newly staged blocks
SEND_GRACE_S = 5.0  # lease slack past a send's own deadline
FREE_WAIT_S = 1.0  # how long a new stage waits for the slots of deferred sends it cancelled
STAGE_WAIT_S = 2.0  # how long a SendKv waits for its Generate to reach P
CANCELLED_KEPT = 1024  # CancelKv'd ids no stage had yet (their Generate may still come)


@dataclass
class _Dest:
    """One destination of a stage: its parts go one after the other, blocks in order."""

    transport: Transport
    peer: PeerAddress
    landing_key: str
    next_block: int  # the first block no part carried yet
    end: int  # one past the last block it gets (the stage's whole blocks, or its tail too)
    parts: int = 0  # parts started
    part: TransferHandle | None = None  # the part on its way
    ended: bool = False  # its last part started, or a part failed: nothing more goes


@dataclass
class _Stage:
    kv_id: str
    slots: list[int]  # slots[i] holds prompt block i, for i < staged (the last: maybe the tail)
    whole: int  # the prompt's whole blocks (len(slots) - 1 when it has a tail)
    deadline: float
    fence: FenceRef | None = None  # the engine request's (its progress: ``staged``)
    staged: int = 0  # blocks the engine copied so far
    generating: bool = True  # the engine request runs: more blocks may come
    engine_holds: bool = True  # the engine may write the slots (until its release)
    send_by: float | None = None  # SendKv came: when its sends must end (monotonic)
    dests: list[_Dest] = field(default_factory=list)
    sends: dict[int, TransferHandle] = field(default_factory=dict)  # open, by transfer id
    closed: str | None = None  # why no more sends may start (cancelled, lease expired)
    deferred: bool = False  # CancelKv(background): nobody waits; first to go when full

    @property
    def sent(self) -> bool:
        """SendKv came and every destination got its last part."""
        return self.send_by is not None and all(d.ended and d.part is None for d in self.dests)


class PrefillRole:
    name = "prefill"
    supports = frozenset({KV_STAGE, "SendKv", "CancelKv", "WarmKv"})

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
        self._cancelled: OrderedDict[str, str] = OrderedDict()  # kv id -> why, before its stage
        self._by_transfer: dict[int, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker = Ticker(self.tick, TICK_S, "prefill-leases")
        self._streaming = asyncio.Event()  # a stage prefills with a send waiting for blocks
        self._poller: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._plane.start(on_sent=self._sent_threadsafe)
        self._ticker.start()
        self._poller = self._loop.create_task(self._poll(), name="prefill-stream")

    async def stop(self) -> None:
        """Drop every stage (the engine is stopped; the plane closes the transports next)."""
        await self._ticker.stop()
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for stage in list(self._stages.values()):
            for handle in stage.sends.values():
                handle.cancel()
            stage.engine_holds = False
            self._release(stage)
        for kv_id in self._pool.owners():
            self._pool.release(kv_id)

    # --- Generate -------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        whole = len(call.prompt) // self._block_size
        blocks = -(-len(call.prompt) // self._block_size)  # and the tail, if any
        if not call.kv_stage or whole == 0:
            async with aclosing(plain(self._engine, call)) as stream:
                async for delta in stream:
                    yield KvDelta(delta)
            return
        kv_id = call.request_id
        if kv_id in self._stages:
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
        lease = time.monotonic() + self._worker.kv_stage_lease_s
        stage = self._stages[kv_id] = _Stage(kv_id, slots, whole, lease)
        if kv_id in self._cancelled:  # the router gave it up before this Generate got here
            self._close(stage, self._cancelled.pop(kv_id))

        def release() -> None:  # the engine let go of the slots
            stage.engine_holds = False
            if stage.generating:  # it never finished: nothing more is sent
                stage.generating = False
                self._close(stage, "the prefill did not finish")
            self._settle(stage)

        def params(fence: FenceRef) -> dict:
            stage.fence = fence
            return wrap(export=ExportParams(slots=slots, fence=fence))

        stream = run_with_kv(self._engine, self._plane.fences, call, params, release)
        async with aclosing(stream):
            async for delta in stream:
                if not delta.finished:
                    yield KvDelta(delta)
                    continue
                n = exported_blocks(delta.kv_transfer_params)
                staged = n > 0 and delta.finish_reason in ("stop", "length")
                self._prefilled(stage, n if staged else 0)
                whole = min(n, stage.whole) if stage.closed is None else 0
                yield KvDelta(delta, staged_blocks=whole)

    def _prefilled(self, stage: _Stage, n: int) -> None:
        """The engine request finished: ``n`` blocks are staged (0: none usable)."""
        stage.generating = False
        if n == 0:
            self._close(stage, "nothing staged")
            return
        stage.staged = n
        stage.deadline = max(stage.deadline, time.monotonic() + self._worker.kv_stage_lease_s)
        self._pump(stage)

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

    # --- KV RPCs --------------------------------------------------------------------------

    async def send_kv(self, call: SendKvCall) -> SendKvResult:
        """One send per destination; returns the bytes it will carry to each (all of the
        prompt's blocks from its first_block, also those still being prefilled)."""
        stage = await self._stage_of(call.kv_request_id)
        if stage is None or stage.closed is not None or stage.send_by is not None:
            why = "never staged, or already released"
            if stage is not None:
                why = stage.closed or "SendKv came twice"
            raise CacheError(f"no staged KV for request {call.kv_request_id!r} ({why})")
        dests = []
        for dest in call.destinations:  # check everything before the first send starts
            if dest.first_block < 0:
                raise InvalidRequestError("first_block must be >= 0", param="destinations")
            transport = self._plane.sender(dest.peer.transport)
            end = len(stage.slots) if dest.tail else stage.whole
            dests.append(
                _Dest(transport, dest.peer.peer(), dest.landing_key, dest.first_block, end)
            )
        deadline_s = call.deadline_s if call.deadline_s > 0 else self._plane.transfer_deadline_s
        now = time.monotonic()
        stage.send_by = now + deadline_s
        stage.deadline = max(stage.deadline, stage.send_by + SEND_GRACE_S)
        total = len(stage.slots) if stage.generating else stage.staged
        sent: list[int] = []
        wire: list[int] = []  # expected on the wire: raw x the codec's learned ratio
        for dest, call_dest in zip(dests, call.destinations, strict=True):
            end = min(total, dest.end)
            sent.append(max(0, end - dest.next_block) * self._plane.arena.slot_bytes)
            ratio = self._plane.wire_ratio(call_dest.peer.transport, dest.peer)
            wire.append(round(sent[-1] * ratio))
            dest.ended = dest.next_block >= end
            if not dest.ended:
                stage.dests.append(dest)
        self._pump(stage)
        if stage.generating and stage.dests:
            self._streaming.set()
        self._settle(stage)  # nothing to send: the router is done with it
        return SendKvResult(min(total, stage.whole), tuple(sent), tuple(wire))

    async def _stage_of(self, kv_id: str) -> _Stage | None:
        """The stage of ``kv_id``; a SendKv sent right after its Generate may get here first."""
        deadline = time.monotonic() + STAGE_WAIT_S
        while kv_id not in self._stages and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return self._stages.get(kv_id)

    def _pump(self, stage: _Stage) -> None:
        """Start the next part to every destination whose last part ended and that has blocks
        to go: the last part once the prompt is done; before, what is staged while some block
        is not (once every block is, the engine's final output is moments away: one last part
        carries the rest, never an empty one)."""
        if stage.closed is not None or stage.send_by is None:
            return
        if stage.generating and stage.fence is not None:
            stage.staged = max(stage.staged, self._plane.fences.exported(stage.fence))
        for dest in stage.dests:
            if dest.ended or dest.part is not None:
                continue
            staged = min(stage.staged, dest.end)
            if not stage.generating:
                first = min(dest.next_block, staged - 1) if dest.parts else dest.next_block
                if first < staged:
                    self._start_part(stage, dest, first, staged, last=True)
                else:  # the export fell short of this destination's first block
                    dest.ended = True
            elif dest.next_block < staged < dest.end:
                self._start_part(stage, dest, dest.next_block, staged, last=False)

    def _start_part(self, stage: _Stage, dest: _Dest, first: int, end: int, last: bool) -> None:
        """Send blocks [first, end) to ``dest`` (a last part resends the last block when the
        earlier parts already carried every block: the receiver needs the mark)."""
        dest.parts += 1
        parts = dest.parts if last else None
        arena = self._plane.arena
        what = describe(self._engine.kv_geometry)  # each chunk says what it carries
        segments = [
            KVSegment(arena.view(stage.slots[i]), block_start=i, block_end=i + 1, **what)
            for i in range(first, end)
        ]
        assert stage.send_by is not None
        left = max(0.001, stage.send_by - time.monotonic())
        request = SendRequest(wire_id(stage.kv_id, dest.landing_key, parts), segments, left)
        handle = dest.transport.send(dest.peer, request)
        self._plane.started(handle.transfer_id)
        if stage.deferred:
            handle.defer()
        dest.part, dest.next_block, dest.ended = handle, end, last
        stage.sends[handle.transfer_id] = handle
        self._by_transfer[handle.transfer_id] = stage.kv_id

    async def _poll(self) -> None:
        """While a stage prefills with sends waiting, send what the engine staged since."""
        while True:
            await self._streaming.wait()
            streaming = [st for st in self._stages.values() if st.generating and st.dests]
            if not streaming:
                self._streaming.clear()
                continue
            for stage in streaming:
                self._pump(stage)
            await asyncio.sleep(POLL_S)

    async def warm_kv(self, call: WarmKvCall) -> WarmKvResult:
        """Open and measure the links to the receivers the router named (``WarmKvRequest``)."""
        return WarmKvResult(self._plane.warm(call.peers))

    async def cancel_kv(self, call: CancelKvCall) -> CancelKvResult:
        stage = self._stages.get(call.kv_request_id)
        if stage is None:
            if not call.background:  # its Generate may still be on its way (streamed sends)
                self._cancelled[call.kv_request_id] = f"cancelled: {call.reason or 'CancelKv'}"
                while len(self._cancelled) > CANCELLED_KEPT:
                    self._cancelled.popitem(last=False)
            return CancelKvResult(False)
        if call.background and stage.closed is None and stage.dests and not stage.sent:
            stage.deferred = True
            for handle in stage.sends.values():  # released as ever, when they end
                handle.defer()
            return CancelKvResult(True)
        self._close(stage, f"cancelled: {call.reason or 'CancelKv'}")
        return CancelKvResult(True)

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
        failed = status.state.value != "done"
        if failed:
            log.info("KV send of %s ended %s: %s", kv_id, status.state.value, status.reason)
        for dest in stage.dests:
            if dest.part is not None and dest.part.transfer_id == status.transfer_id:
                dest.part = None
                dest.ended = dest.ended or failed
        self._pump(stage)
        self._settle(stage)

    def _close(self, stage: _Stage, why: str) -> None:
        """No more sends; cancel the open ones; release once none is open."""
        if stage.closed is None:
            stage.closed = why
        for handle in list(stage.sends.values()):
            handle.cancel()  # terminal later, reported through _sent
        self._settle(stage)

    def _settle(self, stage: _Stage) -> None:
        """Release the stage once nothing holds its slots and nothing more will be sent."""
        if stage.engine_holds or stage.sends or stage.generating:
            return
        if stage.closed is not None or stage.sent:
            self._release(stage)

    def _release(self, stage: _Stage) -> None:
        if self._stages.get(stage.kv_id) is stage:
            del self._stages[stage.kv_id]
            self._pool.release(stage.kv_id)
        for tid in stage.sends:
            self._by_transfer.pop(tid, None)

    def tick(self, now: float) -> None:
        for stage in list(self._stages.values()):
            if stage.deadline <= now and stage.closed is None and not stage.generating:
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
            wan_links=self._plane.wan_links(),
            kv_bytes_sent=self._plane.bytes_sent,
            kv_wire_bytes_sent=self._plane.wire_bytes_sent,
            wan_wire_ratio=self._plane.wan_wire_ratio(),
            kv_bytes_received=self._plane.bytes_received,
        )
