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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from pdd.config.router import PddPolicyConfig
from pdd.errors import UnavailableError
from pdd.router.pool import WorkerPool
from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, KvIn, TokenEvent
from pdd.router.workers import KvState, Prepared

log = logging.getLogger(__name__)

REAL_FINISHES = ("stop", "length")  # a tier ended the request, as opposed to abort / error


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
        self._cached_reported = False
        self._last_emit_at: float | None = None
        self._switch_from: float | None = None
        self._parties: dict[str, asyncio.Task[Prepared] | None] = {}

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
        self, worker_id: str, tier: str, *, kv_source: str | None, await_kv: bool
    ) -> AsyncIterator[TokenEvent]:
        """The last tier: (AwaitKv, then) Generate ``prompt + emitted`` to the end.

        Settles the KV parties when it ends the request with stop/length; any other end
        leaves them to ``close()``.
        """
        if await_kv:
            state = await self.await_kv(worker_id)
            if state.state != "done":
                log.warning(
                    "request %s: KV to %s ended %s (%s); it recomputes what is missing",
                    self.kv_id, worker_id, state.state, state.reason,
                )  # fmt: skip
        kv_in = None if kv_source is None else self.kv_in(kv_source)
        req = self.continuation(self.kv_id)
        async for event in self.generate(worker_id, req, kv_in=kv_in):
            out = self.take(event, tier, final=True)
            if self.finish_reason in REAL_FINISHES:
                self.settle()  # before the yield: the consumer may close us right there
            yield out
            if self.finished:
                break

    def kv_in(self, source: str) -> KvIn:
        return KvIn(source, self.kv_id, self.policy.kv_in_wait_s)

    async def await_kv(self, worker_id: str) -> KvState:
        """Poll AwaitKv until the KV landed, failed, or ``await_kv_timeout_s`` passed."""
        client = self.pool.client(worker_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.await_kv_timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                state = KvState("timeout", reason="router await_kv_timeout_s passed")
                break
            state = await client.await_kv(self.kv_id, min(self.policy.await_kv_poll_s, left))
            if state.state != "timeout":
                break
        self.trace.kv_state = state.state
        return state

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
