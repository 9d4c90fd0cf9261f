"""One disaggregated request's state across tiers: the emitted tokens and what workers hold.

``RequestRun`` is created by a pipeline driver per request and owns:

* the emitted token list, the single truth of what the client has seen. Every tier continues
  ``prompt + emitted`` (``continuation``) with ``max_tokens`` (and ``min_tokens``) reduced by
  what was emitted; ``take`` appends a tier's tokens, cuts anything past ``max_tokens`` and
  decides whether that tier's finish ends the request. Nothing else appends, so the stream
  never repeats or skips a token.
* the KV parties: every worker that may hold KV state for the request (P's staged blocks,
  a PrepareKv reservation or DRC lease on RLD/MD/D). ``settle()`` on a clean end (the last
  tier finished after its KV arrived: the workers release by themselves); otherwise
  ``release_kv(reason)`` sends CancelKv to each, in the background, after its PrepareKv
  settled. ``close()`` releases whatever is neither settled nor released: every failure path
  and every client disconnect goes through it.

Generate streams go through ``generate`` (load tracking, unhealthy marking); closing one
cancels the gRPC stream and Aborts the request on the worker (``WorkerClient.generate``).

Takeover (``finish_on``): when the last tier's worker is lost mid-request (its stream broke,
or it ended the request with error/abort), ``recovery.takeover`` picks who continues
``prompt + emitted`` (another MD, else RLD, else P); the emitted list makes that seamless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from contextlib import aclosing
from dataclasses import replace

from pdd.config.router import PddPolicyConfig
from pdd.errors import PddError, UnavailableError
from pdd.protocol import Role
from pdd.router.decide.recovery import (
    LOST_FINISHES,
    TIER_OF_ROLE,
    WorkerLost,
    is_unreachable,
    is_worker_loss,
    takeover,
)
from pdd.router.fleet.pool import WorkerPool
from pdd.router.fleet.workers import KvState, Prepared
from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, KvIn, TokenEvent

log = logging.getLogger(__name__)

REAL_FINISHES = ("stop", "length")  # a tier ended the request, as opposed to abort / error
# What a takeover loads: MD whatever prefix its DRC holds, RLD a landing it may still hold for
# the request (else it computes the prompt), P nothing (its prefix cache only).
TAKEOVER_KV = {"md": "drc", "rld": "transfer", "p": None}
SEND_DEADLINE_GRACE_S = 2.0  # AwaitKv gives up this long after P's send deadline passed


class RequestRun:
    def __init__(
        self, pool: WorkerPool, req: GenerationRequest, trace: PddTrace, policy: PddPolicyConfig
    ):
        self.pool = pool
        self.req = req
        self.trace = trace
        self.policy = policy
        self.kv_id = req.request_id  # the key the KV travels under on every worker
        self.emitted: list[int] = []
        self.finish_reason: str | None = None
        self.p_cached_tokens = 0  # P's prefix-cache hit: the request's usage.cached_tokens
        self.kv_sent_at: float | None = None  # loop time SendKv returned (PStage.send)
        self._cached_reported = False
        self._last_emit_at: float | None = None
        self._switch_from: float | None = None
        self._parties: dict[str, asyncio.Task[Prepared] | None] = {}
        self.takeovers: list[tuple[str, str]] = []  # (lost worker, the one that took over)

    # --- the emitted stream ---------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.req.sampling.max_tokens - len(self.emitted)

    def continuation(self, request_id: str, *, max_tokens: int | None = None) -> GenerationRequest:
        """The request a tier runs: ``prompt + emitted``, the budget left (or ``max_tokens``)."""
        s = self.req.sampling
        budget = self.remaining if max_tokens is None else max_tokens
        min_left = min(budget, max(0, s.min_tokens - len(self.emitted)))
        return replace(
            self.req,
            request_id=request_id,
            prompt_token_ids=self.req.prompt_token_ids + tuple(self.emitted),
            sampling=replace(s, max_tokens=budget, min_tokens=min_left),
        )

    def take(self, event: TokenEvent, tier: str, *, final: bool) -> TokenEvent:
        """Emit ``event``'s tokens (at most ``remaining``); returns what the client gets.

        ``final``: this tier's finish reason ends the request (P's ``length`` after its one
        token does not). Reaching ``max_tokens`` ends it with ``length`` whatever the tier.
        """
        tokens = event.token_ids[: max(self.remaining, 0)]
        cut = len(tokens) < len(event.token_ids)
        finish = event.finish_reason if final else None
        if cut or (
            finish is None and len(self.emitted) + len(tokens) >= self.req.sampling.max_tokens
        ):
            finish = "length"
        self.emitted.extend(tokens)
        if tokens:
            self.trace.count(tier, len(tokens))
            now = time.monotonic()
            if self._switch_from is not None and tier == "md":
                self.trace.handoff_stall_s = now - self._switch_from
                self._switch_from = None
            self._last_emit_at = now
        self.finish_reason = finish
        cached = 0 if self._cached_reported else self.p_cached_tokens
        self._cached_reported = True
        return replace(
            event,
            token_ids=tokens,
            logprobs=event.logprobs[: len(tokens)],
            finish_reason=finish,
            stop_token_id=None if cut or not final else event.stop_token_id,
            num_cached_tokens=cached,
        )

    def mark_switch(self) -> None:
        """The handoff switch starts now: the next MD tokens end the stall being measured."""
        self._switch_from = self._last_emit_at

    # --- workers --------------------------------------------------------------------------

    async def generate(
        self, worker_id: str, req: GenerationRequest, *, kv_stage: bool = False,
        kv_in: KvIn | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """One Generate stream on a worker, counted as load while it runs."""
        client = self.pool.client(worker_id)
        with self.pool.track(worker_id):
            try:
                async with aclosing(client.generate(req, kv_stage=kv_stage, kv_in=kv_in)) as evs:
                    async for event in evs:
                        yield event
            except UnavailableError as exc:
                self.pool.mark_unhealthy(worker_id, exc.message)
                raise

    async def finish_on(
        self, worker_id: str, tier: str, *, kv_source: str | None, await_kv: bool,
        lost: Collection[str] = (),
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """The last tier: (AwaitKv, then) Generate ``prompt + emitted`` to the end.

        If that worker is lost before the request finished (``recovery.is_worker_loss``), or
        is in ``lost`` already, another takes over (``recovery.takeover``: MD, else RLD, else
        P) and continues ``prompt + emitted``, recomputing its KV; with nobody left the
        failure is raised. Settles the KV parties when it ends the request with stop/length;
        any other end leaves them to ``close()``.
        """
        excluded = set(lost)
        attempt = 0
        while True:
            try:
                if worker_id in excluded:
                    raise UnavailableError(f"worker {worker_id} was lost earlier")
                stream = self._finish_once(worker_id, tier, kv_source, await_kv, attempt)
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
        self, worker_id: str, tier: str, kv_source: str | None, await_kv: bool, attempt: int
    ) -> AsyncIterator[TokenEvent]:
        if await_kv:
            state = await self.await_kv(worker_id)
            if state.state != "done":
                log.warning(
                    "request %s: KV to %s ended %s (%s); it recomputes what is missing",
                    self.kv_id, worker_id, state.state, state.reason,
                )  # fmt: skip
        kv_in = None if kv_source is None else self.kv_in(kv_source)
        rid = self.kv_id if attempt == 0 else f"{self.kv_id}.takeover{attempt}"
        async for event in self.generate(worker_id, self.continuation(rid), kv_in=kv_in):
            lost = event.finish_reason in LOST_FINISHES
            out = self.take(event, tier, final=not lost)
            if self.finish_reason in REAL_FINISHES:
                self.settle()  # before the yield: the consumer may close us right there
            if out.token_ids or self.finished or not lost:
                yield out
            if self.finished:
                break
            if lost:
                raise WorkerLost(
                    f"worker {worker_id} ended request {rid} with {event.finish_reason!r}"
                )

    def _take_over(self, worker_id: str, excluded: set[str], exc: PddError) -> tuple[str, str]:
        """The worker that continues after ``worker_id`` was lost; raises ``exc`` if none."""
        self.pool.mark_unhealthy(worker_id, exc.message)  # suspect until a good health poll
        self.release_kv(f"worker {worker_id} lost", [worker_id])
        cached = self.pool.md_cached_tokens(self.req.prompt_token_ids)
        nxt = takeover(self.pool.view(), excluded, cached)
        if nxt is None:
            log.error(
                "request %s: %s lost after %d tokens and no worker can take over: %s",
                self.kv_id, worker_id, len(self.emitted), exc.message,
            )  # fmt: skip
            raise exc
        log.warning(
            "request %s: %s lost after %d tokens (%s); %s takes over from prompt + emitted",
            self.kv_id, worker_id, len(self.emitted), exc.message, nxt.id,
        )  # fmt: skip
        self.takeovers.append((worker_id, nxt.id))
        if nxt.role is Role.MAIN_DECODE:
            self.trace.md = nxt.id
        return nxt.id, TIER_OF_ROLE[nxt.role]

    def kv_in(self, source: str) -> KvIn:
        return KvIn(source, self.kv_id, self.policy.kv_in_wait_s)

    async def await_kv(self, worker_id: str) -> KvState:
        """Poll AwaitKv until the KV landed, failed, or the wait's deadline passed.

        The deadline is ``await_kv_timeout_s``, and never later than P's send deadline plus
        ``SEND_DEADLINE_GRACE_S`` after SendKv: by then P's transfer ended one way or the
        other, so KV still missing is not coming (e.g. P's connection was cut before the
        first chunk, which the receiver never saw). A wait that times out gives the
        reservation up (CancelKv, awaited), so the worker's Generate does not wait for it
        and its landing slots are free at once.
        """
        client = self.pool.client(worker_id)
        loop = asyncio.get_running_loop()
        deadline, why = loop.time() + self.policy.await_kv_timeout_s, "await_kv_timeout_s"
        if self.kv_sent_at is not None:
            send_end = self.kv_sent_at + self.policy.send_kv_deadline_s + SEND_DEADLINE_GRACE_S
            if send_end < deadline:
                deadline, why = send_end, "P's send deadline"
        while True:
            left = deadline - loop.time()
            if left <= 0:
                state = KvState("timeout", reason=f"router: {why} passed")
                break
            try:
                state = await client.await_kv(self.kv_id, min(self.policy.await_kv_poll_s, left))
            except PddError as exc:  # the RPC itself timed out: cut off, a loss (takeover)
                if is_unreachable(exc) and not is_worker_loss(exc):
                    raise UnavailableError(f"{exc.message} (unreachable)") from exc
                raise
            if state.state != "timeout":
                break
        self.trace.kv_state, self.trace.kv_reason = state.state, state.reason
        if state.state == "timeout":
            await self.give_up_kv(worker_id, state.reason)
        return state

    async def give_up_kv(self, worker_id: str, reason: str) -> None:
        """CancelKv on one party now (awaited: its next Generate must not wait for the KV)."""
        if worker_id not in self._parties:
            return
        prepared = self._parties.pop(worker_id)
        if prepared is not None:
            await asyncio.gather(prepared, return_exceptions=True)
        try:
            await self.pool.client(worker_id).cancel_kv(self.kv_id, reason)
        except PddError as exc:
            if is_worker_loss(exc):
                raise  # the caller's takeover handles it
            log.warning("request %s: CancelKv on %s failed: %s (its lease ends it)",
                        self.kv_id, worker_id, exc.message)  # fmt: skip

    # --- KV ownership ---------------------------------------------------------------------

    def prepare(self, worker_id: str) -> asyncio.Task[Prepared]:
        """PrepareKv on a destination, in the background; it is a KV party from now on."""
        client = self.pool.client(worker_id)
        coro = client.prepare_kv(self.kv_id, self.req.prompt_token_ids, self.policy.kv_lease_s)
        task = asyncio.get_running_loop().create_task(coro)
        self._parties[worker_id] = task
        return task

    def hold(self, worker_id: str) -> None:
        """``worker_id`` may hold KV for the request (P staging)."""
        self._parties.setdefault(worker_id, None)

    def restart_kv(self, attempt: int) -> None:
        """A fresh KV id for the P stage's retry ``attempt`` (release the old parties first:
        their CancelKv carries the old id; a dead P's leftovers never meet the new one)."""
        assert not self._parties, "restart_kv with KV parties still held"
        self.kv_id = f"{self.req.request_id}.retry{attempt}"

    def release_kv(self, reason: str, worker_ids: list[str] | None = None) -> None:
        """CancelKv on the given parties (default: all), in the background."""
        for wid in list(self._parties if worker_ids is None else worker_ids):
            if wid not in self._parties:
                continue
            after = self._parties.pop(wid)
            self.pool.client(wid).cancel_kv_in_background(self.kv_id, reason, after)

    def settle(self) -> None:
        """Clean end: every party releases its KV by itself."""
        self._parties.clear()

    def close(self) -> None:
        """The request is over: release what is neither settled nor released."""
        self.release_kv("finished" if self.finished else "aborted")
