"""MD's Catch-Up sessions: one request kept open in the engine across its warm-ups and the
switch (``GenerateRequest.session``).

Without them each Catch-Up call is a request of its own: it finds the previous call's whole
blocks in vLLM's prefix cache and recomputes the rest, the last partly filled block included,
at the full context, in the stream (on the lab, one CPU core at ~2,500 tokens: the gap at the
switch 285-368 ms without sessions, 190 ms with them; docs/benchmarks.md). A
session is one vLLM streaming-input request (``pdd.engine.engine.EngineSession``) whose KV
stays in the engine between calls:

    warm-up 1 (keep)   opens it: loads the prompt's KV from the DRC like any Generate, then
                       computes prompt + emitted less its last token; samples one (dropped)
    warm-up k (keep)   computes the tokens emitted since, less the last
    the switch         computes the rest (at least the token held back) and decodes to the
                       end; the session then closes and MD stores the request's own blocks

A kept turn holds its last token back so that the next always has one to compute (the
engine samples from it). Ownership: ``Sessions`` owns the open sessions between calls; a call
takes its session out (so one call at a time), and the turn either puts it back (a kept turn
that ended well) or ends it (the last turn, a failure, a cancelled call). A session the
router does not continue within ``idle_s`` (RLD finished the request, a failure, a takeover
elsewhere) is aborted, so its KV is freed in the engine. The DRC pin of the first turn's load
is released at its first token (the load ran) or, if the session ends before that, once the
engine posted the session's fence (as ``pdd.worker.kv_run``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdd.engine.connector_params import FenceRef, LoadParams, wrap
from pdd.engine.types import EngineDelta
from pdd.worker.kv_run import REAL_FINISHES, end_fence, offered_tokens
from pdd.worker.roles import GenerateCall, KvDelta

if TYPE_CHECKING:
    from pdd.engine.engine import Engine, EngineSession
    from pdd.worker.slots import Fences

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """One open session and what it owns: its engine request, the fence of its first turn's
    load (None without one) and the release of that load's DRC pin (runs once)."""

    engine: EngineSession
    fence: FenceRef | None
    _release: Callable[[], None] | None
    idle_since: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class Sessions:
    """The open Catch-Up sessions of one MD (event loop only)."""

    def __init__(self, engine: Engine, fences: Fences, limit: int, idle_s: float) -> None:
        self._engine = engine
        self._fences = fences
        self._limit = limit
        self._idle_s = idle_s
        self._open: dict[str, _Held] = {}  # between calls
        self._live = 0  # open or in a call
        self._ending: set[asyncio.Task[None]] = set()
        self.opened = 0
        self.continued = 0

    @property
    def live(self) -> int:
        return self._live

    def has_room(self) -> bool:
        return self._live < self._limit

    def take(self, session_id: str, prompt: list[int]) -> tuple[_Held, list[int]] | None:
        """The open session ``session_id`` and the tokens ``prompt`` adds to it, taken out
        for one call; None when there is none. One whose tokens ``prompt`` does not extend
        is ended here (the call then runs whole)."""
        held = self._open.pop(session_id, None)
        if held is None:
            return None
        have = held.engine.tokens
        if len(prompt) <= len(have) or prompt[: len(have)] != have:
            log.warning("session %s: the call's prompt does not extend it; ending it", session_id)
            self._spawn_end(held)
            return None
        return held, prompt[len(have) :]

    async def open(
        self, call: GenerateCall, slots: list[int], block_size: int, release: Callable[[], None]
    ) -> AsyncIterator[KvDelta]:
        """The session's first turn: load the prompt's first ``len(slots)`` blocks from
        ``slots`` (none: compute them) and compute ``call.prompt`` less its last token.
        ``release`` frees the slots' pin (see the module doc)."""
        assert call.session is not None and call.session.keep
        try:
            fence = self._fences.take() if slots else None
        except BaseException:
            release()
            raise
        self.opened += 1  # its engine request id is new even if an older one is still ending
        session = self._engine.session(f"{call.session.id}.s{self.opened}", call.cache_salt)
        held = _Held(session, fence, release)
        self._live += 1
        params = wrap(load=LoadParams(slots=slots, fence=fence)) if fence is not None else None
        tokens = call.prompt[:-1]
        offered = offered_tokens(len(slots), block_size, len(tokens) + 1)
        first = True
        async with aclosing(self._turn(held, call, tokens, params)) as stream:
            async for delta in stream:
                yield KvDelta(delta, loaded_tokens=offered if first else 0)
                first = False

    async def resume(self, held: _Held, call: GenerateCall, new: list[int]):
        """A later turn: compute ``new`` (a kept turn holds the last back) and sample."""
        assert call.session is not None
        self.continued += 1
        tokens = new[:-1] if call.session.keep else new
        if not tokens:  # a kept turn with nothing to compute: the session holds the rest
            held.idle_since = time.monotonic()
            self._open[call.session.id] = held
            yield KvDelta(EngineDelta((), None, "length", None, len(call.prompt), 0))
            return
        async with aclosing(self._turn(held, call, tokens, None)) as stream:
            async for delta in stream:
                yield KvDelta(delta)

    async def _turn(
        self, held: _Held, call: GenerateCall, tokens: list[int], params: dict | None
    ) -> AsyncIterator[EngineDelta]:
        assert call.session is not None
        keep, ok = call.session.keep, False
        try:
            async with aclosing(held.engine.turn(tokens, call.sampling, params)) as stream:
                async for delta in stream:
                    if delta.token_ids:  # the forward after the load ran: the slots are free
                        held.release()
                    ok = delta.finish_reason in REAL_FINISHES
                    yield delta
        finally:
            if ok and keep:
                held.idle_since = time.monotonic()
                self._open[call.session.id] = held
            else:
                await self._end(held, aborted=not ok)

    async def _end(self, held: _Held, *, aborted: bool) -> None:
        """End ``held``: close it (its last turn ended well) or abort it."""
        self._live -= 1
        if aborted:
            await held.engine.abort()
        else:
            await held.engine.close()
        if held.fence is None:
            held.release()
        else:
            reached = held.engine.reached_engine
            end_fence(self._fences, held.fence, held.release, reached=reached, finished=not aborted)

    def _spawn_end(self, held: _Held) -> None:
        task = asyncio.get_running_loop().create_task(self._end(held, aborted=True))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def end(self, session_id: str) -> bool:
        """Abort the open session ``session_id`` (between calls); whether there was one."""
        held = self._open.pop(session_id, None)
        if held is not None:
            self._spawn_end(held)
        return held is not None

    def expire(self, now: float) -> int:
        """Abort the sessions nobody continued within ``idle_s``; how many."""
        stale = [sid for sid, h in self._open.items() if now - h.idle_since >= self._idle_s]
        for sid in stale:
            log.info("session %s not continued for %.0f s: ending it", sid, self._idle_s)
            self._spawn_end(self._open.pop(sid))
        return len(stale)

    async def stop(self) -> None:
        """Abort every open session (the worker stops)."""
        while self._open:
            _, held = self._open.popitem()
            await self._end(held, aborted=True)
        await asyncio.gather(*self._ending, return_exceptions=True)
