"""The RLD -> MD handoff of p_rld_md: One-Shot, Catch-Up, and the anomaly filter.

After P's token, RLD streams eager tokens while MD's KV crosses the WAN; the request always
ends on MD, unless RLD finishes it first (the anomaly: then the WAN transfer is cut off).

    router                 RLD (dc-a)                      MD (dc-b)
      |-- Generate(prompt+[t1], kv_in=TRANSFER) ->|
      |<- t2 t3 ... (emitted) --------------------|
      |-- AwaitKv (polled) -------------------------------------------> |
      |<- done --------------------------------------------------------- |
    One-Shot (the switch):
      |-- cancel stream + Abort, CancelKv ->|  (later tokens are dropped, never emitted)
      |-- Generate(prompt+[t1..tk], kv_in=DRC, max_tokens-k) ----------> |
      |<- t(k+1) ... (emitted) ----------------------------------------- |
    Catch-Up (while gap = k - tokens MD computed >= catch_up_threshold_tokens, and at least
    min_catch_up_rounds times: the first warm-up loads the prompt's KV from MD's DRC into its
    engine while RLD streams, so the switch computes only what RLD emitted since):
      |-- Generate(prompt+[t1..tk], max_tokens=1) (warm-up; its token dropped) -> |
      |<- t(k+1) .. t(k+j) from RLD meanwhile |
      |   ... next warm-up with [t1..t(k+j)]; then the One-Shot switch (a small gap)
    Anomaly: RLD ends the request (EOS, stop, length) before AwaitKv says done: rld_finished.
      MD's KV still lands, for the conversation's next turn: CancelKv(background) on P (the
      rest is sent behind every other transfer) and MD (it lands into the DRC, no Generate
      comes); the next request to MD that extends this prompt cancels it, its own transfer
      carrying those blocks (``fleet.deferred``). A request marked one_off (the body's
      "pdd": {"one_off": true}) cuts it instead: CancelKv on P and MD (what landed stays).

Everything runs in tasks that feed one queue (RLD events, the KV state, warm-up ends); the
generator consumes it in order, so the decision point is exact: RLD tokens queued before the
KV signal are emitted, the ones after it are dropped. An RLD that fails (error, abort) just
stops; MD takes over when its KV is there. A warm-up that fails falls back to the switch.
A WAN transfer that fails, is cancelled or times out never forces the switch (MD would
recompute the whole prompt in a visible stall while RLD streams fine): RLD decodes to the
end, and the record keeps the transfer's state and reason; only if RLD is gone too does MD
take over from the prompt.
An MD lost before the switch (its AwaitKv or warm-up broke: ``recovery.is_worker_loss``)
leaves the request to RLD, which decodes to the end; if RLD is gone too, the switch is a
takeover by another worker (``RequestRun.finish_on``). An MD lost after the switch is the
same takeover.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator
from typing import Any

from pdd.errors import PddError
from pdd.protocol import HandoffMode
from pdd.router.decide.recovery import is_worker_loss
from pdd.router.drive.request_run import REAL_FINISHES, RequestRun
from pdd.router.fleet.workers import KvState
from pdd.router.types import GenerationRequest, SessionRef, TokenEvent

log = logging.getLogger(__name__)


class _Next(enum.Enum):
    CONTINUE = "continue"
    SWITCH = "switch"
    DONE = "done"


class RelayHandoff:
    """One request's RLD stream and its handoff to MD. Use ``events()`` once."""

    def __init__(
        self, run: RequestRun, rld: str, md: str, *, rld_kv: bool, md_kv: bool,
        md_lost: bool = False,
    ):  # fmt: skip
        self._run = run  # its Generate and the takeover (finish_on); the halves below
        self._stream = run.stream
        self._kv = run.kv
        self._trace = run.trace
        self._pool = run.pool
        self._rld = rld
        self._md = md
        self._rld_kv = rld_kv  # KV is on its way to RLD (else it computes the short prompt)
        self._md_kv = md_kv  # KV is on its way to MD (else it holds every block already)
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._rld_task: asyncio.Task[None] | None = None
        self._kv_ready = False
        self._kv_failed = False  # the WAN transfer ended without the KV: RLD goes on
        self._rld_alive = True
        self._md_lost = md_lost  # MD lost (PrepareKv, AwaitKv, a warm-up): never switch to it
        self._warming = False
        self._synced = 0  # emitted tokens MD has computed (its warm-ups)
        self._rounds = 0  # warm-ups started
        self._sessions = run.policy.catch_up_sessions  # warm-ups keep the request open on MD
        self._session_open = False  # a warm-up ended well: MD holds the session

    async def events(self) -> AsyncIterator[TokenEvent]:
        self._rld_task = self._spawn(self._read_rld())
        self._spawn(self._await_kv())
        try:
            while True:
                kind, payload = await self._queue.get()
                if kind == "rld":
                    out, step = self._on_rld(payload)
                    if out is not None:
                        yield out
                else:
                    step = self._on_signal(kind, payload)
                if step is _Next.DONE:
                    return
                if step is _Next.SWITCH:
                    break
            await self._stop_rld()
            run = self._run
            self._kv.release("handed off to MD", [self._rld])  # RLD may never have loaded it
            self._trace.handoff_rounds = self._rounds + 1
            self._stream.mark_switch()
            lost = (self._md,) if self._md_lost else ()
            session, self._session_open = self._session(keep=False), False
            finish = run.finish_on(self._md, "md", kv_source="drc", await_kv=False, lost=lost,
                                   session=session)  # fmt: skip
            async for event in finish:
                yield event
        finally:
            await self._cancel_tasks()
            if self._session_open:  # no switch came: MD need not hold the request
                with contextlib.suppress(PddError):  # MD left the fleet: nothing to end
                    self._pool.client(self._md).end_session(self._kv.kv_id)

    # --- decisions (called in queue order) ------------------------------------------------

    def _on_rld(self, event: TokenEvent) -> tuple[TokenEvent | None, _Next]:
        ended = event.finish_reason in REAL_FINISHES
        out = self._stream.take(event, "rld", final=ended)
        if self._stream.finished:
            self._trace.handoff_rounds = self._rounds  # warm-ups done before RLD ended
            if not self._kv_ready:
                self._trace.handoff = HandoffMode.RLD_FINISHED
                if self._md_kv and not (self._kv_failed or self._md_lost or self._run.req.one_off):
                    self._defer_md_kv()
            self._kv.release("rld_finished")
            return out, _Next.DONE
        if event.finish_reason is not None:  # abort / error: RLD is gone, MD takes over
            return out, self._rld_gone()
        return out, _Next.CONTINUE

    def _on_signal(self, kind: str, payload: Any) -> _Next:
        if kind == "rld_failed":
            return self._rld_gone()
        if kind == "kv":
            if self._md_lost:  # no KV went to a lost MD: RLD goes on (or a takeover)
                return _Next.CONTINUE if self._rld_alive else _Next.SWITCH
            if payload.state != "done" and self._rld_alive:
                self._kv_failed = True
                log.warning(
                    "request %s: KV to %s ended %s (%s); RLD %s finishes the request",
                    self._kv.kv_id, self._md, payload.state, payload.reason, self._rld,
                )  # fmt: skip
                return _Next.CONTINUE
            self._kv_ready = True
            if self._trace.handoff is HandoffMode.ONE_SHOT or not self._rld_alive:
                return _Next.SWITCH
            return self._next_round()
        if kind == "kv_error":
            if not is_worker_loss(payload):
                raise payload
            return self._md_gone(payload)
        if kind == "warm":
            self._warming = False
            self._synced = payload
            return self._next_round() if self._rld_alive else _Next.SWITCH
        assert kind == "warm_failed", kind
        self._warming = False
        if isinstance(payload, PddError) and is_worker_loss(payload):
            return self._md_gone(payload)
        return _Next.SWITCH

    def _defer_md_kv(self) -> None:
        """RLD ended the request before MD's KV landed: the rest still crosses, behind every
        other transfer, so that MD holds the prefix the conversation's next turn starts with
        (``fleet.deferred``; a request marked ``one_off`` cuts it instead)."""
        p, req = self._trace.p, self._run.req
        if p is None:
            return
        self._kv.defer(
            [p, self._md], "rld_finished: the rest of the prefix lands in the background"
        )
        self._pool.defer_kv(self._md, self._kv.kv_id, p, req.prompt_token_ids, req.cache_salt)
        self._trace.kv_deferred = True

    def _md_gone(self, exc: PddError) -> _Next:
        """MD was lost before the switch: RLD, if it still streams, finishes the request;
        otherwise the switch goes straight to a takeover (``RequestRun.finish_on``)."""
        self._md_lost = True
        self._pool.mark_unhealthy(self._md, exc.message)
        log.warning(
            "request %s: MD %s lost before the handoff (%s); %s", self._kv.kv_id, self._md,
            exc.message, "RLD finishes the request" if self._rld_alive else "taking over",
        )  # fmt: skip
        return _Next.CONTINUE if self._rld_alive else _Next.SWITCH

    def _rld_gone(self) -> _Next:
        self._rld_alive = False
        if self._md_lost or self._kv_failed:  # nobody else will signal: switch now
            return _Next.SWITCH
        return _Next.SWITCH if self._kv_ready and not self._warming else _Next.CONTINUE

    def _next_round(self) -> _Next:
        """Catch-Up: another warm-up while the gap is large, else the switch."""
        policy = self._run.policy
        gap = len(self._stream.emitted) - self._synced
        # MD's first Generate loads the prompt's KV that crossed into its DRC: warm-ups do
        # that off the stream (min_catch_up_rounds), however small the gap
        least = policy.min_catch_up_rounds if self._md_kv else 0
        small = gap < policy.catch_up_threshold_tokens and self._rounds >= least
        if small or gap <= 0 or self._rounds >= policy.max_catch_up_rounds:
            return _Next.SWITCH
        self._rounds += 1
        self._warming = True
        stream = self._stream  # the warm-up's prompt is fixed now: prompt + emitted so far
        req = stream.continuation(f"{self._kv.kv_id}.warm{self._rounds}", max_tokens=1)
        self._spawn(self._warm_up(req, len(stream.emitted)))
        return _Next.CONTINUE

    # --- tasks (they only feed the queue) -------------------------------------------------

    async def _read_rld(self) -> None:
        run = self._run
        kv_in = self._kv.kv_in("transfer") if self._rld_kv else None
        req = self._stream.continuation(self._kv.kv_id)
        try:
            async for event in run.generate(self._rld, req, kv_in=kv_in):
                self._queue.put_nowait(("rld", event))
        except PddError as exc:
            self._queue.put_nowait(("rld_failed", exc))

    async def _await_kv(self) -> None:
        try:
            state = await self._kv.await_kv(self._md) if self._md_kv else KvState("done")
        except PddError as exc:
            self._queue.put_nowait(("kv_error", exc))
            return
        self._queue.put_nowait(("kv", state))

    def _session(self, *, keep: bool) -> SessionRef | None:
        """The session of MD's calls: a warm-up opens or continues it (keep), the switch
        continues and ends it (only if a warm-up left it open)."""
        if not self._sessions or not (keep or self._session_open):
            return None
        return SessionRef(self._kv.kv_id, keep)

    async def _warm_up(self, req: GenerationRequest, synced: int) -> None:
        """MD computes ``req``'s prompt (prompt + emitted) into its prefix cache, or into the
        session it holds open; the one token it samples is dropped. Reports ``synced``
        (emitted tokens MD now holds)."""
        run = self._run
        finish, session = None, self._session(keep=True)
        try:
            stream = run.generate(self._md, req, kv_in=self._kv.kv_in("drc"), session=session)
            async for event in stream:
                finish = event.finish_reason
        except PddError as exc:
            self._queue.put_nowait(("warm_failed", exc))
            return
        ok = finish in REAL_FINISHES
        self._session_open = self._session_open or (ok and session is not None)
        self._queue.put_nowait(("warm", synced) if ok else ("warm_failed", finish))

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        return task

    async def _stop_rld(self) -> None:
        if self._rld_task is not None and not self._rld_task.done():
            self._rld_task.cancel()
            await asyncio.gather(self._rld_task, return_exceptions=True)

    async def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
