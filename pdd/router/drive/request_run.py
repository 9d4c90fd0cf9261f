"""One disaggregated request's run across tiers: the takeover loop over its two halves.

``RequestRun`` is created by a pipeline driver per request and composes:

* ``stream`` (``emitted.EmittedStream``): the emitted tokens, the single truth of what the
  client has seen, and how each tier continues ``prompt + emitted``. Pure.
* ``kv`` (``kv_parties.KvParties``): every worker that holds or expects KV for the request,
  AwaitKv polling, and the one place that cancels that KV (``close``).

It adds what needs both: Generate streams (``generate``: load tracking, unhealthy marking;
closing one cancels the gRPC stream and Aborts the request on the worker,
``WorkerClient.generate``), and the takeover (``finish_on``): when the last tier's worker is
lost mid-request (its stream broke, or it ended the request with error/abort),
``recovery.takeover`` picks who continues ``prompt + emitted`` (another MD, else RLD, else P);
the emitted list makes that seamless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import aclosing

from pdd.config.router import PddPolicyConfig
from pdd.errors import PddError, PromptRefMissing, UnavailableError
from pdd.protocol import Role
from pdd.router.decide.recovery import (
    LOST_FINISHES,
    TIER_OF_ROLE,
    WorkerLost,
    is_worker_loss,
    takeover,
)
from pdd.router.drive.emitted import EmittedStream
from pdd.router.drive.kv_parties import KvParties
from pdd.router.fleet.pool import WorkerPool
from pdd.router.fleet.workers import KvState
from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, KvIn, SessionRef, TokenEvent

log = logging.getLogger(__name__)

REAL_FINISHES = ("stop", "length")  # a tier ended the request, as opposed to abort / error
WATCH_GRACE_S = 1.0  # a finished request waits this long at most for its AwaitKv's answer
# What a takeover loads: MD whatever prefix its DRC holds, RLD a landing it may still hold for
# the request (else it computes the prompt), P nothing (its prefix cache only).
TAKEOVER_KV = {"md": "drc", "rld": "transfer", "p": None}


class RequestRun:
    def __init__(
        self, pool: WorkerPool, req: GenerationRequest, trace: PddTrace, policy: PddPolicyConfig
    ):
        self.pool = pool
        self.req = req
        self.trace = trace
        self.policy = policy
        self.stream = EmittedStream(req, trace)
        self.kv = KvParties(pool, req, trace, policy)
        self.takeovers: list[tuple[str, str]] = []  # (lost worker, the one that took over)

    @property
    def finished(self) -> bool:
        return self.stream.finished

    def close(self) -> None:
        """The request is over: release the KV that is neither settled nor released."""
        self.kv.close(self.stream.finished)

    async def generate(
        self, worker_id: str, req: GenerationRequest, *, kv_stage: bool = False,
        kv_in: KvIn | None = None, session: SessionRef | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """One Generate stream on a worker, counted as load while it runs. A worker that got
        the prompt in PrepareKv gets only what follows it (``KvParties.prompt_ref``), or the
        whole prompt again if it no longer holds it."""
        client = self.pool.client(worker_id)
        ref = self.kv.prompt_ref(worker_id, req.prompt_token_ids)
        with self.pool.track(worker_id):
            while True:
                try:
                    stream = client.generate(
                        req, kv_stage=kv_stage, kv_in=kv_in, prompt_ref=ref, session=session
                    )
                    async with aclosing(stream) as evs:
                        async for event in evs:
                            yield event
                    return
                except PromptRefMissing as exc:  # refused before it started: nothing emitted
                    if ref is None:
                        raise
                    log.info("%s; sending the prompt whole", exc.message)
                    ref = None
                except UnavailableError as exc:
                    self.pool.mark_unhealthy(worker_id, exc.message)
                    raise

    async def finish_on(
        self, worker_id: str, tier: str, *, kv_source: str | None, await_kv: bool,
        lost: Collection[str] = (), compute_sooner: Callable[[KvState], bool] | None = None,
        session: SessionRef | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """The last tier: Generate ``prompt + emitted`` to the end. With ``await_kv`` it is
        sent at once and waits on the worker for its KV, while ``KvParties.watch`` follows
        the landing (one WAN round trip less than AwaitKv, then Generate).

        If that worker is lost before the request finished (``recovery.is_worker_loss``), or
        is in ``lost`` already, another takes over (``recovery.takeover``: MD, else RLD, else
        P) and continues ``prompt + emitted``, recomputing its KV; with nobody left the
        failure is raised. ``session``: the MD Catch-Up session ``worker_id`` holds open (its
        first attempt ends it; a takeover elsewhere has none). Settles the KV parties when it ends the request with stop/length;
        any other end leaves them to ``close()``. ``compute_sooner``: see ``KvParties.await_kv``.
        """
        excluded = set(lost)
        attempt = 0
        while True:
            try:
                if worker_id in excluded:
                    raise UnavailableError(f"worker {worker_id} was lost earlier")
                stream = self._finish_once(worker_id, tier, kv_source, await_kv, attempt,
                                           compute_sooner, session if attempt == 0 else None)  # fmt: skip
                async with aclosing(stream) as events:
                    async for event in events:
                        yield event
                return
            except PddError as exc:
                if self.finished or not is_worker_loss(exc):
                    raise
                excluded.add(worker_id)
                worker_id, tier = self._take_over(worker_id, excluded, exc)
                kv_source, await_kv, attempt = TAKEOVER_KV[tier], False, attempt + 1

    async def _finish_once(
        self, worker_id: str, tier: str, kv_source: str | None, await_kv: bool, attempt: int,
        compute_sooner: Callable[[KvState], bool] | None = None,
        session: SessionRef | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        kv_in, watch = None, None
        if await_kv and self.req.await_kv_first:  # the older flow, kept for comparisons
            await self.kv.await_kv(worker_id, compute_sooner)
            await_kv = False
        if kv_source is not None and await_kv:  # the Generate waits for its KV on the worker
            kv_in = self.kv.waiting_kv_in(kv_source)
            watch = self.kv.watch(worker_id, compute_sooner)
        elif kv_source is not None:
            kv_in = self.kv.kv_in(kv_source)
        kv_id = self.kv.kv_id
        rid = kv_id if attempt == 0 else f"{kv_id}.takeover{attempt}"
        try:
            req = self.stream.continuation(rid)
            stream = self.generate(worker_id, req, kv_in=kv_in, session=session)
            if watch is not None:
                stream = _watched(stream, watch)
            async with aclosing(stream) as events:
                async for event in events:
                    lost = event.finish_reason in LOST_FINISHES
                    out = self.stream.take(event, tier, final=not lost)
                    if self.stream.finish_reason in REAL_FINISHES:
                        self.kv.settle()  # before the yield: the consumer may close us here
                    if out.token_ids or self.finished or not lost:
                        yield out
                    if self.finished:
                        break
                    if lost:
                        raise WorkerLost(
                            f"worker {worker_id} ended request {rid} with {event.finish_reason!r}"
                        )
        finally:
            if watch is not None:
                await _end_watch(watch, self.finished)

    def _take_over(self, worker_id: str, excluded: set[str], exc: PddError) -> tuple[str, str]:
        """The worker that continues after ``worker_id`` was lost; raises ``exc`` if none."""
        self.pool.mark_unhealthy(worker_id, exc.message)  # suspect until a good health poll
        self.kv.release(f"worker {worker_id} lost", [worker_id])
        cached = self.pool.md_cached_tokens(self.req.prompt_token_ids, self.req.cache_salt)
        nxt = takeover(self.pool.view(), excluded, cached)
        if nxt is None:
            log.error(
                "request %s: %s lost after %d tokens and no worker can take over: %s",
                self.kv.kv_id, worker_id, len(self.stream.emitted), exc.message,
            )  # fmt: skip
            raise exc
        log.warning(
            "request %s: %s lost after %d tokens (%s); %s takes over from prompt + emitted",
            self.kv.kv_id, worker_id, len(self.stream.emitted), exc.message, nxt.id,
        )  # fmt: skip
        self.takeovers.append((worker_id, nxt.id))
        if nxt.role is Role.MAIN_DECODE:
            self.trace.md = nxt.id
        return nxt.id, TIER_OF_ROLE[nxt.role]


async def _watched(
    events: AsyncIterator[TokenEvent], watch: asyncio.Task[KvState]
) -> AsyncIterator[TokenEvent]:
    """``events`` of a Generate waiting for its KV, ended with the watch's error if the
    watch failed (AwaitKv found the worker lost or cut off) before the first event came: a
    worker cut off by a partition would otherwise hold the request until its own deadline."""
    async with aclosing(events):
        first = asyncio.ensure_future(anext(events))
        try:
            await asyncio.wait({first, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and watch.exception() is not None:
                raise watch.exception()
            event = await first
        except StopAsyncIteration:
            return
        finally:
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
        yield event
        async for event in events:
            yield event


async def _end_watch(watch: asyncio.Task[KvState], finished: bool) -> None:
    """The Generate ended. Once it emitted a token its KV wait is over, so the watch's last
    AwaitKv is answering (the record's ``kv_state``): a finished request gives it a moment;
    anything else (a loss, a disconnect) cancels it. ``close()`` releases what is left. The
    watch's error matters only before the first token (``_watched``)."""
    if finished and not watch.done():
        await asyncio.wait({watch}, timeout=WATCH_GRACE_S)
    if not watch.done():
        watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
