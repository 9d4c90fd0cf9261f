"""The KV parties of one request: every worker that holds or expects KV for it, and the one
place that cancels that KV.

A party is P's staged blocks (``hold``) or a PrepareKv reservation / DRC lease on RLD, MD or
D (``prepare``). ``settle()`` on a clean end (the last tier finished after its KV arrived: the
workers release by themselves); otherwise ``release(reason)`` sends CancelKv to each, in the
background, after its PrepareKv settled. ``close()`` releases whatever is neither settled nor
released: every failure path and every client disconnect goes through it. ``await_kv`` polls
AwaitKv on a destination and gives its reservation up when the KV is not coming; ``watch``
runs it beside the destination's own Generate, which waits for its KV itself (``waiting_kv_in``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pdd.config.router import PddPolicyConfig
from pdd.errors import PddError, UnavailableError
from pdd.router.decide.recovery import is_unreachable, is_worker_loss
from pdd.router.fleet.pool import WorkerPool
from pdd.router.fleet.workers import KvState, Prepared
from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, KvIn, PromptRef

log = logging.getLogger(__name__)

SEND_DEADLINE_GRACE_S = 2.0  # AwaitKv gives up this long after P's send deadline passed
# A Generate waiting for its own KV waits this much past the router's AwaitKv deadline: the
# router's give-up (CancelKv, which wakes it) comes first; its own wait is the backstop.
GENERATE_WAIT_MARGIN_S = 1.0


class KvParties:
    """Who holds or expects KV for ``req``, under the key ``kv_id`` on every worker."""

    def __init__(
        self, pool: WorkerPool, req: GenerationRequest, trace: PddTrace, policy: PddPolicyConfig
    ) -> None:
        self._pool = pool
        self._req = req
        self._trace = trace
        self._policy = policy
        self.kv_id = req.request_id  # the key the KV travels under on every worker
        self.sent_at: float | None = None  # loop time SendKv returned (PStage.send)
        self._parties: dict[str, asyncio.Task[Prepared] | None] = {}
        # destinations that keep the prompt their PrepareKv brought, and under which KV id
        self._prompt_kept: dict[str, str] = {}

    def kv_in(self, source: str) -> KvIn:
        return KvIn(source, self.kv_id, self._policy.kv_in_wait_s)

    def waiting_kv_in(self, source: str) -> KvIn:
        """``kv_in`` for a Generate sent before its KV landed: it waits inside the worker until
        the router's AwaitKv deadline (plus a margin), not ``kv_in_wait_s``."""
        left = self._deadline()[0] - asyncio.get_running_loop().time()
        return KvIn(source, self.kv_id, max(0.0, left) + GENERATE_WAIT_MARGIN_S)

    def supersede(self, md: str) -> None:
        """Cancel the deferred transfers to ``md`` that this prompt extends: this request's
        own transfer (or MD's own computation) covers their blocks (``fleet.deferred``)."""
        req = self._req
        for old in self._pool.superseded_kv(md, req.prompt_token_ids, req.cache_salt):
            why = f"superseded by request {self.kv_id}"
            for wid in (old.p, md):  # P stops sending; MD keeps what landed
                with contextlib.suppress(UnavailableError):  # P left: its sends went with it
                    self._pool.client(wid).cancel_kv_in_background(old.kv_id, why)

    def prepare(self, worker_id: str) -> asyncio.Task[Prepared]:
        """PrepareKv on a destination, in the background; it is a KV party from now on
        (``supersede`` first)."""
        self.supersede(worker_id)
        client = self._pool.client(worker_id)
        req = self._req
        coro = client.prepare_kv(
            self.kv_id, req.prompt_token_ids, self._policy.kv_lease_s, req.cache_salt
        )
        task = asyncio.get_running_loop().create_task(coro)
        self._parties[worker_id] = task
        kv_id = self.kv_id
        task.add_done_callback(lambda t: self._prepared(t, worker_id, kv_id))
        return task

    def _prepared(self, task: asyncio.Task[Prepared], worker_id: str, kv_id: str) -> None:
        if not task.cancelled() and task.exception() is None and task.result().keeps_prompt:
            self._prompt_kept[worker_id] = kv_id

    def prompt_ref(self, worker_id: str, prompt: tuple[int, ...]) -> PromptRef | None:
        """How a Generate of ``prompt`` (the request's prompt + what was emitted) on
        ``worker_id`` refers to the prompt its PrepareKv brought, so that only the rest crosses;
        None: send it whole (no PrepareKv there, or the worker does not keep prompts)."""
        kv_id, head = self._prompt_kept.get(worker_id), self._req.prompt_token_ids
        if kv_id is None or prompt[: len(head)] != head:
            return None
        return PromptRef(kv_id, len(head))

    def hold(self, worker_id: str) -> None:
        """``worker_id`` may hold KV for the request (P staging)."""
        self._parties.setdefault(worker_id, None)

    def restart(self, attempt: int) -> None:
        """A fresh KV id for the P stage's retry ``attempt`` (release the old parties first:
        their CancelKv carries the old id; a dead P's leftovers never meet the new one)."""
        assert not self._parties, "restart with KV parties still held"
        self.kv_id = f"{self._req.request_id}.retry{attempt}"

    def release(self, reason: str, worker_ids: list[str] | None = None) -> None:
        """CancelKv on the given parties (default: all), in the background."""
        for wid in list(self._parties if worker_ids is None else worker_ids):
            if wid not in self._parties:
                continue
            after = self._parties.pop(wid)
            self._pool.client(wid).cancel_kv_in_background(self.kv_id, reason, after)

    def defer(self, worker_ids: list[str], reason: str) -> None:
        """CancelKv(background) on these parties: the request stops waiting for the KV, which
        still lands (P sends it behind every other transfer; MD keeps it in its DRC)."""
        for wid in worker_ids:
            if wid in self._parties:
                after = self._parties.pop(wid)
                self._pool.client(wid).cancel_kv_in_background(
                    self.kv_id, reason, after, background=True
                )

    def settle(self) -> None:
        """Clean end: every party releases its KV by itself."""
        self._parties.clear()

    def close(self, finished: bool) -> None:
        """The request is over: release what is neither settled nor released."""
        self.release("finished" if finished else "aborted")

    async def await_kv(
        self, worker_id: str, compute_sooner: Callable[[KvState], bool] | None = None
    ) -> KvState:
        """Poll AwaitKv until the KV landed, failed, or the wait's deadline passed.

        ``compute_sooner`` (recompute or wait): asked before each poll with what has landed so
        far; True gives the rest up (CancelKv: what landed stays) so the worker computes it,
        and the answer is "cancelled".

        The deadline is ``await_kv_timeout_s``, and never later than P's send deadline plus
        ``SEND_DEADLINE_GRACE_S`` after SendKv: by then P's transfer ended one way or the
        other, so KV still missing is not coming (e.g. P's connection was cut before the
        first chunk, which the receiver never saw). A wait that times out gives the
        reservation up (CancelKv, awaited), so the worker's Generate does not wait for it
        and its landing slots are free at once.
        """
        client = self._pool.client(worker_id)
        loop = asyncio.get_running_loop()
        deadline, why = self._deadline()
        state = KvState("timeout")  # nothing landed yet, as far as the router knows
        while True:
            left = deadline - loop.time()
            if left <= 0:
                state = KvState("timeout", reason=f"router: {why} passed")
                break
            if compute_sooner is not None and compute_sooner(state):
                state = KvState("cancelled", state.bytes_received, state.blocks_ready,
                                "router: computing the rest is sooner than its transfer")  # fmt: skip
                self._trace.md_computed = True
                await self.give_up(worker_id, state.reason)
                break
            try:
                state = await client.await_kv(self.kv_id, min(self._policy.await_kv_poll_s, left))
            except PddError as exc:  # the RPC itself timed out: cut off, a loss (takeover)
                if is_unreachable(exc) and not is_worker_loss(exc):
                    raise UnavailableError(f"{exc.message} (unreachable)") from exc
                raise
            if state.state != "timeout":
                break
        self._trace.kv_state, self._trace.kv_reason = state.state, state.reason
        if state.state != "done":
            log.warning("request %s: KV to %s ended %s (%s); it computes what is missing",
                        self.kv_id, worker_id, state.state, state.reason)  # fmt: skip
        if state.state == "timeout":
            await self.give_up(worker_id, state.reason)
        return state

    def _deadline(self) -> tuple[float, str]:
        """When waiting for KV ends (loop time), and the setting that says so."""
        deadline = asyncio.get_running_loop().time() + self._policy.await_kv_timeout_s
        if self.sent_at is not None:
            send_end = self.sent_at + self._policy.send_kv_deadline_s + SEND_DEADLINE_GRACE_S
            if send_end < deadline:
                return send_end, "P's send deadline"
        return deadline, "await_kv_timeout_s"

    def watch(
        self, worker_id: str, compute_sooner: Callable[[KvState], bool] | None = None
    ) -> asyncio.Task[KvState]:
        """``await_kv`` in the background, beside ``worker_id``'s Generate that waits for the
        KV itself (``waiting_kv_in``): no AwaitKv round trip before the Generate. The watch
        records the outcome and gives the reservation up (CancelKv wakes the Generate, which
        computes what is missing) at the deadline or once computing is sooner. It raises
        what AwaitKv raised (a worker lost or cut off: ``RequestRun`` ends the Generate with
        it when no token came yet)."""
        return asyncio.get_running_loop().create_task(self.await_kv(worker_id, compute_sooner))

    async def give_up(self, worker_id: str, reason: str) -> None:
        """CancelKv on one party now (awaited: its next Generate must not wait for the KV)."""
        if worker_id not in self._parties:
            return
        prepared = self._parties.pop(worker_id)
        if prepared is not None:
            await asyncio.gather(prepared, return_exceptions=True)
        try:
            await self._pool.client(worker_id).cancel_kv(self.kv_id, reason)
        except PddError as exc:
            if is_worker_loss(exc):
                raise  # the caller's takeover handles it
            log.warning("request %s: CancelKv on %s failed: %s (its lease ends it)",
                        self.kv_id, worker_id, exc.message)  # fmt: skip
