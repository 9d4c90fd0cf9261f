"""Slot ownership in the worker shell: the staging slot pool and the engine's release fences.

``SlotPool`` hands out slots of the shell's staging arena (prefill: prompt blocks waiting to be
sent; relay_decode: blocks landed for a request) to *owners* (a request's KV id). It is the
check-then-act pair of STYLE.md section 2: ``can_allocate`` / ``allocate``; a request that does
not fit is refused (OverloadedError -> RESOURCE_EXHAUSTED), never queued. ``release(owner)``
is the one way slots come back. Thread-safe: transport threads allocate landing slots.

``Fences`` owns the fence board (pdd.cache.arena.FenceBoard) the KV connector posts to once
the engine will never touch a request's slots again (see pdd/engine/connector.py, slot
contract 3). Lifecycle of one fence::

    take() -> FenceRef(index, ticket)      passed in the request's kv_transfer_params
    watch(ref, on_posted)                  the shell wants to know (aborted request): the
                                           poller calls on_posted once the ticket is read back
    retire(ref)                            normal finish (the final output already proved the
                                           engine is done): only the index is reclaimed later
    the index is free again once its ticket was read back (or the engine is gone)

The *progress board* beside it (same indices) is where the connector posts, after each engine
step, how far an exporting request's slots are filled (``exported``): P streams its blocks while
it prefills. ``take`` zeroes the word before the engine sees the fence; the index's previous
request can no longer post to it (its fence was read back).

A fence the engine has not posted after ``timeout_s`` is never given up: the engine core may
still be running (stalled, swapped out, SIGSTOPped) and touch those slots. The fence turns
*overdue*: ``stall_reason`` says so (the worker reports itself not ready, so the router stops
sending it work) and the slots stay quarantined, held by their owner, until the engine posts
the ticket after all (then everything is released and the worker is ready again) or the engine
is gone (``stop``: its process has exited, nothing can touch the slots any more).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdd.cache.arena import FenceBoard
from pdd.engine.connector_params import FenceRef
from pdd.errors import OverloadedError

log = logging.getLogger(__name__)

POLL_S = 0.005  # fence poll period while any fence is watched


class SlotPool:
    """Bounded allocator of arena slots ``[first, first + num_slots)`` by owner (see module
    docstring)."""

    def __init__(self, num_slots: int, first: int = 0) -> None:
        self.num_slots = num_slots
        self._free = list(range(first + num_slots - 1, first - 1, -1))  # pop(): lowest first
        self._owned: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.num_slots - len(self._free)

    def can_allocate(self, n: int) -> bool:
        with self._lock:
            return n <= len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        """``n`` more slots for ``owner``. Raises OverloadedError (nothing taken) if full."""
        with self._lock:
            if n > len(self._free):
                raise OverloadedError(
                    f"KV staging arena full: {n} slots needed, {len(self._free)} of "
                    f"{self.num_slots} free"
                )
            slots = [self._free.pop() for _ in range(n)]
            self._owned.setdefault(owner, []).extend(slots)
            return slots

    def release(self, owner: str) -> int:
        """Give back every slot of ``owner``; returns how many. Idempotent."""
        with self._lock:
            slots = self._owned.pop(owner, [])
            self._free.extend(sorted(slots, reverse=True))
            return len(slots)

    def owners(self) -> list[str]:
        with self._lock:
            return list(self._owned)


@dataclass
class _Watch:
    ref: FenceRef
    on_posted: Callable[[], None] | None
    since: float
    overdue: bool = False


class Fences:
    """The fence board, its progress board and the index/ticket bookkeeping. Loop-side (not
    thread-safe)."""

    def __init__(
        self, board: FenceBoard, timeout_s: float, progress: FenceBoard | None = None
    ) -> None:
        self.board = board
        self.progress = progress
        self._timeout_s = timeout_s
        self._free = list(range(board.size - 1, -1, -1))
        self._tickets = itertools.count(1)
        self._watched: dict[int, _Watch] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def outstanding(self) -> int:
        """Fences taken and not yet read back (leak check: 0 when idle)."""
        return self.board.size - len(self._free)

    def take(self) -> FenceRef:
        """A fresh fence. Raises OverloadedError when every index is in use."""
        if not self._free:
            raise OverloadedError(f"all {self.board.size} KV fences in use")
        index = self._free.pop()
        if self.progress is not None:
            self.progress.post(index, 0)
        return FenceRef(index=index, ticket=next(self._tickets))

    def exported(self, ref: FenceRef) -> int:
        """The end of the prompt blocks the engine copied so far for ``ref``'s exporting
        request (0 without a progress board)."""
        return self.progress.read(ref.index) if self.progress is not None else 0

    def watch(self, ref: FenceRef, on_posted: Callable[[], None] | None) -> None:
        """Call ``on_posted`` (on the loop) once the engine posted ``ref``; reclaim its index."""
        self._watched[ref.index] = _Watch(ref, on_posted, time.monotonic())
        self._wake.set()

    def forget(self, ref: FenceRef) -> None:
        """The request never reached the engine: no post will come, the index is free now."""
        self._free.append(ref.index)

    def retire(self, ref: FenceRef) -> None:
        """The request finished normally: nothing waits, the index comes back when posted."""
        self.watch(ref, None)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="kv-fences")

    async def stop(self) -> None:
        """Stop polling and run every pending callback (the engine is gone by now)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        watched, self._watched = self._watched, {}
        for w in watched.values():
            self._finish(w)

    def stall_reason(self) -> str | None:
        """Why the engine counts as stalled (fences overdue), or None."""
        overdue = [w for w in self._watched.values() if w.overdue]
        if not overdue:
            return None
        oldest = time.monotonic() - min(w.since for w in overdue)
        return (
            f"engine core stalled: {len(overdue)} KV fence(s) not posted for up to "
            f"{oldest:.0f} s; their slots stay quarantined until it answers"
        )

    def check(self) -> None:
        """Run the callbacks of posted fences; mark the late ones overdue. Called by the
        poller."""
        now = time.monotonic()
        for index, w in list(self._watched.items()):
            if self.board.read(index) != w.ref.ticket:
                if not w.overdue and now - w.since >= self._timeout_s:
                    w.overdue = True
                    log.error(
                        "KV fence %d (ticket %d) not posted after %.0f s: the engine core is "
                        "stalled; its slots stay quarantined and this worker reports not ready",
                        index, w.ref.ticket, self._timeout_s,
                    )  # fmt: skip
                continue
            if w.overdue:
                log.warning(
                    "KV fence %d posted %.1f s late: releasing its slots", index, now - w.since
                )
            del self._watched[index]
            self._finish(w)

    def _finish(self, w: _Watch) -> None:
        self._free.append(w.ref.index)
        if w.on_posted is not None:
            try:
                w.on_posted()
            except Exception:  # a release callback must not stop the poller
                log.exception("KV fence %d release callback failed", w.ref.index)

    async def _poll(self) -> None:
        while True:
            if not self._watched:
                self._wake.clear()
                await self._wake.wait()
            self.check()
            await asyncio.sleep(POLL_S)
