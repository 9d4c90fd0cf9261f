"""The MainDecode (MD) role: the Decode-side RadixCache over the shell's arena, decode from it.

Owns the DRC (pdd.cache.drc) whose host tier *is* the shell's shared-memory arena, so the KV
connector loads DRC blocks straight from their slots, and composes:

- ``DrcLanding`` (landing.py): the shell's landing state machine (pdd.worker.landing) over
  the DRC: PrepareKv / AwaitKv / CancelKv and the TCP receiver's hooks;
- ``OwnBlocks`` (store.py): after a request finished, the whole blocks of its prompt + output
  the DRC lacks are exported from the engine and stored, so the next turn sends none of them;
- Generate(kv_in=DRC or TRANSFER): waits up to kv_in.wait_s for the request's inbound KV, then
  matches the prompt in the DRC (landed blocks included), pins the matched prefix under the
  owner ``gen:<request id>`` (a DRC lease of its own), loads it (LoadParams) and releases the
  pin when the engine is done with the slots (final output or fence);
- DrcEvents: the DRC's snapshot or events (pdd.cache.messages) for the router's view.

Arena layout: the whole arena is the DRC host tier (cache.host_capacity_gib); OwnBlocks
(worker.kv_store_own_blocks) exports into the DRC's landing slots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import BlockHash, block_hashes, model_salt
from pdd.cache.host_tier import HostTier
from pdd.config import CacheConfig, PddConfig, WorkerConfig
from pdd.errors import CacheError, CacheFullError, InvalidRequestError
from pdd.main_decode.landing import DrcLanding
from pdd.main_decode.sessions import Sessions
from pdd.main_decode.store import OwnBlocks
from pdd.transfer import ReceiverHooks
from pdd.transfer.ucx_auth import kv_token
from pdd.worker.capacity import ArenaSize
from pdd.worker.kv_plane import PlaneSpec
from pdd.worker.kv_run import (
    REAL_FINISHES,
    plain,
    stream_loading,
)
from pdd.worker.roles import (
    KV_IN,
    SESSIONS,
    AwaitKvCall,
    AwaitKvResult,
    CancelKvCall,
    CancelKvResult,
    DrcEventsCall,
    DrcEventsResult,
    GenerateCall,
    KvDelta,
    KvStats,
    PrepareKvCall,
    PrepareKvResult,
    RoleContext,
)
from pdd.worker.ticker import Ticker

log = logging.getLogger(__name__)

TICK_S = 0.25


def drc_on_arena(cache: CacheConfig, arena, num_slots: int, block_size: int) -> DecodeRadixCache:
    """A DRC whose host tier is ``arena[0:num_slots]`` (the slots the connector loads from)."""
    tier = HostTier(num_slots, arena.slot_bytes, buffer=arena.buffer)
    return DecodeRadixCache(cache, arena.slot_bytes, block_size, tier=tier)


class MainDecodeRole:
    name = "main_decode"
    supports = frozenset({KV_IN, SESSIONS, "PrepareKv", "AwaitKv", "CancelKv", "DrcEvents"})

    @staticmethod
    def plane_spec(worker: WorkerConfig, block_bytes: int, config: PddConfig) -> PlaneSpec:
        """The arena is the DRC (OwnBlocks exports into its landing slots); TCP receiver
        unless configured."""
        drc = config.cache.host_slots(block_bytes)
        arenas = (ArenaSize("DRC host tier", "cache.host_capacity_gib",
                            config.cache.host_capacity_gib, drc),)  # fmt: skip
        role = "kv_both" if worker.kv_store_own_blocks else "kv_consumer"
        return PlaneSpec(role, drc, worker.kv_transport or "tcp", (), arenas)

    def __init__(self, ctx: RoleContext) -> None:
        assert ctx.plane is not None, "main_decode needs a KV plane"
        cfg = ctx.config
        self._engine = ctx.engine
        self._plane = ctx.plane
        self._block_size = ctx.block_size
        self._model = cfg.model
        self._pin_ttl_s = cfg.cache.lease_ttl_s
        drc_slots = cfg.cache.host_slots(ctx.block_bytes)
        self.drc = drc_on_arena(cfg.cache, ctx.plane.arena, drc_slots, ctx.block_size)
        self._landing = DrcLanding(
            self.drc,
            ctx.plane.arena.slot_bytes,
            ctx.worker.kv_landing_lease_s,
            lambda: ctx.engine.kv_geometry,
        )
        self._own = OwnBlocks(ctx.engine, ctx.plane, self.drc, self.hashes)
        self._stores = ctx.worker.kv_store_own_blocks
        limit = max(1, cfg.engine_for(ctx.worker.id).max_num_seqs // 2)  # the rest decode
        self.sessions = Sessions(ctx.engine, ctx.plane.fences, limit, ctx.worker.md_session_idle_s)
        self._ticker = Ticker(self.tick, TICK_S, "md-leases")
        self.kv_in_waits = 0  # Generate calls that found their KV still on its way

    def hashes(self, tokens: list[int], cache_salt: str = "") -> list[BlockHash]:
        """Chain hashes of the whole blocks of ``tokens`` in the prefix-cache namespace
        ``cache_salt`` (the router computes the same)."""
        salt = model_salt(self._model.name, self._model.dtype, self._block_size, cache_salt)
        return block_hashes(tokens, self._block_size, salt)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._landing.waiters.bind(loop)
        hooks = ReceiverHooks(
            self._landing.allocate,
            on_received=self._landing.received,
            on_verified=self._landing.verified,
        )
        self._plane.start(hooks)
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()
        await self.sessions.stop()
        await self._own.stop()
        self._landing.release_all()

    # --- Generate -------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        taken = None
        if call.session is not None:  # a Catch-Up call: its session may be open here
            taken = self.sessions.take(call.session.id, call.prompt)
        if taken is not None:
            held, new = taken
            stream = self.sessions.resume(held, call, new)
        else:
            stream = await self._start(call)
        output: list[int] = []
        keep = call.session is not None and call.session.keep
        async with aclosing(stream):
            async for out in stream:
                output.extend(out.delta.token_ids)
                finished = out.delta.finish_reason in REAL_FINISHES
                if finished and self._stores and not keep:
                    self._own.store(call.request_id, call.prompt + output, call.cache_salt)
                yield out

    async def _start(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        """The stream of a call that continues no session: wait for its KV, pin and load
        what the DRC holds; a Catch-Up call that asks to be kept opens a session."""
        if call.kv_in is not None and self._landing.expecting(call.kv_in.kv_request_id):
            kv_id = call.kv_in.kv_request_id
            self.kv_in_waits += 1  # a full hit (nothing to receive) never gets here
            arrived = lambda: not self._landing.expecting(kv_id)  # noqa: E731
            await self._landing.waiters.wait_until(kv_id, arrived, call.kv_in.wait_s)
        owner = f"gen:{call.request_id}"
        slots = self._pin(call, owner) if call.kv_in is not None else []
        if call.kv_in is not None:
            self._landing.consume(call.kv_in.kv_request_id)  # our own pins hold what we load
        release = lambda: self.drc.release(owner)  # noqa: E731
        if call.session is not None and call.session.keep and self.sessions.has_room():
            return self.sessions.open(call, slots, self._block_size, release)
        if slots:
            return stream_loading(
                self._engine, self._plane.fences, call, slots, self._block_size, release
            )
        return self._plain(call)

    async def _plain(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        async with aclosing(plain(self._engine, call)) as stream:
            async for delta in stream:
                yield KvDelta(delta)

    def _pin(self, call: GenerateCall, owner: str) -> list[int]:
        """Pin the prompt's cached whole-block prefix for ``owner``; its slots ([] if none)."""
        request_id, chain = call.request_id, self.hashes(call.prompt, call.cache_salt)
        cached = self.drc.match(chain).cached_blocks
        if cached == 0:
            return []
        try:
            self.drc.reserve(owner, chain[:cached], ttl_s=self._pin_ttl_s)
        except CacheFullError:  # evicted meanwhile and no room to land it: compute it
            return []
        except CacheError as exc:
            raise InvalidRequestError(f"request {request_id!r} is already running") from exc
        slots = list(self.drc.ready(owner).slots)
        if not slots:
            self.drc.release(owner)
        return slots

    # --- KV RPCs --------------------------------------------------------------------------

    async def prepare_kv(self, call: PrepareKvCall) -> PrepareKvResult:
        prompt, kv_id = list(call.prompt), call.kv_request_id
        chain = self.hashes(prompt, call.cache_salt)
        await self._own.settle(chain)  # the previous turn's own blocks, if still landing
        keyed = kv_token() is not None  # with fleet credentials: bind it to the router's P
        res = self._landing.prepare(kv_id, chain, len(prompt), call.lease_s, keyed)
        address, key = self._plane.address(), self._landing.landing_key(kv_id)
        return PrepareKvResult(res.cached_blocks, len(res.receive), address, key)

    async def await_kv(self, call: AwaitKvCall) -> AwaitKvResult:
        return await self._landing.await_kv(call.kv_request_id, call.timeout_s)

    async def cancel_kv(self, call: CancelKvCall) -> CancelKvResult:
        if call.background:  # the request ended without it; the prefix still lands
            return CancelKvResult(self._landing.keep(call.kv_request_id, call.reason))
        return CancelKvResult(self._landing.cancel(call.kv_request_id, call.reason))

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    async def drc_events(self, call: DrcEventsCall) -> DrcEventsResult:
        if call.since < 0:
            return DrcEventsResult(self.drc.snapshot())
        return DrcEventsResult(self.drc.events_since(call.since))

    # --- leases, stats --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self._landing.expire(now)
        self.sessions.expire(now)
        for rid in self.drc.expire():
            log.warning("DRC lease %s expired (backstop)", rid)
        self._plane.drain()

    def kv_stats(self) -> KvStats:
        drc = self.drc.stats()
        return KvStats(
            pinned_slots=drc.pinned_blocks + drc.landing_blocks,
            arena_blocks=drc.capacity_blocks,
            free_blocks=drc.free_blocks + drc.evictable_blocks + self._landing.kept_room(),
            open_transfers=self._plane.open_transfers(),
            address=self._plane.address(),
            drc=drc,
            drc_query_tokens=self._landing.query_tokens,
            drc_hit_tokens=self._landing.hit_tokens,
            kv_bytes_sent=self._plane.bytes_sent,
            kv_bytes_received=self._plane.bytes_received,
            kv_refused_chunks=self._landing.wire_check.refused + self._landing.refused_chunks,
            kv_in_waits=self.kv_in_waits,
            own_blocks_stored=self._own.stored_blocks,
            md_sessions=self.sessions.live,
            md_session_turns=self.sessions.continued,
        )
